"""What an INPUT can be: the table of input kinds, telling one from its name or its first bytes, and reading it.

One row per kind of input (a tar, plain or compressed, as WebDataset and img2dataset write; a Parquet
file, as Hugging Face ``datasets`` and img2dataset write; a folder of image files, local or a prefix of
objects, named as an INPUT: ``preprocess.inputs.folder_samples``). A row names the kind for a person, the
file-name suffixes that claim it, a test of the first ``HEAD_BYTES`` bytes, and the reader that yields
its samples (``RawSample`` / ``SampleProblem``: key, image bytes, ``txt`` / ``json`` / ``cls``). The
worker asks this table for an input's reader (``samples_of``) and everything after the samples (decode,
shards, index, report, failure reasons) is shared, whatever the kind. A new kind adds its row here, and
``preprocess.inputs.resolve`` and ``preprocess.worker`` ask this table only.

When the first bytes are read. A name that claims a kind (``x.tar``, ``x.tar.gz``, ``x.parquet``) is
taken at its word: a nightly rerun over 10,000 tars makes no read or request per tar
(``preprocess.inputs.resolve``), and a ``.tar`` that turns out not to be one fails as an input (exit 1, named in
the report), as a corrupt one does. A name that claims no kind (``notes.txt``, ``shard-000``: only an
INPUT named explicitly can be one) is read: its first 512 bytes, one ``read`` or one ranged GET (and once
more by the worker that reads it). If no kind takes them the run is refused before Ray starts and before
the output is touched (``UnsupportedInput``, exit 2), naming the file, what it looks like and the kinds
accepted.

Globs. A glob takes the files whose name claims a kind that the glob may take: tars always, another kind
only when the pattern's own name ends with one of its suffixes (``data/*.parquet``). So ``data/*`` over
img2dataset's WebDataset output takes its tars and still ignores the ``.parquet`` metadata files written
beside them (they hold no images), as it always did. A glob also takes the folders (local, or prefixes of
objects) it matches that hold image files, whatever it ends with unless that claims a file kind
(``data/*``, ``data/*/``, ``s3://bucket/drops/*``; not ``data/*.tar``): ``preprocess.inputs.resolve`` looks into
them (``glob_takes_folders``); a folder inside another one taken is part of it, not a second input.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from preprocess.config import JobConfig
from preprocess.inputs.first_bytes import HEAD_BYTES, looks_like
from preprocess.inputs.folder_samples import iter_folder_samples
from preprocess.inputs.parquet_samples import PARQUET_SUFFIXES, is_parquet_head, iter_parquet_samples
from preprocess.inputs.raw_sample import InputExtent, RawSample, SampleProblem
from preprocess.inputs.tar_samples import TAR_SUFFIXES, is_tar_head, iter_tar_samples
from shardio.store.root import DatasetRoot, Place, open_input

__all__ = ["InputKind", "INPUT_KINDS", "HEAD_BYTES", "TAR_SUFFIXES", "claimed_kind", "kind_of", "looks_like",
           "accepted_kinds", "glob_takes", "glob_takes_folders", "glob_kinds", "FOLDER_KIND", "input_kind",
           "samples_of", "SampleReader", "strip_kind_suffix", "KindReader"]

# An input's samples: (the input as the worker opened it (``shardio.store.root.open_input``), or its path or
# URL; config; size and ETag as listed (size None: not listed, found by the reader); the ``InputExtent`` the
# reader says how far it is through the input in (or None: a reader that cannot tell, such as a Python
# source's, leaves it unset)) -> samples in the input's order.
# Raises ``shardio.errors.InputError`` naming the input if the input itself cannot be read.
SampleReader = Callable[[Place, JobConfig, "int | None", str, "InputExtent | None"],
                        Iterator[RawSample | SampleProblem]]


@dataclass(frozen=True)
class InputKind:
    name: str
    described: str  # for a person: what it is
    suffixes: tuple[str, ...]  # names that claim this kind (lower case)
    recognises: Callable[[bytes], bool]  # the first HEAD_BYTES bytes (fewer for a shorter file)
    samples: SampleReader  # a kind's reader
    plural: str  # what a glob takes of it, for a message
    any_glob: bool = False  # a glob takes it whatever the pattern's own suffix (tars: what globs always took)
    is_folder: bool = False  # a directory or prefix named as an INPUT (no suffix, no first bytes)


def _tar_samples(path: Place, cfg: JobConfig, size: int, etag: str,
                 extent: InputExtent | None = None) -> Iterator[RawSample | SampleProblem]:
    # An object is read at the size and ETag its LIST found (no HEAD; a replaced object fails the input).
    return iter_tar_samples(path, cfg.image_extensions, size=size, etag=etag, extent=extent)


INPUT_KINDS: tuple[InputKind, ...] = (
    InputKind("tar", "a tar archive of samples (WebDataset, img2dataset), plain or compressed with gzip, bzip2 "
                     "or xz", TAR_SUFFIXES, is_tar_head, _tar_samples,
              "tar files (.tar, .tar.gz, .tgz, .tar.bz2, .tar.xz)", any_glob=True),
    InputKind("parquet", "a Parquet file with an image column (Hugging Face datasets, img2dataset)",
              PARQUET_SUFFIXES, is_parquet_head, iter_parquet_samples,
              "Parquet files where the pattern ends with .parquet"),
    InputKind("folder", "a folder of image files with KEY.txt / KEY.json sidecars (a local directory or a "
                        "bucket prefix holding images, named as an INPUT)", (), lambda head: False, iter_folder_samples,
              "folders of image files (image_extensions)", is_folder=True),
)
FOLDER_KIND = next(kind for kind in INPUT_KINDS if kind.is_folder)
_KIND_NAMED = {kind.name: kind for kind in INPUT_KINDS}


def claimed_kind(name: str) -> InputKind | None:
    """The kind a path or URL's name claims by its suffix, or None."""
    lowered = name.lower()
    return next((kind for kind in INPUT_KINDS if lowered.endswith(kind.suffixes)), None)


