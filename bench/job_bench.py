"""The preprocessing job itself (``preprocess.job.run_job``) on the corpus: start-up, steady rate, memory.

Start-up and steady rate are separated by timing runs of different sizes: with Ray already up, a run over
all the tars minus a run over ``cores`` tars is pure steady-state work (the same tasks, the same warm
worker processes), so ``(large - small images) / (large - small seconds)`` is the marginal rate; a cold
``run_job`` (which starts and stops Ray itself) minus ``images / marginal rate`` is the fixed cost.

Memory is sampled from outside with psutil (every 20 ms) over the driver and its process tree: Ray's
worker processes are descendants of the raylet the driver starts, and show as ``ray::...`` once
``setproctitle`` names them.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Self

import psutil
import ray

from preprocess.config import JobConfig
from preprocess.job import RunOptions, RunReport, run_job
from preprocess.worker import process_input

__all__ = [
    "ForeignLoad",
    "RssSampler",
    "cold_run",
    "local_ray",
    "memory_run",
    "two_node_cluster",
    "warm_rates",
]

_RAY_INIT = {
    "include_dashboard": False,
    "logging_level": "WARNING",
    "configure_logging": True,
    "log_to_driver": True,
}


def _fresh(root: str, name: str) -> str:
    path = os.path.join(root, name)
    shutil.rmtree(path, ignore_errors=True)
    return path


def _run(tars: list[str], output: str, cfg: JobConfig, workers: int | None = None) -> tuple[float, RunReport]:
    start = time.perf_counter()
    report = run_job(RunOptions(inputs=list(tars), output=output, config=cfg, workers=workers))
    seconds = time.perf_counter() - start
    if report.exit_code != 0 or report.samples_failed:
        raise RuntimeError(f"benchmark job failed: {report.inputs_failed or report.failures[:3]}")
    return seconds, report


def interleaved_rounds(tars: list[str], root: str, configs: dict[str, JobConfig], rounds: int,
                       log: Callable[[str], None], *, warmup: int = 1, keep_last: bool = False,
                       run: Callable[..., tuple[float, RunReport]] = _run) -> list[dict[str, float]]:
    """The job over ``tars`` under two ``configs`` (a base, then the one compared), Ray already initialised:
    ``warmup`` untimed runs of each (a job's workers run slower over their first few tars), then ``rounds``
    rounds of one run each, in alternating order; images/s of each config, per round. With ``keep_last``
    the last round's outputs stay under ``root/NAME`` (to compare them)."""
    base, other = configs
    for _ in range(warmup):
        for name, config in configs.items():
            run(tars, _fresh(root, f"warmup-{name}"), config)
            shutil.rmtree(os.path.join(root, f"warmup-{name}"), ignore_errors=True)
    per_round: list[dict[str, float]] = []
    for index in range(rounds):
        rates: dict[str, float] = {}
        for name in (base, other) if index % 2 == 0 else (other, base):
            seconds, report = run(tars, _fresh(root, name), configs[name])
            rates[name] = report.samples_written / seconds
            if not (keep_last and index == rounds - 1):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        log(f"round {index + 1}/{rounds}: {base} {rates[base]:.0f} img/s, {other} {rates[other]:.0f} img/s, "
            f"{other} / {base} {rates[other] / rates[base]:.3f}")
        per_round.append(rates)
    return per_round


def worker_cpu_ms(tar: str, root: str, configs: dict[str, JobConfig], rounds: int) -> dict[str, list[float]]:
    """CPU ms per image of ``process_input`` over ``tar`` (this process and its commit thread) under each of
    ``configs``, alternating, after one untimed pass of each (caches, imports): one value a round each."""
    stat = os.stat(tar)
    names = list(configs)
    cpu_ms: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds + 1):
        for name in names if index % 2 == 0 else names[::-1]:
            output = _fresh(root, f"worker-{name}")
            started = time.process_time()
            result = process_input(tar, output, configs[name], (stat.st_size, stat.st_mtime_ns))
            spent = time.process_time() - started
            shutil.rmtree(output, ignore_errors=True)
            if result.error or not result.samples:
                raise RuntimeError(f"{tar}: the worker wrote nothing ({result.error})")
            if index:
                cpu_ms[name].append(spent * 1e3 / result.samples)
    return cpu_ms


