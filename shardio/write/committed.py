"""What a dataset directory has committed, as a writer reads it (``load_committed``: a format 3 generation
as columns, a version 1/2 one as its ``Manifest``), and restoring a ``manifest.json`` that is lost or
corrupt from the newest kept generation the shard checker (``shardio.format.shard_check``, shared with the
reader and ``verify``) finds whole (``recover_manifest``, ``restore_manifest``)."""

from __future__ import annotations

from shardio.errors import ShardError, ShardFormatError
from shardio.format import MANIFEST_NAME, MANIFESTS_DIR, Manifest
from shardio.format.manifests import DatasetIndex, generation_path, list_generations, load_index, load_manifest
from shardio.format.shard_check import shard_problems
from shardio.store.root import DatasetRoot, Place, open_root
from shardio.write.lock import writing

__all__ = ["load_committed", "load_current", "manifest_path", "recover_manifest", "restore_manifest"]


def recover_manifest(place: Place) -> Manifest:
    """Restore the newest valid kept generation (it parses, and every shard it lists is on disk with its
    size) as ``manifest.json`` and return it: for a ``manifest.json`` that is missing or unusable. Raises
    ShardFormatError when no generation is valid. The caller holds the output lock. Inputs that only an
    unusable newer generation listed are then uncommitted: the next run processes them again from their
    tars (the same shard names and bytes)."""
    root = open_root(place)
    store, directory = root.storage, root.path
    problems = []
    for generation in reversed(list_generations(root)):
        try:
            manifest = load_manifest(root, generation)
        except ShardError as e:
            problems.append(f"generation {generation}: {e}")
            continue
        bad = shard_problems(root, manifest)
        if bad:
            problems.append(f"generation {generation}: {bad[0][1]}")
            continue
        with store.open_read(generation_path(root, generation)) as f:
            store.publish(store.join(directory, MANIFEST_NAME), f.read())
        return manifest
    raise ShardFormatError(
        f"{store.join(directory, MANIFEST_NAME)}: unusable, and no kept generation can replace it "
        f"({'; '.join(problems) or f'none in {MANIFESTS_DIR}/'}); HINT: restore the directory from a backup, "
        "or re-run preprocess into a new directory"
    )


def restore_manifest(place: Place, wait_for_lock: bool = False) -> Manifest | None:
    """Under the lock: if ``manifest.json`` is missing or unusable and kept generations exist, restore the
    newest valid one (``recover_manifest``) and return it; None if it was fine or nothing can restore it
    (the caller's own error stands)."""
    root = open_root(place)
    if not list_generations(root):
        return None
    with writing(root, wait_for_lock):
        try:
            load_manifest(root)
            return None
        except ShardError:
            return recover_manifest(root)


def load_committed(place: Place) -> tuple[DatasetIndex | Manifest | None, str]:
    """What is committed (None for a new dataset) and a warning ("" if none): a format 3 generation as
    columns (``DatasetIndex``: no object per shard), a version 1/2 one as its ``Manifest`` (its first
    commit upgrades it). A missing or corrupt ``manifest.json`` with kept generations is restored from
    the newest valid one, and the warning says so: rebuilding from nothing would drop every committed
    input (and the leftover cleaning would then delete their shards). The caller holds the lock."""
    root = open_root(place)
    path = manifest_path(root)
    try:
        if not root.storage.exists(path) and not list_generations(root):
            return None, ""
        return _committed(root), ""
    except ShardError as e:
        if not list_generations(root):
            raise
        problem = str(e.__cause__) if e.__cause__ is not None else "missing"  # without load_manifest's hint
    restored = recover_manifest(root)
    return _committed(root), (f"{path}: restored from kept generation {restored.generation} ({restored.samples} "
                                   f"samples, {len(restored.inputs)} inputs) because it was unusable: {problem}")


def _committed(root: DatasetRoot) -> DatasetIndex | Manifest:
    index = load_index(root)
    return index if index.segments is not None else load_manifest(root)


def manifest_path(place: Place) -> str:
    """Where the committed manifest is (for messages; read it with ``load_manifest``)."""
    return open_root(place).join(MANIFEST_NAME)


def load_current(place: Place) -> Manifest | None:
    """The committed manifest as it is, or None if there is no ``manifest.json``."""
    root = open_root(place)
    return load_manifest(root) if root.storage.exists(manifest_path(root)) else None
