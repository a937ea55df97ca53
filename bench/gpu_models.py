"""``make gpu-check``'s ``models`` part: the job with a model on the GPU against the model alone on the same
pre-decoded batches (goal: >= 0.8, issue "Model outputs as shards": the job keeps the model busy).

- **The job**: ``preprocess run`` (local Ray, every core) over LAION-like tars (``bench.corpus``) at 256² with
  ``models: {latent: bench.gpu_models:make_encoder}`` on the device (``replicas: auto``: one Ray actor per GPU,
  fed by every core's decode tasks); its rate is the run report's ``processing_images_per_s`` (after start-up:
  Ray, the replica's model loaded).
- **The model alone**: the dataset that run wrote, its pixels in memory as uint8 batches (what the job hands the
  model), moved and run batch after batch, synchronised at the end.

``Encoder`` is sized to be slower than the draft decode of 16 cores (about 4-5k images/s at 256²): eight 3×3
convolutions of 128 channels at full size, then three strided ones to [B, 8, h/8, w/8] (about 160 GFLOP an image),
in bfloat16 on CUDA, so the ratio says whether the job feeds the model, not whether the model waits for
nothing. The dry run uses a two-layer stand-in on the CPU over two small tars.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

import torch

from bench.corpus import CorpusSpec, build_corpus

GOAL = 0.8
BATCH = 64


class Encoder(torch.nn.Module):
    """uint8 [B, h, w, 3] -> [B, 8, h/8, w/8]: a VAE encoder's shape, with enough compute to be the job's limit."""

    def __init__(self, width: int = 128, full_size_layers: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = [torch.nn.Conv2d(3, width, 3, padding=1), torch.nn.SiLU()]
        for _ in range(full_size_layers - 1):
            layers += [torch.nn.Conv2d(width, width, 3, padding=1), torch.nn.SiLU()]
        for _ in range(3):
            layers += [torch.nn.Conv2d(width, width, 3, stride=2, padding=1), torch.nn.SiLU()]
        layers.append(torch.nn.Conv2d(width, 8, 1))
        self.net = torch.nn.Sequential(*layers)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = pixels.permute(0, 3, 1, 2).float() / 127.5 - 1
        with torch.autocast(pixels.device.type, dtype=torch.bfloat16, enabled=pixels.device.type == "cuda"):
            return self.net(x).to(torch.bfloat16)


def make_encoder() -> Encoder:
    return Encoder()


def make_small_encoder() -> Encoder:
    """The dry run's stand-in: two layers of 8 channels."""
    return Encoder(width=8, full_size_layers=1)


def run(work: str, device: torch.device, dry: bool = False) -> dict[str, Any]:
    spec = CorpusSpec(tars=2, samples_per_tar=24) if dry else CorpusSpec(tars=8, samples_per_tar=400)
    corpus = build_corpus(os.path.join(work, "corpus"), spec, log=lambda *a, **k: None)
    side, fn = (64, "bench.gpu_models:make_small_encoder") if dry else (256, "bench.gpu_models:make_encoder")
    out = os.path.join(work, "models-job")
    shutil.rmtree(out, ignore_errors=True)
    config = os.path.join(work, "models.yaml")
    with open(config, "w", encoding="utf-8") as f:
        json.dump({"models": {"latent": {"fn": fn, "device": device.type, "batch_size": BATCH}}}, f)  # YAML
    report = os.path.join(work, "models-report.json")
    workers = ["--workers", "1"] if dry else []
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "preprocess.cli", "run", os.path.join(corpus.directory, "*.tar"),
                           "--output", out, "--config", config, "--size", str(side), "-q", "--report", report,
                           *workers], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the job with a model exited {done.returncode}: {done.stderr[-2000:]}")
    with open(report, encoding="utf-8") as f:
        ran = json.load(f)
    job_rate = float(ran["processing_images_per_s"])
    alone = _model_alone(out, fn, device)
    return {"device": str(device), "model": fn, "side": side, "samples": ran["samples_written"],
            "job_seconds": round(time.perf_counter() - started, 1), "job_startup_s": ran.get("startup_s"),
            "job_samples_per_s": round(job_rate, 1), "model_alone_samples_per_s": round(alone, 1),
            "ratio": round(job_rate / alone, 3), "goal": GOAL}


def _model_alone(dataset: str, fn: str, device: torch.device) -> float:
    """The model over the dataset's pixels already in memory, batch after batch: samples/s."""
    from preprocess.models.loading import load_model
    from preprocess.models.model_config import ModelSpec
    from shardio import ShardDataset

    batches = [batch["image"].clone() for batch in ShardDataset(dataset, BATCH)]
    if device.type == "cuda":
        batches = [b.pin_memory() for b in batches]
    model = load_model(ModelSpec(name="latent", fn=fn))
    if isinstance(model, torch.nn.Module):
        model = model.to(device).eval()
    with torch.inference_mode():
        model(batches[0].to(device))  # warm: kernels chosen, memory allocated
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        for batch in batches:
            model(batch.to(device, non_blocking=True))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return sum(len(b) for b in batches) / (time.perf_counter() - started)
