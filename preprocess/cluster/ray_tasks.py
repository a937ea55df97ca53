"""Running inputs as Ray tasks: one task per input, largest first, each task's progress and result streamed.

One task per input tar, submitted largest input first (``largest_first``: the sizes are known from the
plan's stat / LIST), so the run does not end on one big tar decoding alone while the other cores idle,
and scheduled with Ray's SPREAD strategy: on a cluster the inputs go round the nodes
from the first task on, instead of piling onto whichever node's worker started first (on a loaded
2-node test cluster that was all 8 inputs on one node). A task writes its shards itself, straight into
the output directory, and sends the driver only small messages (progress counts, then the shard list and
failures): no image bytes or pixels pass through the driver or the object store. A task whose worker dies is
retried by Ray (``max_retries``); shard names are deterministic and writes atomic, so a retry overwrites, never
duplicates.

A decode that never returns (``preprocess.image.decode_watch``): the task says which member is stuck
(``StuckDecode``), the driver ends that worker process (``ray.cancel(force=True)``: the stuck C call cannot
be interrupted, and a forced cancel is never retried by Ray) and submits the input again with every member
stuck so far to skip; the worker records those as failed samples and the input commits. At most
``MAX_STUCK_DECODES`` per input: a tar whose decodes keep sticking fails as an input instead of costing
one bound (61 s by default) per image.

Models with replicas (``preprocess.models.replicas``): the job starts them; input number ``i`` (in submission
order, kept by a retry) feeds replica ``i mod N`` of each such model, and an input whose task has ended, however,
is dropped from its replicas (a no-op after a task that took its outputs), whose short batches would otherwise
wait for it.

The cluster itself (joined or started, one build on every node) is ``preprocess.cluster.ray_cluster``'s.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import ray

from preprocess.config import JobConfig
from preprocess.image.decode_watch import Heartbeat, StuckDecode, hard_bound_s, watch_steps
from preprocess.inputs.kinds import SampleReader
from preprocess.inputs.resolve import InputFingerprint
from preprocess.plan import largest_first_key
from preprocess.cluster.ray_cluster import node_name
from preprocess.models.replicas import ModelReplicas, ReplicaFeed
from preprocess.worker import InputResult, iter_process_input
from shardio.errors import ConfigError
from shardio.store.root import Place

__all__ = ["stream_inputs", "Progress", "TaskEvent", "AttemptTracker", "TASK_MAX_RETRIES", "TASK_OPTIONS",
           "largest_first", "MAX_STUCK_DECODES", "StuckDecode"]

TASK_MAX_RETRIES = 3
# Stuck decodes skipped per input before the input itself fails (each costs one hard bound plus a restart
# of the tar; unusual JPEG layouts hung in 3 of 504 test runs, never two in one tar).
MAX_STUCK_DECODES = 3
# SPREAD: see the module docstring. The options are a constant so the tests can check them.
TASK_OPTIONS: dict[str, Any] = {"num_cpus": 1, "max_retries": TASK_MAX_RETRIES, "retry_exceptions": False,
                                "scheduling_strategy": "SPREAD"}
# How long the driver waits for a task message before checking for a stop request (Ctrl-C reaction time).
WAIT_S = 0.5


@dataclass
class Progress:
    input: str
    done: int
    failed: int
    node: str = ""  # host/Ray node id of the worker running this attempt
    worker: str = ""  # Ray worker id (8 hex): a new one for the same input means Ray retried the task
    fraction: float | None = None  # share of the input read, where its reader can tell (worker.InputProgress)
    expected: int | None = None  # the input's sample count, where its reader counts it first (rows, images)
    size: int = 0  # the input's size in bytes, as listed (its fingerprint's): the weight of its fraction


@dataclass
class TaskEvent:
    """An input's task "started" (its first message arrived) or was "retried" (messages now come from
    another worker: the previous one died and Ray re-ran the task; ``attempt`` counts from 1)."""

    kind: str
    input: str
    node: str
    worker: str
    attempt: int = 1
    previous_worker: str = ""


class AttemptTracker:
    """Turns Progress messages into "started" (an input's first message) and "retried" (a message from
    another worker than the input's last: Ray re-ran the task after its worker died) events.

    Ray exposes no attempt number, so this is what the driver can see: a retry whose new attempt never
    gets past the messages the old one already sent is invisible (``_task`` sends one more at the end, so
    that only happens if the old worker died between its last message and its result).
    """

    def __init__(self) -> None:
        self.current: dict[str, tuple[str, int]] = {}  # input -> (worker of its latest attempt, attempt)

    def see(self, message: Progress) -> TaskEvent | None:
        seen = self.current.get(message.input)
        if seen is None:
            self.current[message.input] = (message.worker, 1)
            return TaskEvent("started", message.input, message.node, message.worker)
        worker, attempt = seen
        if message.worker == worker:
            return None
        self.current[message.input] = (message.worker, attempt + 1)
        return TaskEvent("retried", message.input, message.node, message.worker, attempt + 1, worker)

def _task(input_path: str, output_dir: Place, cfg_dict: dict[str, Any], fingerprint: InputFingerprint,
          skip_members: tuple[str, ...] = (), reader: SampleReader | None = None, name_fence: str = "",
          model_replicas: dict[str, Any] | None = None):
    context = ray.get_runtime_context()
    node = node_name(context.get_node_id())
    worker = context.get_worker_id()[:8]
    cfg = JobConfig(**cfg_dict)
    heartbeat = Heartbeat()
    feeds = {name: ReplicaFeed(replica, name, input_path) for name, replica in (model_replicas or {}).items()}
    steps = watch_steps(iter_process_input(input_path, output_dir, cfg, fingerprint, skip_members, heartbeat, reader,
                                           name_fence, model_feeds=feeds),
                        heartbeat, hard_bound_s(cfg.max_decode_seconds))
    size = fingerprint[0]
    yield Progress(input_path, 0, 0, node, worker, size=size)  # "started", with where
    while True:
        try:
            message = next(steps)
        except StopIteration as stop:
            result: InputResult = stop.value
            result.node = f"{result.node}/{context.get_node_id()[:8]}"
            # Ray drops a retried generator's messages up to the index the driver already has, so a retry
            # shows only in later ones: this last one always comes after, and names the worker.
            yield Progress(input_path, result.samples, len(result.failures), node, worker,
                           fraction=1.0 if result.error is None else None, size=size)
            yield result
            return
        if isinstance(message, StuckDecode):
            message.input, message.node, message.worker = input_path, node, worker
            yield message
            # The driver now ends this process (ray.cancel, force): nothing here can stop the stuck call.
            threading.Event().wait()
        yield Progress(input_path, message.done, message.failed, node, worker, message.fraction,
                       message.expected, size)


def _failure_reason(error: Exception) -> str:
    """One line: the task's own exception (``OSError: [Errno 28] No space left on device``) where there is
    one; Ray's first line only names the task and its pid."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException):
        return f"worker failed: {type(cause).__name__}: {cause}".splitlines()[0]
    return f"worker failed: {error}".splitlines()[0]


def largest_first(items: list[tuple[str, InputFingerprint]]) -> list[tuple[str, InputFingerprint]]:
    """The submission order: input size descending (the fingerprint's first field), then path, so the
    longest tasks start first and the tail of a run is short ones (classic LPT scheduling). A list the
    plan already sorted (``preprocess.plan``) costs one pass."""
    return sorted(items, key=largest_first_key)


def stream_inputs(
    items: list[tuple[str, InputFingerprint]], output_dir: Place, cfg: JobConfig,
    max_in_flight: int | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    task_env: dict[str, str] | None = None,
    reader: SampleReader | None = None,
    name_fence: str = "",
    replicas: ModelReplicas | None = None,
) -> Iterator[Progress | TaskEvent | InputResult]:
    """Run every (input, fingerprint) as a task, largest input first; yield Progress messages, a TaskEvent when an
    input's task starts or is retried, and each InputResult as it ends.

    At most ``max_in_flight`` tasks are submitted at once (default: 2 per CPU), so a run over 100,000
    tars does not flood the scheduler, and a killed run has started little it did not finish. Once
    ``should_stop()`` (checked at least every ``WAIT_S``) is true, nothing more is submitted, the running
    tasks are cancelled (their inputs are simply not done: a cancelled task removes its partial shards,
    and the job removes whatever a killed one left) and the iteration ends. ``task_env``: environment
    variables every task gets (``preprocess.cluster.cluster_access.task_env``), in its Ray ``runtime_env``.
    ``output_dir``: the output's root (sent to each task as its path, opened there once), or its path.
    ``reader``: a Python source's (``preprocess.inputs.sources``), put in the object store once, not pickled
    into every task. ``name_fence``: what the names of the shard files carry (``shardio.format.spec``,
    "Fencing names"; ``shardio.write.directory.shard_name_fence``). ``replicas``: the run's model replicas
    (``preprocess.models.replicas.start_replicas``), None when no model has any.
    """
    remote = ray.remote(**TASK_OPTIONS)(_task)
    reader_ref = ray.put(reader) if reader is not None else None
    if task_env:  # .options replaces a runtime_env: keep TASK_OPTIONS' own variables beside these
        base = TASK_OPTIONS.get("runtime_env") or {}
        env_vars = {**base.get("env_vars", {}), **task_env}
        remote = remote.options(runtime_env={**base, "env_vars": env_vars})
    limit = max_in_flight or max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))
    # One ordered list read front to back: the driver holds one reference per input to process, and its
    # fingerprint only while the task runs (a dict of every input would double that).
    queue = largest_first(items)
    next_item = 0
    running: dict[Any, str] = {}
    fingerprints: dict[str, InputFingerprint] = {}  # inputs submitted and not yet ended
    cfg_dict = cfg.to_dict()
    attempts = AttemptTracker()
    stuck_members: dict[str, list[str]] = {}  # input -> members whose decode never finished, in order
    fed: dict[str, dict[str, Any]] = {}  # input -> output -> its replica (chosen at its first submission)

    def submit(path: str) -> None:
        # The members to skip only when there are some: a first attempt is called with the 4 arguments it
        # always had (wrappers of _task, as the crash-safety tests use, keep working).
        skip = tuple(stuck_members.get(path, ()))
        extra = [skip, reader_ref] if reader_ref is not None else [skip] if skip else []
        keywords: dict[str, Any] = {"name_fence": name_fence} if name_fence else {}
        if path in fed:
            keywords["model_replicas"] = fed[path]
        running[remote.remote(path, output_dir, cfg_dict, fingerprints[path], *extra, **keywords)] = path

    def ended(path: str) -> InputFingerprint:
        stuck_members.pop(path, None)
        if path in fed and replicas is not None:  # a dead task's samples there would keep a short batch waiting
            replicas.drop(path, fed.pop(path))
        return InputFingerprint(*fingerprints.pop(path))

    try:
        while next_item < len(queue) or running:
            if should_stop():
                return  # the tasks still running are cancelled below
            while next_item < len(queue) and len(running) < limit:
                path, fingerprint = queue[next_item]
                queue[next_item] = None  # type: ignore[call-overload]  # not needed again: let it go
                fingerprints[path] = fingerprint
                if replicas is not None:
                    fed[path] = replicas.for_input(next_item)
                next_item += 1
                submit(path)
            ready, _ = ray.wait(list(running), num_returns=1, timeout=WAIT_S)
            for generator in ready:
                try:
                    ref = next(generator)
                except StopIteration:
                    ended(running.pop(generator))
                    continue
                try:
                    message = ray.get(ref)
                except ray.exceptions.RayError as e:
                    # The task failed for good (worker died more than TASK_MAX_RETRIES times, or a bug).
                    path = running.pop(generator)
                    size, mtime_ns, etag = ended(path)
                    if isinstance(getattr(e, "cause", None), ConfigError):
                        # A model breaking its contract (preprocess.models.runner) would break it on every
                        # input: the run stops, and no input is remembered as failed for it.
                        raise e.cause from None
                    reason = _failure_reason(e)
                    yield InputResult(input=path, size=size, mtime_ns=mtime_ns, error=reason, etag=etag)
                    continue
                if isinstance(message, StuckDecode):
                    path = running.pop(generator)
                    ray.cancel(generator, force=True)
                    stuck = stuck_members.setdefault(path, [])
                    stuck.append(message.member)
                    yield message
                    if len(stuck) <= MAX_STUCK_DECODES:
                        submit(path)
                        continue
                    size, mtime_ns, etag = ended(path)
                    bound = hard_bound_s(cfg.max_decode_seconds)
                    yield InputResult(input=path, size=size, mtime_ns=mtime_ns, etag=etag, error=(
                        f"{len(stuck)} decodes did not finish within {bound:g} s ({', '.join(stuck)}); the input was "
                        f"given up after {MAX_STUCK_DECODES} restarts without them and not committed"))
                    continue
                if isinstance(message, Progress) and (event := attempts.see(message)) is not None:
                    yield event
                yield message
    finally:  # asked to stop, or the consumer stopped (an error): no task keeps running for a run that is over
        for generator in running:
            ray.cancel(generator)
