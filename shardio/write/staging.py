"""Staging and publishing shard files (for ``shardio.write.shard_writer``): each file is written under a
unique ``.tmp-`` name (``stage``) and given its final name when finished (``promote``); a promoted name is
unlisted, so invisible to readers, until a commit (``shardio.write.commit``) lists it, and a failed input's
files are removed again (``discard_staged``, ``discard``)."""

from __future__ import annotations

from shardio.format import SHARDS_DIR
from shardio.store.root import Place, open_root

__all__ = ["shard_paths", "stage", "promote", "discard_staged", "discard"]


def shard_paths(name: str, pixel_suffix: str = ".npy") -> tuple[str, str]:
    """The pixel and metadata files of shard ``name``, relative to the dataset directory (``pixel_suffix``:
    ``.jpg.npy`` for a JPEG shard, ``shardio.format.jpeg_shard``)."""
    return f"{SHARDS_DIR}/{name}{pixel_suffix}", f"{SHARDS_DIR}/{name}.jsonl"


def stage(place: Place, rel_path: str) -> tuple[int, str]:
    """A new staged file for ``rel_path`` under a unique name no other writer can pick (a ``.tmp-`` name:
    unlisted, so invisible, and removed by ``clean_leftovers`` if its writer dies); (writable fd, path)."""
    root = open_root(place)
    store, directory = root.storage, root.path
    store.makedirs(store.join(directory, SHARDS_DIR))
    return store.create_temp(store.join(directory, rel_path))


def promote(place: Place, staged_path: str, rel_path: str) -> None:
    """Give a finished (fsynced) staged file its final name; it is visible once a commit lists it."""
    root = open_root(place)
    store, directory = root.storage, root.path
    store.promote(staged_path, store.join(directory, rel_path))


def discard_staged(place: Place, staged_path: str) -> None:
    root = open_root(place)
    root.storage.remove(staged_path)


def discard(place: Place, rel_path: str) -> None:
    """Remove a promoted file no commit lists (a failed input's shards)."""
    root = open_root(place)
    store, directory = root.storage, root.path
    store.remove(store.join(directory, rel_path))
