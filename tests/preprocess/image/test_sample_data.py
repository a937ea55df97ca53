"""The sample dataset shows orientation and crop at a glance: after the job's transform every image is
upright (red border on top, blue at the bottom, green left, yellow right), EXIF-tagged ones included, and
the images stay photo-sized JPEGs."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest
from PIL import Image

from preprocess.config import JobConfig
from preprocess.sample_data import SIDE_COLOURS, _awkward, annotate, make_sample_dataset, photo_like
from preprocess.image.transform import process_image

# stretch: the whole image lands in the output, so all four borders are there to look at
STRETCH = JobConfig(height=128, width=128, mode="stretch")


@pytest.fixture(autouse=True)
def _restore_pillow_limit(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # process_image sets it


def _nearest_side(pixel: np.ndarray) -> str:
    return min(SIDE_COLOURS, key=lambda side: float(np.sum((pixel.astype(float) - SIDE_COLOURS[side]) ** 2)))


def assert_upright(pixels: np.ndarray) -> None:
    h, w, _ = pixels.shape
    found = {"top": pixels[1, w // 2], "bottom": pixels[h - 2, w // 2], "left": pixels[h // 2, 1],
             "right": pixels[h // 2, w - 2]}
    assert {side: _nearest_side(p) for side, p in found.items()} == {s: s for s in found}, found


@pytest.mark.parametrize("orientation", [2, 3, 6, 8])
def test_exif_tagged_samples_come_out_upright(orientation):
    ext, data = _awkward(np.random.default_rng(0), f"exif{orientation}", 7)
    assert ext == "jpg" and Image.open(io.BytesIO(data)).getexif().get(0x0112) == orientation
    image = process_image(data, STRETCH)
    assert (image.width, image.height) == (1200, 900)  # the upright size
    assert_upright(image.pixels)


def test_stored_pixels_of_a_tagged_sample_are_not_upright():
    # What a reader ignoring the tag would show: the preview would show the mistake.
    ext, data = _awkward(np.random.default_rng(0), "exif3", 7)
    stored = np.asarray(Image.open(io.BytesIO(data)).convert("RGB").resize((128, 128)))
    h, w, _ = stored.shape
    assert _nearest_side(stored[1, w // 2]) == "bottom" and _nearest_side(stored[h - 2, w // 2]) == "top"


def test_a_plain_sample_is_upright_after_a_centre_crop_with_the_ring_centred():
    upright = annotate(photo_like(np.random.default_rng(1), 1920, 1080), 42)
    out = io.BytesIO()
    upright.save(out, "JPEG", quality=90)
    pixels = process_image(out.getvalue(), JobConfig(height=256, width=256)).pixels
    # a centre crop of a landscape image keeps its full height: top red, bottom blue
    assert _nearest_side(pixels[1, 128]) == "top" and _nearest_side(pixels[254, 128]) == "bottom"
    # the white ring (radius 0.44 of the short side) crosses the middle row symmetrically
    row = pixels[128].astype(int).sum(axis=1)
    white = np.flatnonzero(row > 3 * 235)
    left, right = white[white < 64], white[white > 192]
    assert len(left) and len(right) and abs((left.mean() - 0) - (255 - right.mean())) <= 4


def test_the_tars_hold_photo_sized_jpegs_and_an_exif_sample(tmp_path):
    (path,) = make_sample_dataset(str(tmp_path), tars=1, samples_per_tar=7)
    with tarfile.open(path) as tar:
        images = {m.name: tar.extractfile(m).read() for m in tar if m.name.endswith(".jpg")}
    sizes = [Image.open(io.BytesIO(d)).size for d in images.values()]
    assert all(1_000_000 <= w * h <= 2_500_000 for w, h in sizes), sizes
    tags = [Image.open(io.BytesIO(d)).getexif().get(0x0112) for d in images.values()]
    assert 6 in tags
    again = make_sample_dataset(str(tmp_path / "again"), tars=1, samples_per_tar=7)
    assert open(again[0], "rb").read() == open(path, "rb").read(), "the same arguments give the same bytes"


def test_the_run_summary_says_the_sample_datasets_truncated_jpeg_fails_on_purpose(tmp_path):
    """A newcomer's first run ends "failed 1": the summary says that failure is the sample's own, meant;
    the same failure in any other folder gets no such note."""
    from preprocess import run_display
    from preprocess.inputs.tar_samples import iter_tar_samples
    from shardio.errors import SampleError
    from shardio.format.run_report import RunReport

    (path,) = make_sample_dataset(str(tmp_path / "sample"), tars=1, samples_per_tar=30)
    failures = []
    for sample in iter_tar_samples(path, ("jpg", "png")):
        try:
            process_image(sample.image, STRETCH)
        except SampleError as e:
            failures.append({"input": path, "key": sample.key, "code": e.code.value, "reason": str(e)})
    assert [(f["key"], f["code"]) for f in failures] == [("000000029", "truncated")]
    report = RunReport(run_id="r", output=str(tmp_path / "out"), started="", config={}, samples_written=29,
                       samples_failed=1, failures=failures)
    with run_display.console.capture() as captured:
        run_display.summary(report, "out/reports/r.json")
    said = " ".join(captured.get().split())
    assert "failed 1" in said
    assert "note: 00000.tar sample 000000029 fails on purpose: a JPEG cut in half on purpose" in said, said
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    copied = [{**failures[0], "input": str(elsewhere / "00000.tar")}]
    with run_display.console.capture() as captured:
        run_display.summary(RunReport(run_id="r", output="o", started="", config={}, failures=copied), "r.json")
    assert "on purpose" not in captured.get()
