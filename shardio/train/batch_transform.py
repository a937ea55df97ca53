"""Handing a batch to a transform on the device: the transform's interface (``BatchTransform``), each sample's
epoch position (from the batch, or from the dataset and the batch's number) and ``transform_batch``. Shared by
``DeviceLoader(transform=...)`` and ``shardio.train.augment``'s transforms, so neither imports the other."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from shardio.read.dataset import ShardDataset

__all__ = ["DEVICE_FIELDS", "BatchTransform", "batch_positions", "transform_batch"]

# The batch's tensors besides ``image`` that go to the device as they are: the label, SDXL's size and crop
# conditioning (``shardio.format``, "Metadata"), a ``mode: pad`` batch's picture boxes.
DEVICE_FIELDS = ("cls", "original_size", "crop_top_left", "content_box")


class BatchTransform(Protocol):
    """What ``DeviceLoader(transform=...)`` calls with each batch's images once they are on the device."""

    def __call__(self, image: torch.Tensor, *, epoch: int, positions: torch.Tensor,
                 content_box: torch.Tensor | None = None) -> torch.Tensor: ...


def _dataset_of(source: Any) -> ShardDataset | None:
    if isinstance(source, ShardDataset):
        return source
    dataset = getattr(source, "dataset", None)
    return dataset if isinstance(dataset, ShardDataset) else None


def batch_positions(dataset: ShardDataset, batch_number: int) -> torch.Tensor:
    """Epoch positions (int64 [B]) of this rank's ``batch_number``-th batch of the epoch (1-based: the
    count ``ShardDataset.batches_seen`` has right after handing it out; see ``shardio.read.resume``)."""
    positions = dataset.batch_positions(batch_number)
    return torch.arange(positions.start, positions.stop, dtype=torch.int64)


def transform_batch(transform: BatchTransform, batch: dict[str, Any], device: torch.device | str,
                    source: Any = None, batch_number: int | None = None) -> dict[str, Any]:
    """``batch`` on ``device`` with ``image`` replaced by ``transform(image, epoch, positions)``.

    Positions and epoch come from the batch's ``"__position__"``/``"__epoch__"`` (``PositionedBatches``)
    or else from ``source`` (a ``ShardDataset`` or a loader of one) and the 1-based ``batch_number``;
    ``"content_box"`` [B, 4] is passed on when the batch has it."""
    device = torch.device(device)
    out = dict(batch)
    for name in ("image", *DEVICE_FIELDS):
        if isinstance(batch.get(name), torch.Tensor):
            out[name] = batch[name].to(device, non_blocking=True)
    if "__position__" in batch:
        positions, epoch = batch["__position__"], int(batch.get("__epoch__", 0))
    else:
        dataset = _dataset_of(source)
        if dataset is None or batch_number is None:
            raise ValueError("the transform needs each sample's epoch position: iterate a ShardDataset or a "
                             "ShardLoader, or wrap the loader in shardio.train.augment.PositionedBatches")
        positions, epoch = batch_positions(dataset, batch_number), dataset.epoch
    if len(positions) != len(batch["image"]):
        raise ValueError(f"{len(positions)} positions for a batch of {len(batch['image'])} images: the "
                         "loader and the dataset disagree on the batch count (resume both from one "
                         "state_dict)")
    out["image"] = transform(out["image"], epoch=epoch, positions=torch.as_tensor(positions).to(device),
                             content_box=out.get("content_box"))
    return out
