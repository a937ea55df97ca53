"""The GPU check's Lightning row: a ``lightning.Trainer`` with its default logging fed by ``ShardDataModule``
(``shardio.train.lightning``) with ``TrainAugment``, per dataset (raw, JPEG, yuv420), and the share of the
training time spent waiting for data.

The Trainer is Lightning's defaults (its logger, progress bar and model summary; ``self.log`` of the loss each
step, which the logger writes every 50 steps), with no checkpoint written (a 100 MB ResNet-50 file is no
logging) and ``bf16-mixed`` precision; the module is a classifier step (the model ``make_model`` gives, in
channels_last, SGD with momentum). Two clocks:

- **data wait**: the time in each ``next()`` of the train loader Lightning iterates (the ``EpochLoader`` the
  data module gives, wrapped: a new epoch's iterator and its first batch included), the time the loop's
  thread can queue no GPU work. Lightning fetches no batch ahead of a loader with a length, so the wait for
  batch ``i + 1`` falls inside step ``i``'s interval, from one ``on_train_batch_start`` to the next.
- **between steps**: from ``on_train_batch_end`` to the next ``on_train_batch_start``: the data wait plus
  Lightning's own work between steps (logging, the progress bar, the transfer hook, the transform's launch).

Both are shares of the wall time from the first timed step's start to the last one's (the first ``warmup``
steps left out: model and allocator start-up). ``steps`` crosses an epoch's end where the dataset is
small enough (the next epoch's first batches are prepared while the last ones are consumed). Goal: data
wait < 0.5% of step time with ResNet-50 bf16.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch

from shardio.train.augment import TrainAugment
from shardio.train.lightning import ShardDataModule


class _TimedBatches:
    """A train loader with each ``next()`` timed into ``waits``; ``len`` and the resume state are the
    loader's (Lightning saves and restores them as it would the loader's own)."""

    def __init__(self, loader: Any, waits: list[float]) -> None:
        self.loader, self.waits = loader, waits

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        begin = time.perf_counter()  # at the first next(): a generator's body starts there
        batches = iter(self.loader)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            self.waits.append(time.perf_counter() - begin)
            yield batch
            begin = time.perf_counter()

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


class _TimedDataModule(ShardDataModule):
    def __init__(self, *args: Any, waits: list[float], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.waits = waits

    def train_dataloader(self) -> Any:
        return _TimedBatches(super().train_dataloader(), self.waits)


class _StepClock(pl.Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.starts.append(time.perf_counter())

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.ends.append(time.perf_counter())


class _Classifier(pl.LightningModule):
    def __init__(self, make_model: Callable[[], torch.nn.Module]) -> None:
        super().__init__()
        self.model = make_model().to(memory_format=torch.channels_last)
        self.loss = torch.nn.CrossEntropyLoss()

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss = self.loss(self.model(batch["image"]), batch["cls"] % 1000)
        self.log("train_loss", loss)  # the default: on_step, written by the logger every 50 steps
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def wait_share(dataset_dir: str, device: torch.device, make_model: Callable[[], torch.nn.Module], work: str,
               batch: int = 256, size: int = 224, warmup: int = 5, steps: int = 40) -> dict[str, Any]:
    """One Trainer fit of ``warmup + steps`` steps over ``dataset_dir``: the data wait's and the
    between-steps time's shares of the timed steps, and their step time."""
    waits: list[float] = []
    clock = _StepClock()
    data = _TimedDataModule(dataset_dir, batch, train_transform=TrainAugment(size), waits=waits)
    trainer = pl.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
                         max_steps=warmup + steps, precision="bf16-mixed", enable_checkpointing=False,
                         default_root_dir=work, callbacks=[clock])
    trainer.fit(_Classifier(make_model), datamodule=data)
    starts, ends = clock.starts, clock.ends
    last = len(starts) - 1  # the timed steps: warmup .. last - 1, each from its start to the next one's
    if last <= warmup:
        raise RuntimeError(f"the Trainer ran {len(starts)} steps, fewer than {warmup} warm-up + 2")
    wall = starts[last] - starts[warmup]
    step_times = [starts[i + 1] - starts[i] for i in range(warmup, last)]
    data_waits = waits[warmup + 1:last + 1]  # batch i + 1's fetch, inside step i's interval
    between = [starts[i + 1] - ends[i] for i in range(warmup, last)]
    return {"steps": last - warmup, "batches_per_epoch": len(data.train_dataset),
            "data_wait_share": round(sum(data_waits) / wall, 4),
            "between_steps_share": round(sum(between) / wall, 4),
            "step_ms": round(1e3 * statistics.median(step_times), 2),
            "data_wait_ms_median": round(1e3 * statistics.median(data_waits), 3),
            "data_wait_ms_max": round(1e3 * max(data_waits), 2),
            "samples_per_s": round(batch * len(step_times) / wall, 1)}


def run(datasets: dict[str, str], device: torch.device, make_model: Callable[[], torch.nn.Module], work: str,
        batch: int = 256, size: int = 224, warmup: int = 5, steps: int = 40,
        model: str = "ResNet-50 bf16") -> dict[str, Any]:
    """``wait_share`` per dataset (a fresh Trainer and model each); ``model`` names ``make_model``'s."""
    out: dict[str, Any] = {"model": model, "batch": batch, "size": size, "warmup": warmup, "steps": steps,
                           "lightning": pl.__version__, "precision": "bf16-mixed"}
    for name, directory in datasets.items():
        out[name] = wait_share(directory, device, make_model, os.path.join(work, name), batch, size, warmup, steps)
    return out
