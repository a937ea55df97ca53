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
N tars is then one listing of their folders with one ``stat`` per tar (``preprocess.inputs.resolve``), and a
lookup per tar (``preprocess.plan``): ~1 s at 30k tars for ``run_job``, and Ray is not started
(``python -m bench.scale_job``), where hashing would read every byte
(1,000 x 1 GB tars: minutes of I/O per nightly run). The cost: a file rewritten in place with the same
size within one timestamp tick (kernels stamp mtime from a coarse clock, a few ms) is not seen as
changed; ``touch`` it to force. Drops that land as new files (the usual case) are never missed.

An object in a bucket is recognised by URL plus (size, ETag), both from the LIST that found it
(``preprocess.inputs.resolve``): a no-op rerun costs one LIST request per 1,000 objects, and no HEAD or GET.
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

Model outputs (``models:``, spec "Model outputs"): a run loads each model once in the driver and identifies it
(``preprocess.models.identity``) before the output is touched, a run with nothing new to do too (it would
otherwise call a dataset made by another model up to date); a model whose identity differs from the one the
dataset records for its output is refused (``ConfigError``, exit 2, naming the output and both identities), unless
the run rewrites that output for every input (``--rewrite-output``: ``preprocess.rewrite``). The models run in the
tasks (``preprocess.worker``), or, for a model with replicas (one per GPU of the cluster by default:
``preprocess.models.replicas``), in Ray actors the run starts once Ray is up, before any task, and kills at its
end, however it ends; either way each input says which model ran it: an input processed with another model than
the driver's (a node with another copy) fails, not committed. Each finished input's output dtypes and per-bucket
shapes go into the root's ``outputs`` at its commit, where another dtype or another shape for a bucket is refused.

Disk full (ENOSPC / EDQUOT) in a worker or in the driver stops the run: finished inputs are committed if
the manifest still fits, unlisted files are removed, and ``OutputFull`` says so; the dataset stays as of
its last commit.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

from preprocess.cluster.cluster_access import check_cluster_access, task_env
from preprocess.committed import Committed, check_compatible, read_committed
from preprocess.config import JobConfig
from preprocess.inputs.kinds import SampleReader
from preprocess.inputs.resolve import InputFingerprint
from preprocess.models.recorded_outputs import check_worker_models, fold_outputs, identify_models, made_by
from preprocess.models.replicas import start_replicas
from preprocess.plan import check_prune, plan_inputs
from preprocess.rewrite import check_rewrite, config_to_compare, new_fence, rewrite_todo
from preprocess.cluster.ray_cluster import check_cluster_address, check_cluster_build, ray_session
from preprocess.cluster.ray_tasks import Progress, StuckDecode, TaskEvent, stream_inputs
from preprocess.remembered_failures import remembered_failures, set_aside_remembered
from preprocess.inputs.run_inputs import RunInputs, resolve_run_inputs
from preprocess.inputs.sources import Source
from preprocess.image.versions import build_difference, library_versions, pixel_build, version_drift
from preprocess.worker import InputResult
from shardio.write import directory as dataset_dir
from shardio.store.local import is_disk_full
from shardio.write.directory import Committer, drop_inputs
from shardio.write.retention import Retention, collect
from shardio.errors import (NodeBuildMismatch, OutputFull, PruneRefused, RayUnavailable, ShardioError,
                            VersionDrift)
from shardio.format import config_buckets, dataset_format_version
from shardio.store.root import DatasetRoot, open_root
from shardio.format.manifests import DatasetIndex, load_index, read_root
from shardio.format.run_report import RunReport, report_json

__all__ = ["RunOptions", "RunReport", "run_job", "dataset_config", "drop_inputs", "OutputFull", "PruneRefused",
           "COMMIT_INTERVAL_S", "report_json", "fold_result"]

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
    # dashboard); default: each node's own (preprocess.cluster.cluster_access).
    pass_credentials: bool = False
    # Read again the inputs that failed for their bytes in the last run and are unchanged since (default:
    # they are reported failed again without being read; see "A permanently broken input" above).
    retry_failed: bool = False
    # Inputs from Python instead of paths (preprocess.inputs.sources): its inputs are the run's, ``inputs`` stays empty.
    source: Source | None = None
    # An output of ``models:`` rewritten by its (new) model for every input, committed once (preprocess.rewrite).
    rewrite_output: str | None = None


