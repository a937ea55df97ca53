"""The preprocessing job with input and output on the bench's S3 server, against the same job on local disk.

Both runs go through ``run_job`` in this process, Ray already up (``local_ray``: its start-up is not part
of either), on the same tars: local ``DIR/*.tar`` into a fresh local folder, and ``s3://BUCKET/corpus/*.tar``
into a fresh ``s3://BUCKET/job/N`` prefix. One untimed run of each first (it starts the worker processes;
the first S3 run also pays each worker's first client: its time is kept as ``first_s3_run_s``), then
``reps`` alternated local / S3 runs, each after an untimed run of its own kind (Ray's workers are kept per
task environment); the ratio is the median local time over the median S3 time.
If the job does not accept URLs on this branch yet (the S3 job is another module's work) the S3 row says
"not available" with the job's own error.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.machine_cpu import TreeCpu, machine_cpu_s
from preprocess.config import JobConfig
from shardio.errors import ShardioError

# What a job refusing or failing on s3:// raises while the S3 job is another module's work in progress:
# shardio's tree (UnsupportedPath, StorageAccessError, ...), _run's RuntimeError, the OS's and the
# argument checks'. Anything else is a bug of the bench and stops it.
JOB_FAILURES = (ShardioError, RuntimeError, OSError, ValueError)

__all__ = ["job_rows", "upload_files"]


def upload_files(store: Any, files: dict[str, str], threads: int = 4) -> int:
    """PUT each local file (key -> path) with obstore (multipart for the large ones); total bytes."""
    import obstore

    def put(item: tuple[str, str]) -> int:
        key, path = item
        with open(path, "rb") as f:
            obstore.put(store, key, f)
        return os.path.getsize(path)

    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(put, files.items()))


def _run(inputs: str, output: str, cfg: JobConfig) -> tuple[float, int]:
    from preprocess.job import RunOptions, run_job

    start = time.perf_counter()
    report = run_job(RunOptions(inputs=[inputs], output=output, config=cfg))
    seconds = time.perf_counter() - start
    if report.exit_code != 0 or report.samples_failed:
        raise RuntimeError(f"job on {inputs} -> {output} failed: exit {report.exit_code}, "
                           f"{report.inputs_failed or report.failures[:3]}")
    return seconds, report.samples_written


def _cpu_seconds(pid: int | None) -> float:
    """CPU time (user + system) of the S3 server process so far: on this machine it shares the cores."""
    if pid is None:
        return 0.0
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def job_rows(tars: list[str], store: Any, bucket: str, scratch: str, reps: int = 2,
             server_pid: int | None = None) -> dict[str, Any]:
    from bench.job_bench import local_ray

    cfg = JobConfig()
    directory = os.path.dirname(os.path.abspath(tars[0]))
    local_inputs = os.path.join(directory, "*.tar")
    remote_inputs = f"s3://{bucket}/corpus/*.tar"
    uploaded = upload_files(store, {f"corpus/{os.path.basename(t)}": t for t in tars})
    result: dict[str, Any] = {"tars": len(tars), "input_bytes": uploaded, "reps": reps}
    times: dict[str, list[float]] = {"local": [], "s3": []}
    server_cpu: list[float] = []  # the server's CPU seconds during each S3 run
    job_cpu: dict[str, list[float]] = {"local": [], "s3": []}  # the machine's CPU seconds less the server's
    # The job's own processes' CPU seconds (this process, Ray's daemons and workers; not the server's tree, not
    # kernel threads: the writeback of the server's files, up to a second a run here, is the server's work).
    own_cpu: dict[str, list[float]] = {"local": [], "s3": []}
    leave_out = (server_pid,) if server_pid is not None else ()
    with local_ray(os.cpu_count() or 1) as session:
        result["ray_init_s"] = round(session.startup_s, 3)
        output = os.path.join(scratch, "job-local")
        shutil.rmtree(output, ignore_errors=True)
        _, images = _run(local_inputs, output, cfg)  # warm-up: worker processes, imports
        result["images"] = images
        try:  # warm-up of the S3 path too: the workers' first client (imports, credentials, connections)
            result["first_s3_run_s"] = round(_run(remote_inputs, f"s3://{bucket}/job/warm-up", cfg)[0], 3)
        except JOB_FAILURES as exc:  # the S3 job is another module's work in progress: report it
            traceback.print_exc()
            result["s3"] = f"not available: {type(exc).__name__}: {exc}"
        for rep in range(reps):
            # Ray keeps a worker per task environment (an S3 run's tasks carry the store's settings): the first
            # run after one of the other kind starts new workers. Each timed run follows an untimed one of its
            # own kind, as a scheduled rerun finds them.
            for kind in ("local", "s3") if rep % 2 == 0 else ("s3", "local"):
                if kind == "local":
                    for _ in range(2):  # the first untimed
                        shutil.rmtree(output, ignore_errors=True)
                        machine = machine_cpu_s()
                        with TreeCpu(os.getpid(), leave_out) as own:
                            seconds = _run(local_inputs, output, cfg)[0]
                    times["local"].append(seconds)
                    job_cpu["local"].append(machine_cpu_s() - machine)
                    own_cpu["local"].append(own.seconds)
                    continue
                if "s3" in result:  # the S3 job failed once: not available, keep the local timings only
                    continue
                try:
                    _run(remote_inputs, f"s3://{bucket}/job/{rep}-warm", cfg)
                    cpu_before, machine = _cpu_seconds(server_pid), machine_cpu_s()
                    with TreeCpu(os.getpid(), leave_out) as own:
                        seconds, written = _run(remote_inputs, f"s3://{bucket}/job/{rep}", cfg)
                    server_cpu.append(_cpu_seconds(server_pid) - cpu_before)
                    job_cpu["s3"].append(machine_cpu_s() - machine - server_cpu[-1])
                    own_cpu["s3"].append(own.seconds)
                    if written != images:
                        raise RuntimeError(f"the S3 job wrote {written} samples, the local one {images}")
                    times["s3"].append(seconds)
                except JOB_FAILURES as exc:  # the S3 job is another module's work in progress: report it
                    traceback.print_exc()
                    result["s3"] = f"not available: {type(exc).__name__}: {exc}"
        shutil.rmtree(output, ignore_errors=True)
    result["local"] = {"seconds": [round(t, 3) for t in times["local"]],
                       "images/s": round(images / statistics.median(times["local"]), 1)}
    if times["s3"]:
        result["s3"] = {"seconds": [round(t, 3) for t in times["s3"]],
                        "images/s": round(images / statistics.median(times["s3"]), 1)}
        result["s3 / local"] = round(statistics.median(times["local"]) / statistics.median(times["s3"]), 3)
        if server_pid is not None:
            cores = os.cpu_count() or 1
            share = statistics.median(c / (t * cores) for c, t in zip(server_cpu, times["s3"]))
            # The S3 server runs on the job's own cores here (on a real deployment it is elsewhere): the
            # share of the machine it took during the S3 runs is CPU the job could not use.
            result["server_cpu_share"] = round(share, 3)
            result["s3 / local, server CPU excluded"] = (round(result["s3 / local"] / (1 - share), 3) if share < 1
                                                         else None)
            # The machine's CPU less the server's process, local over S3 (kernel threads' work counted as the job's).
            result["job_cpu_s"] = {kind: [round(c, 2) for c in cpu] for kind, cpu in job_cpu.items()}
            server_by_run = {"local": [0.0] * len(times["local"]), "s3": server_cpu}
            result["machine_busy"] = {kind: round(statistics.median(
                (job + server) / (seconds * cores)
                for job, server, seconds in zip(job_cpu[kind], server_by_run[kind], times[kind])), 3)
                for kind in ("local", "s3")}
            if min(job_cpu["s3"]) > 0:
                result["s3 / local, per machine CPU second less the server's"] = round(
                    statistics.median(job_cpu["local"]) / statistics.median(job_cpu["s3"]), 3)
            # The job's own processes, local over S3: what the S3 job reaches on the cores the server leaves it.
            result["job_process_cpu_s"] = {kind: [round(c, 2) for c in cpu] for kind, cpu in own_cpu.items()}
            if own_cpu["s3"] and min(own_cpu["s3"]) > 0:
                result["s3 / local, per job CPU second"] = round(
                    statistics.median(own_cpu["local"]) / statistics.median(own_cpu["s3"]), 3)
    return result
