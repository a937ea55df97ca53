"""The one protocol of a dataset directory: everything that creates, writes, renames or removes a file
there, but the later deletion of what no kept generation needs (``shardio.write.retention``). This module
writes the protocol down and is its one interface for callers outside ``shardio.write``; each step lives in
a module of its own, named below.

Who calls it: ``preprocess`` (``run``, ``verify``, ``gc``) and the writer (``shardio.write.shard_writer`` stages
shards here); the reader calls only the shard checker. Written once against ``shardio.store.base.Storage``;
the guarantees it needs from storage, and how the local filesystem gives each, are in that module's
docstring. Each function takes the dataset's root (``shardio.store.root.DatasetRoot``: the directory with
the backend chosen when it was opened) or its path, opened once at the call (``open_root``); what it calls
below is given the root, so a caller holding the root never has the backend chosen again. The lock is
keyed by the root's path, one spelling per dataset. The format it writes is ``shardio.format`` (layout,
manifest, "Generations", "Retention") and ``shardio.format.run_report`` (``reports/RUN_ID.json``).

What it owns, in the order of a run:

- **Opening for writing** (``shardio.write.lock``): ``ensure_output_dir``, then ``writing(directory)`` holds
  the one-writer lock (``Storage.lock``) for every change below, fencing out a lease's previous holder
  first (``writing``, "Fencing"), and ``check_held`` proves it still holds it before each step.
- **Reading what is committed** (``shardio.write.committed``): ``load_committed`` (restoring a lost or
  corrupt ``manifest.json`` from the newest valid kept generation: ``recover_manifest``).
- **Cleaning leftovers** of a killed run (``shardio.write.cleaning``): a run with work marks the dataset
  (``mark_run``: ``.run-RUN.json``) while its tasks may promote files; ``clean_after_runs`` compares every
  shard file with the index (``clean_leftovers``: temp files, unlisted files named as a run names a shard's,
  generation files newer than the commit) only when a mark was left, and otherwise never reads
  ``shards/``. It deletes only what a run of the dataset writes (``shardio.format``, "What a run of a
  dataset writes"): any other file it meets is named in ``Cleaned.foreign``, for the caller to report.
- **Staging and publishing shards** (``shardio.write.staging``): workers (``shardio.write.shard_writer``)
  ``stage`` each file under a unique ``.tmp-`` name and ``promote`` it to its final name; a name is
  unlisted, so invisible, until a commit lists it.
- **The commit** (``shardio.write.commit``: ``Committer`` / ``commit``, over
  ``shardio.write.editable_index.EditableIndex``: what is committed read from the segments, this run's
  changes beside it): shards in dataset order, a storage barrier (the shards are durable first),
  ``manifests/GEN.json`` created once (conditional create), then ``manifest.json`` (the commit point).
  Killed between the two, the generation file is newer than ``manifest.json`` and the next run's cleaning
  removes it. Nothing is deleted at a commit: files it stops listing (an input dropped or changed:
  ``Committer.drop_input``, ``drop_inputs``) go to ``retired`` and wait for ``collect``.
- **Retention** (``shardio.write.retention``, through ``check_held``, ``listed_hashes`` and
  ``collect_segments``): ``collect`` / ``gc`` delete what no kept generation needs.
- **Run reports** (``shardio.write.commit``): ``save_report`` / ``report_path``.
- **Restoring** (``shardio.write.committed``) a corrupt ``manifest.json`` from a kept generation the shard
  checker (``shardio.format.shard_check``, shared with the reader and ``verify``) finds whole.

The modules import one way: ``lock`` <- ``committed`` <- ``commit``; ``lock`` <- ``cleaning``; ``staging``
alone; none imports this one. Its interface takes plain values (paths, numbers, ``shardio.format``
entries): no Ray, no Pillow, none of preprocess's types.
"""

from __future__ import annotations

from shardio.write.cleaning import (
    Cleaned,
    clean_after_runs,
    clean_leftovers,
    collect_segments,
    foreign_files_warning,
    forget_runs,
    listed_hashes,
    mark_run,
    unfinished_runs,
    unmark_run,
)
from shardio.write.commit import Committer, commit, drop_inputs, report_path, save_report
from shardio.write.committed import load_committed, load_current, manifest_path, recover_manifest, restore_manifest
from shardio.write.lock import check_held, check_writable, ensure_output_dir, may_delete, shard_name_fence, writing
from shardio.write.staging import discard, discard_staged, promote, shard_paths, stage

__all__ = [
    "ensure_output_dir", "check_writable", "writing", "load_committed", "load_current", "manifest_path",
    "recover_manifest", "restore_manifest", "Cleaned", "foreign_files_warning", "clean_leftovers", "shard_paths",
    "stage", "promote", "discard_staged", "discard",
    "commit", "Committer", "drop_inputs", "collect_segments", "clean_after_runs", "mark_run", "unmark_run",
    "unfinished_runs", "forget_runs", "check_held", "may_delete", "shard_name_fence", "listed_hashes", "save_report",
    "report_path",
]
