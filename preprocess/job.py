"""The preprocessing job: inputs -> committed shards in one output directory, incrementally.

A run: take the output lock, read the index (if any) as columns and refuse a different config, clean
what a killed run left, skip inputs already committed unchanged (same path, size and mtime), run the
rest as Ray tasks, and commit what finished every ``COMMIT_INTERVAL_S`` (a segment of what changed and a
new root, published atomically). The root is the commit: a run killed at any instant leaves the previous
generation or a newer one, never a half-state; files it lists are complete, files it neither lists nor
retires are invisible and removed by the next run, which knows to look by the mark the killed run left
(the protocol itself, with what it needs from storage, is ``shardio.write.directory``).

What a run holds does not grow with the shards the dataset holds: the committed index is read as
columns (``DatasetIndex``), an input is found in the segments by name (``EditableIndex``), and only the
inputs the run adds or replaces become objects, let go at each commit. LAION-2B-en's size (230k tars,
2.3M shards) plus 10 new tars: 3.9 s and 330 MB, the same as a no-op rerun (the listing and the plan:
O(inputs)), against 23 s and 2.3 GB when a run loaded an object per shard (``python -m bench.scale_job
--synthetic 230000:10``).

Recognising committed inputs: by path plus (size, mtime_ns), not by a content hash. A no-op rerun over
N tars is then one listing of their folders with one ``stat`` per tar (``preprocess.inputs``), and a
lookup per tar (``preprocess.plan``): ~1 s at 30k tars for ``run_job``, and Ray is not started
(``python -m bench.scale_job``), where hashing would read every byte
(1,000 x 1 GB tars: minutes of I/O per nightly run). The cost: a file rewritten in place with the same
size within one timestamp tick (kernels stamp mtime from a coarse clock, a few ms) is not seen as
changed; ``touch`` it to force. Drops that land as new files (the usual case) are never missed.

An object in a bucket is recognised by URL plus (size, ETag), both from the LIST that found it
(``preprocess.inputs``): a no-op rerun costs one LIST request per 1,000 objects, and no HEAD or GET.
LastModified is not compared (uploading the same bytes again changes it). What ETag + size misses is
only in the safe direction: an ETag is the MD5 of a single-part upload, while a multipart or SSE-KMS
ETag changes with every upload, so at worst unchanged bytes are processed again.

A changed input gets new shard names (the fingerprint is in them), committed together with the
removal of its old shards in one manifest rename; the old files stay on disk as ``retired`` for the
readers of older generations, and the retention (``shardio.write.retention``: 24 h and 3 generations by default,
``RunOptions.retention``) collects them at the end of a later run, or ``preprocess gc``.

``--prune`` that would drop more than half of the committed inputs or samples is refused
(``PruneRefused``, before anything is touched) unless ``confirm_large_prune``: an input list that shrank
by accident (a source mount half down) must not empty a dataset. A ``manifest.json`` that is missing or
corrupt while kept generations exist is restored from the newest valid one, with a warning.

A permanently broken input (not a tar, truncated, a corrupt header: ``InputError.lasting``) fails the
same way on every read, so it is read once. The run that finds it records its fingerprint (size, mtime_ns,
ETag: what the plan compares) with the failure in its report's ``inputs_failed`` (``fingerprint``,
``failed_in``); the next run reads the newest report (``latest_report``: one listing of ``reports/`` and
one read, under the lock) and reports an input with the same fingerprint failed again, as it was, without
reading it: a rerun with nothing else to do answers without starting Ray (1 s, where reading the broken
tar again took 7 s), and carries the entry into its own report, so the memory lasts while the file is
unchanged. It still exits 1: the input is still not in the dataset. A changed file (a re-download) is
read again, as is every remembered one under ``RunOptions.retry_failed`` (``--retry-failed``). The run
reports are the memory because they already are the run history: no new file in the dataset's format; a
report lost or unreadable only costs one more read of the input. Failures a retry may cure (a read
error, a download cut, Ray losing a task) are never remembered.

An input is committed whole or not at all: the samples a broken input gave before its break (a
``.tar.gz`` cut mid-stream decodes its first members) are dropped, counted in the report
(``samples_lost``) and said in its reason. Kept, they would commit the input under its fingerprint, and a
rerun would skip it as committed, hiding that the rest of the tar is missing; re-downloaded whole, it is
processed whole.

Idempotent under any kill: shard names and bytes depend only on (input path, size, mtime, config), so
a rerun after SIGKILL rewrites exactly the files the killed run would have, and the manifest lists
inputs in a fixed order (input path, then shard name): an interrupted-then-rerun dataset is byte for
byte the uninterrupted one. A dead run's tasks still finishing on a shared cluster can only rename
identical bytes over a name, or leave unlisted files that the next run removes.

Disk full (ENOSPC / EDQUOT) in a worker or in the driver stops the run: finished inputs are committed if
the manifest still fits, unlisted files are removed, and ``OutputFull`` says so; the dataset stays as of
its last commit.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from preprocess.class_table import extend_class_table, folder_class_names
from preprocess.config import BUCKET, JobConfig
from preprocess.input_kinds import NumberedClasses, SampleReader
from preprocess.inputs import InputFingerprint, ResolvedInputs, resolve_inputs
from preprocess.plan import Plan, check_output_apart, plan_inputs
from preprocess.sources import Source
from preprocess.cluster_access import check_cluster_access, task_env
from preprocess.ray_cluster import check_cluster_address, check_cluster_build, ray_session
from preprocess.ray_tasks import Progress, StuckDecode, TaskEvent, stream_inputs
from preprocess.versions import build_difference, library_versions, pixel_build, version_drift
from preprocess.worker import InputResult
from shardio.write import directory as dataset_dir
from shardio.store.local import is_disk_full
from shardio.store.paths import normalize
from shardio.write.directory import Committer, drop_inputs
from shardio.write.retention import Retention, collect
from shardio.errors import (DatasetIncompatibleError, NodeBuildMismatch, NoInputsMatched, OutputFull,
                            PruneRefused, RayUnavailable, ShardError, ShardioError, VersionDrift)
from shardio.format import BUCKET_FORMAT_VERSION, InputEntry, Manifest
from shardio.store.backends import for_path
from shardio.format.manifests import DatasetIndex, load_index, read_root
from shardio.format.run_report import RunReport, latest_report, report_json

__all__ = ["RunOptions", "RunReport", "run_job", "dataset_config", "drop_inputs", "OutputFull", "PruneRefused", "COMMIT_INTERVAL_S",
           "report_json", "fold_result"]

# Commit the manifest at most this often while inputs finish (and always at the end): a killed run
# loses at most this much finished work, and a 1,000-tar manifest is not rewritten 1,000 times.
COMMIT_INTERVAL_S = 2.0


@dataclass
class RunOptions:
    inputs: list[str]
    output: str
    config: JobConfig
    workers: int | None = None
    ray_address: str | None = None
    wait_for_lock: bool = False
    prune: bool = False
    strict_versions: bool = False  # a Pillow / libjpeg-turbo other than the dataset's: error, not warning
    confirm_large_prune: bool = False  # let --prune drop more than half of the inputs or samples
    retention: Retention = field(default_factory=Retention)
    # Give the tasks this driver's object-store credentials (kept in their Ray runtime_env: visible in the
    # dashboard); default: each node's own (preprocess.cluster_access).
    pass_credentials: bool = False
    # Read again the inputs that failed for their bytes in the last run and are unchanged since (default:
    # they are reported failed again without being read; see "A permanently broken input" above).
    retry_failed: bool = False
    # Inputs from Python instead of paths (preprocess.sources): its inputs are the run's, ``inputs`` stays empty.
    source: Source | None = None


def dataset_config(output: str) -> dict[str, Any] | None:
    """The stored config of the dataset at ``output`` (what a rerun starts from: ``load_config(base=...)``),
    or None if there is none yet, or it cannot be read now (the run itself then says why, under the lock).

    From the root alone (a few KB: format 3 keeps the config there, versions 1-2 at the top of the one
    document): the run loads the whole index once, under the lock. A root that cannot be read this way
    (corrupt, say) goes through ``load_current``, which may restore a kept generation's."""
    directory = normalize(output)
    try:
        config = read_root(directory).get("config")
        if isinstance(config, dict):
            return dict(config)
    except FileNotFoundError:
        return None
    except (ShardioError, OSError):
        pass
    try:
        manifest = dataset_dir.load_current(directory)
    except (ShardioError, OSError):
        return None
    return dict(manifest.config) if manifest is not None else None


