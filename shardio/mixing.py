"""``MixedDataset``: batches drawn from several shardio datasets with weights, resumable and DDP-equal.

Mixing is per batch: each batch comes whole from one dataset, the dataset drawn with probability
``weight / sum(weights)``. A batch stays one slice (or a few) of memory maps, with no per-sample work;
across a few batches the model sees the mixture (a batch of 256 drawn per sample would mix within the
batch, at the cost of one copy per sample, ~0.4 of copy speed at 256×256 in ``bench.reader``).

The schedule is a pure function of ``(seed, epoch)``: epoch ``e``'s ``batches_per_epoch`` choices come
from ``np.random.default_rng([seed, e])``, the same on every rank. Each dataset is read as an endless
sequence of its own epochs (its ``set_epoch`` advanced each time it runs out); where it stands at the
start of mixed epoch ``e`` is the number of batches the choices of epochs ``0..e-1`` took from it. So:

- ``set_epoch(e)`` alone gives epoch ``e``'s batches, whatever ran before in this process;
- ``state_dict()`` is ``(epoch, batches_seen)`` and resumes at exactly the next batch;
- every rank yields ``batches_per_epoch`` batches: the ranks draw the same choices, and each dataset
  yields the same number of batches on every rank (``ShardDataset``'s guarantee), so DDP never waits.

A dataset weighted above its share of ``batches_per_epoch`` (default: the datasets' batches together)
repeats its epochs within one mixed epoch; one weighted below it spreads an epoch over several. Each
batch carries ``"__source__"`` (the dataset's index) and ``"__position__"``/``"__epoch__"`` (its samples'
positions in that dataset's epoch, for ``shardio.augment`` transforms). Iterate it directly or with
``DeviceLoader`` (``num_workers=0``: the datasets are read in this process).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from shardio.augment import batch_positions
from shardio.dataset import ShardDataset
from shardio.errors import DatasetIncompatibleError

__all__ = ["MixedDataset"]

Batch = dict[str, Any]


class MixedDataset(IterableDataset):
    """Batches from ``datasets`` (``ShardDataset``s of one image shape, batch size and world) drawn with
    ``weights``; ``len`` is ``batches_per_epoch`` on every rank (see the module docstring)."""

    def __init__(self, datasets: Sequence[ShardDataset], weights: Sequence[float], *,
                 batches_per_epoch: int | None = None, seed: int = 0) -> None:
        super().__init__()
        datasets = list(datasets)
        if not datasets:
            raise ValueError("MixedDataset needs at least one dataset")
        if len({id(d) for d in datasets}) != len(datasets):
            raise ValueError("the same ShardDataset object is given twice; open the path twice to weight it")
        weight_array = np.asarray(weights, dtype=np.float64)
        if weight_array.shape != (len(datasets),) or not np.all(np.isfinite(weight_array)) \
                or np.any(weight_array < 0) or weight_array.sum() <= 0:
            raise ValueError(f"weights must be {len(datasets)} finite non-negative numbers, not all 0; "
                             f"got {list(weights)}")
        first = datasets[0]
        for other in datasets[1:]:
            if other.snapshot.shape != first.snapshot.shape:
                raise DatasetIncompatibleError(
                    f"cannot mix {first.path} (images {first.snapshot.shape}) with {other.path} (images "
                    f"{other.snapshot.shape}): a batch has one shape; preprocess both with the same "
                    "height and width")
            for name in ("batch_size", "rank", "world_size"):
                if getattr(other, name) != getattr(first, name):
                    raise ValueError(
                        f"cannot mix {first.path} ({name}={getattr(first, name)}) with {other.path} "
                        f"({name}={getattr(other, name)}): the mixed datasets need one {name}")
        self.datasets = datasets
        self.weights = weight_array / weight_array.sum()
        self.batches_per_epoch = (sum(len(d) for d in datasets) if batches_per_epoch is None
                                  else int(batches_per_epoch))
        if self.batches_per_epoch < 1:
            raise ValueError(f"batches_per_epoch must be >= 1, got {batches_per_epoch}")
        self.seed = int(seed)
        self.epoch = 0
        self.batches_seen = 0
        self._resume: tuple[int, int] | None = None
        self._taken_before: dict[int, np.ndarray] = {0: np.zeros(len(datasets), np.int64)}

    @property
    def batch_size(self) -> int:
        return self.datasets[0].batch_size

    def __len__(self) -> int:
        return self.batches_per_epoch

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch of the next iterator."""
        self.epoch = int(epoch)

    def choices(self, epoch: int | None = None) -> np.ndarray:
        """The dataset index of each batch of ``epoch`` (int64 [batches_per_epoch])."""
        rng = np.random.default_rng([self.seed, self.epoch if epoch is None else int(epoch)])
        return rng.choice(len(self.datasets), size=self.batches_per_epoch, p=self.weights).astype(np.int64)

    def _batches_before(self, epoch: int) -> np.ndarray:
        """Batches each dataset gave in epochs ``0..epoch-1``: one categorical draw per past epoch
        (~10 ms for 100 epochs of 10k batches), remembered for the epochs asked for since."""
        known = max(e for e in self._taken_before if e <= epoch)
        taken = self._taken_before[known].copy()
        for past in range(known, epoch):
            taken += np.bincount(self.choices(past), minlength=len(self.datasets))
        self._taken_before[epoch] = taken
        return taken

    def state_dict(self, batches_seen: int | None = None) -> dict[str, Any]:
        """Where this iteration is; ``batches_seen`` defaults to the batches handed out."""
        return {"epoch": self.epoch, "batches_seen": self.batches_seen if batches_seen is None else
                int(batches_seen), "seed": self.seed, "weights": self.weights.tolist(),
                "batches_per_epoch": self.batches_per_epoch,
                "datasets": [d.state_dict(0)["samples"] for d in self.datasets]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iterator of ``state["epoch"]`` yields the batches after ``batches_seen``."""
        mine = self.state_dict()
        for key in ("seed", "batches_per_epoch", "datasets"):
            if state[key] != mine[key]:
                raise ValueError(f"cannot resume: the state has {key}={state[key]!r}, this MixedDataset has "
                                 f"{mine[key]!r}; resume with the same datasets and settings")
        if not np.allclose(state["weights"], mine["weights"], rtol=0, atol=1e-12):
            raise ValueError(f"cannot resume: the state has weights {state['weights']}, this MixedDataset "
                             f"has {mine['weights']}")
        if not 0 <= int(state["batches_seen"]) <= self.batches_per_epoch:
            raise ValueError(f"batches_seen={state['batches_seen']} is outside 0..{self.batches_per_epoch}")
        self.epoch, self.batches_seen = int(state["epoch"]), int(state["batches_seen"])
        self._resume = (self.epoch, self.batches_seen)

    def __iter__(self) -> Iterator[Batch]:
        # Not a generator function: the epoch and resume point are read when the iterator is made.
        if get_worker_info() is not None:
            raise ValueError("MixedDataset reads its datasets in the process that iterates it: use it with "
                             "num_workers=0 (or directly, or with shardio.DeviceLoader); every DataLoader "
                             "worker would otherwise yield the whole epoch")
        resume, self._resume = self._resume, None
        skip = resume[1] if resume is not None and resume[0] == self.epoch else 0
        choices = self.choices()
        start = self._batches_before(self.epoch) + np.bincount(choices[:skip], minlength=len(self.datasets))
        self.batches_seen = skip
        return self._generate(choices[skip:].tolist(), start.tolist())

    def _generate(self, choices: list[int], start: list[int]) -> Iterator[Batch]:
        streams: list[Iterator[Batch] | None] = [None] * len(self.datasets)
        for source in choices:
            stream = streams[source]
            if stream is None:  # opened on first use: a dataset never drawn is never read
                stream = streams[source] = _endless(self.datasets[source], start[source])
            batch = next(stream)
            dataset = self.datasets[source]
            where = dataset.state_dict()  # the batch just handed out is number batches_seen of its epoch
            batch["__source__"] = source
            batch["__epoch__"] = where["epoch"]
            batch["__position__"] = batch_positions(dataset, where["batches_seen"])
            self.batches_seen += 1
            yield batch


def _endless(dataset: ShardDataset, position: int) -> Iterator[Batch]:
    """``dataset``'s batches from ``position`` (counted over its epochs 0, 1, ...) on, epoch after epoch."""
    epoch, skip = divmod(position, len(dataset))
    while True:
        dataset.set_epoch(epoch)
        if skip:
            dataset.load_state_dict(dataset.state_dict(skip))
        yield from dataset
        epoch, skip = epoch + 1, 0

