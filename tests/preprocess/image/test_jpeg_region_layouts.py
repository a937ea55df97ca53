"""Which JPEG sampling layouts the region decoder takes, proven against Pillow's path byte for byte.

libjpeg-turbo 2.1.5's partial decoding is wrong on some layouts: ``jpeg_crop_scanline`` on 2x4 and 4x2
luma gave max |diff| 255 against Pillow at draft scales 2 and 4 with columns cropped, ``jpeg_skip_scanlines``
refused a valid baseline 2x4 file as cut and never returned on a progressive one (issue 22, A to C).
Every layout ``cjpeg`` accepts for 3 components (h x v luma with 1x1 chroma: h * v + 2 blocks a MCU, at
most 10), mixed chroma and grayscale, baseline, progressive and with restart markers, goes through
``process_image`` at configs that reach draft scales 1, 2, 4 and 8 with the rows or the columns cropped,
pad and stretch: the region path must give Pillow's pixels and refuse nothing Pillow accepts, and the
layouts outside ``jpeg_region.proven_layout`` must not reach the region decoder at all.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from preprocess.image import jpeg_region
from preprocess.config import JobConfig
from preprocess.image.jpeg_markers import jpeg_layout
from preprocess.image.transform import process_image
from tests.cjpeg_tool import cjpeg

# cjpeg -sample arguments: every luma h x v that fits 10 blocks a MCU with 1x1 chroma, then others.
PROVEN = ["1x1", "2x1", "1x2", "2x2", "4x1", "1x4", "3x1", "1x3", "3x2", "2x3", "gray", "gray 2x2"]
FALLING_BACK = ["2x4", "4x2", "2x2,1x2,1x1", "1x1,1x1,1x2", "2x2,2x1,2x1"]
ENCODINGS = {"baseline": [], "progressive": ["-progressive"], "restart": ["-restart", "1"],
             "progressive restart": ["-progressive", "-restart", "2B"]}
# 1024x1025: the size the defects were found at (not a multiple of any MCU); crops there reach past the
# region decoder's margins at every scale. 733x491: odd, landscape.
SIZES = [(1024, 1025), (733, 491)]


def photo(width: int, height: int, seed: int) -> np.ndarray:
    """Gradients plus noise: a wrong pixel anywhere shows."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width * 255, y / height * 255, (x + y) % 97 * 2.6], axis=-1)
    return np.clip(base + rng.normal(0, 8, (height, width, 3)), 0, 255).astype(np.uint8)


def configs(width: int, height: int) -> dict[str, JobConfig]:
    """Configs reaching each draft scale s with the columns cropped (a target narrower than the source)
    and with the rows cropped, plus pad and stretch. Scale 1 (a full decode, the slowest) on the smaller
    size only: the defects were at 1/2 and 1/4."""
    found = {}
    for scale in (1, 2, 4, 8) if width * height < 500_000 else (2, 4, 8):
        # A target side at 0.9 / s of the source's: the draft scale is exactly s on that side.
        narrow_h = int(height / scale * 0.9)
        found[f"1/{scale} columns cropped"] = JobConfig(height=narrow_h, width=max(8, int(narrow_h * 0.6)))
        wide_w = int(width / scale * 0.9)
        found[f"1/{scale} rows cropped"] = JobConfig(height=max(8, int(wide_w * 0.6)), width=wide_w)
    found["pad 1/2"] = JobConfig(mode="pad", height=int(height / 2 * 0.9), width=int(width / 2 * 0.9))
    found["stretch 1/4"] = JobConfig(mode="stretch", height=int(height / 4 * 0.9), width=int(width / 5))
    return found


def encode(sample: str, encoding: str, size: tuple[int, int]) -> bytes:
    width, height = size
    pixels = photo(width, height, width * 7 + height)
    factors = sample.split()
    colour = ["-grayscale"] if factors[0] == "gray" else []
    sampling = ["-sample", factors[-1]] if factors[-1] != "gray" else []
    return cjpeg(pixels, "-quality", "75", *colour, *sampling, *ENCODINGS[encoding])


