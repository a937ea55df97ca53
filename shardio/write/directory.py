"""The one owner of a dataset directory's protocol: everything that creates, writes, renames or removes a file
there, but the later deletion of what no kept generation needs (``shardio.write.retention``).

Who calls it: ``preprocess`` (``run``, ``verify``, ``gc``) and the writer (``shardio.write.shard_writer`` stages
shards here); the reader calls only the shard checker. Written once against ``shardio.store.base.Storage``
(``for_path``); the guarantees it needs from storage, and how the local filesystem gives each, are in
that module's docstring. The format it writes is ``shardio.format`` (layout, manifest, "Generations",
"Retention") and ``shardio.format.run_report`` (``reports/RUN_ID.json``).

What it owns, in the order of a run:

- **Opening for writing**: ``ensure_output_dir``, then ``writing(directory)`` holds the one-writer
  lock (``Storage.lock``) for every change below.
- **Reading what is committed**: ``load_committed`` (restoring a lost or corrupt ``manifest.json`` from
  the newest valid kept generation: ``recover_manifest``).
- **Cleaning leftovers** of a killed run: a run with work marks the dataset (``mark_run``:
  ``.run-RUN.json``) while its tasks may promote files; ``clean_after_runs`` compares every shard file
  with the index (``clean_leftovers``: temp files, unlisted files named as a run names a shard's,
  generation files newer than the commit) only when a mark was left, and otherwise never reads
  ``shards/``. It deletes only what a run of the dataset writes (``shardio.format``, "What a run of a
  dataset writes"): any other file it meets is named in ``Cleaned.foreign``, for the caller to report.
- **Staging and publishing shards**: workers (``shardio.write.shard_writer``) ``stage`` each file under a unique
  ``.tmp-`` name and ``promote`` it to its final name; a name is unlisted, so invisible, until a commit
  lists it.
- **The commit** (``Committer`` / ``commit``, over ``shardio.write.editable_index.EditableIndex``: what is
  committed read from the segments, this run's changes beside it): shards in dataset order, a
  storage barrier (the shards are durable first), ``manifests/GEN.json`` created once (conditional create), then ``manifest.json`` (the
  commit point). Killed between the two, the generation file is newer than ``manifest.json`` and
  the next run's cleaning removes it. Nothing is deleted at a commit: files it stops listing (an input
  dropped or changed: ``Committer.drop_input``, ``drop_inputs``) go to ``retired`` and wait for ``collect``.
- **Retention** (``shardio.write.retention``, through ``check_held``, ``listed_hashes`` and
  ``collect_segments`` here): ``collect`` / ``gc`` delete what no kept generation needs.
- **Run reports**: ``save_report`` / ``report_path``.
- **Restoring** a corrupt ``manifest.json`` from a kept generation the shard checker
  (``shardio.format.shard_check``, shared with the reader and ``verify``) finds whole.

Its interface takes plain values (paths, numbers, ``shardio.format`` entries): no Ray, no Pillow, none of
preprocess's types.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardio.errors import CommitConflict, OutputUnusable, ShardError, ShardFormatError
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
    is_shard_file_name,
)
from shardio.format.index import (
    Delta,
    SegmentRef,
    check_segment_path,
    encode_segment,
    plan_compaction,
    root_json,
    segment_path,
)
from shardio.format.manifests import (
    DatasetIndex,
    generation_path,
    list_generations,
    load_index,
    load_manifest,
    open_segment,
    read_root,
)
from shardio.format.segment_merge import MergedSegment, merge_columns
from shardio.format.shard_table import SegmentColumns, ShardTable, hashes_in, string_hashes
from shardio.format.shard_check import shard_problems
from shardio.store.backends import for_path
from shardio.store.base import TEMP_PREFIX, Storage
from shardio.write.editable_index import EditableIndex

__all__ = [
    "ensure_output_dir", "check_writable", "writing", "load_committed", "load_current", "manifest_path", "recover_manifest",
    "restore_manifest", "Cleaned", "foreign_files_warning", "clean_leftovers", "shard_paths", "stage", "promote", "discard_staged", "discard",
    "commit", "Committer", "drop_inputs", "collect_segments", "clean_after_runs", "mark_run", "unmark_run",
    "unfinished_runs", "forget_runs", "check_held", "may_delete", "shard_name_fence", "listed_hashes", "save_report",
    "report_path",
]

# A nightly run must not pull shards from under an epoch started the night before: 24 h covers a
# day-long epoch; 3 generations cover reruns in quick succession (a retry, a repair) on top of that.
def _now() -> datetime:
    return datetime.now(timezone.utc)


# --- generations: the commit's last step, leftovers, retention, restore ---------------------------------------------


def _publish_generation(directory: str, index: EditableIndex, published_here: bool, run: str = "") -> int:
    """The last step of ``commit`` (its only caller): ``index`` as the next generation,
    ``manifests/GEN.json`` (created once: never over an existing one), then ``manifest.json``. Stamps the
    files retired by this commit, drops retired entries whose file ``collect`` already deleted (at a
    writer's first commit: later ones follow its own, and nothing collects while it holds the lock),
    and returns the new generation."""
    store = for_path(directory)
    if published_here:
        # This writer published the newest generation itself: no listing of manifests/ (a run of
        # 18,000 commits would list up to 18,000 files at each); another writer's is a CommitConflict below.
        generation = index.generation + 1
    else:
        generation = max([index.generation, *list_generations(directory)]) + 1
    now = _now().isoformat(timespec="seconds")
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
        check_held(directory)
        try:
            store.publish_new(generation_path(directory, generation), data)
        except FileExistsError:
            raise CommitConflict(f"{generation_path(directory, generation)}: another writer committed generation "
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
        _unfenced.discard(directory)  # this commit fenced out any previous holder (``writing``)
    except BaseException:
        index.generation, index.updated, index.retired = before
        raise
    return generation


_LISTING_CHUNK = 1 << 16  # names of shards/ hashed and looked up at a time (clean_leftovers)


def listed_hashes(committed: Manifest | DatasetIndex) -> np.ndarray:
    """The files under ``shards/`` that ``committed`` lists (pixels and metadata), as the sorted 64-bit
    hashes of their paths (``ShardTable.path_hashes``): from the index's columns for a ``DatasetIndex``,
    no Python object per shard (8 bytes a file). Ask with ``hashes_in(listed, string_hashes(paths))``.
    A hash says "maybe listed": two paths with one hash make an unlisted file look listed, so a check
    through it can only keep a file that could have gone (never delete one that is listed)."""
    table = committed.shards if isinstance(committed, DatasetIndex) else ShardTable.from_entries(committed.shards)
    return table.path_hashes()


@dataclass
class Cleaned:
    """What a leftover cleaning did: ``removed`` files, and the ``foreign`` files of ``shards/`` it left
    because no run of this dataset writes such a name (paths relative to the dataset, sorted): a user's
    notes, a tar copied in. They are reported, never deleted (spec, "What a run of a dataset writes")."""

    removed: int = 0
    foreign: list[str] = field(default_factory=list)
    complete: bool = True  # False: only temp files were looked at (``may_delete``): run marks must stay



_FOREIGN_SHOWN = 10  # foreign files named in a warning; the rest counted


def foreign_files_warning(directory: str, foreign: list[str]) -> str:
    """A line naming the files of ``shards/`` a cleaning left as not the dataset's ("" if none), for a
    run report's warnings, the log and ``gc``'s output."""
    if not foreign:
        return ""
    shown = ", ".join(foreign[:_FOREIGN_SHOWN])
    more = f" and {len(foreign) - _FOREIGN_SHOWN} more" if len(foreign) > _FOREIGN_SHOWN else ""
    return (f"{directory}: left {len(foreign)} file(s) in {SHARDS_DIR}/ that no run of this dataset wrote "
            f"and no generation lists: {shown}{more}; not deleted: move them out of the dataset folder")


def clean_leftovers(directory: str, committed: Manifest | DatasetIndex | None) -> Cleaned:
    """Remove what a killed run left: temp files, shard files (a shard's name: ``is_shard_file_name``)
    neither listed nor retired by ``committed`` (the committed generation, as a ``Manifest`` or as
    columns, a ``DatasetIndex``: the same files go), and generation files newer than it (a commit killed
    before ``manifest.json``). Any other file in ``shards/`` is not the dataset's: left, and named in
    ``Cleaned.foreign``.

    Membership without an object per listed shard or per file: the listed paths as sorted hashes
    (``listed_hashes``), ``shards/`` read a chunk of names at a time (``Storage.iter_dir``) and each chunk
    hashed and looked up at once; the retired paths (a short list: retention bounds it) as a set. A hash
    collision can only keep a leftover (it looks listed), never remove a listed file."""
    if committed is None:
        return _clean(directory, None, lambda names: names)
    listed = listed_hashes(committed)
    retired = {r.path for r in committed.retired}

    def unlisted(names: list[str]) -> list[str]:
        paths = [f"{SHARDS_DIR}/{name}" for name in names]
        rows = np.flatnonzero(~hashes_in(listed, string_hashes(paths))).tolist()
        return [names[i] for i in rows if paths[i] not in retired]

    return _clean(directory, committed, unlisted)


def _written_by_a_run(name: str) -> bool:
    """A name in ``shards/`` that a run of a dataset gives a file: a shard's, or a staged one."""
    return name.startswith(TEMP_PREFIX) or is_shard_file_name(name)


# A run with work marks the dataset while its tasks may promote shard files (spec, "Layout"): a mark left
# behind names a run killed before its end, whose promoted but uncommitted files only a pass over every
# shard file finds. Without one, a run's leftover cleaning costs the temp files it finds, not the dataset.
RUN_MARK_PREFIX = ".run-"


def _run_mark(directory: str, run: str) -> str:
    return for_path(directory).join(directory, f"{RUN_MARK_PREFIX}{run}.json")


def mark_run(directory: str, run: str) -> None:
    """Before a run's first task: ``.run-RUN.json`` (its id and start time). The caller holds the lock."""
    check_held(directory)
    data = json.dumps({"run": run, "started": _now().isoformat(timespec="seconds")}).encode()
    for_path(directory).publish(_run_mark(directory, run), data)


def unmark_run(directory: str, run: str) -> None:
    """After a run whose every task ended and whose leftovers are cleaned: its mark goes."""
    store = for_path(directory)
    try:
        store.remove(_run_mark(directory, run))
    except FileNotFoundError:
        pass


def unfinished_runs(directory: str) -> list[str]:
    """The ids of runs whose mark is left: killed, or stopped before every task ended."""
    names = for_path(directory).list_dir(directory)
    return sorted(n[len(RUN_MARK_PREFIX):-len(".json")] for n in names
                  if n.startswith(RUN_MARK_PREFIX) and n.endswith(".json"))


def clean_after_runs(directory: str, committed: Manifest | DatasetIndex | None) -> Cleaned:
    """A run's leftover cleaning: ``clean_leftovers`` (every shard file against the index) when a run
    left its mark (then the marks go); otherwise the temp files outside ``shards/``, generation files
    newer than ``committed`` and segments no root names, without reading ``shards/`` (on object storage,
    a LIST of every shard). The caller holds the lock."""
    unfinished = unfinished_runs(directory)
    if not unfinished:  # every run ended, its tasks' files handed in or discarded: shards/ is not read
        return _clean(directory, committed, None)
    cleaned = clean_leftovers(directory, committed)
    if cleaned.complete:
        forget_runs(directory, unfinished)
    return cleaned


def forget_runs(directory: str, runs: list[str]) -> None:
    """The marks of ``runs`` go, once their leftovers have (``clean_leftovers`` ran after they ended)."""
    for run in runs:
        unmark_run(directory, run)


def _clean(directory: str, committed: Manifest | DatasetIndex | None,
           unlisted_shards: Callable[[list[str]], list[str]] | None) -> Cleaned:
    """``unlisted_shards``: of a chunk of names in ``shards/``, those no generation needs (the folder is
    read ``_LISTING_CHUNK`` names at a time, and nothing is removed until it has all been read); of
    these, the names a run writes go and the others are reported; None: leave ``shards/`` unread (no
    run left anything there)."""
    store = for_path(directory)
    check_held(directory)
    cleaned = Cleaned()
    for folder in (directory, store.join(directory, REPORTS_DIR), store.join(directory, MANIFESTS_DIR)):
        for name in store.list_dir(folder):
            if name.startswith(TEMP_PREFIX):
                store.remove(store.join(folder, name))
                cleaned.removed += 1
    if not may_delete(directory):
        cleaned.complete = False  # a previous holder not fenced out yet may still commit what is there
        return cleaned
    names = store.iter_dir(store.join(directory, SHARDS_DIR)) if unlisted_shards is not None else iter(())
    doomed: list[str] = []
    while unlisted_shards is not None and (chunk := list(itertools.islice(names, _LISTING_CHUNK))):
        for name in unlisted_shards(chunk):
            (doomed if _written_by_a_run(name) else cleaned.foreign).append(name)
    cleaned.foreign = sorted(f"{SHARDS_DIR}/{name}" for name in cleaned.foreign)
    for name in sorted(doomed):
        check_held(directory)
        store.remove(store.join(directory, SHARDS_DIR, name))
        cleaned.removed += 1
    if committed is not None:
        for generation in list_generations(directory):
            if generation > committed.generation:
                store.remove(generation_path(directory, generation))
                cleaned.removed += 1
    cleaned.removed += len(collect_segments(directory, committed))
    return cleaned


def collect_segments(directory: str, manifest: Manifest | DatasetIndex | None) -> list[str]:
    """Delete the index segments that neither ``manifest`` (the committed one) nor any generation file
    left in ``manifests/`` names: a killed commit's, or those only collected generations named. Deletes
    only ``index/SHA256.npz`` names (and temp files), and nothing when a root cannot be read (what it
    names is unknown, so nothing is surely unused)."""
    store = for_path(directory)
    folder = store.join(directory, INDEX_DIR)
    names = store.list_dir(folder)
    if not names or not may_delete(directory):
        return []
    named = {ref.path for ref in (manifest.segments or [])} if manifest is not None else set()
    for generation in list_generations(directory):
        try:
            segments = read_root(directory, generation).get("segments", [])
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
            check_held(directory)
            store.remove(store.join(directory, rel))
            removed.append(rel)
    return removed


def recover_manifest(directory: str) -> Manifest:
    """Restore the newest valid kept generation (it parses, and every shard it lists is on disk with its
    size) as ``manifest.json`` and return it: for a ``manifest.json`` that is missing or unusable. Raises
    ShardFormatError when no generation is valid. The caller holds the output lock. Inputs that only an
    unusable newer generation listed are then uncommitted: the next run processes them again from their
    tars (the same shard names and bytes)."""
    store = for_path(directory)
    problems = []
    for generation in reversed(list_generations(directory)):
        try:
            manifest = load_manifest(directory, generation)
        except ShardError as e:
            problems.append(f"generation {generation}: {e}")
            continue
        bad = shard_problems(directory, manifest)
        if bad:
            problems.append(f"generation {generation}: {bad[0][1]}")
            continue
        with store.open_read(generation_path(directory, generation)) as f:
            store.publish(store.join(directory, MANIFEST_NAME), f.read())
        return manifest
    raise ShardFormatError(
        f"{store.join(directory, MANIFEST_NAME)}: unusable, and no kept generation can replace it "
        f"({'; '.join(problems) or f'none in {MANIFESTS_DIR}/'}); HINT: restore the directory from a backup, "
        "or re-run preprocess into a new directory"
    )


def restore_manifest(directory: str, wait_for_lock: bool = False) -> Manifest | None:
    """Under the lock: if ``manifest.json`` is missing or unusable and kept generations exist, restore the
    newest valid one (``recover_manifest``) and return it; None if it was fine or nothing can restore it
    (the caller's own error stands)."""
    if not list_generations(directory):
        return None
    with writing(directory, wait_for_lock):
        try:
            load_manifest(directory)
            return None
        except ShardError:
            return recover_manifest(directory)


def load_committed(directory: str) -> tuple[DatasetIndex | Manifest | None, str]:
    """What is committed (None for a new dataset) and a warning ("" if none): a format 3 generation as
    columns (``DatasetIndex``: no object per shard), a version 1/2 one as its ``Manifest`` (its first
    commit upgrades it). A missing or corrupt ``manifest.json`` with kept generations is restored from
    the newest valid one, and the warning says so: rebuilding from nothing would drop every committed
    input (and the leftover cleaning would then delete their shards). The caller holds the lock."""
    path = manifest_path(directory)
    try:
        if not for_path(directory).exists(path) and not list_generations(directory):
            return None, ""
        return _committed(directory), ""
    except ShardError as e:
        if not list_generations(directory):
            raise
        problem = str(e.__cause__) if e.__cause__ is not None else "missing"  # without load_manifest's hint
    restored = recover_manifest(directory)
    return _committed(directory), (f"{path}: restored from kept generation {restored.generation} ({restored.samples} "
                                   f"samples, {len(restored.inputs)} inputs) because it was unusable: {problem}")


def _committed(directory: str) -> DatasetIndex | Manifest:
    index = load_index(directory)
    return index if index.segments is not None else load_manifest(directory)


def manifest_path(directory: str) -> str:
    """Where the committed manifest is (for messages; read it with ``load_manifest``)."""
    return for_path(directory).join(directory, MANIFEST_NAME)


def load_current(directory: str) -> Manifest | None:
    """The committed manifest as it is, or None if there is no ``manifest.json``."""
    return load_manifest(directory) if for_path(directory).exists(manifest_path(directory)) else None


# --- opening for writing ------------------------------------------------------------------------------


def ensure_output_dir(directory: str) -> None:
    """Create the dataset directory if needed; ``OutputUnusable`` (not a traceback) if it cannot be used."""
    store = for_path(directory)
    if store.exists(directory) and not store.is_dir(directory):
        raise OutputUnusable(f"{directory}: --output is an existing file, not a directory; give a dataset "
                             "directory (created if missing)")
    try:
        store.makedirs(directory)
    except OSError as e:
        raise OutputUnusable(f"{directory}: --output cannot be created ({e.strerror}); check the path and "
                             "that this user may write its parent") from e


# The lock handle of each directory this process holds: commits and deletions check it first (a lease
# on object storage can be lost by a holder paused past its expiry).
_held: dict[str, Any] = {}
# Directories whose lease this process took over from another holder and could not fence yet (nothing
# committed to publish over): until its first commit, nothing there is deleted but temp files.
_unfenced: set[str] = set()
_FENCE_TRIES = 5


def check_writable(directory: str, writer: str) -> None:
    """Create and remove one small temp file in ``directory`` (``.tmp-access-probe-WRITER``: a killed
    probe's leftover goes with the next run's clean-up, as any temp file): proof that this process, e.g. a
    Ray node's, can write the dataset. Raises what the store raises (``StorageAccessError``, ``OSError``)."""
    store = for_path(directory)
    probe = store.join(directory, f"{TEMP_PREFIX}access-probe-{writer}")
    store.publish_new(probe, b"")
    store.remove(probe)


def check_held(directory: str) -> None:
    """``OutputLocked`` unless this process can prove it still holds the lock of ``directory`` (a lease
    past its proven life, or lost: ``shardio.store.lease``); called before every commit step and deletion."""
    handle = _held.get(directory)
    if handle is not None:
        handle.check()


def _takeover_fence(directory: str) -> str:
    """This holder's lease token where it took the lease over from a holder that may live, else ""."""
    handle = _held.get(directory)
    return handle.token if getattr(handle, "holder_may_live", False) else ""


def shard_name_fence(directory: str, committed: Any) -> str:
    """The fence the names of the shard files this run writes carry (spec, "Fencing names"): this holder's
    own where it took the lease over from a holder that may live (that holder may still delete the files
    it staged, by name, however late: none of its names is ever written again), else the committed
    root's (``committed``: what ``load_committed`` gave), "" for a dataset that never needed one."""
    return _takeover_fence(directory) or getattr(committed, "name_fence", "")


def may_delete(directory: str) -> bool:
    """Whether this holder may delete what no generation needs: not while it took the lease over from
    another holder it could not fence out yet (``writing``): that holder may still commit what it wrote."""
    return directory not in _unfenced


@contextmanager
def writing(directory: str, wait_for_lock: bool = False) -> Iterator[None]:
    """Hold the one-writer lock of ``directory`` (``OutputLocked`` if a live run has it, unless waiting).
    On object storage the store is first checked to honour conditional writes (the lease and the commit
    rely on them: ``UnsupportedStore`` otherwise), then the lock is a renewed lease (``shardio.store.lease``).

    **Fencing.** A lease taken over from another holder (expired: paused, cut off; or dead) may leave
    that holder alive and about to commit what it staged. Before anything else, this holder publishes
    the committed root again as the next generation (``_fence``: ``manifests/GEN.json`` created once,
    ``manifest.json`` replaced with ``If-Match`` on the version it read): the old holder's commit, which
    replaces ``manifest.json`` only over the version it last saw (or creates the generation file it
    numbered after it), is refused by the store from then on, however late it arrives. Only then are its
    uncommitted files deleted as leftovers. With nothing committed yet, the first commit of this holder
    (create-if-absent of ``manifest.json``) is the fence, and nothing but temp files is deleted before it.
    So no committed generation names a file a cleaning removed, whatever happened to the lease."""
    store = for_path(directory)
    if not store.is_local:
        store.check_conditional_writes(directory)  # type: ignore[attr-defined]
    with store.lock(directory, wait_for_lock) as handle:
        _held[directory] = handle
        try:
            if handle.taken_over and not _fence(directory):
                _unfenced.add(directory)
            yield
        finally:
            _held.pop(directory, None)
            _unfenced.discard(directory)


def _fence(directory: str) -> bool:
    """Publish the committed root again as the next generation (``writing``, "Fencing"); False, having
    changed nothing, where nothing is committed (or the root is unreadable: no version to fence on).
    ``CommitConflict`` if the previous holder keeps committing over ``_FENCE_TRIES`` attempts."""
    store = for_path(directory)
    path = store.join(directory, MANIFEST_NAME)
    for _ in range(_FENCE_TRIES):
        version: str | None
        try:
            data, version = store.read_versioned(path)
        except FileNotFoundError:  # a first commit killed between its two files: its generation file
            generations = list_generations(directory)
            if not generations:
                return False
            data, version = store.read_bytes(generation_path(directory, generations[-1])), None
        try:
            root = json.loads(data)
            generation = max([int(root.get("generation") or 0), *list_generations(directory)]) + 1
        except (ValueError, TypeError, AttributeError):
            return False
        root.update(generation=generation, updated=_now().isoformat(timespec="seconds"))
        root.pop("run", None)  # a commit outside a run (spec, "Retention")
        if fence := _takeover_fence(directory):
            root["fence"] = fence
        fenced = json.dumps(root, indent=1, ensure_ascii=False).encode("utf-8")
        check_held(directory)
        try:
            store.publish_new(generation_path(directory, generation), fenced)
        except FileExistsError:
            continue  # the previous holder numbered a commit after what was read: read again
        try:
            if version is None:
                store.publish_new(path, fenced)
            else:
                store.publish(path, fenced, if_version=version)
            return True
        except (CommitConflict, FileExistsError):
            store.remove(generation_path(directory, generation))  # never current: named by nothing
    raise CommitConflict(f"{path}: another writer kept committing while this run took over its expired lease; "
                         "nothing was overwritten: rerun")


# --- staging shards (``shardio.write.shard_writer``) ----------------------------------------------------------------


def shard_paths(name: str, pixel_suffix: str = ".npy") -> tuple[str, str]:
    """The pixel and metadata files of shard ``name``, relative to the dataset directory (``pixel_suffix``:
    ``.jpg.npy`` for a JPEG shard, ``shardio.format.jpeg_shard``)."""
    return f"{SHARDS_DIR}/{name}{pixel_suffix}", f"{SHARDS_DIR}/{name}.jsonl"


def stage(directory: str, rel_path: str) -> tuple[int, str]:
    """A new staged file for ``rel_path`` under a unique name no other writer can pick (a ``.tmp-`` name:
    unlisted, so invisible, and removed by ``clean_leftovers`` if its writer dies); (writable fd, path)."""
    store = for_path(directory)
    store.makedirs(store.join(directory, SHARDS_DIR))
    return store.create_temp(store.join(directory, rel_path))


def promote(directory: str, staged_path: str, rel_path: str) -> None:
    """Give a finished (fsynced) staged file its final name; it is visible once a commit lists it."""
    store = for_path(directory)
    store.promote(staged_path, store.join(directory, rel_path))


def discard_staged(directory: str, staged_path: str) -> None:
    for_path(directory).remove(staged_path)


def discard(directory: str, rel_path: str) -> None:
    """Remove a promoted file no commit lists (a failed input's shards)."""
    store = for_path(directory)
    store.remove(store.join(directory, rel_path))


# --- the commit ---------------------------------------------------------------------------------------


def commit(directory: str, manifest: Manifest | EditableIndex, touched: Iterable[str] | None = None,
           run: str = "", published_here: bool = False) -> int:
    """The one way a dataset is committed: after a storage barrier that makes the promoted shards durable
    first (a power cut, e.g. a preempted VM, must not leave listed shards missing; one fsync, ~0.2 ms
    here), one new segment with what changed (of the ``touched`` names: a ``Committer`` knows them;
    every name when not given), compaction, then the root. A version 1/2 manifest is upgraded: its first
    segment holds everything. ``run``: the run committing (its id goes into the root: spec,
    "Retention"); ``published_here``: this writer published the current generation itself. A
    ``Manifest`` given here gets the new generation, version and segments. Returns the new generation."""
    if isinstance(manifest, Manifest):
        manifest.shards.sort(key=lambda e: (e.input, e.path))  # dataset order, as the index folds it
        index = EditableIndex.from_manifest(manifest)
        generation = commit(directory, index, run=run)
        index.to_manifest_fields(manifest)
        return generation
    index = manifest
    store = for_path(directory)
    shards_dir = store.join(directory, SHARDS_DIR)
    if store.exists(shards_dir):
        store.barrier(shards_dir)
    delta = index.delta(index.pending() if touched is None else set(touched))
    segments = list(index.segments or [])
    opened = index.opened_segments()  # by full path: compaction reads these, never fetches them again
    # Spec, "Fencing names": the root names it, and its segments hold it.
    index.name_fence = shard_name_fence(directory, index)
    if not delta.empty:
        segments.append(_write_segment(directory, delta, opened, index.name_fence))
    segments = _compact(directory, segments, opened, index.name_fence)
    before = index.segments
    index.segments = segments
    try:
        generation = _publish_generation(directory, index, published_here, run)
    except BaseException:
        index.segments = before  # not committed: the next commit writes this delta again
        raise
    # What was committed is read from the segments from now on (the ones this commit wrote opened,
    # the others kept): the changes the index held go, so a run holds only what it did since.
    index.committed(segments, [opened.get(store.join(directory, ref.path)) or open_segment(store, directory, ref)
                               for ref in segments])
    return generation


def _write_segment(directory: str, delta: Delta, opened: dict[str, SegmentColumns] | None = None,
                   fence: str = "") -> SegmentRef:
    """Create the segment of ``delta`` (create-only: a name that exists already holds these bytes, its
    name being their sha256); named by no root until the commit publishes one."""
    store = for_path(directory)
    data = encode_segment(delta, fence)
    rel = segment_path(data)
    store.makedirs(store.join(directory, INDEX_DIR))
    check_held(directory)
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


def _compact(directory: str, segments: list[SegmentRef],
             opened: dict[str, SegmentColumns] | None = None, fence: str = "") -> list[SegmentRef]:
    """Merge the newest segments while ``plan_compaction`` asks (spec: "Compaction"); the merged segment
    is written before the root that names it, so a killed compaction is a killed commit. ``opened``:
    segments this run holds as columns already (by full path), read from there."""
    store = for_path(directory)
    opened = {} if opened is None else opened
    while count := plan_compaction(segments):
        run = [opened.get(store.join(directory, ref.path)) or open_segment(store, directory, ref)
               for ref in segments[-count:]]
        merged = merge_columns(run, from_start=count == len(segments), fence=fence)  # columns: no object per shard
        if merged is not None:
            ref = _write_merged(directory, merged)
            _keep_written(store, directory, ref.path, merged.data, opened)
        segments = segments[:-count] + ([] if merged is None else [ref])
    return segments


def _write_merged(directory: str, merged: MergedSegment) -> SegmentRef:
    """Create a merged segment as ``_write_segment`` creates a commit's (create-only)."""
    store = for_path(directory)
    rel = segment_path(merged.data)
    store.makedirs(store.join(directory, INDEX_DIR))
    check_held(directory)
    try:
        store.publish_new(store.join(directory, rel), merged.data)
    except FileExistsError:
        pass
    return SegmentRef(rel, len(merged.data), merged.shards, merged.inputs, merged.removed, merged.samples)


class Committer:
    """Folds finished and dropped inputs into an ``EditableIndex`` of what is committed and commits it at
    most every ``interval_s`` seconds (``maybe_commit``) or when forced. The caller holds the lock.

    ``committed``: what ``load_committed`` gave (a ``DatasetIndex``: columns, no object per committed
    shard; a ``Manifest``: a version 1/2 one, upgraded at the first commit), or None for a new dataset (then ``shape``, ``config``, ``versions`` say what it is)."""

    def __init__(self, directory: str, committed: DatasetIndex | Manifest | None,
                 interval_s: float = 0.0, run: str = "", *, shape: tuple[int, int, int] = (0, 0, 3),
                 config: dict[str, Any] | None = None, versions: dict[str, Any] | None = None) -> None:
        self.directory = directory
        self.run = run
        self.index = EditableIndex.of(committed, shape, config, versions)
        self.interval_s = interval_s
        self.last_commit = 0.0
        self.published = False  # this process published the newest generation
        # input names added or dropped since the last commit (a Manifest's every name: its first commit
        # compares them all with the segments it was read from)
        self.touched: set[str] = self.index.pending() if isinstance(committed, Manifest) else set()
        self.dirty = False

    def add_input(self, input_path: str, size: int, mtime_ns: int,
                  shards: Iterable[ShardEntry | dict[str, Any]], failed: int = 0, etag: str = "") -> None:
        """List ``input_path``'s (promoted) shards, replacing the input's older ones, which are retired."""
        new_entries = sorted((s if isinstance(s, ShardEntry) else ShardEntry(**s) for s in shards),
                             key=lambda e: e.path)
        buckets = len(self.index.buckets)
        for e in new_entries:
            if not 0 <= e.bucket < buckets:
                raise ValueError(f"{e.path}: bucket {e.bucket}, the dataset has {buckets} (spec, \"Buckets\")")
        entry = InputEntry(size=size, mtime_ns=mtime_ns, samples=sum(e.samples for e in new_entries),
                           failed=failed, shards=[e.path for e in new_entries], etag=etag)
        old = self.index.put(input_path, (entry, new_entries, True))
        # The same name is the same bytes (input path, size, mtime, config): a retired file listed again
        # (an input restored to its old state, a repair) is live again, not retention's to collect.
        relisted = {e.path for e in new_entries} | {e.meta_path for e in new_entries}
        if old is not None:
            self.index.retire([p for e in old[1] if e.path not in relisted for p in (e.path, e.meta_path)])
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
        self.index.retire([p for e in old[1] if e.path not in keep for p in (e.path, e.meta_path)])
        self.touched.add(input_path)
        self.dirty = True

    def maybe_commit(self, force: bool = False) -> None:
        if not self.dirty or (not force and time.monotonic() - self.last_commit < self.interval_s):
            return
        self.commit()

    def committed_index(self) -> DatasetIndex:
        """The generation committed last, as a reader's columns: from the segments this committer holds
        (no second fetch of the index), or read (a version 1/2 dataset nothing was committed to yet)."""
        if self.index.segments is None:
            return load_index(self.directory)
        return self.index.as_committed(manifest_path(self.directory))

    def commit(self) -> int:
        """Commit now, even with nothing changed (a new dataset's empty first generation)."""
        generation = commit(self.directory, self.index, self.touched, self.run, self.published)
        self.published = True
        self.last_commit = time.monotonic()
        self.dirty = False
        self.touched = set()
        return generation


def drop_inputs(directory: str, inputs: list[str], wait_for_lock: bool = False) -> DatasetIndex:
    """Remove committed inputs (their shards) from the dataset in one commit, under the lock (their files
    are retired, kept for older generations' readers); a later run over them processes them afresh.
    Returns the dataset as committed. (``preprocess verify --repair`` uses this for inputs behind bad
    shards.)"""
    with writing(directory, wait_for_lock):
        committed, _ = load_committed(directory)
        committer = Committer(directory, committed)
        for path in inputs:
            if committer.index.input(path) is not None:
                committer.drop_input(path)
        committer.maybe_commit(force=True)
        return committer.committed_index()


def report_path(directory: str, run_id: str) -> str:
    return for_path(directory).join(directory, REPORTS_DIR, f"{run_id}.json")


def save_report(directory: str, run_id: str, data: bytes) -> str:
    """Publish one run's report (``shardio.format.run_report``) atomically; returns its path."""
    store = for_path(directory)
    store.makedirs(store.join(directory, REPORTS_DIR))
    path = report_path(directory, run_id)
    store.publish(path, data)
    return path