def _check_compatible(manifest: Manifest | DatasetIndex, cfg: JobConfig, directory: str) -> None:
    wanted = cfg.output_dict()
    stored = {**JobConfig().output_dict(), **manifest.config}  # keys newer than the dataset: their defaults
    if stored == wanted:
        return
    # Said over the full form: a raw dataset stores no encoding keys (JobConfig.to_dict), which a JPEG run
    # would otherwise read back as "encoding: dataset has None".
    full = JobConfig().full_output_dict()
    said_stored, said_wanted = {**full, **stored}, {**full, **wanted}
    keys = sorted(set(said_stored) | set(said_wanted))
    diffs = [f"{k}: dataset has {said_stored.get(k)!r}, this run {said_wanted.get(k)!r}"
             for k in keys if said_stored.get(k) != said_wanted.get(k)]
    raise DatasetIncompatibleError(
        f"{dataset_dir.manifest_path(directory)}: written with a different config ({'; '.join(diffs)}); "
        "shards of different shapes or pixels never mix: leave these keys out of the flags and --config file "
        "(a rerun uses the dataset's own config), or use a new --output"
    )


def run_job(
    options: RunOptions, on_event: Callable[[str, Any], None] | None = None,
    stop_requested: Callable[[], str] = lambda: "",
) -> RunReport:
    """Run the job; ``on_event(kind, payload)`` receives "plan", "progress", "started" / "retried"
    (``TaskEvent``), "input" (``InputResult``), "warning" (str) and "ray" (str: a line a Ray instance this
    run started printed) events (the CLI's progress bar and logs). Raises DatasetIncompatibleError
    (VersionDrift under ``strict_versions``) / OutputLocked / RayUnavailable before any work, OutputFull if
    the output disk fills up (see the module docstring); returns the report otherwise (its ``exit_code``
    says whether every input was processed).

    ``stop_requested()`` returns why to stop early (a signal's name, e.g. "SIGINT"), or "": once it does,
    no more inputs start, running ones are cancelled, the finished ones are committed and the report
    (``interrupted``, ``inputs_unfinished``) is written. A report is written whatever happens after the
    lock is taken, an unexpected exception included (then re-raised)."""
    emit = on_event or (lambda kind, payload: None)
    started = time.perf_counter()
    cfg = options.config
    directory = normalize(options.output)  # a URL stays a URL: object storage
    report = RunReport(
        run_id=datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6],
        output=directory,
        # Microseconds: two runs in one second (a no-op rerun takes ~1 s) still order by their start.
        started=datetime.now(timezone.utc).isoformat(timespec="microseconds"),
        config=cfg.to_dict(),
        # The format version this run writes: a bucketed dataset's is 4 (spec, "Buckets"), else the library's.
        versions={**library_versions(),
                  **({"format_version": BUCKET_FORMAT_VERSION} if cfg.mode == BUCKET else {})},
    )
    # NoInputsMatched: before the output is touched
    resolved = source_inputs(options) if options.source is not None else resolve_inputs(options.inputs,
                                                                                         cfg.image_extensions)
    # folder_classes: the names the folder inputs bring; a folder with no class folder fails here, unread.
    class_names = folder_class_names(resolved) if cfg.folder_classes else {}
    paths, report.inputs_failed, report.inputs_ignored = resolved.paths, resolved.failed, resolved.ignored
    report.files_ignored = resolved.files_ignored
    listing_failed = len(resolved.failed)
    if not paths:  # every INPUT failed (a folder, missing paths): refused before the output is touched
        reasons = "; ".join(f"{failed['input']}: {failed['reason']}" for failed in resolved.failed[:5])
        more = f" (and {len(resolved.failed) - 5} more)" if len(resolved.failed) > 5 else ""
        reasons = reasons or "no INPUT was given"
        raise NoInputsMatched(f"no input to process: {reasons}{more}; nothing was read or written")
    if options.source is None:  # a source's inputs are names, not files near the output
        check_output_apart(directory, resolved)
    # Every way of failing to join --ray-address (down, token authentication, not a Ray port) is
    # RayUnavailable here, before the output is touched, even if the run turns out to have nothing to do.
    check_cluster_address(options.ray_address, (lambda line: emit("ray", line)) if on_event is not None else None)
    dataset_dir.ensure_output_dir(directory)
    with dataset_dir.writing(directory, options.wait_for_lock):
        looked = _look_at_index(directory, resolved, options)
        remembered = {} if options.retry_failed else _remembered_failures(directory)
        if looked is not None and looked.planned is not None:
            _set_aside_remembered(looked.planned, remembered, report)
        if looked is not None and looked.planned is not None and not looked.planned.todo:
            _answer_unchanged(directory, looked, options, report, emit, started)
            return report
        if looked is not None:  # a readable version 3 index, checked: what the run edits
            existing, restored, committed = looked.index, "", looked.committed
        else:
            existing, restored = dataset_dir.load_committed(directory)
            committed = _committed_inputs(existing)
        if restored:
            report.warnings.append(restored)
            emit("warning", restored)
        if existing is not None:
            if looked is None:  # a looked-at index was checked already
                _check_compatible(existing, cfg, directory)
            _note_drift(existing.versions, directory, options, report, emit)
        committer = Committer(directory, existing, COMMIT_INTERVAL_S, run=report.run_id,
                              shape=(cfg.height, cfg.width, 3), config=cfg.output_dict(), versions=report.versions)
        index = committer.index
        index.versions = report.versions
        to_prune = sorted(committed.keys() - set(paths)) if options.prune else []  # the only set of paths
        if to_prune and not options.confirm_large_prune:
            _check_prune(committed, index.totals, to_prune, directory)  # refused: nothing changed, not even cleaned
        _note_foreign(directory, dataset_dir.clean_after_runs(directory, existing), report, emit)
        del existing  # a version 1/2 manifest's objects: the index holds what it needs
        if looked is not None and looked.planned is not None:
            planned = looked.planned  # its remembered failures set aside above
        else:
            planned = plan_inputs(resolved, committed)
            _set_aside_remembered(planned, remembered, report)
        del resolved, paths, committed, looked  # the listing's O(inputs) objects: the plan keeps what it needs (todo)
        # The dataset's class table with this run's new names appended, before any task (spec, "Classes").
        reader: SampleReader | None = None
        if options.source is not None:
            reader = options.source.reader()
        elif class_names:
            reader = NumberedClasses(extend_class_table(index, class_names, planned.todo))
        todo = planned.todo
        report.inputs_skipped, report.inputs_skipped_count = planned.skipped_named, planned.skipped
        for path in to_prune:
            committer.drop_input(path)
            report.inputs_pruned.append(path)
        # todo_bytes: the run's size, what the progress's ETA weighs each input by (preprocess.run_progress).
        plan = {"todo": len(todo), "skipped": planned.skipped, "todo_bytes": sum(fp.size for _, fp in todo),
                "remembered": len(report.inputs_failed) - listing_failed}
        listing_failures = len(report.inputs_failed)
        events: Counter[str] = Counter()  # a retried task or a stopped decode: a dead attempt's files

        def counted_emit(kind: str, payload: Any) -> None:
            events[kind] += 1
            emit(kind, payload)

        disk_full: str | None = None
        try:
            if not todo or stop_requested():
                emit("plan", plan)
            else:
                dataset_dir.mark_run(directory, report.run_id)  # tasks may promote files from here on
                disk_full = _process(todo, options, plan, committer, report, counted_emit, started, stop_requested,
                                     routes_ray=on_event is not None, reader=reader)
            if stop_requested():
                _note_interrupted(report, stop_requested(), todo, emit)
            committer.maybe_commit(force=True)
            if index.generation == 0:  # nothing committed yet
                committer.commit()  # an empty, valid dataset: readers get a clear answer
            if disk_full is None:
                now = committer.committed_index()  # what it just committed, from the segments it holds
                if todo and not stop_requested():
                    # Every task has ended. One that failed, was retried or had a decode stopped may have
                    # left files (a dead attempt's): they go now, not at the next run (the lock is held
                    # and the dataset committed). A run stopped early keeps its mark: a cancelled task may
                    # still promote a file, which the next run's cleaning removes.
                    if (len(report.inputs_failed) > listing_failures or events["retried"]
                            or events["warning"]):
                        _note_foreign(directory, dataset_dir.clean_leftovers(directory, now), report, emit)
                    dataset_dir.unmark_run(directory, report.run_id)
                report.files_collected = collect(directory, now, options.retention).files
        except OSError as e:
            if not is_disk_full(e):
                _save_report_after_error(committer, report, e, started)
                raise
            disk_full = f"writing the manifest: {e}"
        except (RayUnavailable, NodeBuildMismatch):
            # Refused before any input's task, like a lock held: no run happened to report, and no task
            # can promote a file, so the mark goes too.
            dataset_dir.unmark_run(directory, report.run_id)
            raise
        except BaseException as e:
            _save_report_after_error(committer, report, e, started)
            raise
        if disk_full is not None:
            _stop_on_full_disk(directory, report, disk_full)
        _close_report(directory, report, started, index.samples, index.generation)
    return report


