"""How far a run is, inside its inputs too: what the ``progress`` log record and the display say.

The workers report each input every ``preprocess.worker.PROGRESS_EVERY`` samples (``Progress``: samples
done, and where the input's reader can tell, the share of it read and its sample count: a Parquet file's
rows and a folder's images are counted before the first sample, a tar is followed by its bytes). One big
Parquet file or folder would otherwise be silent between its ``input_started`` and ``input_finished``.

``RunProgress`` folds the job's events ("plan", "progress", "input") into one snapshot: inputs done of the
plan, samples so far (running inputs included), images/s since the plan, and an ETA where the run's size
is known: each input weighs its listed bytes, a running one its bytes times the share read, so a run of
tars, Parquet files or folders gets one. ``due()`` bounds how often it is said: once per ``interval_s``
(``PROGRESS_INTERVAL_S``: a day-long run logs ~2,900 records) on an injectable clock, so a test with an
interval of 0 sees one record per worker report, and never waits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["RunProgress", "PROGRESS_INTERVAL_S", "RUNNING_SHOWN", "describe", "describe_input",
           "duration_text"]

PROGRESS_INTERVAL_S = 30.0
# Running inputs named in one record, oldest first (largest first scheduling: the longest to go); a cluster
# runs 2 per CPU, too many for one line.
RUNNING_SHOWN = 5


@dataclass
class _Running:
    started: float
    samples: int = 0
    fraction: float | None = None
    expected: int | None = None
    size: int = 0


def _eta(elapsed: float, fraction: float | None) -> float | None:
    if not fraction or fraction <= 0:
        return None
    return round(max(0.0, elapsed * (1 - fraction) / fraction), 1)


class RunProgress:
    """One run's progress from the job's events; ``snapshot()`` says it, ``due()`` says when to."""

    def __init__(self, interval_s: float = PROGRESS_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s, self.clock = interval_s, clock
        self.started = self.last_said = clock()
        self.todo = 0
        self.todo_bytes = 0
        self.inputs_done = 0
        self.samples_done = 0  # of the inputs that ended
        self.bytes_done = 0
        self.running: dict[str, _Running] = {}  # in the order they started

    def see(self, kind: str, payload: Any) -> None:
        if kind == "plan":
            self.todo, self.todo_bytes = payload["todo"], payload.get("todo_bytes", 0)
            self.started = self.last_said = self.clock()
        elif kind == "progress":
            running = self.running.get(payload.input)
            if running is None:
                running = self.running[payload.input] = _Running(self.clock())
            running.samples = max(running.samples, payload.done)  # a retried task starts again from 0
            running.fraction = payload.fraction if payload.fraction is not None else running.fraction
            running.expected = payload.expected if payload.expected is not None else running.expected
            running.size = payload.size or running.size
        elif kind == "input":
            self.running.pop(payload.input, None)
            self.inputs_done += 1
            self.samples_done += payload.samples
            self.bytes_done += payload.size

    def due(self) -> bool:
        """Whether ``interval_s`` has passed since progress was last said (then it counts as said now)."""
        now = self.clock()
        if now - self.last_said < self.interval_s:
            return False
        self.last_said = now
        return True

    @property
    def samples(self) -> int:
        return self.samples_done + sum(r.samples for r in self.running.values())

    def images_per_s(self) -> float:
        return round(self.samples / max(1e-9, self.clock() - self.started), 1)

    def fraction(self) -> float | None:
        """The share of the run done, by the inputs' bytes; None when their sizes are not known."""
        if self.todo_bytes <= 0:
            return None
        read = self.bytes_done + sum(r.size * (r.fraction or 0.0) for r in self.running.values())
        return min(1.0, read / self.todo_bytes)

    def eta_s(self) -> float | None:
        """Seconds the run has left at its rate so far, by the inputs' bytes; None when not known."""
        return _eta(self.clock() - self.started, self.fraction())

    def snapshot(self) -> dict[str, Any]:
        """The ``progress`` record's fields (the log's, the display's)."""
        now = self.clock()
        fraction = self.fraction()
        running = []
        for name, input_ in list(self.running.items())[:RUNNING_SHOWN]:
            entry = {"input": name, "samples": input_.samples, "expected": input_.expected,
                     "fraction": None if input_.fraction is None else round(input_.fraction, 3),
                     "eta_s": _eta(now - input_.started, input_.fraction)}
            running.append({key: value for key, value in entry.items() if value is not None})
        return {"inputs_done": self.inputs_done, "inputs_todo": self.todo,
                "inputs_running": len(self.running), "samples_total": self.samples,
                "images_per_s": self.images_per_s(),
                "fraction": None if fraction is None else round(fraction, 3),
                "eta_s": self.eta_s(), "running": running}


def duration_text(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds // 60 % 60:02d} min"


def describe_input(entry: dict[str, Any]) -> str:
    """``big.parquet 5000/100000 samples (5.0%, ETA 1 min 57 s)``: one running input, for a person."""
    samples = str(entry["samples"])
    if entry.get("expected") is not None:
        samples += f"/{entry['expected']}"
    share = [f"{entry['fraction']:.1%}"] if entry.get("fraction") is not None else []
    share += [f"ETA {duration_text(entry['eta_s'])}"] if entry.get("eta_s") is not None else []
    return f"{entry['input']} {samples} samples" + (f" ({', '.join(share)})" if share else "")


def describe(snapshot: dict[str, Any]) -> str:
    """The snapshot as one line for a person (the display off a terminal)."""
    line = (f"{snapshot['inputs_done']}/{snapshot['inputs_todo']} inputs, "
            f"{snapshot['samples_total']} samples, {snapshot['images_per_s']:.0f} images/s")
    if snapshot.get("fraction") is not None:
        line += f", {snapshot['fraction']:.1%}"
    if snapshot.get("eta_s") is not None:
        line += f", ETA {duration_text(snapshot['eta_s'])}"
    if snapshot["running"]:
        more = snapshot["inputs_running"] - len(snapshot["running"])
        line += "; running: " + "; ".join(describe_input(entry) for entry in snapshot["running"])
        line += f"; and {more} more" if more > 0 else ""
    return line