def dataset_config(output: str) -> dict[str, Any] | None:
    """The stored config of the dataset at ``output`` (what a rerun starts from: ``load_config(base=...)``),
    or None if there is none yet, or it cannot be read now (the run itself then says why, under the lock).

    From the root alone (a few KB: format 3 keeps the config there, versions 1-2 at the top of the one
    document): the run loads the whole index once, under the lock. A root that cannot be read this way
    (corrupt, say) goes through ``load_current``, which may restore a kept generation's."""
    root = open_root(output)
    try:
        config = read_root(root).get("config")
        if isinstance(config, dict):
            return dict(config)
    except FileNotFoundError:
        return None
    except (ShardioError, OSError):
        pass
    try:
        manifest = dataset_dir.load_current(root)
    except (ShardioError, OSError):
        return None
    return dict(manifest.config) if manifest is not None else None


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
    started = time.perf_counter()
    root = open_root(options.output)  # the output opened once: its backend chosen here, the root passed down
    run = _Run(options, root, _new_report(root.path, options.config), on_event or (lambda kind, payload: None),
               started, stop_requested, routes_ray=on_event is not None)
    inputs = resolve_run_inputs(options.inputs, options.source, options.config)  # NoInputsMatched: nothing touched
    _refuse_early(run, inputs)
    dataset_dir.ensure_output_dir(root)
    with dataset_dir.writing(root, options.wait_for_lock):
        committed = read_committed(root)
        if options.rewrite_output is not None:  # ConfigError before anything else is said or touched
            check_rewrite(options.rewrite_output, [spec.name for spec in options.config.model_specs],
                          [o.name for o in committed.outputs], committed.inputs,
                          set(inputs.resolved.paths), options.prune, dataset_dir.manifest_path(root))
        _check_committed(run, committed)
        # ConfigError before anything is touched; with nothing new too: "unchanged" would say a dataset made by
        # another model is up to date
        _check_models(run, committed)
        work = _plan(run, inputs, committed)
        if work.nothing_to_do and committed.columns is not None:
            _answer_unchanged(run, committed.columns, work)
            return run.report
        committer = _open_commit(run, committed, work)
        reader, files = inputs.reader(committer.index, work.todo), inputs.files(work.todo)
        del committed, inputs  # the index's and the listing's O(inputs) objects: the committer and the work suffice
        _run_and_commit(run, work, committer, files, reader)
    return run.report


@dataclass
class _Run:
    """One run as each of its steps sees it: what was asked, where, the report it fills, where its events
    go, when it started and whether it is asked to stop."""

    options: RunOptions
    root: DatasetRoot  # the output, opened once by ``run_job``
    report: RunReport
    emit: Callable[[str, Any], None]
    started: float
    stop_requested: Callable[[], str]
    routes_ray: bool  # an event hook takes what a Ray this run starts prints (the CLI: quiet, JSON)
    # Each output of ``models:`` -> its model's identity as a root records it (``_check_models``).
    identities: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def directory(self) -> str:
        """The output's path, for messages."""
        return self.root.path


@dataclass
class _Work:
    """What the run does, decided once from the listing and what is committed: the inputs to process
    (largest first) and to prune, and the counts the "plan" event says."""

    todo: list[tuple[str, InputFingerprint]]
    to_prune: list[str]
    skipped: int  # committed unchanged
    remembered: int  # failed for their bytes before and unchanged since: reported failed again, unread

    @property
    def nothing_to_do(self) -> bool:
        return not self.todo and not self.to_prune

    def event(self) -> dict[str, Any]:
        # todo_bytes: the run's size, what the progress's ETA weighs each input by (preprocess.run_progress).
        return {"todo": len(self.todo), "skipped": self.skipped, "todo_bytes": sum(fp.size for _, fp in self.todo),
                "remembered": self.remembered}


def _new_report(directory: str, cfg: JobConfig) -> RunReport:
    """The report this run fills: its id and start, its config, the versions it writes with."""
    return RunReport(
        run_id=datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6],
        output=directory,
        # Microseconds: two runs in one second (a no-op rerun takes ~1 s) still order by their start.
        started=datetime.now(timezone.utc).isoformat(timespec="microseconds"),
        config=cfg.to_dict(),
        # The format version this run writes: its dataset's (spec, "The version rule"), not the library's.
        versions={**library_versions(), "format_version": dataset_format_version(cfg.to_dict())},
    )


