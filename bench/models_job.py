"""The job's cost of ``models:`` on the CPU: one worker's images/s over the bench corpus without models, with a
cheap image model and with a small convolution, rounds alternated (goal: with a cheap model >= 0.8 of the job
without models, issue "Model outputs as shards").

``python -m bench.models_job [--rounds 5] [--tars 2]`` runs ``preprocess.worker.process_input`` (the task body,
no Ray: what one core of the job does) over the first ``--tars`` tars of the corpus at 256² bucketed, torch on
one thread as a worker's core; prints a table and adds ``models_job`` to ``bench/results.json`` / ``.md``.

The models: ``cheap`` averages 8×8 blocks (a latent's shape, [3, h/8, w/8] float16, ~0.02 ms an image);
``conv`` is a 3×3 convolution to 4 channels before that pooling (~0.7 ms an image at 256²), as
``tests.preprocess.models.toy_models.LatentNet``. Both batch 16 samples a call.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

from bench.corpus import CorpusSpec, build_corpus
from bench.results_file import write_section

HERE = os.path.dirname(os.path.abspath(__file__))
SECTION = "<!-- models-job: written by python -m bench.models_job -->"
TARGET = 0.8


class PoolLatent(torch.nn.Module):
    """uint8 [B, h, w, 3] -> float16 [B, 3, h/8, w/8]: each 8×8 block's mean (the cheapest latent-shaped model)."""

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.avg_pool2d(pixels.permute(0, 3, 1, 2).float(), 8).half()


class ConvLatent(torch.nn.Module):
    """A 3×3 convolution to 4 channels, then the 8×8 pooling: a small model's compute."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = pixels.permute(0, 3, 1, 2).float() / 255
        return torch.nn.functional.avg_pool2d(self.conv(x), 8).half()


def make_cheap() -> PoolLatent:
    return PoolLatent()


def make_conv() -> ConvLatent:
    return ConvLatent()


MODELS = {"none": None,
          "cheap": {"latent": {"fn": "bench.models_job:make_cheap", "device": "cpu"}},
          "conv": {"latent": {"fn": "bench.models_job:make_conv", "device": "cpu"}}}


def _rate(tars: list[str], models: dict[str, Any] | None, scratch: str) -> float:
    from preprocess.config import JobConfig
    from preprocess.worker import process_input

    cfg = JobConfig(height=256, width=256, mode="bucket", samples_per_shard=200, models=models)
    out = tempfile.mkdtemp(dir=scratch)
    started, samples = time.perf_counter(), 0
    for tar in tars:
        stat = os.stat(tar)
        result = process_input(tar, out, cfg, (stat.st_size, stat.st_mtime_ns))
        if result.error:
            raise RuntimeError(f"{tar}: {result.error}")
        samples += result.samples
    elapsed = time.perf_counter() - started
    shutil.rmtree(out, ignore_errors=True)
    return samples / elapsed


def measure(rounds: int, tar_count: int) -> dict[str, Any]:
    torch.set_num_threads(1)  # one worker's core
    corpus = build_corpus(os.path.join(HERE, "out", "corpus"), CorpusSpec())
    tars = corpus.tars[:tar_count]
    scratch = tempfile.mkdtemp(prefix="models-job-")
    try:
        _rate(tars[:1], MODELS["conv"], scratch)  # warm: imports, the models made once per process
        rates: dict[str, list[float]] = {name: [] for name in MODELS}
        for number in range(rounds):
            for name, models in MODELS.items():
                rates[name].append(_rate(tars, models, scratch))
            print(f"round {number + 1}/{rounds}: " + ", ".join(f"{n} {r[-1]:.0f} img/s" for n, r in rates.items()),
                  flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    ratios = {name: [r / base for r, base in zip(rates[name], rates["none"])] for name in ("cheap", "conv")}
    return {"tars": len(tars), "rounds": rounds,
            "images_per_s": {name: statistics.median(r) for name, r in rates.items()},
            "ratio_median": {name: statistics.median(r) for name, r in ratios.items()},
            "ratio_spread": {name: [min(r), max(r)] for name, r in ratios.items()}, "target": TARGET}


def markdown(result: dict[str, Any]) -> str:
    rate, ratio, spread = result["images_per_s"], result["ratio_median"], result["ratio_spread"]
    met = "yes" if ratio["cheap"] >= TARGET else "**no**"
    return "\n".join([
        SECTION, "## Models in the job (CPU)", "",
        f"`python -m bench.models_job`: one worker (`process_input`, torch on one thread) over {result['tars']} "
        f"tars of the bench corpus at 256² bucketed, medians of {result['rounds']} alternated rounds.", "",
        "| figure | measured | target | met | detail |", "|---|---|---|---|---|",
        f"| job with a cheap model / job without models | {ratio['cheap']:.2f}x | >= {TARGET}x | {met} | "
        f"{rate['cheap']:.0f} vs {rate['none']:.0f} img/s, spread {spread['cheap'][0]:.2f}-{spread['cheap'][1]:.2f} |",
        f"| job with a small convolution / job without models | {ratio['conv']:.2f}x |  |  | "
        f"{rate['conv']:.0f} img/s, spread {spread['conv'][0]:.2f}-{spread['conv'][1]:.2f} |", ""])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tars", type=int, default=2)
    parser.add_argument("--results", default=HERE, help="directory of results.json/.md (default: bench/)")
    args = parser.parse_args(argv)
    result = measure(args.rounds, args.tars)
    text = markdown(result)
    print(text)
    write_section(args.results, "models_job", result, SECTION, text)
    return result


if __name__ == "__main__":
    main()