@dataclass
class _Look:
    """The committed index as a run first sees it (a readable version 3 one): its columns, its committed
    inputs, and the plan against them (None: the run prunes, so it takes the full path)."""

    index: DatasetIndex
    committed: dict[str, InputEntry]
    planned: Plan | None


def _look_at_index(directory: str, resolved: ResolvedInputs, options: RunOptions) -> _Look | None:
    """The index as columns and the plan against it: O(inputs), never an object per shard (LAION-2B-en:
    230k inputs, 2.3M shards, where ``load_manifest`` alone took ~25 s and ~3 GB). None, having changed
    nothing, if the index is not a readable version 3 one: ``load_committed`` then reads, restores or
    upgrades it. DatasetIncompatibleError for another config, before anything is planned."""
    try:
        index = load_index(directory)
    except (ShardError, OSError):
        return None
    if index.segments is None:
        return None
    _check_compatible(index, options.config, directory)
    committed = index.committed_inputs()
    if options.prune and not committed.keys() <= set(resolved.paths):
        return _Look(index, committed, None)
    return _Look(index, committed, plan_inputs(resolved, committed))


def _answer_unchanged(directory: str, looked: _Look, options: RunOptions, report: RunReport,
                      emit: Callable[[str, Any], None], started: float) -> None:
    """A rerun with nothing to do (every listed input committed unchanged, nothing to prune), answered
    from the index's columns: a killed run's leftovers are still cleaned (``clean_after_runs``), retention
    still runs, the report is saved; no commit."""
    index, planned = looked.index, looked.planned
    assert planned is not None
    _note_drift(index.versions, directory, options, report, emit)
    report.inputs_skipped, report.inputs_skipped_count = planned.skipped_named, planned.skipped
    emit("plan", {"todo": 0, "skipped": planned.skipped,
                  "remembered": sum(1 for failed in report.inputs_failed if "failed_in" in failed)})
    _note_foreign(directory, dataset_dir.clean_after_runs(directory, index), report, emit)
    report.files_collected = collect(directory, index, options.retention).files
    _close_report(directory, report, started, index.samples, index.generation)


