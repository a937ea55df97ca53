"""Reading one Parquet file as samples: Hugging Face ``datasets`` and img2dataset layouts, streamed by row group.

Which column is what, decided once per file from its schema (``ParquetLayout``):

- the image: the column ``image_column`` names (config), else the one column whose type holds image
  bytes: ``binary`` / ``large_binary`` (img2dataset's ``jpg``) or a struct with a binary ``bytes`` field
  (Hugging Face's ``Image`` feature, ``{bytes, path}``); with several, the first of ``IMAGE_NAMES``. None, or
  several and none of those names: the file fails as an input, naming its columns;
- ``txt``: the first string column of ``caption``, ``text``, ``txt``;
- ``cls``: the integer column ``label_column`` names, else one named ``label`` or ``cls`` (a null or
  negative label, Hugging Face's -1 for "no label", is no ``cls``); where the file's Hugging Face metadata
  names the classes (a ``ClassLabel``), the sample's ``json`` also carries ``"class": NAME``, as a folder's
  samples do, so the mapping is in the dataset;
- the key: a string column ``key`` (img2dataset's), else ``{file name without .parquet}/{row}``, the row
  counted from 0 over the whole file;
- ``json``: every other column of a scalar type (numbers, strings, booleans; NaN as null), so
  img2dataset's ``url``, ``width``, ``status``, ``error_message`` travel as its tars' ``.json`` do.

A row whose image cell holds no bytes (img2dataset's failed downloads: ``status`` not ``success`` and
``jpg`` null; a Hugging Face struct holding only a ``path``) is a failed sample (``missing_image``) naming
the row and, where there is one, the status and error message; a cell whose bytes are not an image fails
in the decoder like a tar member, its reason starting ``row N``. A file pyarrow cannot open (not Parquet,
cut, a corrupt footer: whatever pyarrow raises reading it, a column name that is not UTF-8 included) fails
the whole input as "not a readable Parquet file", naming the file, and the run remembers it as it does a
broken tar; a row group it cannot read fails the whole input, naming the file and the rows.

Memory: the file is never read whole. ``pyarrow.parquet.ParquetFile.iter_batches`` reads one row group's
columns at a time (only the columns used) and hands them out ``BATCH_ROWS`` rows at a time: a worker holds
one row group of those columns (Hugging Face writes row groups of ~100 images; img2dataset one per file
of ``number_sample_per_shard`` images: 10k web images are ~300 MB) plus one batch as Python objects.
Measured (``python -m bench.parquet_memory``, 300 KB cells, row groups of 32 MB, a loaded 2-core VM): the
reader's RSS grows by 168-169 MB over its imports whether the file is 0.5, 2 or 4 GB (+380 MB with row
groups of 128 MB): pyarrow's buffers for a row group's column chunk and its decoded arrays, and its
allocator keeping freed pages. A
file in a bucket is read the same way by ranged GETs through the project's storage (the footer, then each
row group's column chunks), nothing spooled; its ETag is checked after the last row group as a spooled
tar's is (``preprocess.inputs.remote_tar``).

pyarrow is an extra of the job, imported only when a Parquet file is read (a heavy optional dependency:
a run over tars never loads it, and ``shardio`` never does).
"""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from preprocess.config import JobConfig
from preprocess.inputs.raw_sample import SAMPLES, InputExtent, RawSample, SampleProblem
from shardio.errors import InputError, ShardioError
from shardio.failure_reasons import FailureCode
from shardio.format import escape_name
from shardio.store.root import DatasetRoot, Place, open_input

__all__ = ["PARQUET_SUFFIXES", "is_parquet_head", "iter_parquet_samples", "ParquetLayout", "parquet_layout",
           "IMAGE_NAMES", "CAPTION_NAMES", "LABEL_NAMES", "BATCH_ROWS"]

PARQUET_SUFFIXES = (".parquet",)
IMAGE_NAMES = ("image", "jpg", "jpeg", "png", "webp", "img")
CAPTION_NAMES = ("caption", "text", "txt")
LABEL_NAMES = ("label", "cls")
# Rows turned into Python objects at once: 64 web images are ~20 MB, and per-batch overhead stays small.
BATCH_ROWS = 64


