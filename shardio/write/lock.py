"""Holding a dataset directory for writing: opening it (``ensure_output_dir``, ``check_writable``), the
one-writer lock (``writing``: ``Storage.lock``, a renewed lease on object storage) that every change of the
protocol (``shardio.write.directory``) is made under, the proof before each step that it is still held
(``check_held``), and fencing out a lease's previous holder: before anything is deleted (``may_delete``),
and in the names of the shard files a run writes (``shard_name_fence``)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

from shardio.errors import CommitConflict, OutputUnusable
from shardio.format import MANIFEST_NAME
from shardio.format.manifests import generation_path, list_generations
from shardio.store.root import DatasetRoot, Place, open_root
from shardio.store.base import TEMP_PREFIX

__all__ = [
    "ensure_output_dir", "check_writable", "writing", "check_held", "lock_key", "may_delete", "shard_name_fence",
    "fenced_by_commit", "utc_timestamp",
]


def utc_timestamp() -> str:
    """The time the protocol's files record (a root's ``updated``, a run mark's ``started``): UTC, to the
    second; the commit, the fence and the run marks all take it from here."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def ensure_output_dir(place: Place) -> None:
    """Create the dataset directory if needed; ``OutputUnusable`` (not a traceback) if it cannot be used."""
    root = open_root(place)
    store, directory = root.storage, root.path
    if store.exists(directory) and not store.is_dir(directory):
        raise OutputUnusable(f"{directory}: --output is an existing file, not a directory; give a dataset "
                             "directory (created if missing)")
    try:
        store.makedirs(directory)
    except OSError as e:
        raise OutputUnusable(f"{directory}: --output cannot be created ({e.strerror}); check the path and "
                             "that this user may write its parent") from e


# The lock handle of each directory this process holds, by its ``lock_key``: commits and deletions check it
# first (a lease on object storage can be lost by a holder paused past its expiry).
_held: dict[str, Any] = {}
# Directories whose lease this process took over from another holder and could not fence yet (nothing
# committed to publish over): until its first commit, nothing there is deleted but temp files.
_unfenced: set[str] = set()
_FENCE_TRIES = 5


def lock_key(root: DatasetRoot) -> str:
    """The one key of a dataset in this process's lock tables: a local directory's absolute path (``ds``,
    ``./ds`` and ``/abs/ds`` are one dataset: one lock, one proof it is held; made without a system call, as
    it is asked before every commit step); an object store's normalised URL. Messages keep naming the path as
    the caller gave it."""
    return os.path.abspath(root.path) if root.storage.is_local else root.path


def check_writable(place: Place, writer: str) -> None:
    """Create and remove one small temp file in ``directory`` (``.tmp-access-probe-WRITER``: a killed
    probe's leftover goes with the next run's clean-up, as any temp file): proof that this process, e.g. a
    Ray node's, can write the dataset. Raises what the store raises (``StorageAccessError``, ``OSError``)."""
    root = open_root(place)
    store, directory = root.storage, root.path
    probe = store.join(directory, f"{TEMP_PREFIX}access-probe-{writer}")
    store.publish_new(probe, b"")
    store.remove(probe)


def check_held(place: Place) -> None:
    """``OutputLocked`` unless this process can prove it still holds the lock of ``directory`` (a lease
    past its proven life, or lost: ``shardio.store.lease``); called before every commit step and deletion."""
    handle = _held.get(lock_key(open_root(place)))
    if handle is not None:
        handle.check()


def _takeover_fence(root: DatasetRoot) -> str:
    """This holder's lease token where it took the lease over from a holder that may live, else ""."""
    handle = _held.get(lock_key(root))
    return handle.token if getattr(handle, "holder_may_live", False) else ""


def shard_name_fence(place: Place, committed: Any) -> str:
    """The fence the names of the shard files this run writes carry (spec, "Fencing names"): this holder's
    own where it took the lease over from a holder that may live (that holder may still delete the files
    it staged, by name, however late: none of its names is ever written again), else the committed
    root's (``committed``: what ``load_committed`` gave), "" for a dataset that never needed one."""
    return _takeover_fence(open_root(place)) or getattr(committed, "name_fence", "")


def fenced_by_commit(place: Place) -> None:
    """A commit of this holder published a new generation: any previous holder is fenced out from now on
    (``writing``, "Fencing"), and what no generation needs may be deleted again (``may_delete``)."""
    _unfenced.discard(lock_key(open_root(place)))


def may_delete(place: Place) -> bool:
    """Whether this holder may delete what no generation needs: not while it took the lease over from
    another holder it could not fence out yet (``writing``): that holder may still commit what it wrote."""
    return lock_key(open_root(place)) not in _unfenced


@contextmanager
def writing(place: Place, wait_for_lock: bool = False) -> Iterator[None]:
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
    root = open_root(place)
    store, directory = root.storage, root.path
    if not store.is_local:
        store.check_conditional_writes(directory)  # type: ignore[attr-defined]
    key = lock_key(root)
    with store.lock(directory, wait_for_lock) as handle:
        _held[key] = handle
        try:
            if handle.taken_over and not _fence(root):
                _unfenced.add(key)
            yield
        finally:
            _held.pop(key, None)
            _unfenced.discard(key)


def _fence(root: DatasetRoot) -> bool:
    """Publish the committed root again as the next generation (``writing``, "Fencing"); False, having
    changed nothing, where nothing is committed (or the root is unreadable: no version to fence on).
    ``CommitConflict`` if the previous holder keeps committing over ``_FENCE_TRIES`` attempts."""
    store, directory = root.storage, root.path
    path = store.join(directory, MANIFEST_NAME)
    for _ in range(_FENCE_TRIES):
        version: str | None
        try:
            data, version = store.read_versioned(path)
        except FileNotFoundError:  # a first commit killed between its two files: its generation file
            generations = list_generations(root)
            if not generations:
                return False
            data, version = store.read_bytes(generation_path(root, generations[-1])), None
        try:
            doc = json.loads(data)
            generation = max([int(doc.get("generation") or 0), *list_generations(root)]) + 1
        except (ValueError, TypeError, AttributeError):
            return False
        doc.update(generation=generation, updated=utc_timestamp())
        doc.pop("run", None)  # a commit outside a run (spec, "Retention")
        if fence := _takeover_fence(root):
            doc["fence"] = fence
        fenced = json.dumps(doc, indent=1, ensure_ascii=False).encode("utf-8")
        check_held(root)
        try:
            store.publish_new(generation_path(root, generation), fenced)
        except FileExistsError:
            continue  # the previous holder numbered a commit after what was read: read again
        try:
            if version is None:
                store.publish_new(path, fenced)
            else:
                store.publish(path, fenced, if_version=version)
            return True
        except (CommitConflict, FileExistsError):
            store.remove(generation_path(root, generation))  # never current: named by nothing
    raise CommitConflict(f"{path}: another writer kept committing while this run took over its expired lease; "
                         "nothing was overwritten: rerun")