def source_inputs(options: RunOptions) -> ResolvedInputs:
    """A Python source's inputs as the job's: ``{source}/{input}`` names, each recognised by its version
    (held where an object's ETag is: a rerun compares it, as it compares an object's)."""
    source = options.source
    assert source is not None
    if options.inputs:
        raise NoInputsMatched("give INPUT paths or a source, not both; nothing was read or written")
    listed = {source.input_path(item): InputFingerprint(0, 0, str(item.version)) for item in source.inputs}
    return ResolvedInputs(sorted(listed), listed=listed)


def _note_foreign(directory: str, cleaned: dataset_dir.Cleaned, report: RunReport,
                  emit: Callable[[str, Any], None]) -> None:
    """Files in ``shards/`` the leftover cleaning left because no run writes them: said, not deleted."""
    warning = dataset_dir.foreign_files_warning(directory, cleaned.foreign)
    if warning and warning not in report.warnings:
        report.warnings.append(warning)
        emit("warning", warning)


def _remembered_failures(directory: str) -> dict[str, dict[str, Any]]:
    """The inputs the newest run report says failed for their bytes (``fingerprint`` recorded), by path:
    what this run reports again without reading, if unchanged. None remembered without a readable report."""
    latest = latest_report(directory)
    failed = latest.get("inputs_failed") if latest is not None else None
    if not isinstance(failed, list):
        return {}
    return {entry["input"]: entry for entry in failed
            if isinstance(entry, dict) and isinstance(entry.get("input"), str)
            and isinstance(entry.get("fingerprint"), dict)}


