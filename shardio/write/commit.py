"""The one commit of a dataset directory (``commit``; ``Committer`` and ``shardio.write.shard_writer``'s
``write_manifest`` go through it), over ``shardio.write.editable_index.EditableIndex`` (what is committed
read from the segments, this run's changes beside it): a storage barrier (the promoted shards are durable
first), one index segment of what changed (create-only), compaction, the root as ``manifests/GEN.json``
created once (conditional create), then ``manifest.json`` (the commit point). Killed between the two, the
generation file is newer than ``manifest.json`` and the next run's cleaning (``shardio.write.cleaning``)
removes it. Nothing is deleted at a commit: files it stops listing (an input dropped or changed:
``Committer.drop_input``, ``drop_inputs``) go to ``retired`` and wait for retention. A run's report is
published here too (``save_report``)."""

from __future__ import annotations

import json
from dataclasses import replace
import time
from collections.abc import Iterable
from typing import Any

from shardio.errors import CommitConflict
from shardio.format import (
    INDEX_DIR,
    MANIFEST_NAME,
    MANIFESTS_DIR,
    REPORTS_DIR,
    SHARDS_DIR,
    InputEntry,
    Manifest,
    RetiredFile,
    ShardEntry,
)
from shardio.format.model_outputs import shard_files
from shardio.format.index import Delta, SegmentRef, encode_segment, plan_compaction, root_json, segment_path
from shardio.format.manifests import DatasetIndex, generation_path, list_generations, load_index, open_segment
from shardio.format.segment_merge import MergedSegment, merge_columns
from shardio.format.segment_columns import SegmentColumns
from shardio.store.root import DatasetRoot, Place, open_root
from shardio.store.base import Storage
from shardio.write.committed import load_committed, manifest_path
from shardio.write.editable_index import EditableIndex
from shardio.write.lock import check_held, fenced_by_commit, shard_name_fence, utc_timestamp, writing

__all__ = ["commit", "Committer", "drop_inputs", "save_report", "report_path"]


def commit(place: Place, manifest: Manifest | EditableIndex, touched: Iterable[str] | None = None,
           run: str = "", published_here: bool = False) -> int:
    """The one way a dataset is committed: after a storage barrier that makes the promoted shards durable
    first (a power cut, e.g. a preempted VM, must not leave listed shards missing; one fsync, ~0.2 ms
    here), one new segment with what changed (of the ``touched`` names: a ``Committer`` knows them;
    every name when not given), compaction, then the root. A version 1/2 manifest is upgraded: its first
    segment holds everything. ``run``: the run committing (its id goes into the root: spec,
    "Retention"); ``published_here``: this writer published the current generation itself. A
    ``Manifest`` given here gets the new generation, version and segments. Returns the new generation."""
    root = open_root(place)
    directory = root.path
    if isinstance(manifest, Manifest):
        manifest.shards.sort(key=lambda e: (e.input, e.path))  # dataset order, as the index folds it
        index = EditableIndex.from_manifest(manifest)
        generation = commit(root, index, run=run)
        index.to_manifest_fields(manifest)
        return generation
    index = manifest
    store = root.storage
    shards_dir = store.join(directory, SHARDS_DIR)
    if store.exists(shards_dir):
        store.barrier(shards_dir)
    delta = index.delta(index.pending() if touched is None else set(touched))
    segments = list(index.segments or [])
    opened = index.opened_segments()  # by full path: compaction reads these, never fetches them again
    # Spec, "Fencing names": the root names it, and its segments hold it.
    index.name_fence = shard_name_fence(root, index)
    if not delta.empty:
        segments.append(_write_segment(root, delta, opened, index.name_fence))
    segments = _compact(root, segments, opened, index.name_fence)
    before = index.segments
    index.segments = segments
    try:
        generation = _publish_generation(root, index, published_here, run)
    except BaseException:
        index.segments = before  # not committed: the next commit writes this delta again
        raise
    # What was committed is read from the segments from now on (the ones this commit wrote opened,
    # the others kept): the changes the index held go, so a run holds only what it did since.
    index.committed(segments, [opened.get(store.join(directory, ref.path)) or open_segment(store, directory, ref)
                               for ref in segments])
    return generation


def _write_segment(root: DatasetRoot, delta: Delta, opened: dict[str, SegmentColumns] | None = None,
                   fence: str = "") -> SegmentRef:
    """Create the segment of ``delta`` (create-only: a name that exists already holds these bytes, its
    name being their sha256); named by no root until the commit publishes one."""
    store, directory = root.storage, root.path
    data = encode_segment(delta, fence)
    rel = segment_path(data)
    store.makedirs(store.join(directory, INDEX_DIR))
    check_held(root)
    try:
        store.publish_new(store.join(directory, rel), data)
    except FileExistsError:
        pass
    _keep_written(store, directory, rel, data, opened)
    shards = sum(len(value[1]) for value in delta.inputs.values())
    samples = sum(e.samples for value in delta.inputs.values() for e in value[1])
    return SegmentRef(rel, len(data), shards, len(delta.inputs), len(delta.removed), samples)