# A bare ray.init() joins a cluster another process started on this machine (a concurrent test's
# ray.cluster_utils.Cluster) and then refuses num_cpus: the job's own start-up does that, so wait and retry.
_JOINED_OTHER = "When connecting to an existing cluster"
RETRIES = 3


def cold_run(tars: list[str], root: str, cfg: JobConfig, workers: int | None = None) -> dict[str, Any]:
    """One ``run_job`` that starts Ray itself and shuts it down: what a user's command costs."""
    if ray.is_initialized():
        raise RuntimeError("cold_run needs Ray down")
    for attempt in range(RETRIES):
        try:
            seconds, report = _run(tars, _fresh(root, "cold"), cfg, workers)
            break
        except ValueError as e:
            if _JOINED_OTHER not in str(e) or attempt == RETRIES - 1:
                raise
            time.sleep(10)
    shutil.rmtree(os.path.join(root, "cold"), ignore_errors=True)
    return {
        "seconds": round(seconds, 3),
        "images": report.samples_written,
        "ray_startup_s": report.startup_s,
        "processing_images_per_s": report.processing_images_per_s,
        "images_per_s": report.images_per_s,
    }


def warm_rates(
    small: list[str], large: list[str], root: str, cfg: JobConfig, reps: int, keep_last: bool = False
) -> dict[str, Any]:
    """Marginal images/s between runs over ``small`` and ``large`` tars, Ray already initialised.

    One untimed warm-up run first (it starts the worker processes and imports PIL/numpy in them); then
    ``reps`` alternating small/large runs; medians of each. Returns the last large output when asked.
    """
    _run(small, _fresh(root, "warmup"), cfg)
    times: dict[str, list[float]] = {"small": [], "large": []}
    images: dict[str, int] = {}
    per_node: dict[str, int] = {}
    for rep in range(reps):
        for kind, tars in (("small", small), ("large", large)):
            seconds, report = _run(tars, _fresh(root, kind), cfg)
            times[kind].append(seconds)
            images[kind] = report.samples_written
            if kind == "large":
                per_node = report.inputs_per_node
            if not (keep_last and kind == "large" and rep == reps - 1):
                shutil.rmtree(os.path.join(root, kind), ignore_errors=True)
    shutil.rmtree(os.path.join(root, "warmup"), ignore_errors=True)
    small_s, large_s = statistics.median(times["small"]), statistics.median(times["large"])
    marginal = (
        (images["large"] - images["small"]) / (large_s - small_s) if large_s > small_s else float("nan")
    )
    return {
        "small_images": images["small"],
        "large_images": images["large"],
        "small_s": [round(t, 3) for t in times["small"]],
        "large_s": [round(t, 3) for t in times["large"]],
        "large_images_per_s": round(images["large"] / large_s, 2),
        "marginal_images_per_s": round(marginal, 2),
        "inputs_per_node": per_node,
        "output": os.path.join(root, "large") if keep_last else None,
    }


class local_ray:
    """``ray.init`` with ``num_cpus`` local CPUs for the block (timed: ``startup_s``)."""

    def __init__(self, num_cpus: int) -> None:
        self.num_cpus = num_cpus
        self.startup_s = 0.0

    def __enter__(self) -> Self:
        start = time.perf_counter()
        # address="local": a new instance even while another cluster runs here (tests, `ray start`), which
        # a bare ray.init() would join, refusing num_cpus.
        ray.init(address="local", num_cpus=self.num_cpus, **_RAY_INIT)
        self.startup_s = time.perf_counter() - start
        return self

    def __exit__(self, *exc) -> None:
        ray.shutdown()


class two_node_cluster:
    """A local two-node Ray cluster (``ray.cluster_utils.Cluster``), 1 CPU per node, joined by the driver."""

    def __enter__(self) -> Self:
        from ray.cluster_utils import Cluster

        start = time.perf_counter()
        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        self.cluster.add_node(num_cpus=1)
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, **_RAY_INIT)
        self.startup_s = time.perf_counter() - start
        self.nodes = len([n for n in ray.nodes() if n.get("Alive")])
        return self

    def __exit__(self, *exc) -> None:
        ray.shutdown()
        self.cluster.shutdown()


