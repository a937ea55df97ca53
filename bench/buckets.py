"""``mode: bucket`` against ``mode: center_crop``: how much of the picture's shape is kept, and what it costs.

Aspect kept: every image of the bench corpus goes through the job's transform in bucket mode at a 256²
budget, and its error |log(stored w/h) - log(source w/h)| (source size after EXIF orientation) is taken
beside a square centre crop's (|log(source w/h)|), with the stored area over the budget (min-max). The
bench corpus holds eight web photo sizes (4:3 to 16:9, landscape and portrait); a LAION-like spread, random
crops of those photos (each side cut to a uniform 37-100% of it, so log aspect spreads to beyond 1:3 and 3:1,
and a centre crop loses 0.38 / 1.03 at median / p95, as on LAION-like data), is scored from the sizes alone:
the bucket an image takes depends on its size only (``tests/preprocess/image/test_transform.py`` checks the
transform stores exactly that bucket's shape).

Job cost: the job over every tar in bucket mode and in centre-crop mode, interleaved rounds in one Ray
session (``bench.job_jpeg``'s method: whole runs, alternating which goes first, the median of the rounds'
ratios with their spread), target bucket / centre crop >= 0.95 in images/s. Beside it the CPU time per image
of one worker (``process_input`` over one tar, no Ray), which other processes hardly move.

``python -m bench.buckets [--quick] [--rounds N]`` runs both on the bench corpus and writes
``bench/out/buckets/results.json``; ``make bench`` runs them inside ``bench.run``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.corpus import WEB_SIZES, CorpusSpec, build_corpus, read_images
from bench.job_bench import ForeignLoad, _run, interleaved_rounds, local_ray, worker_cpu_ms
from preprocess.image.buckets import aspect_error, nearest_bucket
from preprocess.config import BUCKET, JobConfig
from preprocess.image.transform import process_image

__all__ = ["aspect_figures", "crop_spread", "bucket_crop_rounds", "bucket_worker_cpu", "summary_lines",
           "TARGET_RATE", "TARGET_MEDIAN", "TARGET_P95", "AREA_RANGE"]

TARGET_RATE = 0.95  # the job in bucket mode >= 0.95 x the centre-crop job's images/s
TARGET_MEDIAN, TARGET_P95 = 0.05, 0.15  # aspect error at a 256² budget
AREA_RANGE = (0.7, 1.0)  # stored area over the budget
CROP_FRACTION = 0.37  # the LAION-like spread: each side of a photo cut to a uniform 37-100% of it
WARMUP_RUNS = 1
CENTRE = "center_crop"


def _stats(errors: list[float]) -> dict[str, float]:
    values = np.asarray(errors)
    return {"median": round(float(np.median(values)), 4), "p95": round(float(np.percentile(values, 95)), 4),
            "max": round(float(values.max()), 4)}


def aspect_figures(images: list[bytes], cfg: JobConfig) -> dict[str, Any]:
    """Every image through the transform in bucket mode: aspect error against the source's, beside a
    square centre crop's, stored area over the budget, samples per bucket."""
    budget = cfg.height * cfg.width
    bucket_errors, centre_errors, areas = [], [], []
    per_bucket = [0] * len(cfg.shapes)
    for data in images:
        out = process_image(data, cfg)
        stored_h, stored_w = out.pixels.shape[:2]
        bucket_errors.append(abs(math.log(stored_w / stored_h) - math.log(out.width / out.height)))
        centre_errors.append(abs(math.log(out.width / out.height)))
        areas.append(stored_h * stored_w / budget)
        per_bucket[out.bucket] += 1
    return {"images": len(images), "bucket": _stats(bucket_errors), "center_crop": _stats(centre_errors),
            "area_min": round(min(areas), 4), "area_max": round(max(areas), 4),
            "samples_per_bucket": {f"{h}x{w}": n for (h, w), n in zip(cfg.shapes, per_bucket) if n}}


