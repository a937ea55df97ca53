"""``shardio info | preview | bench`` in-process (typer's CliRunner) on generated datasets: exit codes and
what they print."""

from __future__ import annotations

import io
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from shardio.format.manifests import load_manifest
from shardio.tools import preview
from shardio.tools.cli import app
from shardio.tools.preview import bucket_samples, bucket_sheet, encode_png, write_preview
from tests.bucket_fixtures import BUCKETS, key_bucket, key_index, make_bucketed_dataset
from tests.dataset_fixtures import jpeg_identifying_pixels, make_dataset, self_identifying_pixels
from tests.object_stores import unusable_credentials


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args), prog_name="shardio")
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def dataset(tmp_path) -> str:
    directory = str(tmp_path / "ds")
    make_dataset(directory, height=16, width=16)  # 117 samples, 15 shards
    return directory


def write_report(directory: str, run_id: str, failures: list[dict[str, str]], processed: list[str]) -> None:
    os.makedirs(os.path.join(directory, "reports"), exist_ok=True)
    report = {"run_id": run_id, "started": run_id, "samples_written": 117, "samples_failed": len(failures),
              "failures": failures, "inputs_processed": processed, "inputs_skipped": [], "inputs_failed": [],
              "elapsed_s": 1.5, "images_per_s": 78.0, "exit_code": 0, "versions": {"shardio": "test"}}
    with open(os.path.join(directory, "reports", f"{run_id}.json"), "w") as f:
        json.dump(report, f)


def test_info_counts_failures_of_current_inputs_from_their_last_run(dataset):
    def bad(key: str, code: str, why: str) -> dict[str, str]:
        return {"input": "input-0.tar", "key": key, "code": code, "reason": f"{key}.jpg: {why}"}

    write_report(dataset, "2024-01-01", [bad("a", "truncated", "cannot decode: OSError: truncated (9 bytes)")],
                 ["input-0.tar"])
    # The second run reprocessed input-0: its failures replace the first run's, they do not add up. They
    # are counted by code: the second one's reason is worded otherwise, its category is the same.
    write_report(dataset, "2024-01-02", [bad("b", "empty_member", "empty image member (0 bytes)"),
                                         bad("c", "empty_member", "zero bytes")], ["input-0.tar"])
    code, out, _ = run("info", dataset)
    assert code == 0
    assert "117  (16x16x3 NHWC uint8, 15 shards from 3 inputs" in out
    assert "2 x empty image member" in out and "truncated" not in out
    assert "run history (2 runs)" in out and "2024-01-02" in out
    code, out, _ = run("info", dataset, "--json")
    info = json.loads(out)
    assert code == 0 and info["samples"] == 117 and info["shape"] == [16, 16, 3] and info["shards"] == 15
    assert info["pixel_bytes"] == 117 * 16 * 16 * 3 + 15 * 128
    assert info["failures_by_reason"] == {"empty image member (0 bytes)": 2}
    assert [r["run_id"] for r in info["runs"]] == ["2024-01-01", "2024-01-02"]


def test_info_shows_a_report_written_before_failure_codes(dataset):
    # Reports written before codes existed hold {input, key, reason}: counted as unknown, never a crash.
    old = [{"input": "input-0.tar", "key": k, "reason": f"{k}.jpg: pixel bomb: 9 > max_image_pixels 8"}
           for k in ("a", "b")]
    write_report(dataset, "2023-12-31", old + [{"input": "input-1.tar", "key": "c", "code": "too_small",
                                                "reason": "c.jpg: image too small (4x4)"}],
                 ["input-0.tar", "input-1.tar"])
    code, out, _ = run("info", dataset)
    assert code == 0
    assert "     2 x unknown (a report from before failure codes: see its reasons)" in out
    assert "     1 x image too small" in out
    code, out, _ = run("info", dataset, "--json")
    assert json.loads(out)["failures_by_reason"] == {
        "unknown (a report from before failure codes: see its reasons)": 2, "image too small": 1}


def test_info_on_a_missing_or_broken_dataset_exits_1_and_says_why(tmp_path, dataset):
    code, _, err = run("info", str(tmp_path / "nope"))
    assert code == 1 and "no such dataset directory" in err
    first_shard = sorted(os.listdir(os.path.join(dataset, "shards")))[0]
    with open(os.path.join(dataset, "shards", first_shard), "r+b") as f:
        f.truncate(100)
    code, _, err = run("info", dataset)
    assert code == 1 and "HINT" in err


