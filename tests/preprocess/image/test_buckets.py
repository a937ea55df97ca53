"""Aspect-ratio buckets (preprocess.image.buckets): the derived list, an explicit list's checks, the nearest bucket."""

from __future__ import annotations

import math

import numpy as np
import pytest

from preprocess.image.buckets import (
    DEFAULT_MAX_RATIO,
    DEFAULT_STEP,
    MIN_AREA_FRACTION,
    aspect_error,
    check_buckets,
    derive_buckets,
    nearest_bucket,
)
from shardio.errors import ConfigError
from shardio.format import MAX_SIDE


@pytest.mark.parametrize("height, width, step, ratio", [
    (256, 256, DEFAULT_STEP, DEFAULT_MAX_RATIO), (256, 256, 32, 2.0), (512, 512, 64, 4.0),
    (1024, 1024, 64, 2.5), (224, 288, 8, 3.0), (100, 100, 10, 1.5),
])
def test_derived_buckets_keep_the_rules(height: int, width: int, step: int, ratio: float) -> None:
    buckets = derive_buckets(height, width, step, ratio)
    budget = height * width
    assert len(set(buckets)) == len(buckets)
    for h, w in buckets:
        assert h % step == 0 and w % step == 0
        assert MIN_AREA_FRACTION * budget <= h * w <= budget
        assert max(h, w) / min(h, w) <= ratio + 1e-12
        assert (w, h) in buckets  # both orientations
    aspects = [w / h for h, w in buckets]
    assert aspects == sorted(aspects)  # tallest first: ids follow the aspect ratio
    assert len(set(aspects)) == len(aspects)  # one bucket per aspect ratio, the one of largest area
    assert derive_buckets(height, width, step, ratio) == buckets  # deterministic


def test_default_buckets_at_256() -> None:
    buckets = derive_buckets(256, 256)
    assert (256, 256) in buckets and buckets[0] == (432, 144) and buckets[-1] == (144, 432)
    areas = [h * w / 65536 for h, w in buckets]
    assert 0.94 <= min(areas) and max(areas) <= 1.0


def test_each_short_side_takes_the_largest_long_side() -> None:
    # 65536 / 224 = 292.6: 288 is the largest multiple of 16 within the budget.
    assert (224, 288) in derive_buckets(256, 256, 16, 3.0)
    assert (224, 304) not in derive_buckets(256, 256, 16, 3.0)


@pytest.mark.parametrize("step, ratio, words", [
    (0, 3.0, "bucket_step must be an integer >= 1"), (16.0, 3.0, "bucket_step must be an integer"),
    (True, 3.0, "bucket_step"), (16, 0.5, "bucket_max_ratio must be a number >= 1"),
    (16, math.inf, "bucket_max_ratio"), (300, 3.0, "larger than the budget's side"),
])
def test_impossible_derivations_are_refused(step, ratio, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        derive_buckets(256, 256, step, ratio)


def test_a_coarse_step_that_leaves_no_bucket_near_the_budget_is_refused() -> None:
    with pytest.raises(ConfigError, match="use a smaller bucket_step"):
        derive_buckets(200, 200, 150, 3.0)  # 150 x 150 is 0.56 of the budget


def test_explicit_lists_are_checked_and_kept_in_order() -> None:
    assert check_buckets([[256, 256], [192, 320], (320, 192)]) == [(256, 256), (192, 320), (320, 192)]


@pytest.mark.parametrize("value, words", [
    ([], "non-empty list"), ("256x256", "non-empty list"), ([[256]], r"buckets\[0\] must be a \[height, width\]"),
    ([[256, 256], [0, 10]], r"buckets\[1\] sides must be integers 1\.\." + str(MAX_SIDE)),
    ([[256, 256.0]], r"buckets\[0\] sides"), ([[MAX_SIDE + 1, 1]], "sides must be"),
    ([[True, 5]], "sides must be"),
    ([[256, 256], [192, 320], [256, 256]], r"buckets\[2\] \[256, 256\] is listed twice"),
])
def test_bad_explicit_lists_name_the_key_and_the_item(value, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        check_buckets(value)


def test_nearest_bucket_by_log_aspect() -> None:
    buckets = [(256, 256), (192, 320), (320, 192)]
    assert nearest_bucket(1000, 1000, buckets) == 0
    assert nearest_bucket(1600, 900, buckets) == 1
    assert nearest_bucket(900, 1600, buckets) == 2
    # In log space, not linear: 1.27 is nearer 1.0 than 1.667 in log (0.239 < 0.272), though not in w/h.
    assert nearest_bucket(1270, 1000, buckets) == 0


def test_ties_go_to_the_larger_area_then_the_first() -> None:
    # 2:1 images are exactly between 1:1 and 4:1 in log aspect.
    assert nearest_bucket(200, 100, [(128, 128), (64, 256)]) == 0
    assert nearest_bucket(200, 100, [(100, 400), (200, 200)]) == 0  # 40000 = 40000: the lower id
    assert nearest_bucket(200, 100, [(10, 40), (200, 200)]) == 1  # larger area
    assert nearest_bucket(300, 200, [(100, 150), (200, 300)]) == 1  # same aspect: larger area
    assert nearest_bucket(300, 200, [(200, 300), (100, 150)]) == 0


def test_nearest_is_the_minimum_of_the_aspect_error() -> None:
    rng = np.random.default_rng(0)
    buckets = derive_buckets(256, 256)
    for _ in range(500):
        width, height = (int(v) for v in rng.integers(1, 5000, 2))
        chosen = nearest_bucket(width, height, buckets)
        errors = [aspect_error(width, height, b) for b in buckets]
        assert errors[chosen] == min(errors)
        assert errors[chosen] == pytest.approx(abs(math.log(buckets[chosen][1] / buckets[chosen][0])
                                                   - math.log(width / height)), abs=1e-12)
