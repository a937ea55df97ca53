"""Where a loader's device work runs and how the training loop waits for it: CUDA streams and events, in one
place, injectable.

``DeviceLoader`` does everything it does to a batch on the device (the host-to-device copy, a JPEG batch's
decode, the normalisation or transform) on the prefetch thread's own stream (``LoaderStreams.producer``),
created with the **highest priority** the device has (``torch.cuda.Stream.priority_range()``: the lowest
number is the highest priority), so a batch's copy and decode are scheduled ahead of the training step's
kernels queued on the default stream instead of waiting behind them (a loop that syncs with the host only
every few steps keeps a long queue there). Each batch's work ends with an event of its own recorded on that
stream; the training loop's stream (``consumer``) waits for that event on the GPU (``wait_event``: no host
sync), and every tensor the batch carries is marked as used on the consumer's stream (``record_use``:
``Tensor.record_stream``), or the caching allocator would hand its memory out again as soon as the producer's
stream is done with it, while the step still reads it (the cross-stream reuse SPDL's documentation warns of).

The ``LoaderStreams`` protocol is the whole interface; ``CudaStreams`` is it on CUDA, its torch calls
injectable too (``new_stream``, ``priorities``...), so CPU tests with fake streams and events check where
each step is placed (``tests/train/test_device_streams.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

__all__ = ["CudaStreams", "LoaderStreams", "highest_priority", "thread_stream"]


class LoaderStreams(Protocol):
    """What ``DeviceLoader`` asks of streams: the prefetch thread's stream, the training loop's, a context
    that queues work on a stream, an event per batch, and marking a tensor used on a stream."""

    def producer(self) -> Any: ...

    def consumer(self) -> Any: ...

    def using(self, stream: Any) -> AbstractContextManager[Any]: ...

    def event(self) -> Any: ...

    def on_device(self, tensor: torch.Tensor) -> bool: ...

    def record_use(self, tensor: torch.Tensor, stream: Any) -> None: ...


def highest_priority(priorities: Callable[[], tuple[int, int]] | None = None) -> int:
    """The highest stream priority: the lowest number of ``torch.cuda.Stream.priority_range()`` (e.g. -5 of
    (0, -5) on an H100; 0 where the device has one priority only)."""
    return min((priorities or torch.cuda.Stream.priority_range)())


_thread_streams = threading.local()


def thread_stream(device: torch.device, new_stream: Callable[..., Any] | None = None,
                  priorities: Callable[[], tuple[int, int]] | None = None) -> Any:
    """This thread's own CUDA stream on ``device``, of the highest priority: work from no other thread is
    ever queued on it (the prefetch thread's, for everything ``DeviceLoader`` does to a batch on the device).
    Made once per thread and device (``new_stream(device, priority=...)``, default ``torch.cuda.Stream``)."""
    streams = getattr(_thread_streams, "streams", None)
    if streams is None:
        streams = _thread_streams.streams = {}
    make = new_stream or torch.cuda.Stream
    key = (device, make)
    if key not in streams:
        streams[key] = make(device, priority=highest_priority(priorities))
    return streams[key]


class CudaStreams:
    """``LoaderStreams`` on CUDA ``device``; each torch call can be replaced (CPU tests pass fakes)."""

    def __init__(self, device: torch.device | str, *, new_stream: Callable[..., Any] | None = None,
                 priorities: Callable[[], tuple[int, int]] | None = None,
                 current_stream: Callable[[torch.device], Any] | None = None,
                 use_stream: Callable[[Any], AbstractContextManager[Any]] | None = None,
                 new_event: Callable[[], Any] | None = None) -> None:
        self.device = torch.device(device)
        self._new_stream, self._priorities = new_stream, priorities
        self._current = current_stream or torch.cuda.current_stream
        self._use = use_stream or torch.cuda.stream
        self._event = new_event or torch.cuda.Event

    def producer(self) -> Any:
        """The calling thread's own stream, of the highest priority."""
        return thread_stream(self.device, self._new_stream, self._priorities)

    def consumer(self) -> Any:
        """The calling thread's current stream (the training loop's)."""
        return self._current(self.device)

    def using(self, stream: Any) -> AbstractContextManager[Any]:
        return self._use(stream)

    def event(self) -> Any:
        return self._event()

    def on_device(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda

    def record_use(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)