def is_parquet_head(head: bytes) -> bool:
    """A Parquet file starts (and ends) with the magic ``PAR1``."""
    return head.startswith(b"PAR1")


def _pyarrow(path: str) -> tuple[Any, Any]:
    """(pyarrow, pyarrow.parquet), or ``InputError`` saying what to install."""
    try:
        # An optional heavy dependency (~60 MB, ~0.2 s to import): only a Parquet input loads it.
        import pyarrow
        import pyarrow.parquet
    except ImportError as e:
        raise InputError(path, "reading Parquet needs pyarrow, which the job's extra installs: "
                               "pip install 'shardio[preprocess]' (or `make install`)", lasting=False) from e
    return pyarrow, pyarrow.parquet


@dataclass(frozen=True)
class ParquetLayout:
    """Which column is what, decided from the schema (see the module docstring)."""

    image: str
    image_is_struct: bool  # Hugging Face's {bytes, path}
    caption: str | None
    label: str | None
    key: str | None
    status: str | None  # img2dataset's: said in the reason of a row without image bytes
    error_message: str | None
    json: tuple[str, ...]  # the other scalar columns
    class_names: tuple[str, ...] = ()  # the label's names, where Hugging Face's metadata gives a ClassLabel

    @property
    def columns(self) -> list[str]:
        named = [self.image, self.caption, self.label, self.key, self.status, self.error_message, *self.json]
        return list(dict.fromkeys(name for name in named if name is not None))


def _is_binary(pa: Any, kind: Any) -> bool:
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind)


def _is_image_type(pa: Any, kind: Any) -> bool:
    """Binary, or a struct with a binary ``bytes`` field (Hugging Face's ``Image``: ``{bytes, path}``)."""
    if pa.types.is_struct(kind):
        index = kind.get_field_index("bytes")
        return index >= 0 and _is_binary(pa, kind.field(index).type)
    return _is_binary(pa, kind)


def _is_scalar(pa: Any, kind: Any) -> bool:
    return (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)
            or pa.types.is_string(kind) or pa.types.is_large_string(kind))


def parquet_layout(path: str, schema: Any, cfg: JobConfig) -> ParquetLayout:
    """The columns of a file with this (arrow) schema; ``InputError`` naming the file and its columns if
    no image column can be told."""
    pa, _ = _pyarrow(path)

    types = {f.name: f.type for f in schema}
    said = ", ".join(f"{name} ({kind})" for name, kind in list(types.items())[:12]) or "none"
    if cfg.image_column is not None:
        if cfg.image_column not in types:
            raise InputError(path, f"no column {cfg.image_column!r} (image_column); its columns: {said}")
        if not _is_image_type(pa, types[cfg.image_column]):
            raise InputError(path, f"column {cfg.image_column!r} (image_column) is {types[cfg.image_column]}, "
                                   "not binary nor a {bytes, path} struct")
        image = cfg.image_column
    else:
        candidates = [name for name, kind in types.items() if _is_image_type(pa, kind)]
        named = [name for name in IMAGE_NAMES if name in candidates]
        if len(candidates) == 1 or named:
            image = named[0] if named else candidates[0]
        elif not candidates:
            raise InputError(path, f"no image column (binary, or a {{bytes, path}} struct); its columns: {said}")
        else:
            raise InputError(path, f"several binary columns ({', '.join(candidates)}): name the image one "
                                   "with image_column in the config")
    caption = next((name for name in CAPTION_NAMES if name in types and _is_string(pa, types[name])), None)
    if cfg.label_column is not None:
        if cfg.label_column not in types or not pa.types.is_integer(types[cfg.label_column]):
            raise InputError(path, f"no integer column {cfg.label_column!r} (label_column); its columns: {said}")
        label = cfg.label_column
    else:
        label = next((name for name in LABEL_NAMES if name in types and pa.types.is_integer(types[name])), None)
    key = "key" if "key" in types and _is_string(pa, types["key"]) else None
    status = "status" if "status" in types and _is_string(pa, types["status"]) else None
    error_message = ("error_message" if "error_message" in types and _is_string(pa, types["error_message"])
                     else None)
    taken = {image, caption, label, key}
    others = tuple(name for name, kind in types.items() if name not in taken and _is_scalar(pa, kind))
    return ParquetLayout(image, pa.types.is_struct(types[image]), caption, label, key, status, error_message,
                         others, _class_names(schema, label))