def both_paths(data: bytes, cfg: JobConfig, monkeypatch) -> tuple[object, object, int]:
    """The region path's and Pillow's result (pixels or the refusal's words), and the region decoder's
    call count on the first."""
    calls = []
    real = jpeg_region._decode_region
    outcomes = []
    for decoder in (lambda *args: calls.append(args) or real(*args), None):
        with monkeypatch.context() as patch:
            patch.setattr(jpeg_region, "_decode_region", decoder)
            try:
                outcomes.append(process_image(data, cfg).pixels)
            except Exception as e:  # SampleError: compared, so a refusal on one side only shows
                outcomes.append(f"{type(e).__name__}: {e}")
    return outcomes[0], outcomes[1], len(calls)


@pytest.fixture(autouse=True)
def _region_decoder_built():
    assert jpeg_region.available(), "preprocess.image._jpeg_region is not built (make install builds it)"


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("sample", PROVEN + FALLING_BACK)
def test_every_sampling_layout_gives_pillows_pixels(sample, encoding, size, monkeypatch):
    data = encode(sample, encoding, size)
    layout = jpeg_layout(data)
    assert layout is not None and layout.complete
    proven = sample in PROVEN
    for name, cfg in configs(*size).items():
        region, pillow, calls = both_paths(data, cfg, monkeypatch)
        assert not isinstance(pillow, str), f"{name}: Pillow's path refused a valid JPEG: {pillow}"
        assert not isinstance(region, str), f"{name}: the region path refused what Pillow accepts: {region}"
        if not np.array_equal(region, pillow):
            diff = np.abs(region.astype(int) - pillow).max()
            pytest.fail(f"{name}: the region path differs from Pillow's (max |diff| {diff})")
        assert calls == (1 if proven else 0), f"{name}: region decoder called {calls} times"
    assert jpeg_region.proven_layout(layout) is proven, layout.sampling


def test_the_bench_corpus_layout_takes_the_region_path(monkeypatch):
    # LAION-like web JPEGs are 4:2:0 (Pillow's and libjpeg's default): the speed-up must stay theirs.
    data = encode("2x2", "baseline", (733, 491))
    assert both_paths(data, JobConfig(), monkeypatch)[2] == 1


HANG = textwrap.dedent("""
    import sys
    from preprocess.image import jpeg_region
    from preprocess.config import JobConfig
    from preprocess.image.jpeg_markers import jpeg_layout
    from preprocess.image.transform import process_image
    data = sys.stdin.buffer.read()
    assert process_image(data, JobConfig(height=192, width=256)).pixels.shape == (192, 256, 3)
    # The C code itself, on the layout the gate keeps from it: it must return (its pixels are not used).
    jpeg_region._decode_region(data, jpeg_layout(data).eoi, 4, 256, 257, 0, 256, 20, 237)
    jpeg_region._decode_region(data, jpeg_layout(data).eoi, 4, 256, 257, 47, 209, 0, 257)
    print("returned")
""")


@pytest.mark.timeout(300)
def test_progressive_2x4_at_1024x1025_returns(tmp_path):
    """It never returned (issue 22, B): jpeg_skip_scanlines below the region, on data already read to the
    EOI. In a child process so that a hang fails this test instead of stopping the suite."""
    data = encode("2x4", "progressive", (1024, 1025))
    try:
        done = subprocess.run([sys.executable, "-c", HANG], input=data, capture_output=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the decoder did not return within 120 s (a 1024x1025 image takes ~0.1 s)")
    assert done.returncode == 0 and done.stdout.strip() == b"returned", done.stderr.decode()


def test_a_missing_cjpeg_fails_the_tests_that_need_it(monkeypatch):
    # CI must run these: never a skip.
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(pytest.fail.Exception, match="cjpeg not found: .*libjpeg-turbo-progs"):
        cjpeg(photo(8, 8, 0))