def _set_aside_remembered(planned: Plan, remembered: dict[str, dict[str, Any]], report: RunReport) -> None:
    """Take out of ``planned.todo`` every input that failed for its bytes before and is unchanged since (the
    same size and mtime, or size and ETag: ``plan._same_input``'s rule), and report it failed again, as it
    was, without reading it; a changed one stays to do."""
    if not remembered:
        return
    todo = []
    for path, fingerprint in planned.todo:
        entry = remembered.get(path)
        if entry is None or not _unchanged_since(entry["fingerprint"], fingerprint):
            todo.append((path, fingerprint))
            continue
        report.inputs_failed.append({key: entry[key] for key in
                                     ("input", "reason", "fingerprint", "failed_in", "samples_lost") if key in entry})
    planned.todo = todo


def _unchanged_since(recorded: dict[str, Any], fingerprint: InputFingerprint) -> bool:
    if fingerprint.etag:
        return recorded.get("size") == fingerprint.size and recorded.get("etag") == fingerprint.etag
    return recorded.get("size") == fingerprint.size and recorded.get("mtime_ns") == fingerprint.mtime_ns


def _note_drift(recorded: dict[str, Any], directory: str, options: RunOptions, report: RunReport,
                emit: Callable[[str, Any], None]) -> None:
    """Library versions other than those the dataset records: a warning, or VersionDrift under
    ``strict_versions``."""
    drift = version_drift(recorded, report.versions, dataset_dir.manifest_path(directory))
    if drift and options.strict_versions:
        raise VersionDrift(drift)
    if drift:
        report.warnings.append(drift)
        emit("warning", drift)


