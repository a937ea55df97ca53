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
from shardio.format import FORMAT_VERSION

__all__ = ["library_versions", "pillow_build"]


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
