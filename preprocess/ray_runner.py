"""Running inputs as Ray tasks: start or join a cluster, stream each task's progress and result.

One task per input tar. A task writes its shards itself, straight into the output directory, and sends
the driver only small messages (progress counts, then the shard list and failures): no image bytes or
pixels pass through the driver or the object store. A task whose worker dies is retried by Ray
(``max_retries``); shard names are deterministic and writes atomic, so a retry overwrites, never duplicates.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import ray

import preprocess
import shardio
from preprocess.config import JobConfig
from preprocess.worker import InputResult, iter_process_input
from shardio.errors import ShardioError

__all__ = ["RayUnavailable", "ray_session", "stream_inputs", "Progress", "TaskEvent", "AttemptTracker",
           "TASK_MAX_RETRIES"]

TASK_MAX_RETRIES = 3
CONNECT_TIMEOUT_S = 5.0


class RayUnavailable(ShardioError):
    """The Ray cluster address given cannot be reached."""


@dataclass
class Progress:
    input: str
    done: int
    failed: int
    node: str = ""  # host/Ray node id of the worker running this attempt
    worker: str = ""  # Ray worker id (8 hex): a new one for the same input means Ray retried the task


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


def _check_reachable(address: str) -> None:
    """Fail in seconds on a dead address: ``ray.init`` itself can retry for minutes."""
    if address in ("auto", "local"):
        return
    host_port = address.split("://", 1)[-1].rsplit("/", 1)[0]
    host, _, port = host_port.rpartition(":")
    if not host or not port.isdigit():
        raise RayUnavailable(f"Ray address {address!r}: expected HOST:PORT, ray://HOST:PORT or 'auto'")
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as e:
        raise RayUnavailable(
            f"Ray cluster at {address} is unreachable ({e.strerror or e}); check the head node is up and "
            "the address/port (`ray status` on the head), or drop --ray-address to run locally"
        ) from None


@contextmanager
def ray_session(address: str | None, workers: int | None) -> Iterator[dict[str, Any]]:
    """Use Ray as found (already initialised: tests, notebooks), join ``address``, or start it locally.

    Yields a small description (address, nodes, CPUs) for the report. Shuts down only what it started.
    """
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        _check_reachable(address)
    started = False
    if not ray.is_initialized():
        common: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True,
                                  "configure_logging": True, "logging_level": "WARNING"}
        if address:
            # Ship our two packages to nodes that may not have them (their deps must be installed there).
            runtime_env = {"py_modules": [os.path.dirname(preprocess.__file__), os.path.dirname(shardio.__file__)]}
            ray.init(address=address, runtime_env=runtime_env, **common)
        else:
            # address="local": always a new local instance, never an existing one found on this machine.
            ray.init(address="local", num_cpus=workers or os.cpu_count() or 1, **common)
        started = True
    try:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        yield {
            "address": address or "local",
            "nodes": len(nodes),
            "cpus": int(ray.cluster_resources().get("CPU", 0)),
        }
    finally:
        if started:
            ray.shutdown()


def _task(input_path: str, output_dir: str, cfg_dict: dict[str, Any], fingerprint: tuple[int, int]):
    context = ray.get_runtime_context()
    # Host name plus Ray node id: several raylets can share one host (and do in the tests).
    node = f"{os.uname().nodename}/{context.get_node_id()[:8]}"
    worker = context.get_worker_id()[:8]
    steps = iter_process_input(input_path, output_dir, JobConfig(**cfg_dict), fingerprint)
    yield Progress(input_path, 0, 0, node, worker)  # "started", with where
    while True:
        try:
            done, failed = next(steps)
        except StopIteration as stop:
            result: InputResult = stop.value
            result.node = f"{result.node}/{context.get_node_id()[:8]}"
            # Ray drops a retried generator's messages up to the index the driver already has, so a retry
            # shows only in later ones: this last one always comes after, and names the worker.
            yield Progress(input_path, result.samples, len(result.failures), node, worker)
            yield result
            return
        yield Progress(input_path, done, failed, node, worker)


def _failure_reason(error: Exception) -> str:
    """One line: the task's own exception (``OSError: [Errno 28] No space left on device``) where there is
    one; Ray's first line only names the task and its pid."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException):
        return f"worker failed: {type(cause).__name__}: {cause}".splitlines()[0]
    return f"worker failed: {error}".splitlines()[0]


def stream_inputs(
    items: list[tuple[str, tuple[int, int]]], output_dir: str, cfg: JobConfig, max_in_flight: int | None = None
) -> Iterator[Progress | TaskEvent | InputResult]:
    """Run every (input, fingerprint) as a task; yield Progress messages, a TaskEvent when an input's task
    starts or is retried, and each InputResult as it ends.

    At most ``max_in_flight`` tasks are submitted at once (default: 2 per CPU), so a run over 100,000
    tars does not flood the scheduler, and a killed run has started little it did not finish.
    """
    remote = ray.remote(num_cpus=1, max_retries=TASK_MAX_RETRIES, retry_exceptions=False)(_task)
    limit = max_in_flight or max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))
    queue = list(reversed(items))
    fingerprints = dict(items)
    running: dict[Any, str] = {}
    cfg_dict = cfg.to_dict()
    attempts = AttemptTracker()
    while queue or running:
        while queue and len(running) < limit:
            path, fingerprint = queue.pop()
            running[remote.remote(path, output_dir, cfg_dict, fingerprint)] = path
        ready, _ = ray.wait(list(running), num_returns=1, timeout=1.0)
        for generator in ready:
            try:
                ref = next(generator)
            except StopIteration:
                del running[generator]
                continue
            try:
                message = ray.get(ref)
            except ray.exceptions.RayError as e:
                # The task failed for good (worker died more than TASK_MAX_RETRIES times, or a bug).
                path = running.pop(generator)
                size, mtime_ns = fingerprints[path]
                reason = _failure_reason(e)
                yield InputResult(input=path, size=size, mtime_ns=mtime_ns, error=reason)
                continue
            if isinstance(message, Progress) and (event := attempts.see(message)) is not None:
                yield event
            yield message
