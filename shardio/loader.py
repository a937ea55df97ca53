"""Feeding ``ShardDataset`` batches to a model: a counting DataLoader and a device prefetcher.

``ShardLoader`` is a ``torch.utils.data.DataLoader`` fixed to what a batch-yielding dataset needs
(``batch_size=None``, no per-sample collate) that counts the batches it hands out, so ``state_dict()``
is exact with any number of workers. ``DeviceLoader`` moves each batch to the device with
``non_blocking`` copies on a side CUDA stream while the model works on the previous one, and turns the
uint8 NHWC images into normalised float NCHW (channels_last memory, which convolutions prefer).

Copies per batch: memory map → pinned buffer (the pin thread, or the worker's shared memory then the pin
thread) → device. Without ``pin_memory=True`` the host-to-device copy cannot overlap anything.
"""

from __future__ import annotations

import atexit
import functools
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from shardio.dataset import ShardDataset

if TYPE_CHECKING:
    from shardio.augment import BatchTransform

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "DeviceLoader", "ShardLoader", "to_device"]

# On the 0-255 scale of the uint8 pixels.
IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


def _no_collate(batch: Any) -> Any:
    # Module level so that it pickles for spawned workers.
    return batch


class ShardLoader(DataLoader):
    """``DataLoader(dataset, batch_size=None, ...)`` that counts batches handed out for ``state_dict``."""

    def __init__(self, dataset: ShardDataset, *, num_workers: int = 0, pin_memory: bool = False,
                 **kwargs: Any) -> None:
        if not isinstance(dataset, ShardDataset):
            raise TypeError(f"ShardLoader takes a ShardDataset, got {type(dataset).__name__}")
        for name in ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"):
            if name in kwargs:
                raise ValueError(f"{name}= belongs to ShardDataset, which yields whole batches")
        if kwargs.get("persistent_workers"):
            raise ValueError(
                "persistent_workers=True keeps the workers' copy of the dataset from the first epoch, so "
                "set_epoch and load_state_dict would not reach them; leave it False"
            )
        if kwargs.get("in_order") is False:
            raise ValueError("in_order=False would hand batches out of the rank's order; leave it True")
        kwargs.setdefault("collate_fn", _no_collate)
        if pin_memory and num_workers == 0:
            dataset.pin_memory = True  # assembled pinned: DataLoader's pin_memory() then has nothing to copy
        super().__init__(dataset, batch_size=None, num_workers=num_workers, pin_memory=pin_memory, **kwargs)
        self.batches_seen = 0

    def __iter__(self) -> Iterator[Any]:
        dataset: ShardDataset = self.dataset  # type: ignore[assignment]
        # Read the resume point before the workers copy the dataset; with workers the main process's
        # dataset is never iterated, so it would otherwise keep it for the next epoch.
        skip = dataset._resume[1] if dataset._resume and dataset._resume[0] == dataset.epoch else 0
        batches = super().__iter__()
        dataset._resume = None
        self.batches_seen = skip
        return self._count(batches)

    def _count(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            self.batches_seen += 1
            yield batch

    def state_dict(self, batches_seen: int | None = None) -> dict[str, Any]:
        """The dataset's state with the batches this loader handed out in the current epoch."""
        return self.dataset.state_dict(self.batches_seen if batches_seen is None else batches_seen)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)