def _class_names(schema: Any, label: str | None) -> tuple[str, ...]:
    """The names of a Hugging Face ``ClassLabel`` column, from the schema's ``huggingface`` metadata (what
    ``datasets`` writes: ``{"info": {"features": {label: {"_type": "ClassLabel", "names": [...]}}}}``);
    none where the file has no such metadata or it does not parse."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if label is None or raw is None:
        return ()
    try:
        feature = json.loads(raw)["info"]["features"][label]
        names = feature["names"] if feature.get("_type") == "ClassLabel" else []
    except (ValueError, KeyError, TypeError, AttributeError):
        return ()
    return tuple(str(name) for name in names) if isinstance(names, list) else ()


def _is_string(pa: Any, kind: Any) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _open(file: DatasetRoot, size: int, pq: Any) -> tuple[Any, Any]:
    """(ParquetFile, the file object to close). A local file by pyarrow's own reads; an object by ranged
    GETs."""
    path, backend = file.path, file.storage
    handle: Any = open(path, "rb") if backend.is_local else _RangedObject(path, size, backend)
    try:
        return pq.ParquetFile(handle, memory_map=False, pre_buffer=False), handle
    except FileNotFoundError:
        handle.close()
        raise InputError(path, "no such file", lasting=False) from None
    except ShardioError:  # the store's (unreachable, refused): not the bytes'
        handle.close()
        raise
    except Exception as e:
        handle.close()
        raise _unreadable(path, e) from e


def _unreadable(path: str, error: Exception) -> InputError:
    """The input's failure for any error reading its footer or schema. pyarrow raises more than its own
    ``ArrowException`` there: a column name that is not UTF-8 is a ``UnicodeDecodeError`` from its
    ``frombytes``, a forged length can be a ``ValueError`` or ``MemoryError``. All of them are the bytes' own
    (the same file fails the same way every run, so the run remembers it), except an ``OSError`` from the disk
    or network (errno set), which a retry may cure."""
    if isinstance(error, OSError) and _is_io_error(error):
        return InputError(path, f"not a readable Parquet file ({_said(error)}); check the disk or network "
                                "and rerun", lasting=False)
    return InputError(path, f"not a readable Parquet file ({type(error).__name__}: {_said(error)}); "
                            "re-download it, or check that this is the file meant")


def _said(error: BaseException) -> str:
    return " ".join((str(error) or type(error).__name__).split())[:300]


def _is_io_error(error: OSError) -> bool:
    """An OSError from the disk or network (a retry may cure it), not pyarrow's parse errors (also OSErrors)."""
    return error.errno is not None


def iter_parquet_samples(source: Place, cfg: JobConfig, size: int | None = None, etag: str = "",
                         extent: InputExtent | None = None) -> Iterator[RawSample | SampleProblem]:
    """Yield each row of the Parquet file at ``source`` (its path, or the input opened already) as a sample,
    in file order, or why it is unusable; raise ``InputError`` naming the file (and the rows) if the file or
    a row group cannot be read."""
    file = open_input(source)
    path = file.path
    pa, pq = _pyarrow(path)
    if os.path.isdir(path):
        raise InputError(path, "is a directory, not a Parquet file")
    if size is None:
        try:
            size = file.storage.file_size(path)
        except FileNotFoundError:
            raise InputError(path, "no such file", lasting=False) from None
    if size == 0:
        raise InputError(path, "empty file (0 bytes), not a Parquet file")
    parquet, handle = _open(file, size, pq)
    try:
        try:  # the rest of the footer: the schema and the row groups' sizes
            schema = parquet.schema_arrow
            footer = parquet.metadata
            group_rows = [footer.row_group(group).num_rows for group in range(footer.num_row_groups)]
        except ShardioError:
            raise
        except Exception as e:
            raise _unreadable(path, e) from e
        layout = parquet_layout(path, schema, cfg)
        if extent is not None:  # one item per row: the footer's count is the input's
            extent.expect(footer.num_rows, SAMPLES)
        stem = _stem(path)
        seen: set[str] = set()
        row = 0
        for group, rows_in_group in enumerate(group_rows):
            first = row
            batches = parquet.iter_batches(batch_size=BATCH_ROWS, row_groups=[group], columns=layout.columns,
                                           use_threads=False)
            while True:
                try:
                    batch = next(batches, None)
                    if batch is None:
                        break
                    columns = {name: batch.column(name).to_pylist() for name in layout.columns}
                except (pa.lib.ArrowException, OSError) as e:
                    raise InputError(path, f"row group {group} (rows {first} to {first + rows_in_group - 1}) "
                                           f"cannot be read ({_said(e)}); re-download the file",
                                     lasting=not (isinstance(e, OSError) and _is_io_error(e))) from e
                for offset in range(batch.num_rows):
                    yield _row_sample(layout, columns, offset, row + offset, stem, seen)
                row += batch.num_rows
        if isinstance(handle, _RangedObject):
            handle.check_unchanged(etag)
    finally:
        handle.close()