def crop_spread(cfg: JobConfig, images: int = 20_000, seed: int = 0) -> dict[str, Any]:
    """The LAION-like spread (module docstring) scored from sizes: the nearest bucket's aspect error."""
    rng = np.random.default_rng(seed)
    bucket_errors, centre_errors = [], []
    for index in rng.integers(len(WEB_SIZES), size=images):
        width, height = WEB_SIZES[index]
        fw, fh = rng.uniform(CROP_FRACTION, 1.0, 2)
        w, h = max(1, round(width * fw)), max(1, round(height * fh))
        bucket_errors.append(aspect_error(w, h, cfg.shapes[nearest_bucket(w, h, cfg.shapes)]))
        centre_errors.append(abs(math.log(w / h)))
    return {"images": images, "bucket": _stats(bucket_errors), "center_crop": _stats(centre_errors)}


def bucket_crop_rounds(tars: list[str], root: str, cfg: JobConfig, rounds: int,
                       log: Callable[[str], None] = print) -> dict[str, Any]:
    """``rounds`` interleaved rounds of the centre-crop and the bucket job over ``tars``, Ray already
    initialised; per-round rates and bucket / centre crop."""
    per_round = interleaved_rounds(tars, root, _mode_configs(cfg), rounds, log, warmup=WARMUP_RUNS, run=_run)
    rows = [{"center_crop_images_per_s": round(rates[CENTRE], 2), "bucket_images_per_s": round(rates[BUCKET], 2),
             "ratio": round(rates[BUCKET] / rates[CENTRE], 4)} for rates in per_round]
    ratios = [row["ratio"] for row in rows]
    return {"rounds": rows, "ratio_median": round(statistics.median(ratios), 4), "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "center_crop_images_per_s": round(statistics.median(r["center_crop_images_per_s"] for r in rows), 2),
            "bucket_images_per_s": round(statistics.median(r["bucket_images_per_s"] for r in rows), 2)}


def bucket_worker_cpu(tar: str, root: str, cfg: JobConfig, rounds: int) -> dict[str, Any]:
    """CPU seconds per image of ``process_input`` over ``tar`` (this process and its commit thread), centre
    crop and bucket alternating after one untimed pass of each; medians and centre / bucket time."""
    cpu_ms = worker_cpu_ms(tar, root, _mode_configs(cfg), rounds)
    centre_ms, bucket_ms = statistics.median(cpu_ms[CENTRE]), statistics.median(cpu_ms[BUCKET])
    return {"center_crop_cpu_ms_per_image": round(centre_ms, 4), "bucket_cpu_ms_per_image": round(bucket_ms, 4),
            "ratio": round(centre_ms / bucket_ms, 4), "rounds": rounds}


def _mode_configs(cfg: JobConfig) -> dict[str, JobConfig]:
    """``cfg`` in centre-crop mode, then in bucket mode (buckets derived from its budget)."""
    return {CENTRE: dataclasses.replace(cfg, mode=CENTRE, buckets=None),
            BUCKET: dataclasses.replace(cfg, mode=BUCKET, buckets=None)}


