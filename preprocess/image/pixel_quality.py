"""What an encoding keeps, measured: PSNR and max abs error of decoded pixels against the raw ones, and
the bytes an image takes.

One definition for ``preprocess diagnose`` (per dataset, on the job's own encode of a sample of its
inputs) and ``python -m bench.jpeg_quality`` (the size/quality curve the config's defaults were chosen
from), so the two never disagree on what "42 dB" means. PSNR is over all three channels with a peak of
255: 40 dB is an RMS error of 2.55 levels, 30 dB of 8. Percentiles are nearest-rank (an image's own
score, never an interpolation), so a set of images that all decode exactly reports inf, not NaN.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

__all__ = ["psnr", "max_abs_error", "decode_jpeg", "PixelQuality", "QualityTally"]


def psnr(reference: np.ndarray, decoded: np.ndarray) -> float:
    """Peak signal-to-noise ratio of ``decoded`` against ``reference`` (uint8 pixels), in dB; inf if equal."""
    if reference.shape != decoded.shape:
        raise ValueError(f"cannot compare pixels of shape {decoded.shape} with {reference.shape}")
    mse = float(np.mean((reference.astype(np.float64) - decoded.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def max_abs_error(reference: np.ndarray, decoded: np.ndarray) -> int:
    """The largest difference of one channel of one pixel, in levels (0-255)."""
    return int(np.abs(reference.astype(np.int16) - decoded.astype(np.int16)).max())


def decode_jpeg(data: bytes) -> np.ndarray:
    """A shard's JPEG decoded to H×W×3 uint8 by Pillow: libjpeg-turbo's ISLOW decode, the pixels the reader's
    batch decode gives too (tests/format/test_jpeg_shards.py holds that they are equal)."""
    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"))


@dataclass(frozen=True)
class PixelQuality:
    """A set of images' quality after an encoding: PSNR in dB (inf: every pixel kept), errors in levels."""

    images: int
    bytes_per_image: float  # mean
    psnr_median_db: float
    psnr_p5_db: float  # 95% of the images score at least this
    psnr_min_db: float
    max_abs_error: int  # over every image

    def to_json(self) -> dict[str, float | int | None]:
        """JSON values (no infinity in JSON: an exact PSNR is null, said as "lossless" by whoever shows it)."""
        def finite(db: float) -> float | None:
            return None if math.isinf(db) else round(db, 2)

        return {"images": self.images, "bytes_per_image": round(self.bytes_per_image, 1),
                "psnr_db": {"median": finite(self.psnr_median_db), "p5": finite(self.psnr_p5_db),
                            "min": finite(self.psnr_min_db)},
                "max_abs_error": self.max_abs_error}


@dataclass
class QualityTally:
    """Scores added one image at a time: a few numbers each, never the pixels (diagnosing 10,000 images
    would otherwise hold 2 GB of them)."""

    psnrs: list[float] = field(default_factory=list)
    errors: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)

    def add(self, reference: np.ndarray, decoded: np.ndarray, nbytes: int) -> None:
        """One image: its raw pixels, the same decoded from what is stored, and the bytes stored."""
        self.psnrs.append(psnr(reference, decoded))
        self.errors.append(max_abs_error(reference, decoded))
        self.sizes.append(nbytes)

    def summary(self) -> PixelQuality:
        if not self.psnrs:
            raise ValueError("no image was measured")
        scores = np.array(self.psnrs)

        def rank(q: float) -> float:
            return float(np.percentile(scores, q, method="inverted_cdf"))

        return PixelQuality(images=len(scores), bytes_per_image=float(np.mean(self.sizes)),
                            psnr_median_db=rank(50), psnr_p5_db=rank(5), psnr_min_db=float(scores.min()),
                            max_abs_error=max(self.errors))
