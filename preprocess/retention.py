"""``preprocess gc DIR``: collect the retired shard files and old generation files that the retention no
longer keeps, under the output lock (the rules are ``shardio.commit``'s; a run applies them at its end
too, so gc is for a retention shorter than a run's, or a dataset no run touches any more)."""

from __future__ import annotations

from datetime import datetime

from preprocess.output_lock import OutputLock
from shardio import storage
from shardio.commit import Collected, Retention, clean_leftovers, collect
from shardio.format import load_manifest

__all__ = ["gc_dataset"]


def gc_dataset(directory: str, retention: Retention, wait_for_lock: bool = False,
               now: datetime | None = None) -> Collected:
    """Remove a killed run's leftovers, then what ``retention`` no longer keeps; returns what went. Raises
    ShardFormatError for a dataset whose ``manifest.json`` is unusable (``verify --repair`` restores it:
    collecting against a guessed manifest could delete what the real one lists)."""
    directory = storage.check_local(directory)
    load_manifest(directory)  # a missing directory or a broken manifest: say so before taking the lock
    with OutputLock(directory, wait=wait_for_lock):
        manifest = load_manifest(directory)
        clean_leftovers(directory, manifest)
        return collect(directory, manifest, retention, now)