def summary_lines(r: dict[str, Any]) -> list[str]:
    """The figures' details, one line each: aspect kept (corpus, LAION-like spread), job cost."""
    a, s = r["aspect"], r["crop_spread"]
    lines = [
        f"aspect error at {r['budget']}: bench corpus ({a['images']} images) bucket median {a['bucket']['median']}"
        f" / p95 {a['bucket']['p95']} vs centre crop {a['center_crop']['median']} / {a['center_crop']['p95']}; "
        f"stored area {a['area_min']}-{a['area_max']} of the budget; {len(r['buckets'])} buckets",
        f"aspect error, LAION-like random crops ({s['images']} sizes): bucket median {s['bucket']['median']} / "
        f"p95 {s['bucket']['p95']} vs centre crop {s['center_crop']['median']} / {s['center_crop']['p95']}",
    ]
    if "job" in r:
        j = r["job"]
        line = (f"job bucket / center_crop median {j['ratio_median']:.3f} of {len(j['rounds'])} interleaved rounds "
                f"(spread {j['ratio_min']:.3f}-{j['ratio_max']:.3f}), {j['bucket_images_per_s']:.0f} vs "
                f"{j['center_crop_images_per_s']:.0f} img/s")
        if "worker_cpu" in r:
            c = r["worker_cpu"]
            line += (f"; one worker's CPU per image {c['bucket_cpu_ms_per_image']:.2f} vs "
                     f"{c['center_crop_cpu_ms_per_image']:.2f} ms (center_crop / bucket {c['ratio']:.3f})")
        lines.append(line)
    return lines


def measure(tars: list[str], root: str, cfg: JobConfig, rounds: int, log: Callable[[str], None] = print,
            job: bool = True) -> dict[str, Any]:
    """Both figures on ``tars`` (Ray already initialised when ``job``); ``cfg``'s budget and bucket keys."""
    bucketed = dataclasses.replace(cfg, mode=BUCKET, buckets=None)
    results: dict[str, Any] = {"budget": f"{cfg.height}x{cfg.width}", "buckets": [list(b) for b in bucketed.shapes]}
    log(f"aspect kept: {len(tars)} tars through the transform in bucket mode")
    results["aspect"] = aspect_figures(read_images(tars), bucketed)
    results["crop_spread"] = crop_spread(bucketed)
    if job:
        log(f"{rounds} rounds of: the job in center_crop and bucket mode over {len(tars)} tars")
        results["job"] = bucket_crop_rounds(tars, root, cfg, rounds, log=log)
        log(f"worker CPU time per image, center_crop vs bucket, over {os.path.basename(tars[0])} (no Ray)")
        results["worker_cpu"] = bucket_worker_cpu(tars[0], root, cfg, max(1, rounds // 2))
    return results


def _log(message: str) -> None:
    print(f"[bench.buckets {time.strftime('%H:%M:%S')}] {message}", flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.buckets", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny corpus, one round (checks the bench runs)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; 1 with --quick)")
    parser.add_argument("--tars", type=int, default=None, help="corpus tars (default: the bench corpus's 6)")
    parser.add_argument("--samples-per-tar", type=int, default=None, help="images a tar (default: the corpus's 200)")
    parser.add_argument("--aspect-only", action="store_true", help="the aspect figures alone (no job)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    args = parser.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 5)
    cores = os.cpu_count() or 1
    spec = CorpusSpec(tars=2 * cores, samples_per_tar=24) if args.quick else CorpusSpec()
    if args.tars or args.samples_per_tar:  # a smaller corpus of the same kind (cached under its own name)
        spec = CorpusSpec(tars=args.tars or spec.tars, samples_per_tar=args.samples_per_tar or spec.samples_per_tar)
    corpus = build_corpus(os.path.join(args.out, "corpus"), spec, log=_log)
    tars = corpus.tars
    runs = os.path.join(args.out, "runs-buckets")
    started = time.perf_counter()
    with ForeignLoad() as foreign:
        if args.aspect_only:
            results = measure(tars, runs, JobConfig(), rounds, log=_log, job=False)
        else:
            with local_ray(cores):
                results = measure(tars, runs, JobConfig(), rounds, log=_log)
    results["foreign_load"] = foreign.summary()
    results["corpus"] = corpus.summary()
    results["bench_seconds"] = round(time.perf_counter() - started, 1)
    shutil.rmtree(runs, ignore_errors=True)
    directory = os.path.join(args.out, "buckets")
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    for line in summary_lines(results):
        print(line)
    _log(f"done in {results['bench_seconds']:.0f} s; wrote {directory}/results.json")
    return results


if __name__ == "__main__":
    main()