def _refuse_early(run: _Run, inputs: RunInputs) -> None:
    """Refused before the output is touched, even if the run turns out to have nothing to do: an input
    inside the output (``OutputUnusable``), and every way of failing to join --ray-address (down, token
    authentication, not a Ray port: ``RayUnavailable``)."""
    inputs.check_apart(run.root)
    check_cluster_address(run.options.ray_address, (lambda line: run.emit("ray", line)) if run.routes_ray else None)


def _check_committed(run: _Run, committed: Committed) -> None:
    """What the run found, said and checked before anything is planned: a restored ``manifest.json`` (a
    warning), another config (``DatasetIncompatibleError``), other library versions (``_note_drift``)."""
    if committed.restored:
        run.report.warnings.append(committed.restored)
        run.emit("warning", committed.restored)
    if committed.index is not None:
        check_compatible(committed.index, run.options.config, run.root, run.options.rewrite_output)
        _note_drift(run, committed.index.versions)


def _check_models(run: _Run, committed: Committed) -> None:
    """Each model loaded once and identified, one that is not the dataset's refused before anything is touched
    (``identify_models``); a model with neither weights nor version is said in a warning."""
    identities, warnings = identify_models(run.options.config.model_specs, committed.outputs,
                                           run.options.rewrite_output, dataset_dir.manifest_path(run.root))
    for warning in warnings:
        run.report.warnings.append(warning)
        run.emit("warning", warning)
    run.identities.update(identities)


def _plan(run: _Run, inputs: RunInputs, committed: Committed) -> _Work:
    """The listing against the committed inputs (``plan_inputs``: no I/O), the remembered failures set aside
    (unless ``retry_failed``), and under ``prune`` the committed inputs no longer listed; the report takes
    what the listing and the plan found."""
    resolved, report = inputs.resolved, run.report
    report.inputs_failed, report.inputs_ignored = resolved.failed, resolved.ignored
    report.files_ignored = resolved.files_ignored
    name = run.options.rewrite_output
    if name is not None and made_by(committed.outputs, name, run.identities[name]):
        # Already this model's (the rewrite done, a rerun of its command): a run as any other, nothing rewritten
        message = f"--rewrite-output {name}: the dataset's {name} is this model's already: nothing to rewrite"
        report.warnings.append(message)
        run.emit("warning", message)
        run.options = replace(run.options, rewrite_output=None)
    elif name is not None:  # every listed input again, the remembered failures included
        return _Work(rewrite_todo(resolved), [], 0, 0)
    planned = plan_inputs(resolved, committed.inputs)
    remembered = set_aside_remembered(planned, {} if run.options.retry_failed else remembered_failures(run.root),
                                      report)
    report.inputs_skipped, report.inputs_skipped_count = planned.skipped_named, planned.skipped
    # the only set of paths
    to_prune = sorted(committed.inputs.keys() - set(resolved.paths)) if run.options.prune else []
    return _Work(planned.todo, to_prune, planned.skipped, remembered)


def _answer_unchanged(run: _Run, index: DatasetIndex, work: _Work) -> None:
    """A rerun with nothing to do (every listed input committed unchanged, nothing to prune), answered
    from the index's columns: a killed run's leftovers are still cleaned (``clean_after_runs``), retention
    still runs, the report is saved; no commit."""
    run.emit("plan", work.event())
    _note_foreign(run, dataset_dir.clean_after_runs(run.root, index))
    run.report.files_collected = collect(run.root, index, run.options.retention).files
    _close_report(run, index.samples, index.generation)


def _open_commit(run: _Run, committed: Committed, work: _Work) -> Committer:
    """The committer over what is committed (a version 1/2 manifest is upgraded at its first commit); then,
    in this order, the prune guard (refused: nothing changed, not even cleaned), a killed run's leftovers
    cleaned, and the inputs to prune dropped."""
    options, cfg, report = run.options, run.options.config, run.report
    committer = Committer(run.root, committed.index, COMMIT_INTERVAL_S, run=report.run_id,
                          shape=(cfg.height, cfg.width, 3), config=cfg.output_dict(), versions=report.versions)
    committer.index.versions = report.versions
    if options.rewrite_output is not None:
        # One commit at the end, every file under a fence none of the dataset's files carries (preprocess.rewrite)
        committer.held = True
        committer.index.name_fence = new_fence(committer.index.dataset_id, committer.index.generation,
                                               options.rewrite_output, run.identities[options.rewrite_output])
        committer.index.config = config_to_compare(committer.index.config, cfg.output_dict(), options.rewrite_output)
    if work.to_prune and not run.options.confirm_large_prune:
        check_prune(committed.inputs, committer.index.totals, work.to_prune, run.directory)
    _note_foreign(run, dataset_dir.clean_after_runs(run.root, committed.index))
    for path in work.to_prune:
        committer.drop_input(path)
        report.inputs_pruned.append(path)
    return committer


