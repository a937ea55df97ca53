"""The job's structured log: one record per input started / finished / failed / retried, and per run.

``EventLogger`` is an ``on_event`` hook for ``run_job``. Each record carries the time, the event, the
input, the worker node, the duration and running counts (inputs done of the plan, samples so far), as a
human line or a JSON line (``preprocess run --log-format human|json --log-file PATH``)::

    {"time": "2026-01-01T12:00:01.234Z", "event": "input_finished", "input": "/data/00001.tar",
     "node": "host/1a2b3c4d", "duration_s": 2.31, "samples": 998, "failed": 2, "shards": 1,
     "inputs_done": 2, "inputs_todo": 10, "samples_total": 1990}

Events: ``run_planned``, ``input_started`` (its task's first message: it is running, and where),
``input_retried`` (messages for the input now come from another Ray worker: the last one died and Ray ran
the task again), ``input_finished``, ``input_failed``, ``warning``, ``run_finished``, or ``error`` (the
run refused to start: incompatible dataset, version drift under ``--strict-versions``, lock held);
``ray`` (``line``: what a Ray instance this run started printed, so that in JSON mode every line of the
stream is JSON) and ``signal`` (``message``: Ctrl-C / SIGTERM received, written by
``preprocess.cluster.stop_signals``). ``run_finished`` carries ``interrupted`` (the signal) when one stopped the run.
``progress`` (at most once per ``--progress-interval`` seconds, 30 by default: ``preprocess.run_progress``)
says how far the run is inside its inputs too: ``inputs_done`` / ``inputs_todo`` / ``inputs_running``,
``samples_total``, ``images_per_s``, and where the inputs' sizes are known ``fraction`` and ``eta_s``; then
``running``, the oldest running inputs (at most 5), each with its ``samples`` and, where its reader can
tell, ``expected`` (a Parquet file's rows, a folder's images), ``fraction`` and ``eta_s`` (a tar's by its
bytes)::

    {"time": "...", "event": "progress", "inputs_done": 2, "inputs_todo": 10, "inputs_running": 2,
     "samples_total": 61230, "images_per_s": 811.7, "fraction": 0.31, "eta_s": 167.4,
     "running": [{"input": "/data/big.parquet", "samples": 41000, "expected": 100000, "fraction": 0.41,
                  "eta_s": 72.0}, {"input": "/data/07.tar", "samples": 230, "fraction": 0.23, "eta_s": 40.1}]}
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, TextIO

from preprocess.run_progress import PROGRESS_INTERVAL_S, RunProgress, describe_input

__all__ = ["EventLogger", "LOG_FORMATS"]

LOG_FORMATS = ("human", "json")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class EventLogger:
    """Writes one record per job event to ``stream`` (flushed, so ``tail -f`` follows a run)."""

    def __init__(self, stream: TextIO, log_format: str = "human",
                 progress_interval_s: float = PROGRESS_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if log_format not in LOG_FORMATS:
            raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
        self.stream, self.log_format = stream, log_format
        self.todo = 0
        self.done = 0
        self.samples = 0
        self.started_at: dict[str, float] = {}  # input -> monotonic time its task started
        self.logged_failures: set[str] = set()
        self.lock = threading.Lock()  # Ray's output arrives from a reader thread
        self.progress = RunProgress(progress_interval_s, clock)

    def __call__(self, kind: str, payload: Any) -> None:
        if kind in ("plan", "progress", "input"):
            self.progress.see(kind, payload)
        if kind == "progress":
            if self.progress.due():
                self._write("progress", **self.progress.snapshot())
        elif kind == "plan":
            cluster = payload.get("cluster") or {}
            self.todo = payload["todo"]
            self._write("run_planned", inputs_todo=payload["todo"], inputs_skipped=payload["skipped"],
                        nodes=cluster.get("nodes"), cpus=cluster.get("cpus"))
        elif kind == "started":
            self.started_at.setdefault(payload.input, time.monotonic())
            self._write("input_started", input=payload.input, node=payload.node, worker=payload.worker,
                        inputs_done=self.done, inputs_todo=self.todo)
        elif kind == "retried":
            self._write("input_retried", input=payload.input, node=payload.node, worker=payload.worker,
                        attempt=payload.attempt, previous_worker=payload.previous_worker)
        elif kind == "input":
            self.done += 1
            started = self.started_at.pop(payload.input, None)
            # The worker's own time for the input; since-start on the driver if it never got that far.
            duration = payload.elapsed_s or (time.monotonic() - started if started is not None else 0.0)
            common = {"input": payload.input, "node": payload.node or None, "duration_s": round(duration, 3)}
            if payload.error is None:
                self.samples += payload.samples
                self._write("input_finished", **common, samples=payload.samples, failed=len(payload.failures),
                            shards=len(payload.shards), inputs_done=self.done, inputs_todo=self.todo,
                            samples_total=self.samples)
            else:
                self.logged_failures.add(payload.input)
                self._write("input_failed", **common, reason=payload.error, inputs_done=self.done,
                            inputs_todo=self.todo)
        elif kind in ("warning", "error"):
            self._write(kind, message=str(payload))
        elif kind == "ray":
            self._write("ray", line=str(payload))

    def finish(self, report: Any) -> None:
        """The run's closing record, from its ``RunReport``; inputs that failed before any task ran
        (no such file, a glob matching nothing) get their ``input_failed`` record here."""
        for failed in report.inputs_failed:
            if failed["input"] not in self.logged_failures:
                self._write("input_failed", input=failed["input"], reason=failed["reason"], duration_s=0.0)
        self._write("run_finished", run_id=report.run_id, exit_code=report.exit_code,
                    samples_written=report.samples_written, samples_failed=report.samples_failed,
                    inputs_processed=len(report.inputs_processed), inputs_skipped=report.inputs_skipped_count,
                    inputs_failed=len(report.inputs_failed), duration_s=report.elapsed_s,
                    images_per_s=report.images_per_s, dataset_samples=report.dataset_samples,
                    interrupted=getattr(report, "interrupted", "") or None)

    def _write(self, event: str, **fields: Any) -> None:
        record = {"time": _now(), "event": event, **{k: v for k, v in fields.items() if v is not None}}
        if self.log_format == "json":
            line = json.dumps(record, ensure_ascii=False)
        else:
            line = _human(record)
        with self.lock:
            self.stream.write(line + "\n")
            self.stream.flush()


def _human(record: dict[str, Any]) -> str:
    r = dict(record)
    head = f"{r.pop('time')} {r.pop('event'):<14}"
    subject = r.pop("input", None)
    parts = [head] + ([subject] if subject else [])
    if "duration_s" in r:
        parts.append(f"{r.pop('duration_s'):.2f} s")
    if "inputs_done" in r and "inputs_todo" in r:
        parts.append(f"[{r.pop('inputs_done')}/{r.pop('inputs_todo')}]")
    running = r.pop("running", None)
    parts += [f"{k}={v}" for k, v in r.items()]
    if running:
        parts.append("running: " + "; ".join(describe_input(entry) for entry in running))
    return "  ".join(str(p) for p in parts)