def _keep_written(store: Storage, directory: str, rel: str, data: bytes,
                  opened: dict[str, SegmentColumns] | None) -> None:
    """A segment just written, as columns for the rest of the run: on object storage its bytes (no GET
    of what this process wrote); a local one is mapped from its file when first needed."""
    if opened is not None and not store.is_local:
        path = store.join(directory, rel)
        opened[path] = SegmentColumns(data, path)


def _compact(root: DatasetRoot, segments: list[SegmentRef],
             opened: dict[str, SegmentColumns] | None = None, fence: str = "") -> list[SegmentRef]:
    """Merge the newest segments while ``plan_compaction`` asks (spec: "Compaction"); the merged segment
    is written before the root that names it, so a killed compaction is a killed commit. ``opened``:
    segments this run holds as columns already (by full path), read from there."""
    store, directory = root.storage, root.path
    opened = {} if opened is None else opened
    while count := plan_compaction(segments):
        run = [opened.get(store.join(directory, ref.path)) or open_segment(store, directory, ref)
               for ref in segments[-count:]]
        merged = merge_columns(run, from_start=count == len(segments), fence=fence)  # columns: no object per shard
        if merged is not None:
            ref = _write_merged(root, merged)
            _keep_written(store, directory, ref.path, merged.data, opened)
        segments = segments[:-count] + ([] if merged is None else [ref])
    return segments


def _write_merged(root: DatasetRoot, merged: MergedSegment) -> SegmentRef:
    """Create a merged segment as ``_write_segment`` creates a commit's (create-only)."""
    store, directory = root.storage, root.path
    rel = segment_path(merged.data)
    store.makedirs(store.join(directory, INDEX_DIR))
    check_held(root)
    try:
        store.publish_new(store.join(directory, rel), merged.data)
    except FileExistsError:
        pass
    return SegmentRef(rel, len(merged.data), merged.shards, merged.inputs, merged.removed, merged.samples)


def _publish_generation(root: DatasetRoot, index: EditableIndex, published_here: bool, run: str = "") -> int:
    """The last step of ``commit`` (its only caller): ``index`` as the next generation,
    ``manifests/GEN.json`` (created once: never over an existing one), then ``manifest.json``. Stamps the
    files retired by this commit, drops retired entries whose file ``collect`` already deleted (at a
    writer's first commit: later ones follow its own, and nothing collects while it holds the lock),
    and returns the new generation."""
    store, directory = root.storage, root.path
    if published_here:
        # This writer published the newest generation itself: no listing of manifests/ (a run of
        # 18,000 commits would list up to 18,000 files at each); another writer's is a CommitConflict below.
        generation = index.generation + 1
    else:
        generation = max([index.generation, *list_generations(root)]) + 1
    now = utc_timestamp()
    retired = []
    for entry in index.retired:
        if entry.generation == 0:
            retired.append(RetiredFile(entry.path, generation, now))
        elif published_here or store.exists(store.join(directory, entry.path)):
            retired.append(entry)
    before = index.generation, index.updated, index.retired
    index.generation, index.updated, index.retired = generation, now, retired
    try:
        data = json.dumps(root_json(index, index.totals, run), indent=1, ensure_ascii=False).encode("utf-8")
        store.makedirs(store.join(directory, MANIFESTS_DIR))
        check_held(root)
        try:
            store.publish_new(generation_path(root, generation), data)
        except FileExistsError:
            raise CommitConflict(f"{generation_path(root, generation)}: another writer committed generation "
                                 f"{generation} first; nothing was overwritten: rerun to build on it") from None
        path = store.join(directory, MANIFEST_NAME)
        if index.source_version or store.is_local:
            index.source_version = store.publish(path, data, if_version=index.source_version or None)
        else:
            try:  # a new dataset on object storage: create-if-absent, so two first runs cannot both commit
                index.source_version = store.publish_new(path, data)
            except FileExistsError:
                raise CommitConflict(f"{path}: another writer created this dataset first; nothing was "
                                     "overwritten: rerun to build on it") from None
        fenced_by_commit(root)  # this commit fenced out any previous holder (``writing``)
    except BaseException:
        index.generation, index.updated, index.retired = before
        raise
    return generation


