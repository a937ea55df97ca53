"""``shardio preview`` on a bucketed dataset: a row per bucket, labelled with its shape, each tile the
stored pixels of a sample of that bucket. The layout is checked on a snapshot stand-in whose shards
have known shapes and pixels (each sample's value is its dataset position)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from bucket_fixtures import BUCKETS, key_bucket, key_index, make_bucketed_dataset
from dataset_fixtures import jpeg_identifying_pixels, self_identifying_pixels
from PIL import Image

from shardio.tools import preview
from shardio.tools.preview import bucket_samples, bucket_sheet, write_preview

GAP = 4


class StubSnapshot:
    """The snapshot surface preview reads: shard counts and buckets, pixels and metadata per shard."""

    is_bucketed = True
    shape = (10, 10, 3)

    def __init__(self) -> None:
        self.buckets = ((8, 12), (12, 8), (10, 10), (6, 16))
        self.shard_buckets = np.array([0, 1, 0, 3, 1, 0], dtype=np.int64)
        self.counts = np.array([5, 4, 3, 0, 6, 2], dtype=np.int64)  # bucket 2 has no shard, 3 no sample
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)])
        self.shards = [SimpleNamespace(path=f"shards/in-{i:05d}.npy") for i in range(len(self.counts))]

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def pixels(self, shard: int) -> np.ndarray:
        h, w = self.buckets[self.shard_buckets[shard]]
        first = int(self.offsets[shard])
        values = np.arange(first, first + self.counts[shard], dtype=np.uint8) * 7 + 1
        return np.broadcast_to(values[:, None, None, None], (self.counts[shard], h, w, 3)).copy()

    def meta(self, shard: int) -> SimpleNamespace:
        first = int(self.offsets[shard])
        return SimpleNamespace(rows=lambda a, b: [(f"k{first + i}", None) for i in range(a, b)])


def test_each_bucket_with_samples_gets_its_own_samples():
    snapshot = StubSnapshot()
    rows = bucket_samples(snapshot, 3, np.random.default_rng(0))
    assert [bucket for bucket, _ in rows] == [0, 1]
    shard_of = np.searchsorted(snapshot.offsets, np.arange(len(snapshot)), side="right") - 1
    for bucket, indices in rows:
        assert len(indices) == 3 == len(set(indices)) and indices == sorted(indices)
        assert all(snapshot.shard_buckets[shard_of[i]] == bucket for i in indices)
    everything = bucket_samples(snapshot, 100, np.random.default_rng(0))
    assert [len(indices) for _, indices in everything] == [10, 10]  # all of a bucket when it has fewer


def test_a_row_per_bucket_labelled_with_its_shape_and_its_tiles_pixels_whole():
    snapshot = StubSnapshot()
    rows = [(0, [0, 9, 19]), (1, [5, 12])]
    sheet, table = bucket_sheet(snapshot, rows)
    assert [(t["number"], t["bucket"], t["shape"], t["key"]) for t in table] == [
        (0, 0, [8, 12], "k0"), (1, 0, [8, 12], "k9"), (2, 0, [8, 12], "k19"),
        (3, 1, [12, 8], "k5"), (4, 1, [12, 8], "k12")]
    label_w = (4 * len("12x8") + 1) + GAP  # the longest label, "12x8" and "8x12" alike
    assert sheet.shape == (GAP + (8 + 7) + GAP + (12 + 7) + GAP, GAP + label_w + 3 * (12 + GAP), 3)
    top = GAP
    for bucket, indices in rows:
        h, w = snapshot.buckets[bucket]
        label = sheet[top : top + 7, GAP : GAP + label_w - GAP]
        assert (label == 255).any() and np.isin(label, (0, 255)).all(), "the shape, white on black"
        left = GAP + label_w
        for index in indices:
            assert (sheet[top : top + h, left : left + w] == (index * 7 + 1) % 256).all()
            left += w + GAP
        top += h + 7 + GAP


def test_write_preview_draws_buckets_and_lists_them(tmp_path, monkeypatch):
    snapshot = StubSnapshot()
    monkeypatch.setattr(preview, "open_dataset", lambda directory: snapshot)
    out = str(tmp_path / "sheet.png")
    result = write_preview("ds", out, n=4, seed=1)
    # 4 tiles over the 2 buckets with samples: 2 each, a row each.
    assert [(b["bucket"], b["shape"], b["samples"], b["tiles"]) for b in result.buckets] == [
        (0, [8, 12], 10, 2), (1, [12, 8], 10, 2)]
    described = json.load(open(out + ".json"))
    assert described["buckets"] == result.buckets and len(described["tiles"]) == 4
    image = np.asarray(Image.open(out).convert("RGB"))
    assert image.shape == result.shape
    again = write_preview("ds", str(tmp_path / "again.png"), n=4, seed=1)
    assert again.table == result.table


# --- on a real bucketed dataset, through the command ----------------------------------------------------------

@pytest.mark.parametrize("encoding", ["raw", "jpeg"])
def test_shardio_preview_of_a_bucketed_dataset_has_a_row_per_bucket(tmp_path, encoding):
    from typer.testing import CliRunner

    from shardio.tools.cli import app

    directory = make_bucketed_dataset(str(tmp_path / "ds"), encoding=encoding)  # buckets (20,12) (16,16) (12,20)
    out = str(tmp_path / "grid.png")
    result = CliRunner().invoke(app, ["preview", directory, "--out", out, "--n", "6", "--seed", "2"])
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "bucket 0: 20x12, 2 of 20 samples shown" in result.stdout
    assert "bucket 2: 12x20, 2 of 13 samples shown" in result.stdout
    described = json.load(open(out + ".json"))
    tiles = described["tiles"]
    assert [t["bucket"] for t in tiles] == [0, 0, 1, 1, 2, 2]
    assert all(key_bucket(t["key"]) == t["bucket"] and t["shape"] == list(BUCKETS[t["bucket"]]) for t in tiles)
    sheet = np.asarray(Image.open(out).convert("RGB"))
    label_w = (4 * len("20x12") + 1) + GAP
    top = GAP
    for bucket, (h, w) in enumerate(BUCKETS):
        left = GAP + label_w
        for tile in tiles[2 * bucket: 2 * bucket + 2]:
            drawn = sheet[top : top + h, left : left + w]
            g = key_index(tile["key"])
            expected = (jpeg_identifying_pixels if encoding == "jpeg" else self_identifying_pixels)(g, h, w)
            if encoding == "jpeg":
                assert np.abs(drawn.astype(int) - expected).max() <= 8, tile
            else:
                assert (drawn == expected).all(), tile
            left += w + GAP
        top += h + 7 + GAP


def test_shardio_bench_reads_a_bucketed_dataset_and_counts_its_bytes(tmp_path):
    from shardio.tools.loader_bench import measure

    directory = make_bucketed_dataset(str(tmp_path / "ds"), samples=(16, 16, 16))  # all shapes 240 or 256 px
    rate = measure(directory, batch_size=8, shuffle=True, seconds=0.05, warmup_batches=1)
    assert rate.batches > 0 and rate.samples > 0
    # bytes per sample between the smallest and largest bucket's, not the budget's for every sample
    per_sample = rate.mb_per_s / rate.samples_per_s * 1e6
    assert min(h * w * 3 for h, w in BUCKETS) * 0.99 <= per_sample <= max(h * w * 3 for h, w in BUCKETS) * 1.01
