"""Fixtures shared by the bad-image and per-image-limit tests: Pillow's process-wide pixel limit restored after
each test, and a guard that fails a test the moment decoding starts (limits must refuse from the header)."""

from __future__ import annotations

import pytest
from PIL import Image, ImageFile

from preprocess.image import jpeg_region


@pytest.fixture(autouse=True)
def _restore_pillow_limit(monkeypatch):
    # process_image sets Pillow's process-wide limit to the config's; keep other tests' Pillow default.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)


class DecodeStarted(Exception):
    pass


@pytest.fixture
def no_decoding(monkeypatch):
    def load(self):
        raise DecodeStarted(f"decoding a {self.size} image")

    def decode_region(data, end, scale, width, height, *region):
        raise DecodeStarted(f"decoding a region {region} of {width}x{height} at 1/{scale}")

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    # JPEGs go through the region decoder when it is built (preprocess.image.jpeg_region), never through load().
    if jpeg_region.available():
        monkeypatch.setattr(jpeg_region, "_decode_region", decode_region)
