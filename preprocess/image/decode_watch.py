"""Bounding every decode: one image that never finishes must not stop the job.

``max_decode_seconds`` is checked after a decode returns (``preprocess.image.transform``); a decode stuck
inside one C call (a libjpeg bug: a progressive 2x4-sampled JPEG that never returned) never
returns, cannot be interrupted in-process, and would hang the job, and every rerun, on the same member.

So the Ray task runs its tar on one decode thread (``watch_steps``) and its own main thread watches a
``Heartbeat`` that the decode loop stamps around each image: one tuple assignment and one
``time.monotonic()`` call per image (~0.2 us next to ~4 ms of decode), and one queue hand-off per
``PROGRESS_EVERY`` (32) images, never one per image. A decode older than ``hard_bound_s`` makes the task
send a ``StuckDecode`` naming the member; the driver then ends that worker process (``ray.cancel(...,
force=True)``) and submits the input again with the member to skip, which the worker records as a failed
sample. The input then commits like any other, so a rerun skips the unchanged input.

The bound is ``2 * max_decode_seconds + 1 s`` (61 s by default). A decode that ran past
``max_decode_seconds`` is refused anyway, so stopping it later changes no sample's outcome, only when we
give up on it; twice the limit keeps a slow-but-finishing decode (a loaded machine) from costing a
restart of its tar, and the second covers the watcher's polling (``hard_bound_s / 4``, at most 1 s).

This needs the stuck call to release the GIL, as both decoders do (``_jpeg_region`` around libjpeg,
Pillow's ``ImagingSectionEnter`` around its decoders); a call holding the GIL would stall the watcher too.

Test-only hook (``HANG_MEMBERS_ENV``): with ``PREPROCESS_TEST_HANG_MEMBERS`` set to an ``fnmatch``
pattern in a worker's environment, decoding an image member whose name matches blocks forever (until
``release_test_hangs``), as the libjpeg bug did. Data alone can never trigger it; never set it outside tests.
"""

from __future__ import annotations

import fnmatch
import os
import queue
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["Heartbeat", "StuckDecode", "hard_bound_s", "watch_steps", "stuck_reason", "HANG_MEMBERS_ENV",
           "hang_pattern_for_tests", "hang_if_test_member", "release_test_hangs"]

HANG_MEMBERS_ENV = "PREPROCESS_TEST_HANG_MEMBERS"
_RELEASE_TEST_HANGS = threading.Event()

T = TypeVar("T")
R = TypeVar("R")


def hard_bound_s(max_decode_seconds: float) -> float:
    """Seconds after which a decode counts as stuck (see the module docstring for the rule)."""
    return 2.0 * max_decode_seconds + 1.0


def stuck_reason(member: str, bound_s: float) -> str:
    """A stuck member's failure reason, as the run report stores it."""
    return (f"{member}: decode did not finish within {bound_s:g} s (2 x max_decode_seconds + 1 s); "
            "its worker was stopped and the sample skipped")


@dataclass
class StuckDecode:
    """A task's message: the decode of ``member`` (sample ``key``) has run ``seconds`` past the bound."""

    input: str
    key: str
    member: str
    seconds: float
    node: str = ""
    worker: str = ""


class Heartbeat:
    """What the decode loop is doing: (key, member, monotonic start) of the image being decoded, or None.
    One attribute holding a tuple, so the watcher never reads a half-updated state."""

    __slots__ = ("current",)

    def __init__(self) -> None:
        self.current: tuple[str, str, float] | None = None

    def begin(self, key: str, member: str) -> None:
        self.current = (key, member, time.monotonic())

    def end(self) -> None:
        self.current = None

    def stuck(self, bound_s: float) -> StuckDecode | None:
        """The decode running longer than ``bound_s``, if there is one (``input`` left for the caller)."""
        current = self.current
        if current is None:
            return None
        key, member, since = current
        seconds = time.monotonic() - since
        return StuckDecode("", key, member, round(seconds, 3)) if seconds > bound_s else None


def watch_steps(steps: Generator[T, None, R], heartbeat: Heartbeat, bound_s: float
                ) -> Generator[T | StuckDecode, None, R | None]:
    """Run ``steps`` on a decode thread and pass its messages on (and its return value, and any exception
    it raises); once ``heartbeat`` shows a decode older than ``bound_s``, yield a ``StuckDecode`` and return
    None, leaving the stuck thread to the caller (the Ray task waits for the driver to end its process).

    Closing this generator (a cancelled task) asks the decode thread to close ``steps`` at its next
    message, so its writer removes the partial shards."""
    messages: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
    closing = threading.Event()

    def pump() -> None:
        try:
            while not closing.is_set():
                try:
                    messages.put(("step", next(steps)))
                except StopIteration as stop:
                    messages.put(("done", stop.value))
                    return
            steps.close()
        except BaseException as e:  # noqa: BLE001 - handed to the watching thread, which raises it
            messages.put(("raised", e))

    thread = threading.Thread(target=pump, name="decode", daemon=True)
    thread.start()
    poll_s = min(1.0, bound_s / 4)
    stuck = None
    try:
        while True:
            try:
                kind, value = messages.get(timeout=poll_s)
            except queue.Empty:
                stuck = heartbeat.stuck(bound_s)
                if stuck is not None:
                    yield stuck
                    return None
                continue
            if kind == "step":
                yield value
            elif kind == "done":
                return value
            else:
                raise value
    finally:
        closing.set()
        if stuck is None and thread.is_alive():
            thread.join(timeout=bound_s)  # its next message comes within ~0.1 s: the close runs then


def hang_pattern_for_tests() -> str:
    """The test-only hang pattern of this process's environment ("" when unset: always, outside tests)."""
    return os.environ.get(HANG_MEMBERS_ENV, "")


def hang_if_test_member(member: str, pattern: str) -> None:
    """Block like a decode that never returns if ``member`` matches the test-only ``pattern``."""
    if pattern and fnmatch.fnmatchcase(member, pattern):
        _RELEASE_TEST_HANGS.wait()


def release_test_hangs() -> None:
    """Let every test hang in this process return (a test without Ray ends its stuck thread); later
    matches hang again."""
    global _RELEASE_TEST_HANGS
    released, _RELEASE_TEST_HANGS = _RELEASE_TEST_HANGS, threading.Event()
    released.set()