def kind_of(head: bytes) -> InputKind | None:
    """The kind whose test takes these first bytes, or None."""
    return next((kind for kind in INPUT_KINDS if kind.recognises(head)), None)


def glob_takes(pattern: str, name: str) -> bool:
    """Whether a glob ``pattern`` takes the file ``name`` it matched (the module docstring's rule)."""
    kind = claimed_kind(name)
    return kind is not None and (kind.any_glob or pattern.lower().endswith(kind.suffixes))


def glob_takes_folders(pattern: str) -> bool:
    """Whether a glob ``pattern`` may take the folders it matches: unless its name claims a file kind."""
    return claimed_kind(pattern.rstrip("/")) is None


def glob_kinds() -> str:
    """What a glob takes, for a message."""
    said = [kind.plural for kind in INPUT_KINDS]
    return f"{', '.join(said[:-1])} or {said[-1]}"


def strip_kind_suffix(name: str) -> str:
    """``name`` without the suffix that claims its kind (``a.parquet`` -> ``a``); tars as shard names always
    had them: ``.tar``, ``.tar.gz``, ``.tgz`` stripped, ``.tar.bz2`` / ``.tar.xz`` kept (names stay stable)."""
    lowered = name.lower()
    for suffix in (".tar.gz", ".tgz", ".tar", *PARQUET_SUFFIXES):
        if lowered.endswith(suffix):
            return name[: -len(suffix)]
    return name


def input_kind(place: Place, size: int | None = None) -> InputKind:
    """The kind of the input at ``place`` (its path, or the input opened already): claimed by its name, else a
    folder (a local directory, or a URL ending in ``/``: a prefix, as ``preprocess.inputs.resolve`` names
    one), else told from its first bytes (one read); bytes no kind takes go to the tar reader, which says what
    they look like."""
    source = open_input(place)
    path, backend = source.path, source.storage
    kind = claimed_kind(path)  # a name's word first: a directory named x.tar fails as the tar it claims to be
    if kind is None and (path.endswith("/") or backend.is_local and os.path.isdir(path)):
        return FOLDER_KIND
    if kind is None:
        try:
            head = (backend.read_range(path, 0, HEAD_BYTES if size is None else min(size, HEAD_BYTES))
                    if size != 0 else b"")
        except OSError:
            head = b""  # the reader itself then says why the input cannot be read
        kind = kind_of(head) or INPUT_KINDS[0]
    return kind


def samples_of(place: Place, cfg: JobConfig, size: int, etag: str = "",
               extent: InputExtent | None = None) -> Iterator[RawSample | SampleProblem]:
    """The samples of the input at ``place`` (its path, or the input opened already: opened here once, and
    its kind's reader given it), by the reader of its kind (``input_kind``); ``extent``, when given, is told
    how far the reader is through the input (progress)."""
    source = open_input(place)
    return input_kind(source, size).samples(source, cfg, size, etag, extent)


@dataclass(frozen=True)
class KindReader:
    """A ``SampleReader`` for a run's paths: each input by the reader of its kind, as the driver found it where
    the input's name claims none (``told``: path -> kind name, from the first bytes the run's resolution read
    once, ``ResolvedInputs.kinds``: the task does not read them again); under ``folder_classes`` a folder's
    classes numbered by the dataset's class table (``class_ids``, name -> id: ``shardio.format.spec``,
    "Classes") instead of the folder's own order. The job gives its tasks one (put in Ray's object store
    once); without either, ``samples_of`` is the reader."""

    told: Mapping[str, str] = field(default_factory=dict)
    class_ids: Mapping[str, int] | None = None

    def __call__(self, place: Place, cfg: JobConfig, size: int | None, etag: str,
                 extent: InputExtent | None = None) -> Iterator[RawSample | SampleProblem]:
        source: DatasetRoot = open_input(place)
        told = self.told.get(source.path)
        kind = _KIND_NAMED[told] if told else input_kind(source, size)
        if kind.is_folder and self.class_ids is not None:
            return iter_folder_samples(source, cfg, size, etag, extent, class_ids=self.class_ids)
        return kind.samples(source, cfg, size, etag, extent)


def accepted_kinds() -> str:
    """The kinds of input a run takes, for a message."""
    return "; ".join(kind.described if kind.is_folder else
                     f"{kind.described} ({', '.join(kind.suffixes)}, or any name whose content is one)"
                     for kind in INPUT_KINDS)
