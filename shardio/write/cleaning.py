"""Cleaning what a killed run left in a dataset directory. A run with work marks the dataset (``mark_run``:
``.run-RUN.json``) while its tasks may promote files; ``clean_after_runs`` compares every shard file with
the index (``clean_leftovers``: temp files, unlisted files named as a run names a shard's, generation files
newer than the commit) only when a mark was left, and otherwise never reads ``shards/``. It deletes only
what a run of the dataset writes (``shardio.format``, "What a run of a dataset writes"): any other file it
meets is named in ``Cleaned.foreign``, for the caller to report. Index segments no root names go too
(``collect_segments``, shared with retention). Nothing is deleted while a previous holder of the lease is
not fenced out (``shardio.write.lock.may_delete``)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from shardio.errors import ShardError, ShardFormatError
from shardio.format import INDEX_DIR, MANIFESTS_DIR, REPORTS_DIR, SHARDS_DIR, Manifest, is_shard_file_name
from shardio.format.index import check_segment_path
from shardio.format.manifests import DatasetIndex, generation_path, list_generations, read_root
from shardio.format.shard_table import ShardTable
from shardio.format.string_hashes import hashes_in, string_hashes
from shardio.store.root import DatasetRoot, Place, open_root
from shardio.store.base import TEMP_PREFIX
from shardio.write.lock import check_held, may_delete, utc_timestamp

__all__ = [
    "Cleaned", "foreign_files_warning", "clean_leftovers", "clean_after_runs", "listed_hashes", "collect_segments",
    "mark_run", "unmark_run", "unfinished_runs", "forget_runs",
]

_LISTING_CHUNK = 1 << 16  # names of shards/ hashed and looked up at a time (clean_leftovers)


def listed_hashes(committed: Manifest | DatasetIndex) -> np.ndarray:
    """The files under ``shards/`` that ``committed`` lists (pixels, metadata and outputs), as the sorted 64-bit
    hashes of their paths (``ShardTable.path_hashes``): from the index's columns for a ``DatasetIndex``,
    no Python object per shard (8 bytes a file). Ask with ``hashes_in(listed, string_hashes(paths))``.
    A hash says "maybe listed": two paths with one hash make an unlisted file look listed, so a check
    through it can only keep a file that could have gone (never delete one that is listed)."""
    table = committed.shards if isinstance(committed, DatasetIndex) else ShardTable.from_entries(committed.shards)
    return table.path_hashes([o.name for o in committed.outputs])


@dataclass
class Cleaned:
    """What a leftover cleaning did: ``removed`` files, and the ``foreign`` files of ``shards/`` it left
    because no run of this dataset writes such a name (paths relative to the dataset, sorted): a user's
    notes, a tar copied in. They are reported, never deleted (spec, "What a run of a dataset writes")."""

    removed: int = 0
    foreign: list[str] = field(default_factory=list)
    complete: bool = True  # False: only temp files were looked at (``may_delete``): run marks must stay


_FOREIGN_SHOWN = 10  # foreign files named in a warning; the rest counted


def foreign_files_warning(place: Place, foreign: list[str]) -> str:
    """A line naming the files of ``shards/`` a cleaning left as not the dataset's ("" if none), for a
    run report's warnings, the log and ``gc``'s output (the place is named, not opened)."""
    directory = str(place)
    if not foreign:
        return ""
    shown = ", ".join(foreign[:_FOREIGN_SHOWN])
    more = f" and {len(foreign) - _FOREIGN_SHOWN} more" if len(foreign) > _FOREIGN_SHOWN else ""
    return (f"{directory}: left {len(foreign)} file(s) in {SHARDS_DIR}/ that no run of this dataset wrote "
            f"and no generation lists: {shown}{more}; not deleted: move them out of the dataset folder")


def clean_leftovers(place: Place, committed: Manifest | DatasetIndex | None) -> Cleaned:
    """Remove what a killed run left: temp files, shard files (a shard's name: ``is_shard_file_name``)
    neither listed nor retired by ``committed`` (the committed generation, as a ``Manifest`` or as
    columns, a ``DatasetIndex``: the same files go), and generation files newer than it (a commit killed
    before ``manifest.json``). Any other file in ``shards/`` is not the dataset's: left, and named in
    ``Cleaned.foreign``.

    Membership without an object per listed shard or per file: the listed paths as sorted hashes
    (``listed_hashes``), ``shards/`` read a chunk of names at a time (``Storage.iter_dir``) and each chunk
    hashed and looked up at once; the retired paths (a short list: retention bounds it) as a set. A hash
    collision can only keep a leftover (it looks listed), never remove a listed file."""
    root = open_root(place)
    if committed is None:
        return _clean(root, None, lambda names: names)
    listed = listed_hashes(committed)
    retired = {r.path for r in committed.retired}

    def unlisted(names: list[str]) -> list[str]:
        paths = [f"{SHARDS_DIR}/{name}" for name in names]
        rows = np.flatnonzero(~hashes_in(listed, string_hashes(paths))).tolist()
        return [names[i] for i in rows if paths[i] not in retired]

    return _clean(root, committed, unlisted)


def _written_by_a_run(name: str) -> bool:
    """A name in ``shards/`` that a run of a dataset gives a file: a shard's, or a staged one."""
    return name.startswith(TEMP_PREFIX) or is_shard_file_name(name)


# A run with work marks the dataset while its tasks may promote shard files (spec, "Layout"): a mark left
# behind names a run killed before its end, whose promoted but uncommitted files only a pass over every
# shard file finds. Without one, a run's leftover cleaning costs the temp files it finds, not the dataset.
RUN_MARK_PREFIX = ".run-"


def _run_mark(root: DatasetRoot, run: str) -> str:
    return root.join(f"{RUN_MARK_PREFIX}{run}.json")


def mark_run(place: Place, run: str) -> None:
    """Before a run's first task: ``.run-RUN.json`` (its id and start time). The caller holds the lock."""
    root = open_root(place)
    check_held(root)
    data = json.dumps({"run": run, "started": utc_timestamp()}).encode()
    root.storage.publish(_run_mark(root, run), data)


def unmark_run(place: Place, run: str) -> None:
    """After a run whose every task ended and whose leftovers are cleaned: its mark goes."""
    root = open_root(place)
    store = root.storage
    try:
        store.remove(_run_mark(root, run))
    except FileNotFoundError:
        pass


def unfinished_runs(place: Place) -> list[str]:
    """The ids of runs whose mark is left: killed, or stopped before every task ended."""
    root = open_root(place)
    directory = root.path
    names = root.storage.list_dir(directory)
    return sorted(n[len(RUN_MARK_PREFIX):-len(".json")] for n in names
                  if n.startswith(RUN_MARK_PREFIX) and n.endswith(".json"))


def clean_after_runs(place: Place, committed: Manifest | DatasetIndex | None) -> Cleaned:
    """A run's leftover cleaning: ``clean_leftovers`` (every shard file against the index) when a run
    left its mark (then the marks go); otherwise the temp files outside ``shards/``, generation files
    newer than ``committed`` and segments no root names, without reading ``shards/`` (on object storage,
    a LIST of every shard). The caller holds the lock."""
    root = open_root(place)
    unfinished = unfinished_runs(root)
    if not unfinished:  # every run ended, its tasks' files handed in or discarded: shards/ is not read
        return _clean(root, committed, None)
    cleaned = clean_leftovers(root, committed)
    if cleaned.complete:
        forget_runs(root, unfinished)
    return cleaned


def forget_runs(place: Place, runs: list[str]) -> None:
    """The marks of ``runs`` go, once their leftovers have (``clean_leftovers`` ran after they ended)."""
    root = open_root(place)
    for run in runs:
        unmark_run(root, run)


def _clean(root: DatasetRoot, committed: Manifest | DatasetIndex | None,
           unlisted_shards: Callable[[list[str]], list[str]] | None) -> Cleaned:
    """``unlisted_shards``: of a chunk of names in ``shards/``, those no generation needs (the folder is
    read ``_LISTING_CHUNK`` names at a time, and nothing is removed until it has all been read); of
    these, the names a run writes go and the others are reported; None: leave ``shards/`` unread (no
    run left anything there)."""
    store, directory = root.storage, root.path
    check_held(root)
    cleaned = Cleaned()
    for folder in (directory, store.join(directory, REPORTS_DIR), store.join(directory, MANIFESTS_DIR)):
        for name in store.list_dir(folder):
            if name.startswith(TEMP_PREFIX):
                store.remove(store.join(folder, name))
                cleaned.removed += 1
    if not may_delete(root):
        cleaned.complete = False  # a previous holder not fenced out yet may still commit what is there
        return cleaned
    names = store.iter_dir(store.join(directory, SHARDS_DIR)) if unlisted_shards is not None else iter(())
    doomed: list[str] = []
    while unlisted_shards is not None and (chunk := list(itertools.islice(names, _LISTING_CHUNK))):
        for name in unlisted_shards(chunk):
            (doomed if _written_by_a_run(name) else cleaned.foreign).append(name)
    cleaned.foreign = sorted(f"{SHARDS_DIR}/{name}" for name in cleaned.foreign)
    for name in sorted(doomed):
        check_held(root)
        store.remove(store.join(directory, SHARDS_DIR, name))
        cleaned.removed += 1
    if committed is not None:
        for generation in list_generations(root):
            if generation > committed.generation:
                store.remove(generation_path(root, generation))
                cleaned.removed += 1
    cleaned.removed += len(collect_segments(root, committed))
    return cleaned


def collect_segments(place: Place, manifest: Manifest | DatasetIndex | None) -> list[str]:
    """Delete the index segments that neither ``manifest`` (the committed one) nor any generation file
    left in ``manifests/`` names: a killed commit's, or those only collected generations named. Deletes
    only ``index/SHA256.npz`` names (and temp files), and nothing when a root cannot be read (what it
    names is unknown, so nothing is surely unused)."""
    root = open_root(place)
    store, directory = root.storage, root.path
    folder = store.join(directory, INDEX_DIR)
    names = store.list_dir(folder)
    if not names or not may_delete(root):
        return []
    named = {ref.path for ref in (manifest.segments or [])} if manifest is not None else set()
    for generation in list_generations(root):
        try:
            segments = read_root(root, generation).get("segments", [])
            named |= {s["path"] for s in segments}
        except (ShardError, OSError, TypeError, KeyError):
            return []
    removed = []
    for name in names:
        rel = f"{INDEX_DIR}/{name}"
        if name.startswith(TEMP_PREFIX):
            store.remove(store.join(folder, name))
            continue
        try:
            check_segment_path(rel, folder)
        except ShardFormatError:
            continue  # not a segment name: not ours to delete
        if rel not in named:
            check_held(root)
            store.remove(store.join(directory, rel))
            removed.append(rel)
    return removed