def test_preview_writes_a_png_of_the_stored_pixels_and_a_key_table(tmp_path, dataset):
    out = str(tmp_path / "sheet" / "grid.png")
    code, stdout, _ = run("preview", dataset, "--out", out, "--n", "9", "--seed", "3")
    assert code == 0 and "wrote" in stdout
    table = json.load(open(out + ".json"))["tiles"]
    assert len(table) == 9 and len({t["index"] for t in table}) == 9
    assert all(t["key"] == f"s{t['index']:06d}" and t["caption"] == f"caption {t['index']}" for t in table)
    assert f"s{table[0]['index']:06d}" in stdout
    sheet = np.asarray(Image.open(out).convert("RGB"))
    assert sheet.shape == (3 * (16 + 7 + 4) + 4, 3 * (16 + 4) + 4, 3)  # each tile has a 7-px strip below
    for tile in table:
        row, col = divmod(tile["number"], 3)
        top, left = 4 + row * 27, 4 + col * 20
        # Every pixel of the tile is the sample's: the number never covers a corner of the image.
        assert (sheet[top : top + 16, left : left + 16] == self_identifying_pixels(tile["index"], 16, 16)).all()
        strip = sheet[top + 16 : top + 23, left : left + 16]
        assert (strip == 255).any() and np.isin(strip, (0, 255)).all(), tile  # its number, white on black
    # Same seed, same samples; another seed, others.
    run("preview", dataset, "--out", str(tmp_path / "again.png"), "--n", "9", "--seed", "3")
    assert json.load(open(str(tmp_path / "again.png.json")))["tiles"] == table


def test_preview_writes_png_bytes_under_a_png_name_and_refuses_another_suffix(tmp_path, dataset):
    """The sheet is PNG (shardio's own encoder): a name whose suffix says another format (or none) would hold
    PNG bytes an image viewer or a pipeline misreads, so it is refused before anything is written."""
    out = tmp_path / "Sheet.PNG"
    code, _, err = run("preview", dataset, "--out", str(out), "--n", "4")
    assert code == 0, err
    assert out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    for name in ("grid.jpg", "grid.jpeg", "grid.webp", "grid"):
        refused = tmp_path / "refused" / name
        code, _, err = run("preview", dataset, "--out", str(refused), "--n", "4")
        said = " ".join(err.split())
        assert code == 2, err
        assert str(refused) in said and ".png" in said, said
        assert not (tmp_path / "refused").exists()


def test_a_scaled_preview_keeps_each_tiles_pixels_whole(tmp_path, dataset):
    out = str(tmp_path / "small.png")
    code, _, err = run("preview", dataset, "--out", out, "--n", "4", "--tile", "8")
    assert code == 0, err
    table = json.load(open(out + ".json"))["tiles"]
    sheet = np.asarray(Image.open(out).convert("RGB"))
    assert sheet.shape == (2 * (8 + 7 + 4) + 4, 2 * (8 + 4) + 4, 3)
    for tile in table:  # nearest-neighbour: every other row and column of the 16x16 sample
        row, col = divmod(tile["number"], 2)
        top, left = 4 + row * 19, 4 + col * 12
        source = self_identifying_pixels(tile["index"], 16, 16)[::2, ::2]
        assert (sheet[top : top + 8, left : left + 8] == source).all(), tile


def test_preview_usage_errors_exit_2(tmp_path, dataset):
    code, _, err = run("preview", dataset, "--out", str(tmp_path / "x.png"), "--n", "0")
    assert code == 2 and "--n" in err
    code, _, err = run("preview", dataset)
    assert code == 2 and "--out" in err


def test_png_encoder_round_trips_through_pil():
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (37, 53, 3), dtype=np.uint8)
    decoded = np.asarray(Image.open(io.BytesIO(encode_png(image))))
    assert (decoded == image).all()


def test_bench_reports_rates_and_whether_a_consumer_waits(dataset):
    code, out, _ = run("bench", dataset, "--batch-size", "16", "--seconds", "0.1", "--repeats", "2",
                       "--workers", "0", "--target-rate", "1e9", "--json")
    assert code == 0
    report = json.loads(out)
    (rate,) = report["rates"]
    assert rate["num_workers"] == 0 and rate["samples"] > 0 and rate["samples_per_s"] > 0
    assert report["would_wait"] is True  # no loader makes a billion samples/s
    # Only one thread was measured: it is the advice, and the note says how many workers the target needs.
    assert report["suggested"]["batch_size"] == 16 and report["suggested"]["num_workers"] == 0
    assert "workers would be needed" in report["suggested"]["note"]
    code, out, _ = run("bench", dataset, "--batch-size", "16", "--seconds", "0.1", "--repeats", "2",
                       "--workers", "0", "--target-rate", "10")
    assert code == 0 and "samples/s" in out and "suggested: DeviceLoader(ShardDataset(" in out


def test_bench_usage_errors(dataset):
    assert run("bench", dataset, "--target-rate", "-5")[0] == 2
    assert run("bench", dataset, "--workers", "two")[0] == 2


