"""Retention: which generations a dataset keeps, and deleting what none of them needs (the rules are the
spec's "Retention", ``shardio.format``): retired shard files, generation roots, the index segments only
collected roots named. Under the output lock (``shardio.write.lock.writing``), at the end of a run
or by ``preprocess gc``; it deletes only paths the manifest's ``retired`` list names, ``manifests/GEN.json``
files and ``index/HEX64.npz`` segments, never a file the current or a kept generation lists."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from shardio.errors import ShardError
from shardio.format import MANIFEST_NAME, Manifest, RetiredFile
from shardio.format.manifests import DatasetIndex, generation_path, list_generations, load_index, read_root
from shardio.format.string_hashes import hashes_in, string_hashes
from shardio.store.root import Place, open_root
from shardio.write.cleaning import clean_leftovers, collect_segments, forget_runs, listed_hashes, unfinished_runs
from shardio.write.lock import check_held, may_delete, writing

__all__ = ["DEFAULT_RETAIN_GENERATIONS", "DEFAULT_RETAIN_HOURS", "DEFAULT_RETAIN_PASSING_MINUTES", "Collected",
           "Retention", "collect", "gc"]

# A nightly run must not pull shards from under an epoch started the night before: 24 h covers a
# day-long epoch; 3 generations cover reruns in quick succession (a retry, a repair) on top of that.
DEFAULT_RETAIN_HOURS = 24.0
DEFAULT_RETAIN_GENERATIONS = 3
DEFAULT_RETAIN_PASSING_MINUTES = 10.0


@dataclass(frozen=True)
class Retention:
    """A generation is kept while it is one of the newest ``generations`` or was current less than
    ``hours`` ago; a passing one (current under ``passing_minutes``: a run's intermediate commit) only
    as the newest of its ``passing_minutes`` bucket (0: every one); a file is collected once no kept
    generation lists it (the spec's "Retention")."""

    hours: float = DEFAULT_RETAIN_HOURS
    generations: int = DEFAULT_RETAIN_GENERATIONS
    passing_minutes: float = DEFAULT_RETAIN_PASSING_MINUTES

    def __post_init__(self) -> None:
        if self.hours < 0 or self.generations < 1 or self.passing_minutes < 0:
            raise ValueError(f"retention needs hours >= 0, generations >= 1 (the current one) and passing minutes "
                             f">= 0, got {self.hours} h, {self.generations} generation(s), {self.passing_minutes} min")


@dataclass
class Collected:
    files: list[str] = field(default_factory=list)  # retired shard files deleted (relative paths)
    bytes: int = 0
    generations: list[int] = field(default_factory=list)  # generation files removed
    kept_generations: list[int] = field(default_factory=list)
    retained_files: int = 0  # retired files still kept for older generations
    segments: list[str] = field(default_factory=list)  # index segments no kept root names any more
    foreign: list[str] = field(default_factory=list)  # files of shards/ no run writes: left, reported (gc)


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _parse_time(text: str) -> datetime | None:
    try:
        parsed = datetime.fromisoformat(text)
    except (TypeError, ValueError):
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


def _bucket(moment: datetime, width: timedelta) -> int:
    return int(moment.timestamp() // width.total_seconds())


def collect(place: Place, manifest: Manifest | DatasetIndex, retention: Retention,
            now: datetime | None = None) -> Collected:
    """Delete the retired files and generation files no kept generation needs (see the format spec).
    ``manifest`` is the committed one (a ``Manifest``, or its columns: a ``DatasetIndex``); the caller holds
    the output lock. Deletes only paths the manifest's ``retired`` list names (validated at load:
    ``shards/NAME``) and ``manifests/GEN.json`` files, never a file the current or a kept generation lists:
    each kept generation is opened as columns (``load_index``) and only the candidates are looked up among
    its listed paths' hashes (``listed_hashes``: no object per shard; a hash collision keeps a file)."""
    root = open_root(place)
    store, directory = root.storage, root.path
    check_held(root)
    if not may_delete(root):  # a previous holder of the lease not fenced out yet: delete nothing
        return Collected(kept_generations=[*list_generations(root)])
    cutoff = (now or _now()) - timedelta(hours=retention.hours)
    current = manifest.generation
    generations = [g for g in list_generations(root) if g < current]

    commit_times: dict[int, datetime | None] = {}

    def committed_at(generation: int) -> datetime | None:
        # A generation file is written once, at its commit: its mtime is the commit time (a copy that
        # resets mtimes only makes retention longer).
        if generation not in commit_times:
            path = generation_path(root, generation)
            if not store.exists(path) and generation == current:
                path = store.join(directory, MANIFEST_NAME)
            try:
                mtime_ns = store.stat_fingerprint(path)[1]
                commit_times[generation] = datetime.fromtimestamp(mtime_ns / 1e9, timezone.utc)
            except FileNotFoundError:
                commit_times[generation] = None
        return commit_times[generation]

    def kept(generation: int, successor_committed: datetime | None) -> bool:
        # An unknown commit time keeps it: never delete what we are not sure is unused.
        return (generation > current - retention.generations or successor_committed is None
                or successor_committed > cutoff)

    runs: dict[int, str] = {}

    def run_of(generation: int) -> str:
        # The run that committed it ("" outside a run, or unreadable: then never a passing one).
        if generation not in runs:
            try:
                run = read_root(root, generation if generation != current else None).get("run", "")
            except (ShardError, OSError):
                run = ""
            runs[generation] = run if isinstance(run, str) else ""
        return runs[generation]

    # The generation after each one still on storage: its successor G+1, or, where an earlier collection
    # removed G+1's root (a passing one), the next kept one. It was committed no earlier than G+1, so
    # its time bounds when G stopped being current from above: a G it lets go was replaced at least as
    # long ago. (G+1's own time lost with its root kept G forever: one root and its files per run.)
    following = dict(zip(generations, [*generations[1:], current]))

    def root_kept(generation: int) -> bool:
        after = following[generation]
        successor = committed_at(after)
        if not kept(generation, successor):
            return False
        committed = committed_at(generation)
        if generation > current - retention.generations or not retention.passing_minutes or None in (
                committed, successor):
            return True
        if not run_of(generation) or run_of(generation) != run_of(after):
            return True  # a run's result, or a commit outside a run: kept by the time rule alone
        bucket = timedelta(minutes=retention.passing_minutes)
        # A passing generation: kept as the newest commit of its bucket (its successor in a later one).
        return _bucket(committed, bucket) != _bucket(successor, bucket)

    result = Collected()
    doomed = [g for g in generations if not root_kept(g)]
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
        wanted = string_hashes([entry.path for entry in candidates])
        protected = hashes_in(listed_hashes(manifest), wanted)
        for generation in result.kept_generations[:-1]:
            try:
                protected |= hashes_in(listed_hashes(load_index(root, generation)), wanted)
            except ShardError:
                pass  # a corrupt old generation cannot be reopened, so it protects nothing
        for entry, listed in zip(candidates, protected.tolist()):
            path = store.join(directory, entry.path)
            if listed:
                result.retained_files += 1
                continue
            try:
                result.bytes += store.file_size(path)
            except FileNotFoundError:
                continue  # collected earlier: the next commit drops the entry
            check_held(root)
            store.remove(path)
            result.files.append(entry.path)
    for generation in doomed:
        check_held(root)
        store.remove(generation_path(root, generation))
        result.generations.append(generation)
    result.segments = collect_segments(root, manifest)
    return result


def gc(place: Place, retention: Retention, wait_for_lock: bool = False,
       now: datetime | None = None) -> Collected:
    """``preprocess gc``: remove a killed run's leftovers, then what ``retention`` no longer keeps; returns
    what went, and the files of ``shards/`` it left because no run writes them (``Collected.foreign``). Raises
    ShardFormatError for a dataset whose ``manifest.json`` is unusable (``verify --repair`` restores it:
    collecting against a guessed manifest could delete what the real one lists)."""
    root = open_root(place)
    load_index(root)  # a missing directory or a broken manifest: say so before taking the lock
    with writing(root, wait_for_lock):
        index = load_index(root)  # the shards as columns: no object per shard
        runs = unfinished_runs(root)
        cleaned = clean_leftovers(root, index)
        if cleaned.complete:
            forget_runs(root, runs)  # what a killed run left has just gone
        collected = collect(root, index, retention, now)
        collected.foreign = cleaned.foreign
        return collected


# --- run reports (the format: shardio.format.run_report) -----------------------------------------------------