def _run_and_commit(run: _Run, work: _Work, committer: Committer, files: list[str],
                    reader: SampleReader | None) -> None:
    """The tasks, the commit and the tidying after them, then the report closed. A report is written
    whatever happens from here (an unexpected exception: what finished is committed, then it is re-raised);
    a full disk ends in ``OutputFull`` (``_stop_on_full_disk``)."""
    disk_full: str | None = None
    try:
        disk_full, left_files = _run_tasks(run, work, committer, files, reader)
        _commit(run, committer, work.todo)
        left_files = left_files or committer.held  # a rewrite not committed: its files are a dead run's
        if disk_full is None:
            _tidy(run, committer, work.todo, left_files)
    except OSError as e:
        if not is_disk_full(e):
            _save_report_after_error(run, committer, e)
            raise
        disk_full = f"writing the manifest: {e}"
    except (RayUnavailable, NodeBuildMismatch):
        # Refused before any input's task, like a lock held: no run happened to report, and no task
        # can promote a file, so the mark goes too.
        dataset_dir.unmark_run(run.root, run.report.run_id)
        raise
    except BaseException as e:
        _save_report_after_error(run, committer, e)
        raise
    if disk_full is not None:
        _stop_on_full_disk(run, disk_full)
    _close_report(run, committer.index.samples, committer.index.generation)


def _run_tasks(run: _Run, work: _Work, committer: Committer, files: list[str],
               reader: SampleReader | None) -> tuple[str | None, bool]:
    """``work.todo`` as Ray tasks (``_process``; nothing to do or a stop already asked for: the plan is
    said, Ray not started). Returns why the run stopped early if the output disk filled up (else None), and
    whether a dead attempt may have left files: a task that failed, was retried or had a decode stopped."""
    if not work.todo or run.stop_requested():
        run.emit("plan", work.event())
        return None, False
    failures_before = len(run.report.inputs_failed)
    events: Counter[str] = Counter()

    def counted_emit(kind: str, payload: Any) -> None:
        events[kind] += 1
        run.emit(kind, payload)

    dataset_dir.mark_run(run.root, run.report.run_id)  # tasks may promote files from here on
    disk_full = _process(replace(run, emit=counted_emit), work, committer, files, reader)
    left_files = len(run.report.inputs_failed) > failures_before or events["retried"] > 0 or events["warning"] > 0
    return disk_full, left_files


def _commit(run: _Run, committer: Committer, todo: list[tuple[str, InputFingerprint]]) -> None:
    """What finished committed; an empty, valid dataset if nothing ever was (readers get a clear answer). A
    rewrite commits only whole: every input done, none failed, no stop."""
    if run.stop_requested():
        _note_interrupted(run, todo)
    if committer.held:
        done = set(run.report.inputs_processed)
        if not run.stop_requested() and all(path in done for path, _ in todo):
            committer.held = False
        else:
            message = (f"--rewrite-output {run.options.rewrite_output}: {len(todo) - len(done)} of {len(todo)} "
                       "input(s) not rewritten: nothing was committed (the dataset is as it was); rerun the rewrite")
            run.report.warnings.append(message)
            run.emit("warning", message)
    committer.maybe_commit(force=True)
    if committer.index.generation == 0 and not committer.held:  # nothing committed yet
        committer.commit()


def _tidy(run: _Run, committer: Committer, todo: list[tuple[str, InputFingerprint]], left_files: bool) -> None:
    """After the commit: a dead attempt's files removed and the run's mark taken away once every task has
    ended, then retention."""
    now = committer.committed_index()  # what it just committed, from the segments it holds
    if todo and not run.stop_requested():
        # Every task has ended. One that failed, was retried or had a decode stopped may have
        # left files (a dead attempt's): they go now, not at the next run (the lock is held
        # and the dataset committed). A run stopped early keeps its mark: a cancelled task may
        # still promote a file, which the next run's cleaning removes.
        if left_files:
            _note_foreign(run, dataset_dir.clean_leftovers(run.root, now))
        dataset_dir.unmark_run(run.root, run.report.run_id)
    run.report.files_collected = collect(run.root, now, run.options.retention).files


