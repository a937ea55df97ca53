"""Which libraries produce the pixels: recorded in every manifest and shown by ``preprocess doctor``.

Pixels depend on the JPEG decoder (libjpeg-turbo version, DCT method) and on the resampler (Pillow vs
Pillow-SIMD, and whether Pillow-SIMD was built with AVX2), so two machines with different builds can write
different bytes for the same input. On a cluster, ``preprocess.cluster.ray_cluster.check_cluster_build`` runs
``pixel_build`` on every node before any task and refuses a node whose answer differs from the driver's
(``build_difference``); each task also returns the ``library_versions`` it ran with, and those (not the
driver's) are what the manifest records.
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

__all__ = ["library_versions", "pillow_build", "pixel_build", "build_difference", "PIXEL_LIBRARIES",
           "VersionDrift", "version_drift"]

# The entries of ``library_versions()`` that change the pixels: the JPEG decoder and the resampler.
PIXEL_LIBRARIES = ("pillow", "pillow_simd", "pillow_avx2", "libjpeg_turbo")


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
        "pillow_avx2": build["built_with_avx2"],
        "libjpeg_turbo": build["libjpeg_turbo"],
        "numpy": np.__version__,
        "python": platform.python_version(),
    }


def pixel_build() -> dict[str, Any]:
    """The ``PIXEL_LIBRARIES`` of this process: what one node must share with the driver."""
    versions = library_versions()
    return {key: versions[key] for key in PIXEL_LIBRARIES}


def build_difference(expected: dict[str, Any], found: dict[str, Any]) -> str | None:
    """``"libjpeg_turbo 3.0.1 (driver: 2.1.5)"``-style list of the pixel libraries that differ, or None."""
    changed = [k for k in PIXEL_LIBRARIES if expected.get(k) != found.get(k)]
    if not changed:
        return None
    return ", ".join(f"{k} {found.get(k)} (driver: {expected.get(k)})" for k in changed)


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