def _close_report(directory: str, report: RunReport, started: float, samples: int, generation: int) -> None:
    """The report's dataset totals and timing, then the report saved; a full disk here is OutputFull (the
    dataset itself is committed)."""
    report.dataset_samples, report.generation = samples, generation
    report.elapsed_s = round(time.perf_counter() - started, 3)
    report.images_per_s = round(report.samples_written / report.elapsed_s, 2) if report.elapsed_s else 0.0
    try:
        _save_report(directory, report)
    except OSError as e:
        if not is_disk_full(e):
            raise
        raise OutputFull(f"{directory}: output disk full writing the run report ({e}); the dataset itself "
                         f"is committed ({samples} samples); free space before the next run") from e


def fold_result(report: RunReport, committer: Committer, result: InputResult) -> None:
    """A finished input into the report and the next commit (at most every ``COMMIT_INTERVAL_S``). The
    job's own share is O(1) per input, whatever the dataset holds: no totals recomputed over every input
    and no manifest re-read (``python -m bench.scale_job`` measures it at 300 / 3k / 30k committed inputs);
    the commit itself is ``shardio.write.directory``'s."""
    _record(report, result)
    if result.error is None:
        # What the workers used, not the driver; the format version is the one this run writes.
        committer.index.versions = {**result.versions, "format_version": report.versions["format_version"]}
        _commit_input(committer, result)
        committer.maybe_commit()


