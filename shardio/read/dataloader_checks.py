"""What a plain ``torch.utils.data.DataLoader`` around a ``ShardDataset`` can get wrong, caught where it shows:
a DataLoader that batches the dataset's batches again (an error at the first ``iter()``), and DataLoader
workers that start the same epoch again (a warning: ``set_epoch`` or ``ShardLoader`` is the fix).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

try:  # torch's private fetcher: only to recognise a DataLoader that batches our batches again (see below)
    from torch.utils.data._utils.fetch import _IterableDatasetFetcher
except ImportError:  # another torch: the check is skipped, nothing else changes
    _IterableDatasetFetcher = None

__all__ = ["WorkerEpochs", "refuse_batched_again"]

# DataLoader worker ids that can warn about a repeated epoch (one int64 each in shared memory).
WATCHED_WORKERS = 256


def batched_again(caller: Any) -> bool:
    """Whether ``caller`` (the frame that called ``iter(dataset)``) is a DataLoader's fetcher that collates
    items into batches (``DataLoader(ds, batch_size=N)``, N not None).

    A DataLoader tells an IterableDataset nothing about its ``batch_size``; the one place it shows is the
    fetcher that calls ``iter()`` on the dataset, in the main process and in each worker alike. Without
    this check ``DataLoader(ds, batch_size=2)`` (the idiom for per-sample datasets) silently yields batches
    of batches (``image`` [2, 256, H, W, 3], ``__key__`` as tuples), or with a partial last batch fails
    deep in ``torch.stack`` ("stack expects each tensor to be equal size"). Batching samples one by one
    would defeat the reader's point (a batch is a slice of a memory map), so the answer is an error at
    the first ``iter()``. A torch whose fetcher differs skips the check."""
    fetcher = caller.f_locals.get("self") if caller is not None else None
    return (_IterableDatasetFetcher is not None and isinstance(fetcher, _IterableDatasetFetcher)
            and bool(getattr(fetcher, "auto_collation", False)))


def refuse_batched_again(caller: Any, path: str, batch_size: int) -> None:
    """Raise where ``caller`` batches the batches of the dataset at ``path`` again (``batched_again``)."""
    if batched_again(caller):
        raise ValueError(
            f"{path}: ShardDataset yields whole batches ({batch_size} samples each), and this "
            "DataLoader batches them again (DataLoader(ds, batch_size=N)): pass batch_size=None to the "
            "DataLoader, or use shardio.ShardLoader(ds, num_workers=...); the batch size is "
            "ShardDataset's own (ShardDataset(path, batch_size))"
        )


class WorkerEpochs:
    """The epoch each DataLoader worker id last started, shared with the workers (forked or spawned): a
    plain DataLoader with workers copies the dataset afresh every epoch, so only they can tell."""

    def __init__(self) -> None:
        self.epochs = torch.full((WATCHED_WORKERS,), -1, dtype=torch.int64).share_memory_()

    def started(self, worker: int, epoch: int, path: str) -> None:
        """Worker ``worker`` begins ``epoch``: a warning if it began that epoch last time too."""
        if worker >= WATCHED_WORKERS:
            return
        if int(self.epochs[worker]) == epoch:
            warnings.warn(
                f"{path}: DataLoader worker {worker} starts epoch {epoch} again (the "
                "same order as last time): a DataLoader with workers never iterates the main "
                "process's dataset, so its epoch cannot advance by itself; call "
                "dataset.set_epoch(epoch) before each epoch, or use shardio.ShardLoader",
                stacklevel=3,
            )
        self.epochs[worker] = epoch
