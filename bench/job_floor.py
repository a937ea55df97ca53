"""The headline ratio, job steady rate / (cores x per-core floor), from interleaved rounds.

On a shared VM the host drifts 20-30% within minutes with nothing visible inside the guest: a job rate and
a floor rate taken minutes apart gave 0.81-0.93 for the same code. So the floor and the job alternate
(floor, job, floor, job, ..., floor): each round's job runs are bracketed by two floor measurements, and its
ratio is the job's marginal rate over the mean of those two, so a drift that is steady across the round
cancels instead of landing on whichever was measured later. The job's two runs alternate their order
(small then large, then large then small) for the same reason. The figure is the median of the rounds'
ratios with their spread (min-max) beside it: drift faster than a round (~10 s on 2 cores) shows as
spread, not as a biased median.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench.job_bench import _fresh, _run
from bench.paths import PathPool
from preprocess.config import JobConfig

__all__ = ["job_floor_rounds", "WARMUP_RUNS"]

# Untimed runs over every tar before the first round. The job's tasks run ~8% slower over their first
# ~5 tars a worker in this bench (0.86-0.91 s a 200-image tar, then 0.78-0.80), though a loop over the same
# tars in one Ray task or one plain process is flat from the first: two large runs (~6 tars a worker on 2
# cores, ~5 s) reach the steady state the figure is about, where one small run (1 tar a worker) did not.
WARMUP_RUNS = 2


def job_floor_rounds(
    pool: PathPool,
    small: list[str],
    large: list[str],
    root: str,
    cfg: JobConfig,
    rounds: int,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """``rounds`` job rounds between ``rounds + 1`` floor measurements, Ray already initialised; per-round
    ratios.

    The job's steady rate is the marginal rate between its small and large run (same warm workers, so
    Ray's per-run fixed cost cancels); the floor is ``pool.rate("floor")`` (draft + load, one process per
    core, the pool idle while the job runs), a round's floor the mean of the measurements before and after
    its job runs. An untimed pass of the floor and ``WARMUP_RUNS`` untimed large runs warm up first.
    """
    pool.rounds(["floor"], 0)  # warm-up pass of the floor's processes
    for _ in range(WARMUP_RUNS):
        _run(large, _fresh(root, "warmup"), cfg)
        shutil.rmtree(os.path.join(root, "warmup"), ignore_errors=True)
    rows: list[dict[str, float]] = []
    images: dict[str, int] = {}
    per_node: dict[str, int] = {}
    floor_after = pool.rate("floor")
    for index in range(rounds):
        floor_before = floor_after
        seconds: dict[str, float] = {}
        order = (("small", small), ("large", large))
        for kind, tars in order if index % 2 == 0 else order[::-1]:
            seconds[kind], report = _run(tars, _fresh(root, kind), cfg)
            images[kind] = report.samples_written
            per_node = report.inputs_per_node
            shutil.rmtree(os.path.join(root, kind), ignore_errors=True)
        floor_after = pool.rate("floor")
        floor = (floor_before + floor_after) / 2
        extra_s = seconds["large"] - seconds["small"]
        steady = (images["large"] - images["small"]) / extra_s if extra_s > 0 else float("nan")
        rows.append({"floor_images_per_s": round(floor, 2), "job_images_per_s": round(steady, 2),
                     "floor_before_images_per_s": round(floor_before, 2),
                     "floor_after_images_per_s": round(floor_after, 2),
                     "small_s": round(seconds["small"], 3), "large_s": round(seconds["large"], 3),
                     "ratio": round(steady / floor, 4)})
        log(f"round {index + 1}/{rounds}: floor {floor:.0f} img/s, job {steady:.0f} img/s, "
            f"ratio {steady / floor:.3f}")
    # A round whose large run was not slower than its small one measured nothing (a stall hit the small
    # run): it stays in "rounds" but not in the figure, whose median NaN would otherwise poison.
    ratios = [row["ratio"] for row in rows if row["ratio"] == row["ratio"]] or [float("nan")]
    return {
        "rounds": rows,
        "ratio_median": round(statistics.median(ratios), 4),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "floor_images_per_s": round(statistics.median(r["floor_images_per_s"] for r in rows), 2),
        # Kept under warm_rates' names: the other figures (scaling, Ray's cost) read them.
        "marginal_images_per_s": round(statistics.median(
            [r["job_images_per_s"] for r in rows if r["ratio"] == r["ratio"]] or [float("nan")]), 2),
        "small_images": images["small"],
        "large_images": images["large"],
        "small_s": [r["small_s"] for r in rows],
        "large_s": [r["large_s"] for r in rows],
        "large_images_per_s": round(images["large"] / statistics.median(r["large_s"] for r in rows), 2),
        "inputs_per_node": per_node,
        "output": None,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