def _commit_input(committer: Committer, result: InputResult) -> None:
    """List a finished input's shards; an object's entry also keeps the ETag it was read at."""
    committer.add_input(result.input, result.size, result.mtime_ns, result.shards, failed=len(result.failures),
                        etag=result.etag)


def _committed_inputs(existing: DatasetIndex | Manifest | None) -> dict[str, InputEntry]:
    """The committed inputs by name, what the plan compares the listing with: one entry per input from
    the index's columns (``shards`` left empty), none per shard; a version 1/2 manifest's own."""
    if existing is None:
        return {}
    return existing.committed_inputs() if isinstance(existing, DatasetIndex) else dict(existing.inputs)


def _check_prune(committed: dict[str, InputEntry], totals: dict[str, int], to_prune: list[str],
                 directory: str) -> None:
    """More than half of the inputs or samples: refuse unless confirmed (see the module docstring)."""
    samples = sum(committed[p].samples for p in to_prune)
    if 2 * len(to_prune) > len(committed) or 2 * samples > totals["samples"]:
        raise PruneRefused(
            f"{directory}: --prune would drop {len(to_prune)} of {len(committed)} committed inputs "
            f"({samples} of {totals['samples']} samples), e.g. {to_prune[0]}; nothing was changed. If the inputs "
            "really are gone, rerun with --confirm-large-prune; if not, check that the source is mounted"
        )


def _process(
    todo: list[tuple[str, InputFingerprint]], options: RunOptions, plan: dict[str, Any], committer: Committer,
    report: RunReport, emit: Callable[[str, Any], None], started: float, stop_requested: Callable[[], str],
    routes_ray: bool, reader: SampleReader | None = None,
) -> str | None:
    """Run ``todo`` as Ray tasks, committing as inputs finish; returns why it stopped early if the output
    disk filled up (every later input would fail the same way), else None. Returns early, tasks
    cancelled, once ``stop_requested()``. ``reader``: what every task reads its input with (a Python
    source's, or the reader of each kind with the dataset's class table); None: ``samples_of``."""
    # With no event hook (library use) Ray prints as it always does; the CLI routes it (quiet, JSON).
    ray_output = (lambda line: emit("ray", line)) if routes_ray else None
    with ray_session(options.ray_address, options.workers, on_output=ray_output) as cluster:
        report.cluster = cluster
        cluster["nodes_checked"] = len(check_cluster_build())  # NodeBuildMismatch: before any task
        files = [p for p, _ in todo] if options.source is None else []  # a source's inputs are no files
        env = task_env(files + [committer.directory], options.pass_credentials)
        # NodeAccessError: a node that cannot read the inputs or write the output, before any task.
        check_cluster_access(files, committer.directory, env, options.pass_credentials)
        expected_build = pixel_build()
        emit("plan", {**plan, "cluster": cluster})  # after Ray's start-up chatter, so the bar is clean
        processing_started = time.perf_counter()
        report.startup_s = round(processing_started - started, 3)
        stream = stream_inputs(todo, committer.directory, options.config,
                               should_stop=lambda: bool(stop_requested()), task_env=env,
                               name_fence=dataset_dir.shard_name_fence(committer.directory, committer.index),
                               reader=reader)
        try:
            for message in stream:
                if isinstance(message, Progress):
                    emit("progress", message)
                    continue
                if isinstance(message, TaskEvent):
                    emit(message.kind, message)  # "started" / "retried": the structured log's events
                    continue
                if isinstance(message, StuckDecode):
                    warning = (f"{message.input}: decoding {message.member} did not finish in {message.seconds:.0f} s "
                               f"(node {message.node}): its worker was stopped; the input restarts without it "
                               "and the sample is counted as failed")
                    report.warnings.append(warning)
                    emit("warning", warning)
                    continue
                _check_worker_build(message, expected_build)
                fold_result(report, committer, message)
                emit("input", message)
                if message.error is not None and is_disk_full(message.error):
                    return f"{message.input}: {message.error}"
        finally:
            stream.close()
            processing_s = time.perf_counter() - processing_started
            report.processing_images_per_s = round(report.samples_written / max(processing_s, 1e-9), 2)
    return None


