"""to_device / DeviceLoader: normalised float NCHW on the device (CPU here; CUDA when present)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dataset_fixtures import indices, make_dataset

from shardio import DeviceLoader, ShardDataset, ShardLoader, to_device

DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.cuda)] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = str(tmp_path_factory.mktemp("device"))
    make_dataset(directory)
    return directory


@pytest.mark.parametrize("device", DEVICES)
def test_to_device_normalises_to_nchw(dataset_dir: str, device: str) -> None:
    batch = next(iter(ShardDataset(dataset_dir, 10)))
    out = to_device(batch, device, mean=(10.0, 20.0, 30.0), std=(2.0, 4.0, 8.0))
    image = out["image"]
    assert image.shape == (10, 3, 8, 8) and image.dtype == torch.float32 and image.device.type == device
    assert image.is_contiguous(memory_format=torch.channels_last)
    nchw = batch["image"].permute(0, 3, 1, 2).float()
    mean = torch.tensor([10.0, 20.0, 30.0]).view(1, 3, 1, 1)
    std = torch.tensor([2.0, 4.0, 8.0]).view(1, 3, 1, 1)
    expected = (nchw - mean) / std
    torch.testing.assert_close(image.cpu(), expected)
    assert out["cls"].device.type == device and out["__key__"] == batch["__key__"]


@pytest.mark.parametrize("device", DEVICES)
def test_device_loader_yields_every_batch_in_order(dataset_dir: str, device: str) -> None:
    ds = ShardDataset(dataset_dir, 10, shuffle=True)
    expected = [indices(b).tolist() for b in ds]
    ds.set_epoch(0)  # each iteration is the next epoch: this one repeats epoch 0
    loader = DeviceLoader(ShardLoader(ds, pin_memory=device == "cuda"), device)
    got = [b["cls"].cpu().tolist() for b in loader]
    assert got == expected and len(loader) == len(expected)
    assert loader.state_dict()["batches_seen"] == len(expected)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_device_loader_state_after_early_stop(dataset_dir: str, prefetch: int) -> None:
    """Prefetched batches are not counted: resuming from the state continues after the last one yielded."""
    expected = [indices(b).tolist() for b in ShardDataset(dataset_dir, 10, shuffle=True)]
    for wrap in (ShardLoader, lambda ds: ds):
        source = wrap(ShardDataset(dataset_dir, 10, shuffle=True))
        loader = DeviceLoader(source, "cpu", prefetch=prefetch)
        head = []
        for batch in loader:
            head.append(batch["cls"].tolist())
            if len(head) == 3:
                break
        state = loader.state_dict()
        assert state["batches_seen"] == 3
        again = ShardDataset(dataset_dir, 10, shuffle=True)
        resumed = DeviceLoader(ShardLoader(again), "cpu", prefetch=prefetch)
        resumed.load_state_dict(state)
        assert head + [b["cls"].tolist() for b in resumed] == expected


def test_device_loader_raises_the_loaders_error(dataset_dir: str) -> None:
    class Broken:
        def __iter__(self):
            yield next(iter(ShardDataset(dataset_dir, 10)))
            raise RuntimeError("disk on fire")

    batches = iter(DeviceLoader(Broken(), "cpu"))
    next(batches)
    with pytest.raises(RuntimeError, match="disk on fire"):
        next(batches)


def test_pin_memory_needs_cuda_or_pins(dataset_dir: str) -> None:
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            ShardDataset(dataset_dir, 10, pin_memory=True)
        return
    for shuffle in (False, True):
        ds = ShardDataset(dataset_dir, 10, shuffle=shuffle, pin_memory=True)
        batches = list(ds)
        assert all(b["image"].is_pinned() for b in batches)
        assert (np.concatenate([indices(b) for b in batches]) == ds.sample_order(0)).all()
        pinned = batches[0]["image"]
        assert pinned.pin_memory().data_ptr() == pinned.data_ptr()  # DataLoader's pinning copies nothing


def _identity_transform(image: torch.Tensor, *, epoch: int, positions: torch.Tensor,
                        content_box: torch.Tensor | None = None) -> torch.Tensor:
    return image.permute(0, 3, 1, 2).float()


@pytest.mark.parametrize("transform", [None, _identity_transform])
def test_the_sources_size_and_crop_go_to_the_device_untouched(dataset_dir: str, transform) -> None:
    # The "meta" device shows where a tensor went without a GPU; the values are checked on the CPU.
    on_host = list(ShardDataset(dataset_dir, 10, shuffle=True))
    for device in ("meta", "cpu"):
        moved = list(DeviceLoader(ShardDataset(dataset_dir, 10, shuffle=True), device, transform=transform))
        assert len(moved) == len(on_host)
        for batch, host in zip(moved, on_host):
            for name in ("original_size", "crop_top_left"):
                assert batch[name].device.type == device and batch[name].dtype == torch.int64
                assert batch[name].shape == (len(host["__key__"]), 2)
                if device == "cpu":
                    assert torch.equal(batch[name], host[name])
