"""``mode: pad`` end to end: the job stores each sample's content box, and random crops of the shards it
wrote never show the letterbox. Each image is one flat non-black colour that says which sample it is
(``index_image``), the fill is black, and the aspect ratios are awkward (very wide, very tall, exact fit,
a 1-pixel-high result, EXIF-rotated): a crop that reaches the fill shows a black pixel."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from preprocess.cli import app
from shardio import DeviceLoader, ShardDataset, ShardLoader, TrainAugment
from shardio.train.augment import PositionedBatches, transform_batch
from tests.tar_factory import Member, TarFactory, decode_index, index_image, jpeg_bytes
from tests.legacy_format import legacy_doc

pytestmark = pytest.mark.ray
runner = CliRunner()
SIZE = 32
# (width, height, EXIF orientation): the stored size; orientations 5-8 turn it upright by 90 degrees.
# 2000x40 into 32² is 32x1: a 1-pixel-high picture; 64x64 and 128x127 fit (almost) exactly.
SHAPES = [(400, 100, 1), (100, 400, 1), (64, 64, 1), (2000, 40, 1), (300, 97, 6), (97, 300, 8),
          (250, 60, 3), (60, 250, 5), (333, 111, 2), (111, 333, 7), (128, 127, 1)]
SAMPLES = 33
# The augmentation's outputs are float 0-255 (identity normalisation): the darkest picture pixel is 8
# (index_image's colours are 16k + 8) give or take JPEG's few levels, far from the fill's 0.
IDENTITY = {"mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)}


def exif(orientation: int) -> bytes:
    tags = Image.Exif()
    tags[0x0112] = orientation
    return tags.tobytes()


@pytest.fixture(scope="module")
def pad_dataset(ray_cluster, tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("pad_job")
    members = []
    for index in range(SAMPLES):
        width, height, orientation = SHAPES[index % len(SHAPES)]
        data = jpeg_bytes(index_image(index, width, height), exif=exif(orientation))
        members += [Member(f"{index:06d}.jpg", data), Member(f"{index:06d}.cls", str(index).encode())]
    tars = TarFactory(str(root / "tars"))
    tars.write("a.tar", members[: 2 * 20])
    tars.write("b.tar", members[2 * 20:])
    out = str(root / "out")
    result = runner.invoke(app, ["run", f"{tars.directory}/*.tar", "--output", out, "--size", str(SIZE),
                                 "--mode", "pad", "--samples-per-shard", "8", "--ray-address", ray_cluster,
                                 "-q"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out


def test_each_line_has_the_box_where_the_picture_is(pad_dataset: str) -> None:
    manifest = legacy_doc(pad_dataset)
    assert manifest["config"]["mode"] == "pad"
    seen = []
    for entry in manifest["shards"]:
        pixels = np.load(os.path.join(pad_dataset, entry["path"]))
        rows = [json.loads(line) for line in open(os.path.join(pad_dataset, entry["meta_path"]))]
        for image, row in zip(pixels, rows):
            x0, y0, x1, y1 = row["box"]
            inside = np.zeros((SIZE, SIZE), dtype=bool)
            inside[y0:y1, x0:x1] = True
            black = (image == 0).all(axis=2)
            assert black[~inside].all() and not black[inside].any(), f"{row['key']}: box {row['box']}"
            assert decode_index(image[y0:y1, x0:x1]) == row["cls"]
            seen.append(row["cls"])
    assert seen == list(range(SAMPLES))


def _assert_no_fill(out: torch.Tensor, what: str) -> None:
    darkest = out.amax(dim=1)  # brightest channel per output pixel: 0 only where all three are the fill
    assert float(darkest.min()) > 4.0, f"{what}: a crop shows the letterbox"


def test_device_loader_crops_never_show_the_letterbox(pad_dataset: str) -> None:
    ds = ShardDataset(pad_dataset, 8, shuffle=True, seed=0, drop_last=False)
    augment = TrainAugment(16, scale=(0.08, 1.0), seed=0, **IDENTITY)
    count = 0
    for epoch in range(3):
        ds.set_epoch(epoch)
        for batch in DeviceLoader(ds, "cpu", transform=augment):
            _assert_no_fill(batch["image"], f"epoch {epoch}")
            count += len(batch["image"])
    assert count == 3 * SAMPLES


def test_without_the_boxes_the_same_crops_would_show_it(pad_dataset: str) -> None:
    """The check above can fail: the same augmentation, boxes dropped, reaches the fill."""
    augment = TrainAugment(16, scale=(0.08, 1.0), seed=0, **IDENTITY)
    shown = 0
    for batch in ShardDataset(pad_dataset, 8, shuffle=True, seed=0, drop_last=False):
        positions = torch.arange(shown, shown + len(batch["image"]))
        out = augment(batch["image"], epoch=0, positions=positions)
        shown += len(batch["image"])
        if float(out.amax(dim=1).min()) <= 4.0:
            return
    pytest.fail("no crop reached the letterbox even without boxes: the fill check proves nothing")


def test_positioned_batches_with_transform_batch_never_show_the_letterbox(pad_dataset: str) -> None:
    augment = TrainAugment(16, seed=1, **IDENTITY)
    dataset = ShardDataset(pad_dataset, 8, shuffle=True, seed=1, drop_last=False)
    loader = PositionedBatches(ShardLoader(dataset))
    for batch in loader:
        _assert_no_fill(transform_batch(augment, batch, "cpu")["image"], "PositionedBatches")


def test_pad_crops_nothing_batches_say_so_and_carry_the_upright_source_size(pad_dataset: str) -> None:
    # SDXL's conditioning: the whole picture is kept, so the crop is (0, 0), and no line stores one.
    seen = 0
    for batch in ShardDataset(pad_dataset, 8, shuffle=True):
        for index, size, crop in zip(batch["cls"].tolist(), batch["original_size"].tolist(),
                                     batch["crop_top_left"].tolist()):
            width, height, orientation = SHAPES[index % len(SHAPES)]
            assert size == ([width, height] if orientation >= 5 else [height, width]) and crop == [0, 0]
            seen += 1
    assert seen == SAMPLES
    for entry in legacy_doc(pad_dataset)["shards"]:
        with open(os.path.join(pad_dataset, entry["meta_path"]), encoding="utf-8") as f:
            assert not any("crop" in json.loads(line) for line in f)
