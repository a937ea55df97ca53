"""``make bench``: preprocessing, scaling, memory and reader figures, each a ratio taken in one run.

``python -m bench.run [--quick] [--results DIR] [--no-cluster] [--rounds N]`` writes ``results.json``,
``results.md`` and ``chart.png`` into ``bench/`` (``--quick``: a 4-tar corpus of 24 images each, one round,
results into ``bench/out/quick``). ``--job-floor-only --rounds 9`` measures only the headline ratio, job /
(cores x floor), in interleaved rounds (``bench.job_floor``; ~2-3 minutes on 2 cores) and writes
``bench/out/job-floor/results.json``: the confirmation run for a quiet machine. Absolute rates drift 2x
on a shared machine; every target is a ratio of two rates measured in the same run (the headline one in
the same rounds), on the same images, to the same 256×256 centre crop.
The corpus and scratch datasets live in ``bench/out`` (the corpus is cached between runs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import time
from typing import Any

import psutil

from bench.buckets import measure as bucket_figures
from bench.chart import draw_chart
from bench.corpus import CorpusSpec, build_corpus, combined_tar, read_images
from bench.job_bench import ForeignLoad, cold_run, local_ray, memory_run, two_node_cluster, warm_rates
from bench.job_floor import job_floor_rounds
from bench.job_jpeg import jpeg_raw_rounds, worker_cpu_rounds
from bench.paths import PathPool, available_paths
from bench.reader_figures import reader_figures, webdataset_samples_per_s
from bench.results_file import write_top
from bench.run_figures import figures, markdown
from bench.stock_pillow import StockPillowPath, ensure_stock_pillow
from preprocess.config import JobConfig
from preprocess.image.versions import library_versions, pillow_build

HERE = os.path.dirname(os.path.abspath(__file__))
SCRATCH = os.path.join(HERE, "out")


def _machine() -> dict[str, Any]:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {
        "cores": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "cpu": model,
        "python": platform.python_version(),
        "load_avg_at_start": os.getloadavg(),
    }


def _log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    cores = os.cpu_count() or 1
    cfg = JobConfig()  # 256×256 centre crop, bicubic, draft on, 1,000-sample shards: the defaults
    spec = CorpusSpec(tars=2 * cores, samples_per_tar=24) if args.quick else CorpusSpec()
    rounds, reps = (1, 1) if args.quick else (3, 3)
    corpus = build_corpus(os.path.join(SCRATCH, "corpus"), spec, log=_log)
    runs = os.path.join(SCRATCH, "runs")
    small, large = corpus.tars[:cores], corpus.tars  # small: one tar per core, so every core is busy
    results: dict[str, Any] = {
        "machine": _machine(),
        "pillow_build": pillow_build(),
        "versions": library_versions(),
        "config": cfg.to_dict(),
        "corpus": corpus.summary(),
        "quick": args.quick,
    }
    _log("PIL build: " + json.dumps(results["pillow_build"]))

    _log(f"per-core paths on the same {corpus.images} images, one process per core ({cores})")
    names = available_paths()
    if "img2dataset" not in names:
        _log("OpenCV not installed: img2dataset-style baseline skipped (pip install opencv-python-headless)")
    stock, results["stock_pillow"] = _stock_pillow(corpus.tars, cfg, cores)
    remote = {}
    if stock is not None:
        remote["naive_stock"] = stock
        names.insert(names.index("naive_simd"), "naive_stock")
        remote["floor_stock"] = stock.path("floor_stock")
        names.insert(names.index("floor") + 1, "floor_stock")
    images = read_images(corpus.tars)
    with PathPool(images, cfg, cores, remote) as pool:
        del images
        try:
            pool.rounds(names, rounds)
        finally:
            if stock is not None:
                stock.close()  # its pool holds every image too; the job runs without it
        for _ in range(rounds):
            pool.worker_rate(large, runs)

        _log("job, cold: run_job starts Ray itself (what one `preprocess run` costs)")
        cold = cold_run(large, runs, cfg)
        _log(f"job, warm, {cores} CPUs: small ({len(small)} tars) vs large ({len(large)} tars) runs,"
             " each round between two floor measurements")
        with local_ray(cores) as session:
            all_cores = job_floor_rounds(pool, small, large, runs, cfg, args.rounds, log=_log)
            all_cores["ray_init_s"] = round(session.startup_s, 3)
            _log("job, warm: encoding jpeg vs raw, interleaved rounds (bench.job_jpeg)")
            jpeg_vs_raw = jpeg_raw_rounds(large, runs, cfg, args.rounds, log=_log)
            jpeg_vs_raw["worker_cpu"] = worker_cpu_rounds(large[0], runs, cfg, max(1, args.rounds // 2))
            _log("mode: bucket vs center_crop: aspect kept, then the job in interleaved rounds (bench.buckets)")
            results["buckets"] = bucket_figures(large, runs, cfg, args.rounds, log=_log)
        _log("job, warm, 1 CPU")
        with local_ray(1) as session:
            one = warm_rates(small, large, runs, cfg, reps)
            one["ray_init_s"] = round(session.startup_s, 3)
        cluster = None
        if not args.no_cluster:
            _log("job on a 2-node local Ray cluster, 1 CPU per node")
            with two_node_cluster() as nodes:
                cluster = warm_rates(small, large, runs, cfg, reps)
                cluster["startup_s"], cluster["nodes"] = round(nodes.startup_s, 3), nodes.nodes
        # The floor once more: the machine drifts; floor-relative figures use every floor sample.
        pool.rounds(["floor"], 1)
        paths = {
            name: {
                "images_per_s": round(pool.median(name), 2),
                "samples": [round(r, 1) for r in pool.samples[name]],
            }
            for name in [*names, "worker"]
        }
    for path in paths.values():
        path["ms_per_image_per_core"] = round(1000 * cores / path["images_per_s"], 3)
    steady = all_cores["marginal_images_per_s"]
    cold["fixed_startup_s"] = round(cold["seconds"] - cold["images"] / steady, 3)
    results["paths"] = paths
    results["job"] = {"cold": cold, "all_cores": all_cores, "one_cpu": one, "two_node_cluster": cluster,
                      "jpeg_vs_raw": jpeg_vs_raw}

    _log("memory: the CLI on one tar of every image, 1 worker, 1,000-sample shards")
    memory = memory_run(combined_tar(corpus), runs, cfg)
    results["memory"] = memory

    _log("reader: ShardDataset on the dataset the memory run wrote, np.copyto of the same bytes")
    results["reader"] = reader_figures(memory["output"], args.quick)
    wds_tars = corpus.tars[: max(1, cores // 2)] if not args.quick else corpus.tars[:1]
    _log(f"reader baseline: WebDataset + PIL DataLoader ({cores} workers) over {len(wds_tars)} source tar(s)")
    results["reader"]["webdataset_pil_samples_per_s"] = _wds(wds_tars, cores, cfg.width)
    shutil.rmtree(runs, ignore_errors=True)
    results["figures"] = figures(results)
    return results


def _stock_pillow(tars: list[str], cfg: JobConfig, cores: int) -> tuple[StockPillowPath | None, dict]:
    """The stock-Pillow naive path's child (installing stock Pillow into bench/out on first use), or None
    with the reason, printed, when it cannot run: the job / naive target then reads n/a."""
    directory, why = ensure_stock_pillow(_log)
    if directory is not None:
        try:
            stock = StockPillowPath(tars, cfg.to_dict(), cores, directory)
        except RuntimeError as exc:
            why = str(exc)
        else:
            info = {**stock.info, "directory": os.path.relpath(directory, os.path.dirname(HERE))}
            _log("naive baseline on stock Pillow: " + json.dumps(info))
            return stock, info
    _log(f"SKIPPED the naive stock-Pillow baseline ({why}); job / naive reads n/a, the Pillow-SIMD row stays")
    return None, {"skipped": why}


def _wds(tars: list[str], workers: int, side: int) -> float | None:
    # examples/train.py globs its pattern: link the chosen tars into a directory of their own.
    directory = os.path.join(SCRATCH, "wds-tars")
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    for tar in tars:
        os.symlink(os.path.abspath(tar), os.path.join(directory, os.path.basename(tar)))
    rate = webdataset_samples_per_s(os.path.join(directory, "*.tar"), workers, side)
    return round(rate, 2) if rate else None


def measure_job_floor(args: argparse.Namespace) -> dict[str, Any]:
    """Only the interleaved job / floor rounds (``--job-floor-only``)."""
    cores = os.cpu_count() or 1
    cfg = JobConfig()
    spec = CorpusSpec(tars=2 * cores, samples_per_tar=24) if args.quick else CorpusSpec()
    corpus = build_corpus(os.path.join(SCRATCH, "corpus"), spec, log=_log)
    runs = os.path.join(SCRATCH, "runs")
    results: dict[str, Any] = {"machine": _machine(), "pillow_build": pillow_build(),
                               "versions": library_versions(), "config": cfg.to_dict(),
                               "corpus": corpus.summary(), "quick": args.quick}
    images = read_images(corpus.tars)
    with PathPool(images, cfg, cores) as pool, local_ray(cores) as session:
        del images
        _log(f"{args.rounds} rounds of: job on {cores} and {len(corpus.tars)} tars between floor measurements "
             f"({cores} processes)")
        results["job_floor"] = job_floor_rounds(
            pool, corpus.tars[:cores], corpus.tars, runs, cfg, args.rounds, log=_log
        )
        results["job_floor"]["ray_init_s"] = round(session.startup_s, 3)
    shutil.rmtree(runs, ignore_errors=True)
    return results


def _job_floor_only(args: argparse.Namespace) -> dict[str, Any]:
    results_dir = args.results or os.path.join(SCRATCH, "job-floor")
    os.makedirs(results_dir, exist_ok=True)
    with ForeignLoad() as foreign:
        results = measure_job_floor(args)
    results["foreign_load"] = foreign.summary()
    with open(os.path.join(results_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    jf, load = results["job_floor"], results["foreign_load"]
    print("| round | floor img/s | job img/s | job / floor |\n|---|---|---|---|")
    for index, row in enumerate(jf["rounds"], 1):
        print(f"| {index} | {row['floor_images_per_s']:.0f} | {row['job_images_per_s']:.0f} "
              f"| {row['ratio']:.3f} |")
    print(f"\njob / (cores x floor): median {jf['ratio_median']:.3f} (spread {jf['ratio_min']:.3f}-"
          f"{jf['ratio_max']:.3f}, {len(jf['rounds'])} rounds; target >= 0.9); other processes used "
          f"{load['mean_cores']} cores on average (max {load['max_cores']})")
    _log(f"wrote {results_dir}/results.json")
    return results


# The keys (and marked results.md sections) other benchmarks add to the files this one writes.
SECTION_KEYS = ("object_store", "cold_epoch", "models_job")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny corpus, one round (checks the bench runs)")
    parser.add_argument(
        "--results",
        help="directory for results.json/.md and chart.png "
        "(default: bench/, or bench/out/quick with --quick)",
    )
    parser.add_argument("--no-cluster", action="store_true", help="skip the 2-node Ray cluster run")
    parser.add_argument("--job-floor-only", action="store_true",
                        help="only the interleaved job / floor rounds (results into bench/out/job-floor)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved job / floor rounds (default 9; 1 with --quick)")
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 9
    if args.job_floor_only:
        return _job_floor_only(args)
    results_dir = args.results or (os.path.join(SCRATCH, "quick") if args.quick else HERE)
    os.makedirs(results_dir, exist_ok=True)
    started = time.perf_counter()
    with ForeignLoad() as foreign:
        results = measure(args)
    results["foreign_load"] = foreign.summary()
    results["bench_seconds"] = round(time.perf_counter() - started, 1)
    text = markdown(results)
    write_top(results_dir, results, text, SECTION_KEYS)
    draw_chart(
        results["figures"],
        f"shardio bench: {results['machine']['cores']} cores, "
        f"PIL {results['pillow_build']['pil_version']}, "
        f"libjpeg-turbo {results['pillow_build']['libjpeg_turbo']}",
        os.path.join(results_dir, "chart.png"),
    )
    print(text)
    _log(f"done in {results['bench_seconds']:.0f} s; wrote {results_dir}/results.json, results.md, chart.png")
    return results


if __name__ == "__main__":
    main()
