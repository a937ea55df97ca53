"""``mode: pad`` content boxes: where the job says the picture is, checked against the pixels it wrote.

Images are smooth gradients in 80-200 (no pixel anywhere near the black fill, even after JPEG and
lanczos ringing), so a box is right exactly when every pixel outside it is the fill and none inside is.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from preprocess.config import JobConfig
from preprocess.image.transform import process_image
from tests.tar_factory import jpeg_bytes, png_bytes

FILL = (0, 0, 0)


def gradient(width: int, height: int) -> Image.Image:
    x = np.linspace(80, 200, width)[None, :, None]
    y = np.linspace(200, 80, height)[:, None, None]
    rgb = np.concatenate([np.broadcast_to(x, (height, width, 1)), np.broadcast_to(y, (height, width, 1)),
                          np.broadcast_to((x + y) / 2, (height, width, 1))], axis=2)
    return Image.fromarray(rgb.round().astype(np.uint8), "RGB")


def exif(orientation: int) -> bytes:
    tags = Image.Exif()
    tags[0x0112] = orientation
    return tags.tobytes()


def assert_box_matches_pixels(pixels: np.ndarray, box: tuple[int, int, int, int] | None) -> None:
    assert box is not None
    x0, y0, x1, y1 = box
    height, width = pixels.shape[:2]
    assert 0 <= x0 < x1 <= width and 0 <= y0 < y1 <= height, f"box {box} outside {width}x{height}"
    is_fill = (pixels == FILL).all(axis=2)
    inside = np.zeros((height, width), dtype=bool)
    inside[y0:y1, x0:x1] = True
    assert is_fill[~inside].all(), f"box {box}: picture pixels outside it"
    assert not is_fill[inside].any(), f"box {box}: fill pixels inside it"


# (stored size, output width x height): very wide, very tall, exact fit, 1-pixel results, odd margins.
SHAPES = [((1000, 20), (64, 64)), ((20, 1000), (64, 64)), ((128, 96), (64, 48)), ((96, 128), (48, 64)),
          ((3000, 4), (64, 64)), ((4, 3000), (64, 64)), ((101, 37), (33, 17)), ((37, 101), (17, 33)),
          ((64, 64), (64, 64)), ((500, 499), (31, 30))]


@pytest.mark.parametrize(("stored", "output"), SHAPES)
@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("encode", ["jpeg", "png"])
def test_pad_box_is_where_the_picture_is(stored, output, orientation, encode) -> None:
    image = gradient(*stored)
    data = (jpeg_bytes(image, exif=exif(orientation)) if encode == "jpeg"
            else _png_with_exif(image, orientation))
    cfg = JobConfig(width=output[0], height=output[1], mode="pad", fill=FILL, resample="lanczos")
    out = process_image(data, cfg)
    assert_box_matches_pixels(out.pixels, out.content_box)


def _png_with_exif(image: Image.Image, orientation: int) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG", exif=exif(orientation))
    return buffer.getvalue()


def test_one_pixel_results_are_one_pixel_boxes() -> None:
    wide = process_image(png_bytes(gradient(5000, 2)), JobConfig(width=64, height=64, mode="pad"))
    tall = process_image(png_bytes(gradient(2, 5000)), JobConfig(width=64, height=64, mode="pad"))
    assert wide.content_box == (0, 31, 64, 32)
    assert tall.content_box == (31, 0, 32, 64)


@pytest.mark.parametrize("mode", ["center_crop", "stretch"])
def test_other_modes_have_no_box(mode: str) -> None:
    out = process_image(png_bytes(gradient(100, 50)), JobConfig(width=32, height=32, mode=mode))
    assert out.content_box is None