class _Sampler:
    """Runs ``_loop`` in a daemon thread for the duration of a ``with`` block; ``_stop`` ends it."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class RssSampler(_Sampler):
    """Peak RSS of a process (the driver) and of its ``ray::`` worker descendants, sampled in a thread."""

    def __init__(self, pid: int, interval_s: float = 0.02) -> None:
        super().__init__(interval_s)
        self.root = psutil.Process(pid)
        self.driver_peak = 0
        self.worker_peak = 0
        self.workers_seen: set[int] = set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.driver_peak = max(self.driver_peak, self.root.memory_info().rss)
                children = self.root.children(recursive=True)
            except psutil.Error:
                return
            for child in children:
                try:
                    title = " ".join(child.cmdline())
                    if title.startswith("ray::") or "default_worker.py" in title:
                        self.worker_peak = max(self.worker_peak, child.memory_info().rss)
                        self.workers_seen.add(child.pid)
                except psutil.Error:
                    continue
            self._stop.wait(self.interval_s)


class ForeignLoad(_Sampler):
    """CPU used by processes outside this one's tree (other agents' tests on a shared machine), sampled
    every ``interval_s``: ``mean_cores`` and ``max_cores`` say whether a run's ratios can be trusted."""

    def __init__(self, interval_s: float = 2.0) -> None:
        super().__init__(interval_s)
        self.samples: list[float] = []

    @staticmethod
    def _cpu() -> dict[int, float]:
        out = {}
        for process in psutil.process_iter(["cpu_times"]):
            times = process.info["cpu_times"]
            if times is not None:
                out[process.pid] = times.user + times.system
        return out

    def _loop(self) -> None:
        me = psutil.Process()
        before, start = self._cpu(), time.monotonic()
        while not self._stop.wait(self.interval_s):
            try:
                ours = {me.pid, *(p.pid for p in me.children(recursive=True))}
            except psutil.Error:
                continue
            now, at = self._cpu(), time.monotonic()
            foreign = sum(t - before.get(pid, 0.0) for pid, t in now.items() if pid not in ours)
            self.samples.append(max(0.0, foreign) / (at - start))
            before, start = now, at

    def summary(self) -> dict[str, float]:
        samples = self.samples or [0.0]
        return {"mean_cores": round(statistics.mean(samples), 2), "max_cores": round(max(samples), 2)}


def memory_run(big_tar: str, root: str, cfg: JobConfig) -> dict[str, Any]:
    """The CLI (``preprocess run``) on one tar of all the images, 1 worker, 1,000-sample shards: peak RSS
    of the task's worker process and of the driver (a fresh process, so nothing of the bench is counted).
    The dataset it writes stays in ``output`` (the reader figures read it)."""
    output = _fresh(root, "memory")
    command = [
        sys.executable,
        "-m",
        "preprocess.cli",
        "run",
        big_tar,
        "--output",
        output,
        "--workers",
        "1",
        "--quiet",
        "--size",
        str(cfg.width),
        "--samples-per-shard",
        str(cfg.samples_per_shard),
    ]
    for attempt in range(RETRIES):
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        with RssSampler(process.pid) as sampler:
            _, stderr = process.communicate()
        if process.returncode == 0 or _JOINED_OTHER not in stderr.decode() or attempt == RETRIES - 1:
            break
        time.sleep(10)
    if process.returncode != 0:
        raise RuntimeError(f"memory run failed ({process.returncode}): {stderr.decode()[-2000:]}")
    return {
        "worker_peak_rss_mb": round(sampler.worker_peak / 2**20, 1),
        "driver_peak_rss_mb": round(sampler.driver_peak / 2**20, 1),
        "worker_processes_seen": len(sampler.workers_seen),
        "samples_per_shard": cfg.samples_per_shard,
        "size": [cfg.height, cfg.width],
        "output": output,
    }
