"""Per-image limits (config keys), each a counted failure with its reason, refused before decoding where
the header tells: min_image_size, max_aspect_ratio, max_jpeg_scans, max_decoded_bytes; and
max_decode_seconds after the fact. Plus the upscaled count and the config keys' validation and storage.

Headers-only images (a PNG claiming 9000x9000 16-bit RGBA in a few hundred bytes) and a patched
``ImageFile.load`` that fails the test if it runs prove a refusal comes before any decoding.
"""

from __future__ import annotations

import json
import os
import struct
import zlib

import numpy as np
import pytest

from preprocess.image import jpeg_region, transform
from preprocess.config import ConfigError, JobConfig, load_config
from preprocess.committed import check_compatible
from preprocess.job import RunOptions, run_job
from preprocess.image.jpeg_markers import jpeg_layout
from preprocess.image.transform import process_image
from preprocess.worker import process_input
from shardio.store.backends import for_path
from shardio.errors import DatasetIncompatibleError, NoInputsMatched, SampleError
from shardio.format import Manifest
from shardio.format.manifests import load_manifest
from shardio.write.shard_writer import write_manifest
from tests.cjpeg_tool import cjpeg
from tests.tar_factory import Member, index_image, jpeg_bytes
from tests.image_limit_helpers import DecodeStarted, _restore_pillow_limit, no_decoding  # noqa: F401

CFG = JobConfig(height=32, width=32)
NEW_KEYS = ("min_image_size", "max_aspect_ratio", "max_jpeg_scans", "max_decoded_bytes")