def _stem(path: str) -> str:
    base = path.rstrip("/").rsplit("/", 1)[-1]
    return base[: -len(".parquet")] if base.lower().endswith(".parquet") else base


def _row_sample(layout: ParquetLayout, columns: dict[str, list[Any]], offset: int, row: int, stem: str,
                seen: set[str]) -> RawSample | SampleProblem:
    raw_key = columns[layout.key][offset] if layout.key else None
    key = escape_name(raw_key) if raw_key else f"{stem}/{row}"
    member = f"row {row}"
    if key in seen:
        return SampleProblem(key, FailureCode.DUPLICATE_KEY, f"{member}: key seen twice in this file (the first "
                                                             "occurrence is kept)", member)
    seen.add(key)
    cell = columns[layout.image][offset]
    image = cell.get("bytes") if layout.image_is_struct and cell is not None else cell
    if not image:
        return SampleProblem(key, FailureCode.MISSING_IMAGE, _why_no_image(layout, columns, offset, member, cell),
                             member)
    fields: dict[str, bytes] = {}
    caption = columns[layout.caption][offset] if layout.caption else None
    if caption is not None:
        fields["txt"] = caption.encode("utf-8", "surrogatepass")
    label = columns[layout.label][offset] if layout.label else None
    extra = {name: _json_value(columns[name][offset]) for name in layout.json}
    if label is not None and label >= 0:
        fields["cls"] = str(label).encode()
        if label < len(layout.class_names):
            extra["class"] = layout.class_names[label]
    if extra:
        fields["json"] = json.dumps(extra, ensure_ascii=False, allow_nan=False).encode("utf-8", "surrogatepass")
    return RawSample(key, member, image, fields)


def _why_no_image(layout: ParquetLayout, columns: dict[str, list[Any]], offset: int, member: str, cell: Any) -> str:
    said = f"{member}: no image bytes in column {layout.image!r}"
    if layout.image_is_struct and cell is not None and cell.get("path"):
        said += f" (only a path: {str(cell['path'])[:200]!r})"
    status = columns[layout.status][offset] if layout.status else None
    if status is not None:
        said += f" (status {status!r}"
        message = columns[layout.error_message][offset] if layout.error_message else None
        said += f": {' '.join(str(message).split())[:200]})" if message else ")"
    elif cell is not None and not layout.image_is_struct:
        said = f"{member}: empty image cell (0 bytes) in column {layout.image!r}"
    return said


def _json_value(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # strict JSON has no NaN or infinity
    return value


class _RangedObject(io.RawIOBase):
    """A seekable file over an object in a bucket: each ``read`` is one ranged GET of exactly what pyarrow
    asks for (the footer, then a row group's column chunks), nothing else is fetched."""

    def __init__(self, url: str, size: int, backend: Any) -> None:
        self.url, self.size, self._backend, self._pos = url, size, backend, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, length: int = -1) -> bytes:
        end = self.size if length is None or length < 0 else min(self.size, self._pos + length)
        if end <= self._pos:
            return b""
        data = self._backend.read_range(self.url, self._pos, end - self._pos)
        self._pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def check_unchanged(self, etag: str) -> None:
        """``InputError`` if the object was replaced while it was read (its ETag is not the listed one)."""
        if not etag:
            return
        now = self._backend.info(self.url).version
        if now and now != etag:
            raise InputError(self.url, f"the object was replaced while it was read (ETag {now}, listed as {etag}): "
                                       "not committed; the next run reads the new one", lasting=False)
