"""``MixedDataset``: batches drawn from several shardio datasets with weights, resumable and DDP-equal.

Mixing is per batch: each batch comes whole from one dataset (so a batch of bucketed datasets is one
bucket of one dataset: the datasets must have the same bucket list, and every rank draws the same
dataset, whose own order gives every rank the same bucket), the dataset drawn with probability
``weight / sum(weights)``. A batch stays one slice (or a few) of memory maps, with no per-sample work;
across a few batches the model sees the mixture (a batch of 256 drawn per sample would mix within the
batch, at the cost of one copy per sample, ~0.4 of copy speed at 256×256 in ``bench.reader``).

The schedule is a pure function of ``(seed, epoch)``: epoch ``e``'s ``batches_per_epoch`` choices come
from ``np.random.default_rng([seed, e])``, the same on every rank. Each dataset is read as an endless
sequence of its own epochs, through its own resume protocol (``shardio.read.resume``): this mixer begins the
dataset's passes and takes their batches through the dataset's ``cursor.handed_out``, one just before
it yields it, so each counts when handed out. Where a dataset stands at the start of mixed epoch ``e`` is the
number of batches the choices of epochs ``0..e-1`` took from it (``ShardDataset.seek``). So:

- each new iteration is the next mixed epoch (the first is 0); ``set_epoch(e)`` pins the next one and
  gives epoch ``e``'s batches, whatever ran before in this process;
- ``state_dict()`` holds the schedule's place (``epoch``, ``batches_seen``: batches this yielded) and each
  dataset's own ``state_dict()`` (its global position and generation); ``load_state_dict`` resumes at
  exactly the next batch, each dataset where its state says (a mid-epoch dataset finishes that epoch on
  the generation its state pins). A state of a finished mixed epoch resumes at the next one, unless
  ``set_epoch`` pins another epoch first, which drops the state (Lightning, after an epoch's last batch);
- every rank yields ``batches_per_epoch`` batches: the ranks draw the same choices, and each dataset
  yields the same number of batches on every rank (``ShardDataset``'s guarantee), so DDP never waits.

A dataset weighted above its share of ``batches_per_epoch`` (default: the datasets' batches together)
repeats its epochs within one mixed epoch; one weighted below it spreads an epoch over several. Each
batch carries ``"__source__"`` (the dataset's index) and ``"__position__"``/``"__epoch__"`` (its samples'
positions in that dataset's epoch, for ``shardio.train.augment`` transforms). Iterate it directly, in the
process that consumes the batches (``num_workers=0``): it counts a batch when it yields it, so a
consumer that pulls batches ahead (``DeviceLoader(prefetch>0)``) would count those not yet trained on.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from shardio.read.batches import FIELDS, has_content_box
from shardio.read.dataset import ShardDataset
from shardio.read.layout import mix_refusal
from shardio.errors import DatasetIncompatibleError
from shardio.format import NONE
from shardio.read.resume import EpochPass

__all__ = ["MixedDataset"]

Batch = dict[str, Any]


class MixedDataset(IterableDataset):
    """Batches from ``datasets`` (``ShardDataset``s of one image shape or bucket list, batch size and world) drawn with
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
            refusal = mix_refusal(first.path, first.layout, other.path, other.layout)
            if refusal is not None:
                raise DatasetIncompatibleError(refusal)
            if (first.snapshot.encoding == NONE) != (other.snapshot.encoding == NONE):
                raise DatasetIncompatibleError(
                    f"cannot mix {first.path} (encoding {first.snapshot.encoding}) with {other.path} (encoding "
                    f"{other.snapshot.encoding}): a dataset without pixels gives batches without image")
            if not _same_outputs(first.outputs, other.outputs):
                raise DatasetIncompatibleError(
                    f"cannot mix {first.path} (model outputs {_outputs_said(first.outputs)}) with {other.path} "
                    f"({_outputs_said(other.outputs)}): every batch of a mix holds the same outputs, of one dtype "
                    "and shape per bucket, made by one model")
            for name in ("batch_size", "rank", "world_size"):
                if getattr(other, name) != getattr(first, name):
                    raise ValueError(
                        f"cannot mix {first.path} ({name}={getattr(first, name)}) with {other.path} "
                        f"({name}={getattr(other, name)}): the mixed datasets need one {name}")
        self.datasets = datasets
        # One schema for the mix: every batch has each key any of the datasets carries, filled as a single
        # dataset fills a sample without it (cls -1, txt/json None, content_box the whole image).
        self.fields = tuple(f for f in FIELDS if any(f in d.fields for d in datasets))
        self.content_box = any(has_content_box(d.snapshot) for d in datasets)
        # What every batch of the mix has beyond the fields: a bucketed dataset's "bucket", filled as 0 (the
        # one shape of a single-shape dataset is the bucket list's only bucket).
        self.batch_defaults = {k: v for d in datasets for k, v in d.layout.batch_defaults.items()}
        self.weights = weight_array / weight_array.sum()
        self.batches_per_epoch = (sum(len(d) for d in datasets) if batches_per_epoch is None
                                  else int(batches_per_epoch))
        if self.batches_per_epoch < 1:
            raise ValueError(f"batches_per_epoch must be >= 1, got {batches_per_epoch}")
        self.seed = int(seed)
        self.epoch = 0  # of the current (before the first iteration: the next) iteration
        self.batches_seen = 0
        self._started = False  # an iteration has begun: the next one is epoch + 1
        self._pinned = False  # set_epoch since the last iteration
        self._resume: dict[str, Any] | None = None  # a loaded state, for the next iteration
        self._taken_before: dict[int, np.ndarray] = {0: np.zeros(len(datasets), np.int64)}

    @property
    def batch_size(self) -> int:
        return self.datasets[0].batch_size

    def __len__(self) -> int:
        """Batches per epoch (``batches_per_epoch``), on every rank."""
        return self.batches_per_epoch

    def __getitem__(self, index: object) -> NoReturn:
        """Refused with a pointer: a mix is iterated; its samples are its datasets'."""
        raise TypeError(f"a MixedDataset is iterated, not indexed (len = {len(self)} batches): a sample is "
                        "one of its datasets', mix.datasets[k].sample(i) (and .find(key) for a key's index)")

    def set_epoch(self, epoch: int) -> None:
        """Pin the epoch of the next iterator (later ones count on from it); a loaded state of another
        epoch is dropped, one of the same epoch still resumes it."""
        self.epoch, self._pinned = int(epoch), True
        if self._resume is not None and self._resume["epoch"] != self.epoch:
            self._resume = None

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

    def state_dict(self) -> dict[str, Any]:
        """The schedule's place (``epoch``, ``batches_seen``: batches handed out) and each dataset's own
        state (``sources``), with the settings a resume must match."""
        if self._resume is not None:
            return dict(self._resume)
        # After set_epoch(e) and before the next iteration: the start of e (which the schedule places).
        seen = 0 if self._pinned else self.batches_seen
        return {"epoch": self.epoch, "batches_seen": seen, "seed": self.seed,
                "weights": self.weights.tolist(), "batches_per_epoch": self.batches_per_epoch,
                "sources": [d.state_dict() for d in self.datasets]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iterator yields what is left of ``state["epoch"]`` after ``batches_seen``."""
        for key, mine in (("seed", self.seed), ("batches_per_epoch", self.batches_per_epoch)):
            if state[key] != mine:
                raise ValueError(f"cannot resume: the state has {key}={state[key]!r}, this MixedDataset has "
                                 f"{mine!r}; resume with the same datasets and settings")
        if not np.allclose(state["weights"], self.weights, rtol=0, atol=1e-12):
            raise ValueError(f"cannot resume: the state has weights {state['weights']}, this MixedDataset "
                             f"has {self.weights.tolist()}")
        if len(state["sources"]) != len(self.datasets):
            raise ValueError(f"cannot resume: the state mixes {len(state['sources'])} datasets, this "
                             f"MixedDataset {len(self.datasets)}")
        if not 0 <= int(state["batches_seen"]) <= self.batches_per_epoch:
            raise ValueError(f"batches_seen={state['batches_seen']} is outside 0..{self.batches_per_epoch}")
        self.epoch, self._pinned = int(state["epoch"]), False
        self._resume = {**state, "epoch": self.epoch, "batches_seen": int(state["batches_seen"])}

    def _begin(self) -> tuple[int, int]:
        """(epoch, batches already handed out of it) of the iteration about to start; places each
        dataset where that epoch needs it."""
        resume, self._resume = self._resume, None
        if resume is not None and resume["batches_seen"] > 0 and (
                self._pinned or resume["batches_seen"] < self.batches_per_epoch):
            for dataset, state in zip(self.datasets, resume["sources"]):
                dataset.load_state_dict(state)
            return resume["epoch"], resume["batches_seen"]
        if resume is not None:  # an epoch's start (the schedule places the datasets), or a finished one
            epoch = resume["epoch"] + (resume["batches_seen"] > 0 and not self._pinned)
        else:
            epoch = self.epoch if self._pinned or not self._started else self.epoch + 1
        for dataset, taken in zip(self.datasets, self._batches_before(epoch).tolist()):
            dataset.seek(*divmod(taken, len(dataset)))
        return epoch, 0

    def __iter__(self) -> Iterator[Batch]:
        # Not a generator function: the epoch and resume point are read when the iterator is made.
        if get_worker_info() is not None:
            raise ValueError("MixedDataset reads its datasets in the process that iterates it: iterate it "
                             "directly (or in a DataLoader with num_workers=0); every DataLoader worker "
                             "would otherwise yield the whole epoch")
        self.epoch, skip = self._begin()
        self._started, self._pinned, self.batches_seen = True, False, skip
        return self._generate(self.choices(self.epoch)[skip:].tolist())

    def _generate(self, choices: list[int]) -> Iterator[Batch]:
        streams: list[Iterator[tuple[EpochPass, int, Batch]] | None] = [None] * len(self.datasets)
        for source in choices:
            stream = streams[source]
            if stream is None:  # begun on first use: a dataset never drawn is never read
                stream = streams[source] = _endless(self.datasets[source])
            epoch_pass, index, batch = next(stream)  # counted now: this yields it next
            positions = epoch_pass.batches[index]
            self._fill_schema(batch)
            batch["__source__"] = source
            batch["__epoch__"] = epoch_pass.epoch
            batch["__position__"] = torch.arange(positions.start, positions.stop, dtype=torch.int64)
            self.batches_seen += 1
            yield batch


    def _fill_schema(self, batch: Batch) -> None:
        count = len(batch["__key__"])
        for name, value in self.batch_defaults.items():
            batch.setdefault(name, value)
        for name in self.fields:
            if name not in batch:
                batch[name] = torch.full((count,), -1, dtype=torch.int64) if name == "cls" else [None] * count
        if self.content_box and "content_box" not in batch:
            height, width = batch["image"].shape[1:3]  # uint8 NHWC, as the datasets yield it
            batch["content_box"] = torch.tensor([[0, 0, width, height]], dtype=torch.int32).repeat(count, 1)


def _endless(dataset: ShardDataset) -> Iterator[tuple[EpochPass, int, Batch]]:
    """``(pass, index in the pass, batch)`` of ``dataset``'s passes, epoch after epoch, each counted on the
    dataset's cursor as the mixer takes it (it yields it at once): each new pass is the dataset's next epoch
    (or the rest of the one it was placed or resumed in)."""
    while True:
        epoch_pass = dataset.begin_pass()
        if epoch_pass.start == 0 and not epoch_pass.batches:
            raise ValueError(f"{dataset.path}: an epoch of this rank has no batch to mix")
        for index, batch in enumerate(dataset.cursor.handed_out(epoch_pass, dataset.iter_pass(epoch_pass))):
            yield epoch_pass, index, batch


def _same_outputs(first: Sequence[Any], other: Sequence[Any]) -> bool:
    """Whether two datasets' outputs mix: the same names in order, each of one dtype and model identity, and one
    shape in each bucket both have reached."""
    if [(o.name, o.dtype, o.identity) for o in first] != [(o.name, o.dtype, o.identity) for o in other]:
        return False
    return all(a is None or b is None or a == b for x, y in zip(first, other) for a, b in zip(x.shapes, y.shapes))


def _outputs_said(outputs: Sequence[Any]) -> str:
    return ", ".join(f"{o.name} {o.dtype} {[list(s) if s else None for s in o.shapes]}" for o in outputs) or "none"