def png_header(width: int, height: int, bit_depth: int = 8, colour_type: int = 2) -> bytes:
    """A PNG that claims ``width`` x ``height`` but holds one byte of pixel data."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, colour_type, 0, 0, 0)
    idat = chunk(b"IDAT", zlib.compress(b"\0"))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + idat + chunk(b"IEND", b"")


def reason(data: bytes, cfg: JobConfig = CFG) -> str:
    with pytest.raises(SampleError) as caught:
        process_image(data, cfg)
    return str(caught.value)


THUMBNAIL = jpeg_bytes(index_image(5, 90, 160))  # portrait 90x160


# --- min_image_size, max_aspect_ratio ------------------------------------------------------------------


def test_min_image_size_refuses_a_short_side_below_it(no_decoding):
    message = reason(THUMBNAIL, JobConfig(height=32, width=32, min_image_size=100))
    assert "image too small (90x160: short side < min_image_size 100)" in message
    # 90 is enough: the decoder starts.
    assert "DecodeStarted" in reason(THUMBNAIL, JobConfig(height=32, width=32, min_image_size=90))


def test_max_aspect_ratio_refuses_long_over_short_above_it(no_decoding):
    message = reason(THUMBNAIL, JobConfig(height=32, width=32, max_aspect_ratio=1.7))
    assert "aspect ratio too large (90x160 is 1.78:1 > max_aspect_ratio 1.7)" in message
    assert "DecodeStarted" in reason(THUMBNAIL, JobConfig(height=32, width=32, max_aspect_ratio=1.8))


def test_defaults_keep_tiny_and_extreme_images():
    for size in [(1, 1), (3, 200), (200, 3)]:
        assert process_image(jpeg_bytes(index_image(1, *size)), CFG).pixels.shape == (32, 32, 3)


@pytest.mark.parametrize("mode, size, upscaled", [
    ("center_crop", (90, 160), True),
    ("center_crop", (640, 480), False),
    ("center_crop", (300, 200), True),  # the short side 200 < 256
    ("pad", (300, 200), False),  # letterboxed: the long side 300 >= 256 is what scales
    ("pad", (200, 100), True),
    ("stretch", (300, 200), True),
    ("stretch", (256, 256), False),
])
def test_upscaled_says_whether_pixels_were_invented(mode, size, upscaled):
    out = process_image(jpeg_bytes(index_image(2, *size)), JobConfig(mode=mode))
    assert out.upscaled is upscaled


def test_process_input_counts_upscaled_samples(tars, tmp_path):
    members = tars.samples([0, 1], size=(320, 240)) + tars.samples([2, 3, 4], size=(90, 160))
    path = tars.write("mixed.tar", members)
    result = process_input(path, str(tmp_path / "out"), JobConfig(height=128, width=128),
                           for_path(path).stat_fingerprint(path))
    assert result.error is None and result.samples == 5 and result.upscaled == 3


# --- max_jpeg_scans ------------------------------------------------------------------------------------


def progressive_with_scans(extra: int) -> bytes:
    """A progressive JPEG (10 scans) with its last scan repeated ``extra`` more times before the EOI."""
    data = jpeg_bytes(index_image(3, 64, 48), progressive=True)
    last_sos, eoi = data.rindex(b"\xff\xda"), len(data) - 2
    return data[:eoi] + data[last_sos:eoi] * extra + data[eoi:]


def test_too_many_jpeg_scans_are_refused_before_decoding(no_decoding):
    assert "too many JPEG scans (150 > max_jpeg_scans 100;" in reason(progressive_with_scans(140))
    assert "too many JPEG scans (10 > max_jpeg_scans 9;" in reason(
        progressive_with_scans(0), JobConfig(height=32, width=32, max_jpeg_scans=9))
    assert "DecodeStarted" in reason(progressive_with_scans(0))


# --- max_decoded_bytes ---------------------------------------------------------------------------------


def test_16_bit_rgba_png_within_the_pixel_limit_is_refused_by_its_decoded_size(no_decoding):
    # 81 M pixels, under max_image_pixels; decoded as RGBA and composited it would take ~1 GB.
    message = reason(png_header(9000, 9000, bit_depth=16, colour_type=6))
    assert "decoded size too large (~1005 MiB for 9000x9000 RGBA, 13 bytes a pixel" in message
    assert "> max_decoded_bytes 536870912" in message


def test_decoded_bytes_are_counted_after_the_jpeg_draft(no_decoding):
    # 2000x1500 to 256x256 drafts at 1/4: 500x375 RGB, 0.75 MB (+ 0.5 MB resize pass), not 12 MB.
    data = jpeg_bytes(index_image(4, 2000, 1500))
    cfg = JobConfig(max_decoded_bytes=2_000_000)
    assert "DecodeStarted" in reason(data, cfg)
    message = reason(data, JobConfig(max_decoded_bytes=2_000_000, draft=False))
    assert "decoded size too large (~13 MiB for 2000x1500 RGB" in message


@pytest.fixture(scope="module")
def flat_2400():
    """A flat 2400x2400 picture (a 2 MB progressive 9400x9400 4:4:4 JPEG peaked at 555 MB: same shape)."""
    return np.full((2400, 2400, 3), (90, 140, 200), np.uint8)


@pytest.mark.parametrize("region", [True, False], ids=["region decoder", "Pillow decoder"])
def test_a_progressive_jpeg_counts_the_coefficients_libjpeg_keeps(flat_2400, region, monkeypatch, no_decoding):
    # Drafted to 1/8 it decodes 300x300 pixels (~1 MiB with the resize), but libjpeg keeps every DCT
    # coefficient of the whole image while it reads the scans: 3 x 300^2 blocks x 128 B = 33 MiB.
    progressive = cjpeg(flat_2400, "-progressive", "-sample", "1x1")
    assert len(progressive) < 200_000
    if not region:
        monkeypatch.setattr(jpeg_region, "_decode_region", None)
    cfg = JobConfig(max_decoded_bytes=16 * 2**20)
    message = reason(progressive, cfg)
    assert ("decoded size too large (~34 MiB for 300x300 RGB, 4 bytes a pixel with its conversion to RGB,"
            " + 33 MiB of DCT coefficients a multi-scan JPEG keeps > max_decoded_bytes 16777216)") in message
    # One interleaved scan is decoded an MCU row at a time: no coefficient buffer, the decoder starts.
    assert "DecodeStarted" in reason(cjpeg(flat_2400, "-sample", "1x1"), cfg)


def test_coefficients_follow_the_sampling_layout():
    # 4:2:0 keeps a quarter of the luma's blocks for each chroma component; sizes pad to whole MCUs.
    layout = jpeg_layout(cjpeg(np.zeros((1001, 999, 3), np.uint8), "-progressive", "-sample", "2x2"))
    luma = 126 * 126  # 999 -> 125 blocks, padded to 126 (a multiple of 2); 1001 -> 126
    assert transform._coefficient_bytes(layout) == (luma + 2 * 63 * 63) * 128


@pytest.mark.parametrize("mode, bytes_per_pixel", [
    ("L", 5), ("RGB", 4), ("P", 5), ("RGBA", 13), ("I;16", 34),
])
def test_decoded_bytes_per_mode(mode, bytes_per_pixel, no_decoding):
    header = {"L": (8, 0), "RGB": (8, 2), "P": (8, 3), "RGBA": (8, 6), "I;16": (16, 0)}[mode]
    cfg = JobConfig(height=1, width=1, max_decoded_bytes=1)
    assert f"100x100 {mode}, {bytes_per_pixel} bytes a pixel" in reason(png_header(100, 100, *header), cfg)


# --- max_decode_seconds --------------------------------------------------------------------------------


def test_max_decode_seconds_fails_a_slower_image():
    # Every decode takes more than a nanosecond: deterministic, whatever the machine's load.
    cfg = JobConfig(height=32, width=32, max_decode_seconds=1e-9)
    message = reason(THUMBNAIL, cfg)
    assert "decode too slow (" in message and "> max_decode_seconds 1e-09)" in message
    assert process_image(THUMBNAIL, CFG).pixels.shape == (32, 32, 3)


# --- config --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key, value", [
    ("min_image_size", -1), ("min_image_size", True), ("min_image_size", "3"), ("min_image_size", 2.5),
    ("max_aspect_ratio", 0.5), ("max_aspect_ratio", float("nan")), ("max_aspect_ratio", "wide"),
    ("max_jpeg_scans", 0), ("max_decoded_bytes", 0), ("max_decode_seconds", 0),
    ("max_decode_seconds", float("inf")),
])
def test_invalid_limits_are_config_errors(key, value):
    with pytest.raises(ConfigError, match=key):
        JobConfig(**{key: value})


def test_limits_from_yaml_and_their_stored_form(tmp_path):
    path = tmp_path / "limits.yaml"
    path.write_text("min_image_size: 64\nmax_aspect_ratio: .inf\nmax_jpeg_scans: 20\nmax_decode_seconds: 5\n")
    cfg = load_config(str(path))
    assert (cfg.min_image_size, cfg.max_aspect_ratio, cfg.max_jpeg_scans) == (64, None, 20)
    assert cfg.max_decode_seconds == 5.0 and isinstance(cfg.max_decode_seconds, float)
    stored = cfg.output_dict()
    assert all(key in stored for key in NEW_KEYS)
    assert "max_decode_seconds" not in stored  # a run policy: its failures depend on the machine's load
    json.dumps(stored, allow_nan=False)  # no infinity in the manifest


def test_a_dataset_written_before_the_limits_existed_is_still_appendable(tmp_path):
    # Its stored config lacks the new keys: they count as their defaults (the refusal comes before Ray).
    out = str(tmp_path / "out")
    os.makedirs(out)
    old = {k: v for k, v in JobConfig(height=16, width=16).output_dict().items() if k not in NEW_KEYS}
    write_manifest(out, Manifest(shape=(16, 16, 3), config=old, versions={}))
    tar = tmp_path / "new.tar"  # never read: both outcomes are decided before Ray starts
    tar.write_bytes(b"")
    check_compatible(load_manifest(out), JobConfig(height=16, width=16), out)  # no refusal: appendable
    with pytest.raises(DatasetIncompatibleError, match="min_image_size: dataset has 0, this run 8"):
        run_job(RunOptions(inputs=[str(tar)], output=out, config=JobConfig(height=16, width=16, min_image_size=8)))


def test_a_run_given_no_input_at_all_says_so(tmp_path):
    with pytest.raises(NoInputsMatched, match="no INPUT was given; nothing was read or written"):
        run_job(RunOptions(inputs=[], output=str(tmp_path / "out"), config=JobConfig(height=16, width=16)))
    assert not os.path.exists(tmp_path / "out")


# --- through the job -----------------------------------------------------------------------------------


@pytest.mark.ray
def test_report_counts_upscaled_samples_and_limit_failures(ray_cluster, tars, tmp_path):
    from typer.testing import CliRunner

    from preprocess.cli import app

    members = tars.samples([0, 1], size=(320, 240)) + tars.samples([2, 3], size=(90, 160))
    members += [Member("000004.jpg", jpeg_bytes(index_image(4, 20, 20)))]  # under min_image_size
    path = tars.write("a.tar", members)
    config = tmp_path / "limits.yaml"
    config.write_text("height: 128\nwidth: 128\nmin_image_size: 32\n")
    out, report_path = str(tmp_path / "out"), str(tmp_path / "report.json")
    result = CliRunner().invoke(app, ["run", path, "--output", out, "--config", str(config),
                                      "--report", report_path], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.load(open(report_path))
    assert report["samples_written"] == 4 and report["samples_upscaled"] == 2
    assert [f["key"] for f in report["failures"]] == ["000004"]
    assert "image too small (20x20: short side < min_image_size 32)" in report["failures"][0]["reason"]
    assert report["failures"][0]["code"] == "too_small"  # through Ray, into the report file
    assert report["failures_by_reason"] == {"image too small": 1}
    assert "1 x image too small" in " ".join(result.output.split())  # the summary
    assert report["config"]["min_image_size"] == 32
    assert json.load(open(os.path.join(out, "manifest.json")))["config"]["min_image_size"] == 32
    assert "(2 upscaled)" in " ".join(result.output.split())
