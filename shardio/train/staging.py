"""Pinned staging buffers for host-to-device copies: one pool per sample shape, reused across steps.

A batch that is not in pinned memory already (a view of a memory map, a DataLoader worker's shared memory,
a batch decoded on the CPU) is copied into a pinned buffer before its ``non_blocking`` copy to the device,
which can only overlap other work from pinned memory. A bucketed dataset's batches change shape from step
to step (each batch is one bucket's [B, h, w, 3]), so ``StagingPools`` keeps a pool per sample shape
(h, w, 3) and dtype: each buffer holds up to the largest batch seen of that shape (a shorter last batch
uses its first rows), and is handed out again once the device copy that read it has run (the event the
caller gives back with it has completed). A steady run allocates a few buffers per bucket in its first
steps and none after; pinned memory is at most ``depth`` buffers per shape, where the caller waits for the
oldest copy rather than allocating past that.

Events and allocation are injectable (``event.query()``, ``event.synchronize()``; ``allocate(shape, dtype)``)
so the pools' bookkeeping is tested without CUDA.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

__all__ = ["Staged", "StagingPools", "pinned_empty"]


class CopyEvent(Protocol):
    """What a slot waits on before reuse: a ``torch.cuda.Event`` recorded after the copy was queued."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised page-locked host tensor (needs CUDA)."""
    return torch.empty(shape, dtype=dtype, pin_memory=True)


@dataclass(eq=False)
class Staged:
    """One buffer of a pool: ``tensor`` is the staged batch (a view of the first rows of ``buffer``)."""

    buffer: torch.Tensor
    tensor: torch.Tensor | None = None
    event: CopyEvent | None = None
    taken: bool = False
    released_at: int = 0
    key: tuple[Any, ...] = field(default=())


class StagingPools:
    """``stage(image)`` copies ``image`` into a free pinned buffer of its sample shape and returns it taken;
    ``release(staged, event)`` gives it back, reusable once ``event`` has completed. One thread at a time
    is expected (the prefetch thread), but the bookkeeping is locked so any use stays consistent."""

    def __init__(self, depth: int = 4, *,
                 allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] = pinned_empty) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.depth, self.allocate = depth, allocate
        self.pools: dict[tuple[Any, ...], list[Staged]] = {}
        self.allocations = 0  # buffers made so far, replacements of a too-short buffer included
        self._order = itertools.count(1)
        self._lock = threading.Lock()

    def nbytes(self) -> int:
        """Bytes of staging memory held, over all pools."""
        return sum(s.buffer.numel() * s.buffer.element_size() for pool in self.pools.values() for s in pool)

    def shapes(self) -> list[tuple[int, ...]]:
        """The sample shapes that have a pool."""
        return [key[0] for key in self.pools]

    def take(self, shape: tuple[int, ...], dtype: torch.dtype = torch.uint8) -> Staged:
        """A taken buffer whose ``tensor`` is ``shape`` ([rows, *sample shape]), contents undefined: for a
        producer that writes into it (a CPU JPEG decode)."""
        rows, key = shape[0], (tuple(shape[1:]), dtype)
        with self._lock:
            slot = self._free_slot(key, rows)
        if slot.buffer.shape[0] < rows:  # a batch larger than this pool's buffers (e.g. the first full one)
            slot.buffer = self._new_buffer(key, rows)
        slot.tensor = slot.buffer[:rows]
        return slot

    def stage(self, image: torch.Tensor) -> Staged:
        """A taken buffer holding a copy of ``image`` (its ``tensor``: ``image``'s shape and dtype)."""
        slot = self.take(tuple(image.shape), image.dtype)
        slot.tensor.copy_(image)  # type: ignore[union-attr]
        return slot

    def release(self, staged: Staged, event: CopyEvent | None) -> None:
        """``staged`` may be reused once ``event`` has completed (``None``: at once, nothing reads it)."""
        with self._lock:
            if not staged.taken:
                raise RuntimeError("a staging buffer was released twice")
            staged.taken, staged.event, staged.tensor = False, event, None
            staged.released_at = next(self._order)

    def _new_buffer(self, key: tuple[Any, ...], rows: int) -> torch.Tensor:
        self.allocations += 1
        return self.allocate((rows, *key[0]), key[1])

    def _free_slot(self, key: tuple[Any, ...], rows: int) -> Staged:
        pool = self.pools.setdefault(key, [])
        waiting = [slot for slot in pool if not slot.taken]
        for slot in waiting:
            if slot.event is None or slot.event.query():
                return self._take(slot)
        if len(pool) < self.depth:
            slot = Staged(self._new_buffer(key, rows), key=key)
            pool.append(slot)
            return self._take(slot)
        if not waiting:
            raise RuntimeError(f"all {self.depth} staging buffers of shape {key[0]} are taken and none was "
                               "released: each stage() needs a release() once its copy is queued")
        oldest = min(waiting, key=lambda slot: slot.released_at)
        assert oldest.event is not None
        oldest.event.synchronize()  # the copy queued longest ago: the first to be done
        return self._take(oldest)

    @staticmethod
    def _take(slot: Staged) -> Staged:
        slot.taken, slot.event = True, None
        return slot
