"""Bad samples: each a ``SampleError`` with a clear reason, counted by ``process_input``; the job goes on.

Pixel bombs are built as headers only (a PNG or JPEG claiming 30000x30000 in a few hundred bytes) and
``ImageFile.load`` is patched to fail the test if it runs: the refusal must come before any decoding.
"""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from preprocess.config import JobConfig
from preprocess.image.transform import process_image
from preprocess.worker import parse_fields, process_input
from shardio.store.backends import for_path
from shardio.errors import SampleError
from tests.tar_factory import Member, decode_index, index_image, jpeg_bytes, png_bytes, read_shards
from tests.image_limit_helpers import DecodeStarted, _restore_pillow_limit, no_decoding  # noqa: F401

CFG = JobConfig(height=32, width=32)


def png_header(width: int, height: int) -> bytes:
    """A PNG that claims ``width`` x ``height`` RGB but holds one byte of pixel data."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = chunk(b"IDAT", zlib.compress(b"\0"))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + idat + chunk(b"IEND", b"")


def jpeg_header(width: int, height: int) -> bytes:
    """A small real JPEG whose SOF0 claims ``width`` x ``height``."""
    data = bytearray(jpeg_bytes(index_image(1, 64, 48)))
    sof = data.index(b"\xff\xc0")
    data[sof + 5: sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def reason(data: bytes, cfg: JobConfig = CFG) -> str:
    with pytest.raises(SampleError) as caught:
        process_image(data, cfg)
    return str(caught.value)


GOOD_JPEG = jpeg_bytes(index_image(9, 160, 120))


# --- one image -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("cut", [0.2, 0.5, 0.95])
def test_truncated_jpeg_is_an_error_not_a_grey_bottom(cut):
    assert "truncated" in reason(GOOD_JPEG[: int(len(GOOD_JPEG) * cut)]).lower()


def test_corrupt_jpeg_scan_data():
    rng = np.random.default_rng(3)
    sos = GOOD_JPEG.index(b"\xff\xda")
    noise = rng.integers(0, 256, len(GOOD_JPEG) - sos - 22, dtype=np.uint8).tobytes()
    # Noise holds stray markers (FF xx): the data ends at the first, before libjpeg's error on what follows.
    assert "JPEG scan data ends early" in reason(GOOD_JPEG[: sos + 20] + noise + b"\xff\xd9")


def test_corrupt_jpeg_header():
    sof = GOOD_JPEG.index(b"\xff\xc0")
    broken = GOOD_JPEG[: sof + 4] + bytes(8) + GOOD_JPEG[sof + 12:]
    assert "JPEG signature but unreadable header" in reason(broken)


def test_corrupt_png_data_is_an_error():
    # A PNG's orientation used to be read before the decode: its getexif() loaded the image, the error was
    # swallowed, and the second load returned partial pixels as if nothing had happened.
    rng = np.random.default_rng(4)
    data = bytearray(png_bytes(Image.fromarray(rng.integers(0, 256, (60, 80, 3), dtype=np.uint8))))
    idat = data.index(b"IDAT")
    data[idat + 200: idat + 260] = bytes(b ^ 0x55 for b in data[idat + 200: idat + 260])
    message = reason(bytes(data))
    assert "cannot decode" in message and "data stream" in message


def test_truncated_png():
    data = png_bytes(Image.fromarray(np.random.default_rng(5).integers(0, 256, (60, 80, 3), dtype=np.uint8)))
    assert "truncated" in reason(data[: len(data) // 2])


@pytest.mark.parametrize("data, expected", [
    (b"", "empty image member (0 bytes)"),
    (b"Hello, this is not a picture at all\n" * 3, "looks like text"),
    (bytes(np.random.default_rng(6).integers(0, 256, 4096, dtype=np.uint8)), "unknown signature"),
    (b"\xff\xd8\xff" + bytes(40), "JPEG signature but unreadable header"),
])
def test_not_an_image(data, expected):
    message = reason(data)
    assert expected in message


@pytest.mark.parametrize("header", [png_header, jpeg_header])
def test_pixel_bomb_is_refused_before_decoding(header, no_decoding):
    message = reason(header(30000, 30000))
    assert "pixel bomb" in message and "900000000" in message
    # Pillow's message quoted its error threshold, twice the limit (178,956,970): now the configured one.
    assert "max_image_pixels 89478485" in message and "178956970" not in message


def test_pillow_warning_band_is_a_pixel_bomb(no_decoding):
    # 95 M pixels: above Pillow's MAX_IMAGE_PIXELS (89.5 M), below twice it, where Pillow only warns.
    message = reason(png_header(10000, 9500))
    assert "pixel bomb: 95000000 pixels > max_image_pixels 89478485" in message


def test_max_image_pixels_is_the_limit_either_way(no_decoding):
    small = JobConfig(height=32, width=32, max_image_pixels=2000)
    assert "pixel bomb" in reason(png_header(50, 50), small)
    assert "DecodeStarted" in reason(png_header(40, 40), small)  # 1600 pixels: allowed, decoding began
    # A limit above Pillow's default is honoured too: this 95 M pixel header gets as far as the decoder.
    large = JobConfig(height=32, width=32, max_image_pixels=200_000_000)
    assert "DecodeStarted" in reason(png_header(10000, 9500), large)


# --- metadata ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, expected", [
    ({"cls": b"seven"}, ".cls is not an integer"),
    ({"cls": b""}, ".cls is not an integer"),
    ({"cls": b"-1"}, ".cls is not an integer"),  # the reader's "no label"
    ({"cls": b"9" * 30}, ".cls is not an integer"),  # overflows the reader's int64 labels
    ({"cls": b"9" * 5000}, ".cls is not an integer"),  # int() itself refuses > 4300 digits
    ({"json": b"{'single': 'quotes'}"}, ".json is not valid JSON"),
    ({"json": b"\xff\xfe{}"}, ".json is not valid JSON"),
    ({"json": b'{"a": NaN}'}, ".json is not valid JSON"),
    ({"json": b'{"a": "\\ud800"}'}, ".json is not valid JSON"),  # a lone surrogate cannot be UTF-8
    ({"json": b"[" * 100_000}, ".json is not valid JSON"),  # deeper than the parser's recursion limit
    ({"json": b"[1, 2]"}, ".json is not a JSON object"),
])
def test_malformed_metadata(fields, expected):
    with pytest.raises(SampleError, match=expected):
        parse_fields(fields)


def test_good_metadata():
    fields = {"txt": b"caf\xc3\xa9 \xff", "cls": b" 42\n", "json": b'{"url": "x", "n": [1, 2.5, null]}'}
    assert parse_fields(fields) == {
        "txt": "café \ufffd",
        "cls": 42,
        "json": {"url": "x", "n": [1, 2.5, None]},
    }
    assert parse_fields({}) == {"txt": None, "cls": None, "json": None}


# --- through process_input -----------------------------------------------------------------------------


def test_bad_samples_are_counted_and_the_input_goes_on(tars, tmp_path):
    good = [0, 2, 4, 6, 8]
    members = tars.samples([0])
    members += [Member("000001.jpg", GOOD_JPEG[: len(GOOD_JPEG) // 2])]  # truncated
    members += tars.samples([2])
    members += [Member("000003.jpg", b"")]  # zero bytes
    members += tars.samples([4])
    members += [Member("000005.jpg", b"<html>404 Not Found</html>")]  # text named .jpg
    members += tars.samples([6])
    members += [Member("000007.png", png_header(30000, 30000))]  # pixel bomb
    members += tars.samples([8])
    members += [Member("000009.txt", b"caption only"), Member("000009.json", b"{}")]  # no image
    members += [Member("000010.jpg", GOOD_JPEG), Member("000010.cls", b"ten")]  # malformed .cls
    members += [Member("000011.jpg", GOOD_JPEG), Member("000011.json", b"{nope")]  # malformed .json
    members += [Member("000002.jpg", jpeg_bytes(index_image(99)))]  # key seen twice: first kept
    path = tars.write("bad.tar", members)
    out = str(tmp_path / "out")
    result = process_input(path, out, CFG, for_path(path).stat_fingerprint(path))

    assert result.error is None and result.samples == len(good)
    reasons = {f["key"]: f["reason"] for f in result.failures}
    assert len(result.failures) == len(reasons) == 8, result.failures
    assert "truncated" in reasons["000001"].lower() and reasons["000001"].startswith("000001.jpg: ")
    assert "empty image member" in reasons["000003"]
    assert "looks like text" in reasons["000005"]
    assert "pixel bomb" in reasons["000007"]
    assert "no image member (has: json, txt)" in reasons["000009"]
    assert ".cls is not an integer" in reasons["000010"]
    assert ".json is not valid JSON" in reasons["000011"]
    assert "key seen twice" in reasons["000002"]
    assert all(f["input"] == path for f in result.failures)

    pixels, rows = read_shards(out, result.shards)
    assert [decode_index(p) for p in pixels] == good, "lost, duplicated or reordered samples"
    assert [r["key"] for r in rows] == [f"{i:06d}" for i in good]
    assert [r["cls"] for r in rows] == good and [r["json"] for r in rows] == [{"index": i} for i in good]
    assert json.loads(json.dumps(rows)) == rows
