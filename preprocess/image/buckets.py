"""Aspect-ratio buckets (``mode: bucket``): the shapes near a pixel budget, and which one an image takes.

NovelAI's method, as Stable Diffusion XL trains: every bucket is a fixed shape (so a shard of one bucket is
still one array a batch slices), sides multiples of ``bucket_step``, area at most the budget
(``height`` x ``width``) and as close to it as the step allows, long/short side up to ``bucket_max_ratio``,
both orientations. An image goes to the bucket nearest its aspect ratio in |log(w/h)|, and is resized to
cover it and centre-cropped by the few pixels that remain.

Derived: for every short side ``v`` (a multiple of the step, ``v * v <= budget``) the long side is the
largest multiple of the step with ``v * long <= budget`` and ``long <= bucket_max_ratio * v``; one bucket
per aspect ratio (the largest), none under ``MIN_AREA_FRACTION`` of the budget. So each short side gives
the bucket of largest area, within ``v * step`` of the budget away from the ratio limit. The list is sorted
by aspect ratio w/h (tallest first) and is what the dataset stores: bucket ids are indices into it, and a
rerun reads it back rather than deriving it again.

The defaults were measured (``python -m bench.buckets``): at a 256x256 budget, step 16 and ratio 3.0 give
15 buckets (144x432 ... 256x256 ... 432x144) whose areas are 0.95-1.0 of the budget, and an aspect error
|log(stored w/h) - log(source w/h)| of median 0.026 / p95 0.036 on the bench corpus and 0.038 / 0.084 on
random crops of it spread beyond 1:3 and 3:1 (where a square centre crop changes it by 0.39 / 1.04); step
32 leaves a median of 0.07 there, and a ratio of 2.0 a p95 of 0.35.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

from shardio.errors import ConfigError
from shardio.format import MAX_BUCKETS, MAX_SIDE

__all__ = ["Bucket", "derive_buckets", "check_buckets", "nearest_bucket", "aspect_error",
           "DEFAULT_STEP", "DEFAULT_MAX_RATIO", "MIN_AREA_FRACTION"]

Bucket = tuple[int, int]  # (height, width), as the config and the format spell it

DEFAULT_STEP = 16
DEFAULT_MAX_RATIO = 3.0
# A derived bucket holds at least this fraction of the budget's pixels (the figure; derived lists
# stay far above it at the defaults: the floor only binds for a step that is coarse against the budget).
MIN_AREA_FRACTION = 0.7


def derive_buckets(height: int, width: int, step: int = DEFAULT_STEP,
                   max_ratio: float = DEFAULT_MAX_RATIO) -> list[Bucket]:
    """The buckets of a ``height`` x ``width`` budget (the module docstring says how); never empty: the
    square nearest the budget is always one. Raises ``ConfigError`` for a step or ratio that cannot work."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ConfigError(f"bucket_step must be an integer >= 1, got {step!r}")
    if isinstance(max_ratio, bool) or not isinstance(max_ratio, (int, float)) or not math.isfinite(max_ratio) \
            or max_ratio < 1.0:
        raise ConfigError(f"bucket_max_ratio must be a number >= 1, got {max_ratio!r}")
    budget = height * width
    if step * step > budget:
        raise ConfigError(f"bucket_step {step} is larger than the budget's side"
                          f" ({height}x{width} = {budget} pixels): no bucket fits")
    largest: dict[Fraction, Bucket] = {}  # landscape buckets by aspect: the largest area of each
    short = step
    while short * short <= budget:
        long = min(budget // short, int(max_ratio * short), MAX_SIDE) // step * step
        if long >= short and short * long >= MIN_AREA_FRACTION * budget:
            aspect = Fraction(long, short)
            if aspect not in largest or short * long > largest[aspect][0] * largest[aspect][1]:
                largest[aspect] = (short, long)
        short += step
    found = {b for h, w in largest.values() for b in ((h, w), (w, h))}  # both orientations
    if not found:
        raise ConfigError(f"no bucket of a {height}x{width} budget with bucket_step {step} holds"
                          f" {MIN_AREA_FRACTION:g} of its area; use a smaller bucket_step")
    return _sorted(found)


def check_buckets(buckets: object, key: str = "buckets") -> list[Bucket]:
    """An explicit list (``[[h, w], ...]``, as YAML or the stored config give it) as sorted-free tuples,
    in the order given: at most MAX_BUCKETS, every side an integer 1..MAX_SIDE, no bucket twice.
    ``ConfigError`` names ``key``."""
    if not isinstance(buckets, (list, tuple)) or not buckets:
        raise ConfigError(f"{key} must be a non-empty list of [height, width] pairs, got {buckets!r}")
    if len(buckets) > MAX_BUCKETS:
        raise ConfigError(f"{key} lists {len(buckets):,} buckets, more than the {MAX_BUCKETS:,} a dataset can "
                          "hold (each shard's bucket id is stored as a uint16)")
    out: list[Bucket] = []
    seen: set[Bucket] = set()
    for i, item in enumerate(buckets):
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise ConfigError(f"{key}[{i}] must be a [height, width] pair, got {item!r}")
        for side in item:
            if isinstance(side, bool) or not isinstance(side, int) or not 1 <= side <= MAX_SIDE:
                raise ConfigError(f"{key}[{i}] sides must be integers 1..{MAX_SIDE}, got {list(item)}")
        bucket = (int(item[0]), int(item[1]))
        if bucket in seen:
            raise ConfigError(f"{key}[{i}] {list(bucket)} is listed twice")
        seen.add(bucket)
        out.append(bucket)
    return out


def nearest_bucket(width: int, height: int, buckets: Sequence[Bucket]) -> int:
    """The index of the bucket nearest a ``width`` x ``height`` image in |log aspect|; a tie goes to the
    larger area, then to the lower index (so the choice depends on the list alone, never on float noise
    between equal aspects: those compare as equal fractions)."""
    best = 0
    for i in range(1, len(buckets)):
        if _closer(width, height, buckets[i], buckets[best]):
            best = i
    return best


def _closer(width: int, height: int, a: Bucket, b: Bucket) -> bool:
    """Whether bucket ``a`` is strictly nearer than ``b`` (then larger area on an exact tie)."""
    da, db = _distance(width, height, a), _distance(width, height, b)
    if da != db:
        return da < db
    return a[0] * a[1] > b[0] * b[1]


def _distance(width: int, height: int, bucket: Bucket) -> float:
    # |log((w/h) / (bw/bh))| = |log(w * bh) - log(h * bw)|; integers first, so equal ratios give exactly 0
    # and mirror distances compare equal.
    num, den = width * bucket[0], height * bucket[1]
    if num == den:
        return 0.0
    return abs(math.log(num / den)) if num > den else abs(math.log(den / num))


def aspect_error(width: int, height: int, bucket: Bucket) -> float:
    """|log(stored w/h) - log(source w/h)| of an image stored in ``bucket``: what the crop changes."""
    return _distance(width, height, bucket)


def _sorted(buckets: set[Bucket]) -> list[Bucket]:
    # Tallest first (w/h ascending, compared exactly as fractions), then larger area.
    return sorted(buckets, key=lambda b: (Fraction(b[1], b[0]), -b[0] * b[1]))