class Committer:
    """Folds finished and dropped inputs into an ``EditableIndex`` of what is committed and commits it at
    most every ``interval_s`` seconds (``maybe_commit``) or when forced. The caller holds the lock.

    ``committed``: what ``load_committed`` gave (a ``DatasetIndex``: columns, no object per committed
    shard; a ``Manifest``: a version 1/2 one, upgraded at the first commit), or None for a new dataset (then
    ``shape``, ``config``, ``versions`` say what it is)."""

    def __init__(self, place: Place, committed: DatasetIndex | Manifest | None,
                 interval_s: float = 0.0, run: str = "", *, shape: tuple[int, int, int] = (0, 0, 3),
                 config: dict[str, Any] | None = None, versions: dict[str, Any] | None = None) -> None:
        self.root = open_root(place)
        self.directory = self.root.path
        self.run = run
        self.index = EditableIndex.of(committed, shape, config, versions)
        self.interval_s = interval_s
        self.last_commit = 0.0
        self.published = False  # this process published the newest generation
        # input names added or dropped since the last commit (a Manifest's every name: its first commit
        # compares them all with the segments it was read from)
        self.touched: set[str] = self.index.pending() if isinstance(committed, Manifest) else set()
        self.dirty = False
        # Held: ``maybe_commit`` commits nothing, forced or not, until the caller lets go (a run whose changes
        # are whole only together: every input's output rewritten by a new model).
        self.held = False

    def add_input(self, input_path: str, size: int, mtime_ns: int,
                  shards: Iterable[ShardEntry | dict[str, Any]], failed: int = 0, etag: str = "") -> None:
        """List ``input_path``'s (promoted) shards, replacing the input's older ones, which are retired."""
        new_entries = sorted((s if isinstance(s, ShardEntry) else ShardEntry(**s) for s in shards),
                             key=lambda e: e.path)
        buckets = len(self.index.buckets)
        for e in new_entries:
            if not 0 <= e.bucket < buckets:
                raise ValueError(f"{e.path}: bucket {e.bucket}, the dataset has {buckets} (spec, \"Buckets\")")
            if len(e.outputs) != len(self.index.outputs):
                raise ValueError(f"{e.path}: {len(e.outputs)} output digests, the dataset has "
                                 f"{len(self.index.outputs)} outputs (spec, \"Model outputs\")")
        new_entries = [e if isinstance(e.outputs, tuple) else replace(e, outputs=tuple(e.outputs)) for e in new_entries]
        entry = InputEntry(size=size, mtime_ns=mtime_ns, samples=sum(e.samples for e in new_entries),
                           failed=failed, shards=[e.path for e in new_entries], etag=etag)
        old = self.index.put(input_path, (entry, new_entries, True))
        # The same name is the same bytes (input path, size, mtime, config): a retired file listed again
        # (an input restored to its old state, a repair) is live again, not retention's to collect.
        names = [o.name for o in self.index.outputs]
        relisted = {p for e in new_entries for p in shard_files(e.path, e.meta_path, names)}
        if old is not None:
            self.index.retire([p for e in old[1] if e.path not in relisted
                               for p in shard_files(e.path, e.meta_path, names)])
        self.index.unretire(relisted)
        self.touched.add(input_path)
        self.dirty = True

    def drop_input(self, input_path: str, keep: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        """Unlist ``input_path``'s shards (but those in ``keep``); they are retired, not deleted: a reader
        of the previous generation may be mid-epoch on them. KeyError if it is not committed."""
        if self.index.input(input_path) is None:
            raise KeyError(input_path)
        old = self.index.remove(input_path)
        assert old is not None
        names = [o.name for o in self.index.outputs]
        self.index.retire([p for e in old[1] if e.path not in keep for p in shard_files(e.path, e.meta_path, names)])
        self.touched.add(input_path)
        self.dirty = True

    def maybe_commit(self, force: bool = False) -> None:
        if self.held or not self.dirty or (not force and time.monotonic() - self.last_commit < self.interval_s):
            return
        self.commit()

    def committed_index(self) -> DatasetIndex:
        """The generation committed last, as a reader's columns: from the segments this committer holds
        (no second fetch of the index), or read (a version 1/2 dataset nothing was committed to yet)."""
        if self.index.segments is None:
            return load_index(self.root)
        return self.index.as_committed(manifest_path(self.root))

    def commit(self) -> int:
        """Commit now, even with nothing changed (a new dataset's empty first generation)."""
        generation = commit(self.root, self.index, self.touched, self.run, self.published)
        self.published = True
        self.last_commit = time.monotonic()
        self.dirty = False
        self.touched = set()
        return generation


def drop_inputs(place: Place, inputs: list[str], wait_for_lock: bool = False) -> DatasetIndex:
    """Remove committed inputs (their shards) from the dataset in one commit, under the lock (their files
    are retired, kept for older generations' readers); a later run over them processes them afresh.
    Returns the dataset as committed. (``preprocess verify --repair`` uses this for inputs behind bad
    shards.)"""
    root = open_root(place)
    with writing(root, wait_for_lock):
        committed, _ = load_committed(root)
        committer = Committer(root, committed)
        for path in inputs:
            if committer.index.input(path) is not None:
                committer.drop_input(path)
        committer.maybe_commit(force=True)
        return committer.committed_index()


def report_path(place: Place, run_id: str) -> str:
    return open_root(place).join(REPORTS_DIR, f"{run_id}.json")


def save_report(place: Place, run_id: str, data: bytes) -> str:
    """Publish one run's report (``shardio.format.run_report``) atomically; returns its path."""
    root = open_root(place)
    store, directory = root.storage, root.path
    store.makedirs(store.join(directory, REPORTS_DIR))
    path = report_path(root, run_id)
    store.publish(path, data)
    return path
