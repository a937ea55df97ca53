"""Fixtures shared by the bad-image and per-image-limit tests: Pillow's process-wide pixel limit restored after
each test, and a guard that fails a test the moment decoding starts (limits must refuse from the header)."""

from __future__ import annotations

import pytest
from PIL import Image, ImageFile


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

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
