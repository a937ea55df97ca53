"""Any other source of images, from Python: a list of inputs and a function yielding each input's samples.

```python
from preprocess.job import RunOptions, run_job
from preprocess.inputs.sources import Sample, Source, SourceInput

def samples(item: SourceInput):          # runs in the Ray workers: open what item.name names
    for row in my_database.rows(shard=item.name):
        yield Sample(key=row.id, image=row.jpeg_bytes, txt=row.caption, cls=row.label)

source = Source("mydb", [SourceInput(f"shard-{i:04d}", version=etag(i)) for i in range(100)], samples)
report = run_job(RunOptions(inputs=[], output="/data/mydb-256", config=JobConfig(), source=source))
```

Each ``SourceInput`` is one input of the job, exactly as a tar is: committed whole or not at all, named
``{source name}/{input name}`` in the dataset (its ``tar`` field, ``inputs=`` selections, the report) and
stored in that name's order as paths are (``shard-0010`` after ``shard-0009``; ``shard-10`` before ``shard-9``),
recognised on a rerun by its ``version`` (any string that changes when its samples change: an ETag, a
content hash, a modification time). A rerun processes only inputs that are new or whose version changed;
a run killed at any moment leaves the previous dataset or a newer one, as for tars. ``samples`` runs in the
Ray workers (it is shipped with cloudpickle, so it must be picklable: a module-level function, or a
closure over plain data), and yields ``Sample``: the image as encoded bytes (JPEG, PNG, WebP: what the tar
reader would hand over) or a decoded ``uint8`` array (H×W, H×W×3 or H×W×4, encoded losslessly to PNG in
the worker, so it goes through the same decode, resize and limits as every image), plus ``txt`` / ``json``
/ ``cls``.

The built-in kinds are the same shape: ``preprocess.inputs.kinds.SampleReader`` maps an input to its
samples (``RawSample`` / ``SampleProblem``), and ``Source.reader`` adapts the function above to it; the
worker (``preprocess.worker``) runs either, and everything after the samples is shared. A sample the
function gives that cannot be used (no image, an array of another type or shape, a key seen twice) is a
counted failure naming the key; an item that is no ``Sample`` at all (a dict, None) is a counted failure
(``not_a_sample``) naming its position in the input (``item 7``, from 0), its type and its repr, and the
input's other samples are kept. An exception raised by the function, or a function that returns no
iterable, fails the input (named in the report, nothing of it committed; the next run tries it again:
fixing the function does not change the input's version, so such a failure is never remembered).
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from preprocess.config import JobConfig
from preprocess.inputs.kinds import SampleReader
from preprocess.inputs.raw_sample import InputExtent, RawSample, SampleProblem
from shardio.errors import ConfigError, InputError
from shardio.failure_reasons import FailureCode
from shardio.format import escape_name

__all__ = ["Source", "SourceInput", "Sample"]

# Names become input names in the dataset and parts of shard file names: plain path-like characters.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]*")


@dataclass(frozen=True)
class SourceInput:
    name: str  # stable: the same input has the same name in every run
    version: str  # changes when the input's samples change


@dataclass
class Sample:
    key: str
    image: bytes | np.ndarray
    txt: str | None = None
    json: dict[str, Any] | None = None
    cls: int | None = None


@dataclass
class Source:
    """A named list of inputs and the function giving an input's samples (see the module docstring)."""

    name: str
    inputs: Sequence[SourceInput]
    samples: Callable[[SourceInput], Iterable[Sample]]

    def __post_init__(self) -> None:
        for name in [self.name, *(item.name for item in self.inputs)]:
            if not isinstance(name, str) or not _NAME.fullmatch(name) or "//" in name or ".." in name.split("/"):
                raise ConfigError(f"source {self.name!r}: {name!r} is not a usable name (letters, digits, "
                                  "'.', '_', '-', '/'; not starting with '/' or '.')")
        empty = [item.name for item in self.inputs if not str(item.version)]
        if empty:
            raise ConfigError(f"source {self.name!r}: input(s) without a version: {', '.join(empty[:5])} (a rerun "
                              "recognises an input by its version)")
        names = [item.name for item in self.inputs]
        if len(set(names)) != len(names):
            twice = sorted({name for name in names if names.count(name) > 1})
            raise ConfigError(f"source {self.name!r}: input name(s) given twice: {', '.join(twice[:5])}")

    def input_path(self, item: SourceInput) -> str:
        """The input's name in the dataset: ``{source}/{input}``."""
        return f"{self.name}/{item.name}"

    def reader(self) -> SampleReader:
        """This source as a ``SampleReader`` (``preprocess.inputs.kinds``): what the worker runs."""
        return _SourceReader(self.name, self.samples)


