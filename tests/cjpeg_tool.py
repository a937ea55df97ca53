"""JPEGs made by libjpeg-turbo's own encoder (``cjpeg``), for the layouts Pillow's encoder cannot write
(2x4, 3x1, 4x2 ... sampling, scan scripts). ``make test`` installs it (Debian: libjpeg-turbo-progs).

A missing ``cjpeg`` fails the test that needs it, never skips it: CI must run these."""

from __future__ import annotations

import io
import shutil
import subprocess

import numpy as np
import pytest
from PIL import Image

MISSING = ("cjpeg not found: the JPEG layout tests need libjpeg-turbo's tools"
           " (`apt-get install libjpeg-turbo-progs`; `make test` installs them)")


def cjpeg(pixels: np.ndarray, *args: str) -> bytes:
    """``pixels`` (H x W x 3 uint8) encoded by ``cjpeg ARGS`` (``-sample 2x4``, ``-progressive`` ...)."""
    tool = shutil.which("cjpeg")
    if tool is None:
        pytest.fail(MISSING)
    ppm = io.BytesIO()
    Image.fromarray(pixels).save(ppm, "PPM")
    done = subprocess.run([tool, *args], input=ppm.getvalue(), capture_output=True, timeout=120)
    if done.returncode != 0:
        raise AssertionError(f"cjpeg {' '.join(args)} failed: {done.stderr.decode(errors='replace')}")
    return done.stdout