def to_device(
    batch: dict[str, Any],
    device: torch.device | str,
    *,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """The batch on ``device``: ``image`` as ``(x - mean) / std`` float N×3×H×W (channels_last memory),
    ``cls`` as int64; other fields unchanged. Copies are ``non_blocking``: overlapped when the source is
    pinned and the caller is on a side stream (``DeviceLoader``)."""
    device = torch.device(device)
    image = batch["image"].to(device, non_blocking=True)
    scale, shift = _affine(tuple(mean), tuple(std), device, dtype)
    # permute of NHWC memory is an NCHW view in channels_last strides; the arithmetic keeps them.
    out = dict(batch)
    out["image"] = image.permute(0, 3, 1, 2).to(dtype).mul_(scale).add_(shift)
    if "cls" in batch:
        out["cls"] = batch["cls"].to(device, non_blocking=True)
    return out


@functools.lru_cache(maxsize=16)
def _affine(mean: tuple[float, ...], std: tuple[float, ...], device: torch.device,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x * scale + shift == (x - mean) / std``, made once per device rather than copied every batch."""
    scale = torch.tensor([1.0 / s for s in std], dtype=dtype).view(1, 3, 1, 1).to(device)
    shift = torch.tensor([-m / s for m, s in zip(mean, std)], dtype=dtype).view(1, 3, 1, 1).to(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # cached for every stream: let no stream see them half-copied
    return scale, shift


class DeviceLoader:
    """Iterate ``loader`` with every batch already on ``device`` (see ``to_device``).

    With ``prefetch > 0`` a background thread pulls the next ``prefetch`` batches (the memory-map copy
    and the pinning run there, both outside the GIL, and on CPU the whole conversion), so with
    ``num_workers=0``, or a ``ShardDataset`` passed directly (pinned here when the loader did not),
    reading overlaps the step. On CUDA the next batch's host-to-device copy and normalisation run on a
    side stream while the current step runs.

    ``state_dict()`` counts the batches this yielded, not those prefetched, so resuming repeats nothing
    and skips nothing.

    ``transform`` (e.g. ``shardio.augment.TrainAugment``) replaces the normalisation: it gets the uint8
    images on the device with their epoch positions and returns the float batch (on CPU it runs in the
    consumer's thread, where the batch count that gives the positions is known).
    """

    def __init__(self, loader: Any, device: torch.device | str, *, prefetch: int = 2,
                 pin_memory: bool | None = None, transform: BatchTransform | None = None,
                 **to_device_kwargs: Any) -> None:
        if transform is not None and to_device_kwargs:
            raise ValueError(f"{sorted(to_device_kwargs)} belong to the transform when one is given")
        self.transform = transform
        self.loader, self.device, self.prefetch = loader, torch.device(device), prefetch
        # Pin what the loader did not (a ShardDataset used directly), in the prefetch thread.
        self.pin_memory = self.device.type == "cuda" if pin_memory is None else pin_memory
        if self.pin_memory and isinstance(loader, ShardDataset):
            loader.pin_memory = True  # batches assembled in pinned memory: one host copy, not two
        self.to_device_kwargs = to_device_kwargs
        self.batches_seen = 0

    def __len__(self) -> int:
        return len(self.loader)

    def _prepare(self, batch: dict[str, Any]) -> dict[str, Any]:
        """What the prefetch thread does to a batch: pin it for CUDA, or all of ``to_device`` on CPU."""
        if self.device.type != "cuda":
            if self.transform is not None:
                return batch  # transformed once counted, in __iter__ (the count gives the positions)
            return to_device(batch, self.device, **self.to_device_kwargs)
        if self.pin_memory and not batch["image"].is_pinned():
            return {**batch, "image": batch["image"].pin_memory()}
        return batch

    def _host_batches(self) -> Iterator[tuple[Any, int]]:
        """(prepared batch, the loader's count once it was handed out)."""
        counted = hasattr(self.loader, "batches_seen")
        source = iter(self.loader)
        if not counted:
            self.batches_seen = 0
        if self.prefetch <= 0:
            for batch in source:
                yield self._prepare(batch), self.loader.batches_seen if counted else self.batches_seen + 1
            return
        prefetcher = _Prefetcher(source, self._prepare, self.prefetch,
                                 (lambda: self.loader.batches_seen) if counted else None)
        try:
            while True:
                item = prefetcher.get()
                if item is _END:
                    return
                if isinstance(item, _Failed):
                    raise item.error
                batch, count = item
                yield batch, self.batches_seen + 1 if count is None else count
        finally:
            prefetcher.close()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self.device.type != "cuda":
            for batch, count in self._host_batches():
                self.batches_seen = count
                yield self._transform(batch, count) if self.transform is not None else batch
            return
        stream = torch.cuda.Stream(self.device)
        host = self._host_batches()

        def load() -> tuple[dict[str, Any], int] | None:
            item = next(host, None)
            if item is None:
                return None
            with torch.cuda.stream(stream):
                if self.transform is not None:
                    return self._transform(*item), item[1]
                return to_device(item[0], self.device, **self.to_device_kwargs), item[1]

        upcoming = load()
        while upcoming is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(stream)
            batch, count = upcoming
            for value in batch.values():
                if isinstance(value, torch.Tensor) and value.is_cuda:
                    value.record_stream(current)  # made on the side stream, freed on this one
            upcoming = load()
            self.batches_seen = count
            yield batch

    def _transform(self, batch: dict[str, Any], count: int) -> dict[str, Any]:
        from shardio.augment import transform_batch  # augment imports this module's constants

        return transform_batch(self.transform, batch, self.device, self.loader, count)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict(self.batches_seen)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


CLOSE_TIMEOUT_S = 60.0


class _Prefetcher:
    """The prefetch thread and its queue: ``close()`` stops and joins it, whether the consumer finished,
    raised, or dropped the iterator; at interpreter exit every live one is closed first.

    Why the exit hook: an exception that ends the program keeps the iterator alive in its traceback until
    interpreter shutdown, and a daemon thread still inside a torch op then aborts the process ("terminate
    called without an active exception", SIGABRT, exit 134; 4 of 6 runs of a 64x128x128 CPU loader): a
    scheduler or torchrun sees a crash instead of the exception's exit 1.
    """

    live: set[_Prefetcher] = set()

    def __init__(self, source: Iterator[Any], prepare: Any, depth: int, count: Any) -> None:
        self.slots: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.source, self.prepare, self.count = source, prepare, count
        self.thread = threading.Thread(target=self._pull, name="shardio-prefetch", daemon=True)
        _Prefetcher.live.add(self)
        self.thread.start()

    def _put(self, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.slots.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def _pull(self) -> None:
        try:
            for batch in self.source:
                if self.stop.is_set():
                    return
                item = (self.prepare(batch), None if self.count is None else self.count())
                if not self._put(item):
                    return
            self._put(_END)
        except Exception as error:  # noqa: BLE001 - handed to the consumer, raised there
            self._put(_Failed(error))

    def get(self) -> Any:
        while True:
            try:
                return self.slots.get(timeout=0.1)
            except queue.Empty:
                if not self.thread.is_alive() and self.slots.empty():  # killed by a BaseException
                    raise RuntimeError("shardio prefetch thread ended without a batch or an error") from None

    def close(self) -> None:
        self.stop.set()
        # The thread ends at its next batch or put: a batch takes milliseconds to assemble, a worker start
        # a few seconds. A source stuck for good (a hung worker) must not hang the exit as well.
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        while self.thread.is_alive() and time.monotonic() < deadline:
            self.thread.join(timeout=0.1)
        _Prefetcher.live.discard(self)
        while not self.slots.empty():  # drop prefetched batches now, not when the iterator is collected
            self.slots.get_nowait()


@atexit.register
def _close_prefetchers() -> None:
    for prefetcher in list(_Prefetcher.live):
        prefetcher.close()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()
