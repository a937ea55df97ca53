"""Stable Diffusion XL's size and crop conditioning end to end through the job (Ray): every batch's and every
``ds.sample(i)``'s ``original_size`` is the source's upright (height, width) and ``crop_top_left`` the (top,
left) its centre crop cut, in the upright source's pixels, computed here from the source sizes alone
(``centre_crop_top_left``); raw and JPEG shards, ``center_crop`` and ``bucket``. Sources are EXIF-rotated
JPEGs (drafted at 1/2 to 1/8) and PNGs of awkward aspect ratios, flat colours that say their sample."""

from __future__ import annotations

import io
import json
import os

import pytest
from PIL import Image
from typer.testing import CliRunner

from preprocess.cli import app
from shardio import ShardDataset
from tests.tar_factory import Member, TarFactory, centre_crop_top_left, decode_index, index_image, jpeg_bytes

pytestmark = pytest.mark.ray
runner = CliRunner()
SIZE = 32
# (stored width, height, EXIF orientation, format): 5-8 turn the picture upright by 90 degrees; 1283x1000
# drafts at 1/8, 129x64 cuts 16.5 or 48.5 pixels (halves round up), 64x64 and 32x32 cut nothing.
SOURCES = [(400, 100, 1, "JPEG"), (100, 400, 6, "JPEG"), (333, 111, 3, "JPEG"), (97, 300, 8, "JPEG"),
           (129, 64, 2, "JPEG"), (640, 241, 5, "JPEG"), (250, 60, 7, "JPEG"), (64, 64, 4, "JPEG"),
           (1283, 1000, 6, "JPEG"), (300, 200, 1, "PNG"), (90, 200, 8, "PNG"), (32, 32, 1, "JPEG")]
SAMPLES = 30


def exif(orientation: int) -> bytes:
    tags = Image.Exif()
    tags[0x0112] = orientation
    return tags.tobytes()


def source_bytes(index: int) -> bytes:
    width, height, orientation, kind = SOURCES[index % len(SOURCES)]
    if kind == "JPEG":
        return jpeg_bytes(index_image(index, width, height), exif=exif(orientation))
    buffer = io.BytesIO()
    index_image(index, width, height).save(buffer, "PNG", exif=exif(orientation))
    return buffer.getvalue()


def upright(index: int) -> tuple[int, int]:
    """The source's upright (width, height), from the table alone."""
    width, height, orientation, _ = SOURCES[index % len(SOURCES)]
    return (height, width) if orientation >= 5 else (width, height)


@pytest.fixture(scope="module", params=[("raw", "center_crop"), ("jpeg", "center_crop"), ("raw", "bucket"),
                                        ("jpeg", "bucket")], ids=lambda p: "-".join(p))
def conditioned(request, ray_cluster, tmp_path_factory: pytest.TempPathFactory) -> str:
    encoding, mode = request.param
    root = tmp_path_factory.mktemp(f"sdxl-{encoding}-{mode}")
    members = []
    for index in range(SAMPLES):
        suffix = "jpg" if SOURCES[index % len(SOURCES)][3] == "JPEG" else "png"
        members += [Member(f"{index:06d}.{suffix}", source_bytes(index)),
                    Member(f"{index:06d}.cls", b"%d" % index)]
    tars = TarFactory(str(root / "tars"))
    tars.write("a.tar", members[:34])
    tars.write("b.tar", members[34:])
    out = str(root / "out")
    flags = ["--bucket-step", "8"] if mode == "bucket" else []
    result = runner.invoke(app, ["run", f"{tars.directory}/*.tar", "--output", out, "--size", str(SIZE),
                                 "--mode", mode, "--encoding", encoding, "--samples-per-shard", "4", *flags,
                                 "--ray-address", ray_cluster, "-q"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out


def test_every_batch_carries_each_samples_source_size_and_crop(conditioned: str) -> None:
    ds = ShardDataset(conditioned, 5, shuffle=True, seed=3)
    seen = []
    for batch in ds:
        height, width = batch["image"].shape[1:3]  # the batch's bucket, or the one shape
        for row, key in enumerate(batch["__key__"]):
            index = int(key)
            assert decode_index(batch["image"][row].numpy()) == index == int(batch["cls"][row])
            source_w, source_h = upright(index)
            assert batch["original_size"][row].tolist() == [source_h, source_w], key
            expected = centre_crop_top_left(upright(index), (width, height))
            assert batch["crop_top_left"][row].tolist() == list(expected), key
            seen.append(index)
    assert sorted(seen) == list(range(SAMPLES))


def test_a_sample_and_its_line_say_the_same(conditioned: str) -> None:
    ds = ShardDataset(conditioned, 5)
    for i in range(ds.num_samples):
        sample = ds.sample(i)
        index = int(sample["__key__"])
        height, width = sample["image"].shape[:2]
        assert sample["original_size"].tolist() == list(upright(index)[::-1])
        assert sample["crop_top_left"].tolist() == list(centre_crop_top_left(upright(index), (width, height)))
    # The line as the spec writes it: ``crop`` beside ``width``/``height``, on every line of a cropping mode.
    shard = ds.snapshot.shards[0]
    with open(os.path.join(conditioned, shard.meta_path), encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    assert all(isinstance(line["crop"], list) and len(line["crop"]) == 2 for line in lines)