def _note_foreign(run: _Run, cleaned: dataset_dir.Cleaned) -> None:
    """Files in ``shards/`` the leftover cleaning left because no run writes them: said, not deleted."""
    warning = dataset_dir.foreign_files_warning(run.root, cleaned.foreign)
    if warning and warning not in run.report.warnings:
        run.report.warnings.append(warning)
        run.emit("warning", warning)


def _note_drift(run: _Run, recorded: dict[str, Any]) -> None:
    """Library versions other than those the dataset records: a warning, or VersionDrift under
    ``strict_versions``."""
    drift = version_drift(recorded, run.report.versions, dataset_dir.manifest_path(run.root))
    if drift and run.options.strict_versions:
        raise VersionDrift(drift)
    if drift:
        run.report.warnings.append(drift)
        run.emit("warning", drift)


def _close_report(run: _Run, samples: int, generation: int) -> None:
    """The report's dataset totals and timing, then the report saved; a full disk here is OutputFull (the
    dataset itself is committed)."""
    root, report = run.root, run.report
    report.dataset_samples, report.generation = samples, generation
    report.elapsed_s = round(time.perf_counter() - run.started, 3)
    report.images_per_s = round(report.samples_written / report.elapsed_s, 2) if report.elapsed_s else 0.0
    try:
        _save_report(root, report)
    except OSError as e:
        if not is_disk_full(e):
            raise
        raise OutputFull(f"{root}: output disk full writing the run report ({e}); the dataset itself "
                         f"is committed ({samples} samples); free space before the next run") from e


def fold_result(report: RunReport, committer: Committer, result: InputResult,
                identities: dict[str, dict[str, Any]] | None = None) -> None:
    """A finished input into the report and the next commit (at most every ``COMMIT_INTERVAL_S``). The
    job's own share is O(1) per input, whatever the dataset holds: no totals recomputed over every input
    and no manifest re-read (``python -m bench.scale_job`` measures it at 300 / 3k / 30k committed inputs);
    the commit itself is ``shardio.write.directory``'s. ``identities``: each output's model identity (a run
    with ``models:``), what the root records of a new output."""
    _record(report, result)
    if result.error is None:
        # What the workers used, not the driver; the format version is the one this run writes.
        committer.index.versions = {**result.versions, "format_version": report.versions["format_version"]}
        if result.outputs:
            fold_outputs(committer, result, identities or {})
        _commit_input(committer, result)
        committer.maybe_commit()


def _commit_input(committer: Committer, result: InputResult) -> None:
    """List a finished input's shards; an object's entry also keeps the ETag it was read at."""
    committer.add_input(result.input, result.size, result.mtime_ns, result.shards, failed=len(result.failures),
                        etag=result.etag)


def _process(run: _Run, work: _Work, committer: Committer, files: list[str], reader: SampleReader | None) -> str | None:
    """Run ``work.todo`` as Ray tasks, committing as inputs finish; returns why it stopped early if the output
    disk filled up (every later input would fail the same way), else None. Returns early, tasks
    cancelled, once ``run.stop_requested()``. ``files``: the inputs every node must reach; ``reader``: what
    every task reads its input with (``RunInputs.reader``; None: ``samples_of``)."""
    options, report, emit = run.options, run.report, run.emit
    # With no event hook (library use) Ray prints as it always does; the CLI routes it (quiet, JSON).
    ray_output = (lambda line: emit("ray", line)) if run.routes_ray else None
    with ray_session(options.ray_address, options.workers, on_output=ray_output) as cluster, ExitStack() as stack:
        report.cluster = cluster
        env = task_env(files + [committer.directory], options.pass_credentials)
        # NodeBuildMismatch: before any task (in the tasks' environment: the worker started for it runs them).
        cluster["nodes_checked"] = len(check_cluster_build(env=env))
        # NodeAccessError: a node that cannot read the inputs or write the output, before any task.
        check_cluster_access(files, committer.directory, env, options.pass_credentials)
        expected_build = pixel_build()
        should_stop = lambda: bool(run.stop_requested())  # noqa: E731
        # ConfigError (a model that fails to load there, more GPU replicas than GPUs): before any task.
        replicas = stack.enter_context(start_replicas(options.config.model_specs, should_stop))
        if replicas is not None:
            cluster["model_replicas"] = replicas.counts
        emit("plan", {**work.event(), "cluster": cluster})  # after Ray's start-up chatter, so the bar is clean
        processing_started = time.perf_counter()
        report.startup_s = round(processing_started - run.started, 3)
        stream = stream_inputs(work.todo, committer.root, options.config, should_stop=should_stop, task_env=env,
                               name_fence=dataset_dir.shard_name_fence(committer.root, committer.index),
                               reader=reader, replicas=replicas)
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
                check_worker_models(message, run.identities)
                fold_result(report, committer, message, run.identities)
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