class _SourceReader:
    """What a worker needs of a source: its name and function (not its list of inputs: the job ships this
    once to the object store, and a list of 100k inputs has no business there)."""

    def __init__(self, name: str, samples: Callable[[SourceInput], Iterable[Sample]]) -> None:
        self.name, self.samples = name, samples

    def __call__(self, place: Any, cfg: JobConfig, size: int, etag: str,
                 extent: InputExtent | None = None) -> Iterator[RawSample | SampleProblem]:
        """``extent`` stays unset: a source's function says nothing of how far it is. ``place``: the input's
        name, as a string or as the worker opened it (a name is never read as a file)."""
        path = str(place)
        item = SourceInput(path[len(self.name) + 1 :], etag)
        seen: set[str] = set()
        try:
            given = self.samples(item)
            if not isinstance(given, Iterable) or isinstance(given, (str, bytes, Sample)):
                raise InputError(path, f"the source's samples() returned {_shown(given)}, not an iterable of "
                                       "Sample (yield preprocess.inputs.sources.Sample(key=..., image=...) from it)",
                                 lasting=False)
            for position, sample in enumerate(given):
                yield _raw(sample, seen) if isinstance(sample, Sample) else _not_a_sample(sample, position)
        except InputError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's function: any failure fails this input, named
            said = " ".join(f"{type(e).__name__}: {e}".split())[:300]
            raise InputError(path, f"the source's samples() raised {said}", lasting=False) from e


def _shown(value: Any) -> str:
    """A value the function gave, for a message: its type and its repr, cut to 120 characters."""
    shown = " ".join(repr(value).split())
    return f"a {type(value).__name__} ({shown[:120]}{'...' if len(shown) > 120 else ''})"


def _not_a_sample(given: Any, position: int) -> SampleProblem:
    """Something the function yielded that is no ``Sample`` (a dict, None, a tuple): a counted failure
    naming its position in the input, not the input's failure. The rest of the input is good and is kept;
    and the input's version does not change when the function is fixed, so a failed input would stay
    failed (remembered) until it did."""
    member = f"item {position}"
    return SampleProblem(member, FailureCode.NOT_A_SAMPLE,
                         f"{member} of the input is {_shown(given)}, not a Sample: samples() must yield "
                         "preprocess.inputs.sources.Sample(key=..., image=bytes or a uint8 array, txt=, json=, "
                         "cls=)",
                         member)


def _raw(sample: Sample, seen: set[str]) -> RawSample | SampleProblem:
    key = escape_name(str(sample.key))
    if key in seen:
        return SampleProblem(key, FailureCode.DUPLICATE_KEY, "key given twice by this input (the first is kept)")
    seen.add(key)
    image = sample.image
    if isinstance(image, np.ndarray):
        encoded = _png(image)
        if isinstance(encoded, str):
            return SampleProblem(key, FailureCode.UNKNOWN_FORMAT, encoded)
        image, member = encoded, "array"
    elif isinstance(image, (bytes, bytearray, memoryview)):
        image, member = bytes(image), "bytes"
    elif image is None:
        return SampleProblem(key, FailureCode.MISSING_IMAGE, "the sample has no image")
    else:
        return SampleProblem(key, FailureCode.UNKNOWN_FORMAT,
                             f"image is a {type(image).__name__}, not bytes nor a numpy array")
    fields: dict[str, bytes] = {}
    if sample.txt is not None:
        fields["txt"] = str(sample.txt).encode("utf-8", "surrogatepass")
    if sample.cls is not None:
        fields["cls"] = str(sample.cls).encode()
    if sample.json is not None:
        try:
            fields["json"] = json.dumps(sample.json, ensure_ascii=False, allow_nan=False).encode("utf-8")
        except (TypeError, ValueError) as e:
            return SampleProblem(key, FailureCode.BAD_JSON, f"json is not JSON-serialisable ({e})")
    return RawSample(key, member, image, fields)


def _png(pixels: np.ndarray) -> bytes | str:
    """A decoded image as PNG bytes (lossless, fastest compression), or why it cannot be one."""
    if pixels.dtype != np.uint8 or not (pixels.ndim == 2 or (pixels.ndim == 3 and pixels.shape[2] in (3, 4))):
        return f"array of {pixels.dtype} {tuple(pixels.shape)}: give uint8 H×W, H×W×3 or H×W×4"
    if 0 in pixels.shape:
        return f"array of shape {tuple(pixels.shape)} holds no pixel"
    out = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels)).save(out, "PNG", compress_level=1)
    return out.getvalue()
