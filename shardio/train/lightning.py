"""Lightning: ``ShardDataModule`` feeds a ``Trainer`` from shardio shards (imports Lightning; ``import
shardio`` does not import this module).

What Lightning does with it, as read in Lightning 2.6 (``loops/fit_loop.py``, ``training_epoch_loop.py``,
``utilities/combined_loader.py``):

- **Epochs.** Lightning calls ``set_epoch`` only on a DataLoader's *sampler*; a dataset that yields whole
  batches has none. The train loader here (``EpochLoader``) sets the dataset's epoch to
  ``trainer.current_epoch`` when each iterator Lightning creates yields its first batch (epoch 0's is
  created in ``FitLoop.setup_data``, later ones after ``on_train_epoch_start``), as a DataLoader's
  sampler is read at the first batch. Lightning creates a resumed run's iterator before it moves past
  the epoch a checkpoint ended, so reading the epoch any earlier restarted a finished epoch (nothing to
  train on). ``ShardDataset`` and ``MixedDataset`` also advance their epoch on each new iterator by
  themselves; the explicit ``set_epoch`` wins over that and names the epoch the Trainer counts, which
  survives a restart.
- **Resume.** ``FitLoop.on_save_checkpoint`` stores ``state_dict()`` of every train loader that has
  ``state_dict``/``load_state_dict`` (``_Stateful``); ``fit(ckpt_path=...)`` calls ``load_state_dict``
  before the first batch, which is then exactly the next one (a state for another epoch than the
  Trainer's, as after a checkpoint at an epoch's last batch, is ignored: that epoch starts fresh).
  Lightning fetches no batch ahead when the loader has a length, so the count in the checkpoint is the
  batches trained on.
- **The device.** ``ShardLoader`` assembles batches in pinned memory when the Trainer's device is CUDA;
  Lightning's ``transfer_batch_to_device`` copies them ``non_blocking``; ``on_after_batch_transfer``
  then turns the uint8 NHWC images into float NCHW on the device: ``train_transform`` (e.g.
  ``TrainAugment``, with each sample's epoch position, so a resumed epoch augments identically) or the
  plain normalisation of ``shardio.to_device``.
- **DDP.** The datasets are built in ``setup()``, after the strategy has initialised
  ``torch.distributed``: each rank takes its rank and world size from there, every rank yields the same
  number of batches, and Lightning adds no sampler to a loader that is not a ``DataLoader``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Union

import lightning.pytorch as pl
import torch

from shardio.store.backends import for_path
from shardio.train.augment import BatchTransform, PositionedBatches, transform_batch
from shardio.read.dataset import ShardDataset
from shardio.train.loader import ShardLoader, to_device
from shardio.read.mixing import MixedDataset

__all__ = ["EpochLoader", "ShardDataModule", "TrainDataset"]

TrainDataset = Union[ShardDataset, MixedDataset]
"""What a ``ShardDataModule`` trains or validates on (a ``SubsetDataset`` is a ``ShardDataset``)."""


class EpochLoader:
    """A batch source for a Trainer: sets ``dataset``'s epoch from ``current_epoch()`` on each new
    iterator; ``len``, ``state_dict`` and ``load_state_dict`` are the source's.

    A loaded state resumes only the epoch it was taken in: a checkpoint saved after an epoch's last
    batch restarts the Trainer in the next epoch, which must start fresh (it yielded nothing at all when
    the state's epoch was kept), and the dataset ignores a resume point for another epoch."""

    def __init__(self, source: PositionedBatches | MixedDataset, dataset: TrainDataset,
                 current_epoch: Callable[[], int] | None = None) -> None:
        # Not ``self.dataset``: Lightning warns that an IterableDataset's len may be wrong with workers
        # whenever a loader has one; ShardDataset's is exact (its workers split its batches).
        self.source, self.epoch_dataset, self.current_epoch = source, dataset, current_epoch

    def __len__(self) -> int:
        return len(self.source)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        # A generator: the epoch is read at the first next(), as a DataLoader's sampler is. Lightning
        # creates the iterator of a resumed run in setup_data, before it has moved past an epoch that
        # the checkpoint ended; the first batch is fetched once the Trainer is in the right epoch.
        if self.current_epoch is not None:
            self.epoch_dataset.set_epoch(self.current_epoch())
        yield from self.source

    def state_dict(self) -> dict[str, Any]:
        return self.source.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source.load_state_dict(state)


class ShardDataModule(pl.LightningDataModule):
    """Train (and optionally validate) from shardio datasets under a Lightning ``Trainer``.

    ``train`` / ``val``: a dataset directory (opened in ``setup()`` as a ``ShardDataset`` with
    ``batch_size``, ``shuffle``, ``seed``, ``drop_last``), or a dataset built by the caller (a
    ``ShardDataset``, a ``shardio.read.mixing.MixedDataset``, a ``shardio.read.subset.SubsetDataset``; build it
    inside ``setup`` under DDP, or pass ``rank``/``world_size``). Batches reach ``training_step`` on the
    device with ``"image"`` float NCHW: ``train_transform(image, epoch=, positions=)`` when given (e.g.
    ``TrainAugment(224)``), else normalised with ``mean``/``std`` (``shardio.to_device``'s defaults).
    ``num_workers``: DataLoader processes for a ``ShardDataset`` (0, reading in the main process, is
    usually fastest: a batch is a slice of a memory map). ``cache_dir`` / ``cache_limit``: the shard
    cache of a ``train`` / ``val`` given as an object-storage URL (``ShardDataset``'s; not passed for a
    local directory).
    """

    def __init__(self, train: str | TrainDataset, batch_size: int = 256, *,
                 val: str | TrainDataset | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = True, num_workers: int = 0,
                 train_transform: BatchTransform | None = None, val_transform: BatchTransform | None = None,
                 cache_dir: str | None = None, cache_limit: int | str | None = None,
                 **normalise: Any) -> None:
        super().__init__()
        self.train_source, self.val_source = train, val
        self.batch_size, self.shuffle, self.seed, self.drop_last = batch_size, shuffle, seed, drop_last
        self.num_workers = num_workers
        self.cache_dir, self.cache_limit = cache_dir, cache_limit
        self.train_transform, self.val_transform, self.normalise = train_transform, val_transform, normalise
        self.train_dataset: TrainDataset | None = None
        self.val_dataset: TrainDataset | None = None
        if val is None:
            # Lightning treats a defined val_dataloader as a validation set ("is_overridden" looks the
            # attribute up on the instance): without one, a model with no validation_step got a warning.
            self.val_dataloader = None  # type: ignore[assignment]

    def setup(self, stage: str) -> None:
        if self.train_dataset is None:
            self.train_dataset = self._open(self.train_source, shuffle=self.shuffle, drop_last=self.drop_last)
        if self.val_source is not None and self.val_dataset is None:
            self.val_dataset = self._open(self.val_source, shuffle=False, drop_last=False)

    def _open(self, source: str | TrainDataset, *, shuffle: bool, drop_last: bool) -> TrainDataset:
        if not isinstance(source, str):
            return source
        local = for_path(source).is_local
        cache = {} if local else {"cache_dir": self.cache_dir, "cache_limit": self.cache_limit}
        return ShardDataset(source, self.batch_size, shuffle=shuffle, seed=self.seed, drop_last=drop_last,
                            **cache)

    def _pinned(self) -> bool:
        trainer = self.trainer
        return trainer is not None and trainer.strategy.root_device.type == "cuda"

    def _loader(self, dataset: TrainDataset) -> PositionedBatches | MixedDataset:
        if isinstance(dataset, ShardDataset):
            # Positions ride along so the transform after the transfer knows each sample's place.
            return PositionedBatches(ShardLoader(dataset, num_workers=self.num_workers,
                                                 pin_memory=self._pinned()))
        return dataset  # a MixedDataset counts itself and adds "__position__"/"__epoch__"

    def train_dataloader(self) -> EpochLoader:
        if self.train_dataset is None:
            self.setup("fit")
        # One loader for the whole fit: Lightning keeps the object unless reload_dataloaders_every_n_epochs.
        return EpochLoader(self._loader(self.train_dataset), self.train_dataset, self._trainer_epoch)

    def val_dataloader(self) -> EpochLoader | list[Any]:
        if self.val_dataset is None:
            return []
        # Wrapped for the same reason as the train loader: no ``dataset`` attribute for Lightning to warn of.
        return EpochLoader(self._loader(self.val_dataset), self.val_dataset)

    def _trainer_epoch(self) -> int:
        return self.trainer.current_epoch if self.trainer is not None else 0

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if not isinstance(batch, dict) or "image" not in batch or batch["image"].dtype != torch.uint8:
            return batch
        training = self.trainer is not None and self.trainer.training
        transform = self.train_transform if training else self.val_transform
        device = batch["image"].device
        if transform is not None:
            return transform_batch(transform, batch, device)
        return to_device(batch, device, **self.normalise)
