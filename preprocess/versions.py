"""Which libraries produce the pixels: recorded in every manifest and shown by ``preprocess doctor``.

Pixels depend on the JPEG decoder (libjpeg-turbo version, DCT method) and on the resampler (Pillow vs
Pillow-SIMD), so two machines with different builds can write different bytes for the same input.
"""

from __future__ import annotations

import platform
import sysconfig
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import PIL
from PIL import features

import shardio
from shardio.errors import VersionDrift
from shardio.format import FORMAT_VERSION

__all__ = ["library_versions", "pillow_build", "PIXEL_LIBRARIES", "VersionDrift", "version_drift"]

# The entries of ``library_versions()`` that change the pixels: the JPEG decoder and the resampler.
PIXEL_LIBRARIES = ("pillow", "pillow_simd", "libjpeg_turbo")


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def pillow_build() -> dict[str, Any]:
    """Pillow-SIMD or stock Pillow, whether it was built with AVX2, and the JPEG library behind it."""
    simd = _dist_version("pillow-simd")
    stock = _dist_version("pillow")
    marker = Path(sysconfig.get_paths()["data"]) / ".pillow-simd-avx2"  # written by `make install`
    cpu_avx2 = False
    try:
        cpu_avx2 = "avx2" in Path("/proc/cpuinfo").read_text()
    except OSError:
        pass
    return {
        "pil_version": PIL.__version__,
        "pillow_simd": simd is not None and stock is None,
        "stock_pillow_installed": stock is not None,
        "built_with_avx2": marker.exists(),
        "cpu_has_avx2": cpu_avx2,
        "libjpeg_turbo": features.version("libjpeg_turbo"),
        "jpeg_api": features.version("jpg"),
        "webp": features.version("webp"),
    }


def library_versions() -> dict[str, Any]:
    build = pillow_build()
    return {
        "shardio": shardio.__version__,
        "format_version": FORMAT_VERSION,
        "pillow": build["pil_version"],
        "pillow_simd": build["pillow_simd"],
        "libjpeg_turbo": build["libjpeg_turbo"],
        "numpy": np.__version__,
        "python": platform.python_version(),
    }


def version_drift(recorded: dict[str, Any], current: dict[str, Any], where: str) -> str | None:
    """A warning if ``current`` differs from ``recorded`` in a library that changes pixels; None if not.

    Only libraries the record names are compared: a manifest without versions cannot drift.
    """
    changed = [k for k in PIXEL_LIBRARIES if k in recorded and recorded[k] != current.get(k)]
    if not changed:
        return None
    was = ", ".join(f"{k} {recorded[k]}" for k in changed)
    now = ", ".join(f"{k} {current.get(k)}" for k in changed)
    return (f"{where}: the dataset was written with {was}; this run has {now}: samples appended now may "
            "differ in pixels from the ones already there (JPEG decoder and resampler builds round "
            "differently); use the same build, or a new --output (--strict-versions makes this an error)")
