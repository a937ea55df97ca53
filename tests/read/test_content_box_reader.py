"""Content boxes from the ``.jsonl`` to the transform: ``ShardMeta.box``, every batch of a ``mode: pad``
dataset carrying ``content_box``, and the loaders handing it to the transform. Datasets are written with
shardio's writer (no Pillow, no Ray): sample ``i`` has ``cls = i`` and a box that is a function of ``i``,
so one comparison catches a box that travelled with the wrong sample."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest
import torch

from shardio import DeviceLoader, ShardDataset, ShardLoader, open_dataset, to_device
from shardio.train.augment import PositionedBatches, transform_batch
from shardio.errors import ShardFormatError
from tests.dataset_fixtures import write_inputs
from tests.legacy_format import legacy_doc

HEIGHT, WIDTH = 8, 12
INPUTS = (13, 9)  # 22 samples in shards of 8: partial shards, and batches of 5 that straddle them


def expected_box(index: int) -> list[int]:
    """Sample ``index``'s box; every 5th sample has none in its line (the whole image)."""
    if index % 5 == 4:
        return [0, 0, WIDTH, HEIGHT]
    return [index % 3, index % 2, WIDTH - index % 4, HEIGHT - index % 3]


def write_dataset(directory: str, mode: str, bad_box: Any = None) -> None:
    def meta_for(index: int, number: int, name: str) -> dict[str, Any]:
        meta: dict[str, Any] = {"key": f"s{index:06d}", "tar": name, "member": f"{index}.jpg",
                                "width": WIDTH, "height": HEIGHT, "cls": index, "txt": None, "json": None}
        if index % 5 != 4:
            meta["box"] = expected_box(index)
        if bad_box is not None and index == 2:
            meta["box"] = bad_box
        return meta

    write_inputs(directory, INPUTS, meta_for, height=HEIGHT, width=WIDTH,
                 config={"height": HEIGHT, "width": WIDTH, "mode": mode},
                 pixels_for=lambda index: np.full((HEIGHT, WIDTH, 3), index, dtype=np.uint8))


@pytest.fixture(scope="module")
def pad_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = str(tmp_path_factory.mktemp("pad"))
    write_dataset(directory, "pad")
    return directory


def assert_boxes_match(batch: dict[str, Any]) -> None:
    box = batch["content_box"]
    assert box.dtype == torch.int32 and box.shape == (len(batch["cls"]), 4)
    assert box.cpu().tolist() == [expected_box(int(i)) for i in batch["cls"].cpu()]


def test_shard_meta_box_parses_the_lines_and_defaults_to_the_whole_image(pad_dir: str) -> None:
    snapshot = open_dataset(pad_dir)
    meta = snapshot.meta(0)
    assert meta.box.dtype == np.int32 and meta.box.shape == (8, 4)
    assert meta.box.tolist() == [expected_box(i) for i in range(8)]


@pytest.mark.parametrize("bad", [[0, 0, WIDTH + 1, HEIGHT], [3, 0, 3, HEIGHT], [-1, 0, 4, 4], [0, 0, 4],
                                 [0, 0, 4.5, 4], "0 0 4 4", [0, 0, True, 4]])
def test_a_bad_box_names_the_file_and_line(tmp_path, bad: Any) -> None:
    write_dataset(str(tmp_path), "pad", bad_box=bad)
    snapshot = open_dataset(str(tmp_path))
    with pytest.raises(ShardFormatError, match=r"\.jsonl: line 3 \(sample 2\): box .*preprocess verify"):
        snapshot.meta(0).box


@pytest.mark.parametrize("workers", [0, 2])
def test_every_batch_of_a_pad_dataset_carries_its_samples_boxes(pad_dir: str, workers: int) -> None:
    ds = ShardDataset(pad_dir, 5, shuffle=True, seed=3, drop_last=False)
    batches = list(ShardLoader(ds, num_workers=workers))
    assert sorted(int(i) for b in batches for i in b["cls"]) == list(range(sum(INPUTS)))
    for batch in batches:
        assert_boxes_match(batch)


def test_a_dataset_of_another_mode_has_no_content_box(tmp_path) -> None:
    write_dataset(str(tmp_path), "center_crop")  # even with boxes in its lines: the manifest decides
    assert all("content_box" not in batch for batch in ShardDataset(str(tmp_path), 5))


class BoxRecorder:
    """A transform that records the boxes it was given (as lists) and returns the images as float NCHW."""

    def __init__(self) -> None:
        self.boxes: list[list[list[int]] | None] = []
        self.devices: list[torch.device] = []

    def __call__(self, image: torch.Tensor, *, epoch: int, positions: torch.Tensor,
                 content_box: torch.Tensor | None = None) -> torch.Tensor:
        self.boxes.append(None if content_box is None else content_box.tolist())
        if content_box is not None:
            self.devices.append(content_box.device)
        return image.permute(0, 3, 1, 2).float()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_device_loader_passes_the_boxes_to_its_transform(pad_dir: str, prefetch: int) -> None:
    recorder = BoxRecorder()
    batches = list(DeviceLoader(ShardDataset(pad_dir, 5, shuffle=True, seed=1), "cpu", prefetch=prefetch,
                                transform=recorder))
    assert len(recorder.boxes) == len(batches) and sum(len(b["cls"]) for b in batches) == sum(INPUTS)
    for batch, boxes in zip(batches, recorder.boxes):
        assert boxes == [expected_box(int(i)) for i in batch["cls"]]


def test_positioned_batches_keep_the_boxes_and_transform_batch_passes_them(pad_dir: str) -> None:
    recorder, seen = BoxRecorder(), 0
    for batch in PositionedBatches(ShardLoader(ShardDataset(pad_dir, 5, shuffle=True, seed=2))):
        seen += len(batch["cls"])
        assert_boxes_match(batch)
        out = transform_batch(recorder, batch, "cpu")
        assert recorder.boxes[-1] == [expected_box(int(i)) for i in batch["cls"]]
        assert out["content_box"].device.type == "cpu"
    assert seen == sum(INPUTS)


def test_to_device_moves_the_boxes(pad_dir: str) -> None:
    batch = next(iter(ShardDataset(pad_dir, 5)))
    moved = to_device(batch, "cpu")
    assert_boxes_match(moved)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_loader_moves_the_boxes_to_the_gpu(pad_dir: str) -> None:
    recorder = BoxRecorder()
    for batch in DeviceLoader(ShardDataset(pad_dir, 5), "cuda", transform=recorder):
        assert batch["content_box"].is_cuda
    assert recorder.devices and all(d.type == "cuda" for d in recorder.devices)


def test_the_jsonl_line_is_what_the_spec_says(pad_dir: str) -> None:
    manifest = legacy_doc(pad_dir)
    first = json.loads(open(os.path.join(pad_dir, manifest["shards"][0]["meta_path"])).readline())
    assert first["box"] == expected_box(0)