def _stop_on_full_disk(run: _Run, reason: str) -> None:
    """Out of space: remove what no manifest lists (frees space, nothing half-visible), keep a report if it
    fits, and raise ``OutputFull`` naming what the dataset still holds."""
    root, report = run.root, run.report
    on_disk = load_index(root) if root.storage.exists(dataset_dir.manifest_path(root)) else None
    dataset_dir.clean_leftovers(root, on_disk)
    report.dataset_samples = on_disk.samples if on_disk else 0
    report.warnings.append(f"stopped: output disk full ({reason})")
    try:
        _save_report(root, report)
    except OSError:
        pass  # no room even for the report: the error below says everything it would
    state = (f"the dataset is as of its last commit ({on_disk.samples} samples, {on_disk.totals['input_count']} inputs)"
             if on_disk else "no dataset was published")
    raise OutputFull(
        f"{root}: output disk full ({reason}); the run stopped and published nothing partial: {state}. "
        "Free space (or raise the quota) and rerun: committed inputs are skipped."
    )


def _record(report: RunReport, result: InputResult) -> None:
    if result.error is not None:
        failed: dict[str, Any] = {"input": result.input, "reason": result.error}
        if result.lasting:  # the bytes' own failure: remembered by the next run (remembered_failures)
            failed["fingerprint"] = {"size": result.size, "mtime_ns": result.mtime_ns, "etag": result.etag}
            failed["failed_in"] = report.run_id
        if result.samples_lost:
            failed["samples_lost"] = result.samples_lost
        report.inputs_failed.append(failed)
        return
    report.inputs_processed.append(result.input)
    report.inputs_per_node[result.node] = report.inputs_per_node.get(result.node, 0) + 1
    report.samples_written += result.samples
    shapes = config_buckets(report.config)  # None: one shape
    if shapes and result.shards:  # kept in the bucket list's order, as `shardio info` lists them
        names = [f"{h}x{w}" for h, w in shapes]
        counts = [report.samples_per_bucket.get(name, 0) for name in names]
        for shard in result.shards:
            counts[shard.get("bucket", 0)] += shard["samples"]
        report.samples_per_bucket = {name: n for name, n in zip(names, counts) if n}
    report.samples_failed += len(result.failures)
    report.samples_upscaled += result.upscaled
    report.failures.extend(result.failures)


def _note_interrupted(run: _Run, todo: list[tuple[str, InputFingerprint]]) -> None:
    report, reason = run.report, run.stop_requested()
    report.interrupted = reason
    ended = set(report.inputs_processed) | {failed["input"] for failed in report.inputs_failed}
    report.inputs_unfinished = [path for path, _ in todo if path not in ended]
    message = (f"{reason}: stopped early; {len(report.inputs_processed)} finished input(s) committed, "
               f"{len(report.inputs_unfinished)} not processed (the next run does them)")
    report.warnings.append(message)
    run.emit("warning", message)


def _save_report_after_error(run: _Run, committer: Committer, error: BaseException) -> None:
    """An unexpected exception after the lock was taken: commit what finished and keep a report saying
    so (best effort: the original exception is what the caller re-raises)."""
    report = run.report
    report.warnings.append(f"stopped by an error: {type(error).__name__}: {error}".splitlines()[0])
    report.elapsed_s = round(time.perf_counter() - run.started, 3)
    try:
        committer.maybe_commit(force=True)
        report.dataset_samples = committer.index.samples
        _save_report(committer.root, report)
    except Exception:  # noqa: BLE001 - never mask the error being raised
        pass


def _save_report(root: DatasetRoot, report: RunReport) -> None:
    dataset_dir.save_report(root, report.run_id, report_json(report))
