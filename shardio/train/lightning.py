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
- **JPEG datasets on a GPU.** As with ``DeviceLoader``, a JPEG dataset's batches are handed out still
  encoded and decoded on the device by ``shardio.train.device_decode.DeviceDecoder`` (batched nvJPEG, a
  stream barrier before each call) on a prefetch thread with its own CUDA stream, finished before the
  batch reaches the Trainer: the decode's host work never runs on the training loop's thread.
  ``transfer_batch_to_device`` then finds the images on the device already; ``on_after_batch_transfer``
  records their use on the step's stream before the transform. ``decode_on_device`` chooses (default: on
  when the Trainer's device is CUDA and torchcodec or torchvision is installed).
- **Bucketed datasets** (``mode: bucket``). Each batch is one bucket's shape (``image`` [B, h, w, 3] and
  its ``"bucket"`` id), and reaches ``training_step`` in that shape: ``TrainAugment()`` (no size) crops
  and flips it back to its own shape, ``TrainAugment(224)`` resizes every batch to one shape. The model
  must take any shape (e.g. convolutions, then global pooling); under DDP every rank gets the same bucket
  at each step.
- **DDP.** The datasets are built in ``setup()``, after the strategy has initialised
  ``torch.distributed``: each rank takes its rank and world size from there, every rank yields the same
  number of batches, and Lightning adds no sampler to a loader that is not a ``DataLoader``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Union

import lightning.pytorch as pl
import torch

from shardio.store.root import open_root
from shardio.read.dataset import ShardDataset
from shardio.read.jpeg_pixels import EncodedImages
from shardio.read.yuv_pixels import YuvPlanes
from shardio.train.augment import BatchTransform, PositionedBatches, transform_batch
from shardio.train import device_decode
from shardio.train.loader import ShardLoader, to_device
from shardio.train.yuv_device import yuv420_rgb
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
    local directory). ``decode_on_device`` / ``device_decoder``: where a JPEG ``ShardDataset``'s batches
    are decoded, as ``DeviceLoader``'s (a ``MixedDataset`` decodes on the CPU); for a yuv420 ``ShardDataset``,
    ``decode_on_device`` (default: on CUDA) moves each batch's planes and converts them on the device.
    """

    def __init__(self, train: str | TrainDataset, batch_size: int = 256, *,
                 val: str | TrainDataset | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = True, num_workers: int = 0,
                 train_transform: BatchTransform | None = None, val_transform: BatchTransform | None = None,
                 cache_dir: str | None = None, cache_limit: int | str | None = None,
                 decode_on_device: bool | None = None,
                 device_decoder: Callable[[EncodedImages], torch.Tensor] | None = None,
                 **normalise: Any) -> None:
        super().__init__()
        if device_decoder is not None and decode_on_device is False:
            raise ValueError("device_decoder= decodes on the device; it contradicts decode_on_device=False")
        self.decode_on_device, self.device_decoder = decode_on_device, device_decoder
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
        root = open_root(source)  # opened once: the dataset is given the root
        cache = {} if root.is_local else {"cache_dir": self.cache_dir, "cache_limit": self.cache_limit}
        return ShardDataset(root, self.batch_size, shuffle=shuffle, seed=self.seed, drop_last=drop_last,
                            **cache)

    def _device(self) -> torch.device:
        trainer = self.trainer
        return trainer.strategy.root_device if trainer is not None else torch.device("cpu")

    def _pinned(self) -> bool:
        return self._device().type == "cuda"

    def _decoder(self, dataset: ShardDataset) -> Callable[[EncodedImages], torch.Tensor] | None:
        """The device decoder of ``dataset``'s batches, or None to decode on the CPU."""
        device = self._device()
        on = self.decode_on_device
        if on is None:
            on = self.device_decoder is not None or (dataset.is_jpeg and device.type == "cuda"
                                                     and device_decode.available())
        if not on or dataset.is_yuv420:
            return None
        if not dataset.is_jpeg:
            raise ValueError(f"{dataset.path}: decode_on_device=True is for JPEG datasets (encoding: jpeg); "
                             f"this one is {dataset.snapshot.encoding}")
        return self.device_decoder or device_decode.DeviceDecoder(device)

    def _planes_on_device(self, dataset: ShardDataset) -> bool:
        """Whether a yuv420 dataset's planes are moved and converted on the device (default: on CUDA)."""
        if not dataset.is_yuv420:
            return False
        if self.device_decoder is not None:
            raise ValueError(f"{dataset.path}: device_decoder= decodes JPEG batches; this dataset is yuv420 (its "
                             "planes are converted on the device by shardio.train.yuv_device)")
        if self.decode_on_device is None:
            return self._device().type == "cuda"
        return self.decode_on_device

    def _loader(self, dataset: TrainDataset) -> PositionedBatches | MixedDataset:
        if not isinstance(dataset, ShardDataset):
            return dataset  # a MixedDataset counts itself and adds "__position__"/"__epoch__"
        # Positions ride along so the transform after the transfer knows each sample's place.
        loader = ShardLoader(dataset, num_workers=self.num_workers, pin_memory=self._pinned())
        if self._planes_on_device(dataset):
            return PositionedBatches(loader, prepare=self._converter(), encoded=True)
        decoder = self._decoder(dataset)
        if decoder is None:
            return PositionedBatches(loader)
        device = self._device()

        def decode(batch: dict[str, Any]) -> dict[str, Any]:  # on the prefetch thread
            images = batch["image"]
            if not isinstance(images, EncodedImages):
                return batch
            return {**batch, "image": device_decode.decode_finished(decoder, images, device)}

        return PositionedBatches(loader, prepare=decode, encoded=True)

    def _converter(self) -> Callable[[dict[str, Any]], dict[str, Any]]:
        """On the prefetch thread: a yuv420 batch's planes (half a raw batch's bytes) moved to the device and
        converted to uint8 RGB there (``shardio.train.yuv_device``), the bytes the CPU conversion gives; the
        normalisation or transform follows on the device in ``on_after_batch_transfer``."""
        device = self._device()

        def convert(batch: dict[str, Any]) -> dict[str, Any]:
            planes = batch["image"]
            if not isinstance(planes, YuvPlanes):
                return batch
            image = yuv420_rgb(planes.planes.to(device, non_blocking=True), planes.height, planes.width)
            if device.type == "cuda":  # the pinned planes may be reused once the batch is handed on
                torch.cuda.current_stream(device).synchronize()
            return {**batch, "image": image}

        return convert

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
        if device.type == "cuda":  # decoded on the prefetch thread's stream (or copied): used on this one
            batch["image"].record_stream(torch.cuda.current_stream(device))
        if transform is not None:
            return transform_batch(transform, batch, device)
        return to_device(batch, device, **self.normalise)