def _check_worker_build(result: InputResult, expected: dict[str, Any]) -> None:
    """An input processed with other pixel libraries than the checked ones (a node that joined the cluster
    after ``check_cluster_build``) fails instead of being committed: its pixels would differ."""
    if result.error is None and (diff := build_difference(expected, result.versions)):
        result.error = (f"processed on node {result.node} with other pixel libraries than the run's ({diff}); "
                        "not committed: install the same build on that node and rerun")
        result.shards, result.failures = [], []


def _stop_on_full_disk(directory: str, report: RunReport, reason: str) -> None:
    """Out of space: remove what no manifest lists (frees space, nothing half-visible), keep a report if it
    fits, and raise ``OutputFull`` naming what the dataset still holds."""
    on_disk = load_index(directory) if for_path(directory).exists(dataset_dir.manifest_path(directory)) else None
    dataset_dir.clean_leftovers(directory, on_disk)
    report.dataset_samples = on_disk.samples if on_disk else 0
    report.warnings.append(f"stopped: output disk full ({reason})")
    try:
        _save_report(directory, report)
    except OSError:
        pass  # no room even for the report: the error below says everything it would
    state = (f"the dataset is as of its last commit ({on_disk.samples} samples, {on_disk.totals['input_count']} inputs)"
             if on_disk else "no dataset was published")
    raise OutputFull(
        f"{directory}: output disk full ({reason}); the run stopped and published nothing partial: {state}. "
        "Free space (or raise the quota) and rerun: committed inputs are skipped."
    )


def _record(report: RunReport, result: InputResult) -> None:
    if result.error is not None:
        failed: dict[str, Any] = {"input": result.input, "reason": result.error}
        if result.lasting:  # the bytes' own failure: remembered by the next run (_remembered_failures)
            failed["fingerprint"] = {"size": result.size, "mtime_ns": result.mtime_ns, "etag": result.etag}
            failed["failed_in"] = report.run_id
        if result.samples_lost:
            failed["samples_lost"] = result.samples_lost
        report.inputs_failed.append(failed)
        return
    report.inputs_processed.append(result.input)
    report.inputs_per_node[result.node] = report.inputs_per_node.get(result.node, 0) + 1
    report.samples_written += result.samples
    shapes = report.config.get("buckets") if report.config.get("mode") == BUCKET else None
    if shapes and result.shards:  # kept in the bucket list's order, as `shardio info` lists them
        names = [f"{h}x{w}" for h, w in shapes]
        counts = [report.samples_per_bucket.get(name, 0) for name in names]
        for shard in result.shards:
            counts[shard.get("bucket", 0)] += shard["samples"]
        report.samples_per_bucket = {name: n for name, n in zip(names, counts) if n}
    report.samples_failed += len(result.failures)
    report.samples_upscaled += result.upscaled
    report.failures.extend(result.failures)


def _note_interrupted(report: RunReport, reason: str, todo: list[tuple[str, InputFingerprint]],
                      emit: Callable[[str, Any], None]) -> None:
    report.interrupted = reason
    ended = set(report.inputs_processed) | {failed["input"] for failed in report.inputs_failed}
    report.inputs_unfinished = [path for path, _ in todo if path not in ended]
    message = (f"{reason}: stopped early; {len(report.inputs_processed)} finished input(s) committed, "
               f"{len(report.inputs_unfinished)} not processed (the next run does them)")
    report.warnings.append(message)
    emit("warning", message)


def _save_report_after_error(
    committer: Committer, report: RunReport, error: BaseException, started: float
) -> None:
    """An unexpected exception after the lock was taken: commit what finished and keep a report saying
    so (best effort: the original exception is what the caller re-raises)."""
    report.warnings.append(f"stopped by an error: {type(error).__name__}: {error}".splitlines()[0])
    report.elapsed_s = round(time.perf_counter() - started, 3)
    try:
        committer.maybe_commit(force=True)
        report.dataset_samples = committer.index.samples
        _save_report(committer.directory, report)
    except Exception:  # noqa: BLE001 - never mask the error being raised
        pass


def _save_report(directory: str, report: RunReport) -> None:
    dataset_dir.save_report(directory, report.run_id, report_json(report))
