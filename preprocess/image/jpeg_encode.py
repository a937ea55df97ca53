"""Encoding one resized image as the JPEG a compact shard stores (``encoding: jpeg``), and what a shard of
any encoding stores for it (``stored_pixels``: the pixels, their JPEG, or their yuv420 planes).

Pillow's encoder (Pillow-SIMD in the job): the same libjpeg-turbo calls as a direct C encoder would make
(``jpeg_set_quality``, ISLOW DCT, standard Huffman tables), byte for byte the same file, and measured as
fast here: 0.23-0.29 ms for a 256×256 image, a few % of the ~4.1 ms the job spends decoding and resizing
a 1.6 MP original (``python -m bench.jpeg_quality`` prints the ratio of one run). ``optimize`` (Huffman tables
per image) is off: it saves ~5% of the bytes for a second pass over the coefficients.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from preprocess.config import JobConfig
from shardio.format import JPEG, YUV420
from shardio.format.yuv_shard import rgb_to_yuv420

__all__ = ["encode_jpeg", "stored_pixels"]

# Pillow's names for the chroma subsampling the config states.
_SUBSAMPLING = {"4:4:4": 0, "4:2:0": 2}


def encode_jpeg(pixels: np.ndarray, quality: int, subsampling: str) -> bytes:
    """The H×W×3 uint8 ``pixels`` as a baseline JFIF at ``quality`` with ``subsampling`` chroma."""
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, "JPEG", quality=quality, subsampling=_SUBSAMPLING[subsampling])
    return out.getvalue()


def stored_pixels(pixels: np.ndarray, cfg: JobConfig) -> np.ndarray | bytes:
    """What a shard of ``cfg``'s dataset stores for one resized image: the pixels themselves (raw), their
    JPEG at the config's quality and subsampling, or their yuv420 planes (``shardio.format.yuv_shard``: numpy,
    full-range BT.601 exactly rounded; Pillow's ``convert("YCbCr")`` is off by one level here and there and
    does not subsample). The worker and ``preprocess diagnose`` both call this, so the quality diagnose
    measures is the quality the job writes."""
    if cfg.encoding == JPEG:
        return encode_jpeg(pixels, cfg.quality, cfg.subsampling)
    if cfg.encoding == YUV420:
        return rgb_to_yuv420(pixels)
    return pixels
