"""Finding and loading a dataset's manifests on its storage: ``DIR/manifest.json`` (the current generation),
the kept generations in ``DIR/manifests/``, and what to say when a directory holds none (the format they
follow is ``shardio.format.spec``'s). The reader and the write side both load through here."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from shardio.errors import ShardError, ShardFormatError, ShardIntegrityError
from shardio.store.checksum import SHA256, XXH3_128
from shardio.format.index import (
    BUCKET_COLUMN,
    SegmentRef,
    check_segment_outputs,
    check_shard_buckets,
    manifest_from_root,
    parse_segment_refs,
)
from shardio.format.segment_cache import cached_segment
from shardio.format.segment_columns import SegmentColumns, map_segment, segment_from_bytes
from shardio.format.shard_table import ShardTable, fold_segments
from shardio.format.buckets import root_buckets
from shardio.format.dataset_config import ConfigDerived
from shardio.format.dataset_manifest import Manifest
from shardio.format.entries import InputEntry, RetiredFile
from shardio.format.model_outputs import OUTPUT_DIGEST_COLUMN, OutputSpec, check_output_digests, root_outputs
from shardio.format.names import check_dataset_path
from shardio.format.root_fields import (parse_json, root_classes, root_dataset_id, root_generation, root_name_fence,
                                        root_shape)
from shardio.format.spec import FORMAT_NAME, INDEX_VERSIONS, MANIFEST_NAME, MANIFESTS_DIR, SHARDS_DIR
from shardio.store.base import Storage
from shardio.store.root import DatasetRoot, Place, open_root
from shardio.store.holders import writer_holding

__all__ = ["DatasetIndex", "generation_path", "list_generations", "load_index", "load_manifest", "open_segment",
           "read_root"]

_Loaded = TypeVar("_Loaded")


@dataclass
class DatasetIndex(ConfigDerived):
    """One generation as a reader needs it: the root's fields and the shards as columns (``ShardTable``),
    no object per shard or input (``load_manifest`` gives those, for a commit to edit)."""

    path: str
    shape: tuple[int, int, int]
    config: dict[str, Any]
    versions: dict[str, Any]
    updated: str
    generation: int
    shards: ShardTable
    retired: list[RetiredFile] = field(default_factory=list)
    # input_count, failed, bytes, meta_bytes: a format 3 root's totals (computed for a version 1/2 one)
    totals: dict[str, int] = field(default_factory=dict)
    source_version: str = ""
    # A format 3 root's segments (``SegmentRef``), oldest first; None for a version 1/2 manifest.
    segments: list[SegmentRef] | None = None
    dataset_id: str = ""  # the root's ``dataset`` ("" where it has none: spec, "Identity")
    name_fence: str = ""  # the root's ``fence`` ("" where it has none: spec, "Fencing names")
    classes: tuple[str, ...] = ()  # the root's class table (() where it has none: spec, "Classes")
    outputs: tuple[OutputSpec, ...] = ()  # the root's model outputs (() where it has none: spec, "Model outputs")

    @property
    def samples(self) -> int:
        return int(self.shards.samples.sum())

    def committed_inputs(self) -> dict[str, InputEntry]:
        """The committed inputs (name -> entry: size, mtime, samples, failed, ETag; ``shards`` left empty):
        what a rerun compares its listing with, O(inputs), without an object per shard."""
        return self.shards.committed_inputs()


def generation_path(place: Place, generation: int) -> str:
    """``DIR/manifests/GEN.json``: the file generation ``generation`` is committed as, once."""
    return _generation_path(open_root(place), generation)


def _generation_path(root: DatasetRoot, generation: int) -> str:
    return root.join(MANIFESTS_DIR, f"{generation:010d}.json")


def list_generations(place: Place) -> list[int]:
    """The generations with a file in ``DIR/manifests/``, oldest first (temp files and strays ignored)."""
    return _generations(open_root(place))


def _generations(root: DatasetRoot) -> list[int]:
    store, directory = root.storage, root.path
    found = []
    for name in store.list_dir(store.join(directory, MANIFESTS_DIR)):
        stem, dot, ext = name.partition(".")
        if dot and ext == "json" and stem.isdigit():
            found.append(int(stem))
    return sorted(found)


def read_root(place: Place, generation: int | None = None) -> dict:
    """The JSON of ``manifest.json`` (or of generation ``generation``'s file) without its segments: a
    version 3 root holds the totals (``samples``, ``shard_count``, ``bytes``...), so ``shardio info``
    on a dataset of millions of shards reads a few KB. ``place``: a path, or a root opened already."""
    root = open_root(place)
    path = root.join(MANIFEST_NAME) if generation is None else _generation_path(root, generation)
    store = root.storage
    doc = parse_json(store.read_bytes(path), path)
    if not isinstance(doc, dict):
        raise ShardFormatError(f"{path}: not a shardio manifest (a JSON {type(doc).__name__})")
    root_generation(doc, path)  # callers read it as a number
    return doc


def _read_document(store: Storage, path: str) -> tuple[Any, str]:
    """The JSON at ``path`` and its version (ETag on object storage); ShardFormatError naming it if not JSON."""
    data, version = store.read_versioned(path)
    return parse_json(data, path), version


def _segment_missing(segment: str) -> ShardIntegrityError:
    """A segment a root names is not there: missing for good (the repair hint), or collected by retention
    after this process read the root that named it (``_load`` tells which, by ``missing_segment`` and
    ``root_generation``: whether that root was replaced since)."""
    error = ShardIntegrityError(f"{segment}: index segment missing (named by the root); HINT: `preprocess verify "
                                "DIR --repair` restores a kept generation")
    error.missing_segment = segment  # type: ignore[attr-defined]
    return error


def _segments_of_root(doc: dict[str, Any], path: str, read: Callable[[], _Loaded]) -> _Loaded:
    try:
        return read()
    except ShardIntegrityError as e:
        e.root_generation = root_generation(doc, path)  # type: ignore[attr-defined]
        raise


def _missing_segment(error: ShardIntegrityError) -> tuple[str, int] | None:
    """(segment, generation of the root that named it) when ``error`` says a segment is gone."""
    segment = getattr(error, "missing_segment", None)
    return None if segment is None else (segment, getattr(error, "root_generation", -1))


def _read_manifest(store: Storage, path: str, directory: str) -> Manifest:
    doc, version = _read_document(store, path)
    if _is_index_root(doc):
        manifest = _segments_of_root(doc, path, lambda: manifest_from_root(
            doc, path, lambda rel: _read_segment(store, directory, rel)))
    else:
        manifest = Manifest.from_json(doc, path)
    manifest.source_version = version
    return manifest


def _is_index_root(doc: Any) -> bool:
    """Whether ``doc`` is a root that names index segments (format 3 or 4), not a version 1/2 manifest."""
    return isinstance(doc, dict) and doc.get("format") == FORMAT_NAME and doc.get("format_version") in INDEX_VERSIONS


def _read_segment(store: Storage, directory: str, rel: str) -> bytes:
    path = store.join(directory, rel)
    try:
        return store.read_bytes(path)
    except FileNotFoundError as e:
        raise _segment_missing(path) from e


def _read_index(store: Storage, path: str, directory: str, segment_cache: str | None = None) -> DatasetIndex:
    doc, version = _read_document(store, path)
    if not _is_index_root(doc):
        manifest = Manifest.from_json(doc, path)
        shards = manifest.shards
        totals = {"input_count": len(manifest.inputs), "failed": sum(i.failed for i in manifest.inputs.values()),
                  "bytes": sum(e.bytes for e in shards), "meta_bytes": sum(e.meta_bytes for e in shards)}
        return DatasetIndex(path, manifest.shape, manifest.config, manifest.versions, manifest.updated,
                            manifest.generation, ShardTable.from_entries(shards, path), manifest.retired, totals,
                            version)
    refs = parse_segment_refs(doc, path)
    buckets = root_buckets(doc, path)
    outputs = root_outputs(doc, len(buckets) if buckets else 1, path)
    segments = _segments_of_root(doc, path, lambda: [open_segment(store, directory, ref, segment_cache)
                                                     for ref in refs])
    for segment in segments:
        check_shard_buckets(segment.arrays.get(BUCKET_COLUMN), len(segment.arrays["shard_samples"]), buckets,
                            segment.path)
        digests = check_output_digests(segment.arrays.get(OUTPUT_DIGEST_COLUMN), len(segment.arrays["shard_samples"]),
                                       segment.path)
        check_segment_outputs(digests, segment.input_count > 0, len(outputs), segment.path)
    table = fold_segments(segments, path)
    try:
        h, w, c = root_shape(doc, path)
        index = DatasetIndex(path, (h, w, c), doc["config"], doc.get("versions", {}), doc.get("updated", ""),
                             root_generation(doc, path), table, [RetiredFile(**r) for r in doc.get("retired", [])],
                             {k: int(doc.get(k, 0)) for k in ("input_count", "failed", "bytes", "meta_bytes")},
                             version, refs, root_dataset_id(doc, path), root_name_fence(doc, path),
                             root_classes(doc, path), outputs)
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise ShardFormatError(f"{path}: malformed root ({type(e).__name__}: {e})") from e
    for retired in index.retired:
        check_dataset_path(retired.path, path)
    if doc.get("samples") != index.samples or doc.get("shard_count") != len(table):
        raise ShardIntegrityError(f"{path}: says {doc.get('samples')} samples in {doc.get('shard_count')} shards, "
                                  f"its segments hold {index.samples} in {len(table)}")
    return index


def open_segment(store: Storage, directory: str, ref: SegmentRef, segment_cache: str | None = None) -> SegmentColumns:
    """Segment ``ref`` of the dataset at ``directory`` as columns: memory-mapped where local; from an object
    store, read whole, or with ``segment_cache`` (a local directory) through the node's shared copy
    (``shardio.format.segment_cache``); its size and sha256 checked against the root's ``ref`` first."""
    segment_file = store.join(directory, ref.path)
    expected = ref.path.rsplit("/", 1)[1].removesuffix(".npz")
    try:
        if store.is_local:
            return map_segment(segment_file, ref.bytes, expected)
        if segment_cache is not None:
            return cached_segment(store, segment_file, ref.bytes, expected, segment_cache)
        return segment_from_bytes(store.read_bytes(segment_file), segment_file, ref.bytes, expected)
    except FileNotFoundError as e:
        raise _segment_missing(segment_file) from e


def load_manifest(place: Place, generation: int | None = None) -> Manifest:
    """Read and check ``DIR/manifest.json`` (the current generation), or the kept generation ``generation``
    from ``DIR/manifests/``; errors say whether the directory is empty, mid-write or foreign, and which
    kept generations can restore a corrupt ``manifest.json``. ``place``: a path, or a root opened already."""
    return _load(open_root(place), generation, _read_manifest)


def load_index(place: Place, generation: int | None = None,
               segment_cache: str | None = None) -> DatasetIndex:
    """``load_manifest`` for a reader: the same checks and errors, the shards as columns (a format 3 index's
    segments memory-mapped where local), so opening 2.3M shards costs ~30 bytes a shard, not an object.
    ``segment_cache``: a local directory where an object-store dataset's segments are kept for every process
    of the node (``shardio.format.segment_cache``); None reads them whole each time."""
    root = open_root(place)
    if segment_cache is None:
        return _load(root, generation, _read_index)
    return _load(root, generation,
                 lambda store, path, folder: _read_index(store, path, folder, segment_cache))


def _load(root: DatasetRoot, generation: int | None, read: Callable[[Storage, str, str], _Loaded]) -> _Loaded:
    store, directory = root.storage, root.path
    if not store.exists(directory):
        raise ShardFormatError(f"{directory}: no such dataset directory")
    if store.is_file(directory):
        kind = "a tar file (an input)" if directory.endswith(_TAR_SUFFIXES) else "a file"
        raise ShardFormatError(
            f"{directory}: is {kind}, not a dataset directory; a dataset is the directory that "
            "`preprocess run INPUT... --output DIR` writes (DIR holds manifest.json): pass DIR"
        )
    if generation is not None:
        path = _generation_path(root, generation)
        try:
            return _read_generation(root, generation, path, read)
        except ShardIntegrityError as e:
            gone = _missing_segment(e)
            if gone is None or store.exists(path):
                raise
            raise ShardError(f"{gone[0]}: gone: generation {generation} was collected by retention while this read "
                             "it (nothing is damaged): open the current generation, or keep generations longer "
                             "(--retain-hours, --retain-generations)") from e
    path = store.join(directory, MANIFEST_NAME)
    kept = _generations(root)
    restore = (f"; kept generations: {_describe(kept)}: `preprocess verify {directory} --repair` restores the "
               "newest valid one (so does the next `preprocess run`)") if kept else ""
    if not store.exists(path):
        raise ShardFormatError(f"{path}: missing; {_why_no_manifest(store, directory)}{restore}")
    try:
        return _read_current(store, path, directory, read)
    except ShardFormatError as e:
        if not restore and "HINT" in str(e):
            raise
        if not restore:
            raise ShardFormatError(f"{e}; HINT: restore it from a backup, or re-run preprocess into a new "
                                   "directory") from e
        raise ShardFormatError(f"{e}{restore}") from e
    except ShardIntegrityError as e:
        raise ShardIntegrityError(f"{e}{restore}") from e


# A root whose segment is gone is re-read this many times when manifest.json has moved on meanwhile: a
# run commits every few seconds and its retention collects the passing roots, so a reader on a slow
# link (3 s a segment GET) may read a root that is collected before it has fetched its segments.
ROOT_RETRIES = 5


def _read_current(store: Storage, path: str, directory: str, read: Callable[[Storage, str, str], _Loaded]) -> _Loaded:
    """``read`` of ``manifest.json``; when a segment its root names is gone and ``manifest.json`` now names
    another generation (retention collected the one read), the newest root is read instead, up to
    ``ROOT_RETRIES`` times. A segment missing from the root that is still current is the dataset's damage
    (the ShardIntegrityError of ``_segment_missing``, with the repair hint)."""
    attempt = 0
    while True:
        try:
            return read(store, path, directory)
        except ShardIntegrityError as e:
            gone = _missing_segment(e)
            if gone is None:
                raise
            newest = root_generation(_read_document(store, path)[0], path) if store.exists(path) else None
            if newest is None or newest == gone[1]:
                raise  # the current root names it: the dataset's damage, with the repair hint
            attempt += 1
            if attempt > ROOT_RETRIES:
                raise ShardError(
                    f"{path}: the dataset moved on {attempt} times while this read its index (generation {gone[1]}'s "
                    f"segment {gone[0]} was collected before it was read; now generation {newest}): a run is "
                    "committing and collecting its passing roots; nothing is damaged: open it again") from e


def _read_generation(root: DatasetRoot, generation: int, path: str,
                     read: Callable[[Storage, str, str], _Loaded]) -> _Loaded:
    store, directory = root.storage, root.path
    if not store.exists(path):
        kept = _generations(root)
        raise ShardFormatError(
            f"{path}: generation {generation} is not kept (kept: {_describe(kept)}); retention collected it, "
            "or it was never committed: open the current generation, or raise --retain-hours/--retain-generations "
            "(a run's passing generations, current for minutes: --retain-passing-minutes 0 keeps each)"
        )
    loaded = read(store, path, directory)
    if loaded.generation != generation:  # type: ignore[attr-defined]
        raise ShardFormatError(f"{path}: holds generation {loaded.generation}, not {generation}")  # type: ignore[attr-defined]
    return loaded


def _describe(generations: list[int]) -> str:
    if not generations:
        return "none"
    if len(generations) > 6:
        return f"{generations[0]}..{generations[-1]} ({len(generations)} files)"
    return ", ".join(str(g) for g in generations)


_TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")


def _why_no_manifest(store: Storage, directory: str) -> str:
    """What a directory without a manifest is, and what to pass instead (the common mistakes: the
    folder of input tars, the dataset's own ``shards/``)."""
    holder = writer_holding(store, directory)
    if holder:
        return (f"a run is writing it ({holder}) and has not committed yet: wait for it to finish, then open it "
                "again (`preprocess run --wait` queues behind it)")
    entries = [e for e in store.list_dir(directory) if not e.startswith(".")]
    if store.is_local:
        parent, base = os.path.dirname(os.path.abspath(directory)), os.path.basename(os.path.abspath(directory))
    else:
        parent, base = directory.rstrip("/").rsplit("/", 1)
    if not entries:
        return "the directory is empty; run `preprocess run INPUT... --output DIR` first"
    if SHARDS_DIR in entries:
        return "shards exist but no manifest: a first run is still writing or was killed; wait or re-run it"
    if base == SHARDS_DIR or any(e.endswith(".npy") for e in entries):
        if store.exists(store.join(parent, MANIFEST_NAME)):
            return f"this is the dataset's {SHARDS_DIR}/ folder: pass the dataset directory {parent}"
        return f"this looks like a {SHARDS_DIR}/ folder: pass the dataset directory (its parent, with manifest.json)"
    tars = [e for e in entries if e.endswith(_TAR_SUFFIXES)]
    if tars:
        return (f"this directory holds {len(tars)} input tar(s), not a dataset: preprocess them first "
                f"(`preprocess run '{store.join(directory, '*.tar')}' --output OUT`) and pass OUT")
    return ("this is not a shardio dataset directory: pass the directory that "
            "`preprocess run --output DIR` wrote (it holds manifest.json)")


def main(argv: list[str]) -> int:
    """``python -m shardio.format.manifests DIR [--sha256]``: ``DIGEST  shards/NAME`` lines of the current
    generation's xxh3_128 shards (or sha256 ones), for ``xxh128sum -c`` / ``sha256sum -c`` run in DIR."""
    paths = [a for a in argv if not a.startswith("--")]
    algorithm = SHA256 if "--sha256" in argv else XXH3_128
    for entry in load_manifest(paths[0] if paths else ".").shards:
        if entry.checksum_algorithm == algorithm:
            print(f"{entry.checksum}  {entry.path}\n{entry.meta_checksum}  {entry.meta_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
