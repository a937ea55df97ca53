"""The commit protocol of a dataset directory: publish a generation, clean a killed run's leftovers,
collect what retention no longer keeps, restore a lost or corrupt ``manifest.json``.

Every writer (``preprocess run``, ``verify --repair``, ``gc``) goes through these functions, with the
output lock held (``preprocess.output_lock``), so one module owns the rules the format spec states
(``shardio.format``, "Generations" and "Retention"). What they need from storage (``shardio.storage``):

- ``write_atomic``: a reader sees the old file or the whole new one (temp file, fsync, rename);
- a rename within a directory is atomic, and a file renamed before another is on disk before it
  (``sync_dir`` after the shard renames, before the manifest's);
- ``list_dir`` / ``stat`` / ``remove`` of plain files; nothing else (no links, no locks).

The order of a commit: ``manifests/GEN.json`` first, then ``manifest.json`` (the commit point). Killed
between the two, the generation file is newer than ``manifest.json`` and ``clean_leftovers`` removes
it. Nothing is deleted at a commit: files it stops listing go to ``retired`` and wait for ``collect``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from shardio import storage
from shardio.errors import ShardError, ShardFormatError
from shardio.format import (
    MANIFEST_NAME,
    MANIFESTS_DIR,
    REPORTS_DIR,
    SHARDS_DIR,
    Manifest,
    RetiredFile,
    check_shard_sizes,
    generation_path,
    list_generations,
    load_manifest,
)

__all__ = ["Retention", "Collected", "publish", "clean_leftovers", "collect", "recover_manifest",
           "DEFAULT_RETAIN_HOURS", "DEFAULT_RETAIN_GENERATIONS"]

# A nightly run must not pull shards from under an epoch started the night before: 24 h covers a
# day-long epoch; 3 generations cover reruns in quick succession (a retry, a repair) on top of that.
DEFAULT_RETAIN_HOURS = 24.0
DEFAULT_RETAIN_GENERATIONS = 3


@dataclass(frozen=True)
class Retention:
    """A generation is kept while it is one of the newest ``generations`` or was current less than
    ``hours`` ago; a file is collected once no kept generation lists it."""

    hours: float = DEFAULT_RETAIN_HOURS
    generations: int = DEFAULT_RETAIN_GENERATIONS

    def __post_init__(self) -> None:
        if self.hours < 0 or self.generations < 1:
            raise ValueError(f"retention needs hours >= 0 and generations >= 1 (the current one), got "
                             f"{self.hours} h, {self.generations} generation(s)")


@dataclass
class Collected:
    files: list[str] = field(default_factory=list)  # retired shard files deleted (relative paths)
    bytes: int = 0
    generations: list[int] = field(default_factory=list)  # generation files removed
    kept_generations: list[int] = field(default_factory=list)
    retained_files: int = 0  # retired files still kept for older generations


def _now() -> datetime:
    return datetime.now(timezone.utc)


def publish(directory: str, manifest: Manifest) -> int:
    """Commit ``manifest`` as the next generation: ``manifests/GEN.json``, then ``manifest.json``. Stamps
    the files retired by this commit, drops retired entries whose file ``collect`` already deleted, and
    returns the new generation."""
    generation = max([manifest.generation, *list_generations(directory)]) + 1
    now = _now().isoformat(timespec="seconds")
    manifest.generation, manifest.updated = generation, now
    retired = []
    for entry in manifest.retired:
        if entry.generation == 0:
            retired.append(RetiredFile(entry.path, generation, now))
        elif storage.exists(storage.join(directory, entry.path)):
            retired.append(entry)
    manifest.retired = retired
    data = json.dumps(manifest.to_json(), indent=1, ensure_ascii=False).encode("utf-8")
    storage.makedirs(storage.join(directory, MANIFESTS_DIR))
    storage.write_atomic(generation_path(directory, generation), data)
    storage.write_atomic(storage.join(directory, MANIFEST_NAME), data)
    return generation


def listed_files(manifest: Manifest) -> set[str]:
    """The files under ``shards/`` that ``manifest`` lists (pixels and metadata)."""
    return {rel for entry in manifest.shards for rel in (entry.path, entry.meta_path)}


def protected_files(manifest: Manifest) -> set[str]:
    """What a dataset owns under ``shards/`` and must keep: the current shards and the retired ones."""
    return listed_files(manifest) | {r.path for r in manifest.retired}


def clean_leftovers(directory: str, manifest: Manifest | None) -> int:
    """Remove what a killed run left: temp files, shard files neither listed nor retired by ``manifest``
    (the committed one), and generation files newer than it (a commit killed before ``manifest.json``).
    Returns how many files went."""
    keep = protected_files(manifest) if manifest is not None else set()
    removed = 0
    for folder in (directory, storage.join(directory, REPORTS_DIR), storage.join(directory, MANIFESTS_DIR)):
        for name in storage.list_dir(folder):
            if name.startswith(storage.TEMP_PREFIX):
                storage.remove(storage.join(folder, name))
                removed += 1
    for name in storage.list_dir(storage.join(directory, SHARDS_DIR)):
        if f"{SHARDS_DIR}/{name}" not in keep:
            storage.remove(storage.join(directory, SHARDS_DIR, name))
            removed += 1
    if manifest is not None:
        for generation in list_generations(directory):
            if generation > manifest.generation:
                storage.remove(generation_path(directory, generation))
                removed += 1
    return removed


def _parse_time(text: str) -> datetime | None:
    try:
        parsed = datetime.fromisoformat(text)
    except (TypeError, ValueError):
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


def collect(directory: str, manifest: Manifest, retention: Retention, now: datetime | None = None) -> Collected:
    """Delete the retired files and generation files no kept generation needs (see the format spec).
    ``manifest`` is the committed one; the caller holds the output lock. Deletes only paths the manifest's
    ``retired`` list names (validated at load: ``shards/NAME``) and ``manifests/GEN.json`` files, never a
    file the current or a kept generation lists."""
    cutoff = (now or _now()) - timedelta(hours=retention.hours)
    current = manifest.generation
    generations = [g for g in list_generations(directory) if g < current]

    commit_times: dict[int, datetime | None] = {}

    def committed_at(generation: int) -> datetime | None:
        # A generation file is written once, at its commit: its mtime is the commit time (a copy that
        # resets mtimes only makes retention longer).
        if generation not in commit_times:
            path = generation_path(directory, generation)
            if not storage.exists(path) and generation == current:
                path = storage.join(directory, MANIFEST_NAME)
            try:
                mtime_ns = storage.stat_fingerprint(path)[1]
                commit_times[generation] = datetime.fromtimestamp(mtime_ns / 1e9, timezone.utc)
            except FileNotFoundError:
                commit_times[generation] = None
        return commit_times[generation]

    def kept(generation: int, successor_committed: datetime | None) -> bool:
        # An unknown commit time keeps it: never delete what we are not sure is unused.
        return (generation > current - retention.generations or successor_committed is None
                or successor_committed > cutoff)

    result = Collected()
    doomed = [g for g in generations if not kept(g, committed_at(g + 1))]
    result.kept_generations = [g for g in generations if g not in doomed] + [current]

    def retired_at(entry: RetiredFile) -> datetime | None:
        # The later of the recorded time and the generation file's: a retired file never goes before the
        # generation file that lists it.
        times = [t for t in (_parse_time(entry.since), committed_at(entry.generation)) if t is not None]
        return max(times) if times else None

    candidates = [r for r in manifest.retired if not kept(r.generation - 1, retired_at(r))]
    result.retained_files = len(manifest.retired) - len(candidates)
    if candidates:
        # The retired list already covers every older generation's files; reading the kept generations
        # too costs a few ms and means a hand-edited or stale ``retired`` entry can never delete a file
        # that a kept snapshot still lists.
        protected = listed_files(manifest)
        for generation in result.kept_generations[:-1]:
            try:
                protected |= listed_files(load_manifest(directory, generation))
            except ShardError:
                pass  # a corrupt old generation cannot be reopened, so it protects nothing
        for entry in candidates:
            path = storage.join(directory, entry.path)
            if entry.path in protected:
                result.retained_files += 1
                continue
            try:
                result.bytes += storage.file_size(path)
            except FileNotFoundError:
                continue  # collected earlier: the next commit drops the entry
            storage.remove(path)
            result.files.append(entry.path)
    for generation in doomed:
        storage.remove(generation_path(directory, generation))
        result.generations.append(generation)
    return result


def recover_manifest(directory: str) -> Manifest:
    """Restore the newest valid kept generation (it parses, and every shard it lists is on disk with its
    size) as ``manifest.json`` and return it: for a ``manifest.json`` that is missing or unusable. Raises
    ShardFormatError when no generation is valid. The caller holds the output lock. Inputs that only an
    unusable newer generation listed are then uncommitted: the next run processes them again from their
    tars (the same shard names and bytes)."""
    problems = []
    for generation in reversed(list_generations(directory)):
        try:
            manifest = load_manifest(directory, generation)
            check_shard_sizes(directory, manifest)
        except ShardError as e:
            problems.append(f"generation {generation}: {e}")
            continue
        with storage.open_read(generation_path(directory, generation)) as f:
            storage.write_atomic(storage.join(directory, MANIFEST_NAME), f.read())
        return manifest
    raise ShardFormatError(
        f"{storage.join(directory, MANIFEST_NAME)}: unusable, and no kept generation can replace it "
        f"({'; '.join(problems) or f'none in {MANIFESTS_DIR}/'}); HINT: restore the directory from a backup, "
        "or re-run preprocess into a new directory"
    )