def test_an_unsupported_url_scheme_is_a_usage_error_as_in_preprocess():
    code, _, err = run("info", "hdfs://namenode/ds")
    assert code == 2, err
    assert "hdfs://namenode/ds" in err and "not supported" in err


def test_the_shardio_cli_needs_neither_pillow_nor_ray_nor_preprocess():
    import subprocess
    import sys

    code = ("import sys, shardio.tools.cli, shardio.tools.info, shardio.tools.preview, shardio.tools.loader_bench\n"
            "bad = [m for m in ('PIL', 'ray', 'preprocess', 'obstore', 'xxhash') if m in sys.modules]\n"
            "assert not bad, bad\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_info_counts_the_bytes_on_disk_without_walking_the_shards(tmp_path):
    from shardio.tools.info import dataset_info
    from tests.dataset_fixtures import retire_input

    out = str(tmp_path / "ds")
    make_dataset(out)
    retire_input(out, "input-1.tar")  # its files stay, retired, for the readers of generation 1

    def walked() -> int:
        return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(out) for name in names)

    assert dataset_info(out)["directory_bytes"] == walked()


@pytest.mark.parametrize("cloud", ["gcs", "azure", "s3"])
def test_unusable_cloud_credentials_exit_2_naming_the_variable_and_the_file(tmp_path, monkeypatch, cloud):
    url, says = unusable_credentials(cloud, tmp_path, monkeypatch)
    for command in (["info", url], ["preview", url, "--out", str(tmp_path / "p.png")]):
        code, stdout, stderr = run(*command)
        assert code == 2, (command, stdout, stderr)
        assert says in stderr and "HINT:" in stderr and "Traceback" not in stdout + stderr


# --- a bucketed dataset: preview draws a row per bucket, labelled with its shape, each tile the stored pixels of
# a sample of that bucket (the layout checked on a snapshot stand-in whose shards have known shapes and pixels,
# each sample's value its dataset position); info shows the bucket histogram --------------------------------

GAP = 4


class StubSnapshot:
    """The snapshot surface preview reads: its encoding, shard counts and buckets, pixels and metadata per shard."""

    is_bucketed = True
    shape = (10, 10, 3)
    encoding = "raw"

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


SAMPLES = (20, 27, 13)


@pytest.fixture(params=["raw", "jpeg"])
def bucketed(tmp_path, request) -> str:
    return make_bucketed_dataset(str(tmp_path / "ds"), BUCKETS, SAMPLES, encoding=request.param)


def test_info_shows_the_bucket_histogram_as_text_and_json(bucketed):
    manifest = load_manifest(bucketed)
    result = CliRunner().invoke(app, ["info", bucketed, "--json"], prog_name="shardio")
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert [b["shape"] for b in info["buckets"]] == [list(b) for b in BUCKETS]
    assert [b["samples"] for b in info["buckets"]] == list(SAMPLES)
    for b in info["buckets"]:
        mine = [e for e in manifest.shards if e.bucket == b["bucket"]]
        assert b["shards"] == len(mine) and b["bytes"] == sum(e.bytes for e in mine)
    if info["encoding"] == "raw":
        assert info["raw_bytes_per_image"] == pytest.approx(info["bytes_per_image"], rel=0.2)
    result = CliRunner().invoke(app, ["info", bucketed], prog_name="shardio")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("buckets"))
    assert lines[at].startswith("buckets      3 shapes")
    for (h, w), count, line in zip(BUCKETS, SAMPLES, lines[at + 1:at + 4]):
        assert f"{h}x{w}" in line.replace(" ", "") and f" {count} samples" in line


def test_info_shows_every_bucket_aspect_even_the_extreme_ones(tmp_path):
    """8192x1 and 8192x8 are valid buckets (sides 1..8192): their aspect must not print as 0."""
    shapes = ((8192, 1), (8192, 8), (16, 16), (12, 20), (1, 8192))
    out = make_bucketed_dataset(str(tmp_path / "ds"), shapes, (1, 1, 1, 1, 1), inputs=1)
    result = CliRunner().invoke(app, ["info", out], prog_name="shardio")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("buckets"))
    assert "w:h" in lines[at]
    rows = [" ".join(line.split()) for line in lines[at + 1:at + 1 + len(shapes)]]
    for (h, w), ratio, row in zip(shapes, ("1:8192", "1:1024", "1:1", "1.67:1", "8192:1"), rows):
        assert row.split()[1:3] == [f"{h}x{w}", ratio], row


def test_info_of_a_single_shape_dataset_has_no_buckets(tmp_path):
    from dataset_fixtures import make_dataset

    out = str(tmp_path / "plain")
    make_dataset(out, (5,))
    result = CliRunner().invoke(app, ["info", out, "--json"], prog_name="shardio")
    assert result.exit_code == 0 and "buckets" not in json.loads(result.stdout)
