"""Augmentation benchmark: ``shardio.train.augment`` throughput against copying the batch, and its resampling
error against an antialiased resize.

``python -m bench.augment [--seconds S] [--batch B] [--device D] [--no-quality]`` takes uint8 NHWC batches
of 256² and 288² (what ``configs/default.yaml`` and ``configs/288.yaml`` store) and, round-robin until
``S`` seconds (default 10) are spent, times on ``D`` (default cpu):

- ``copy``: ``copy_`` of the uint8 batch into a reused buffer, the cost of touching the batch once (the
  pinning copy a ``DeviceLoader`` makes anyway);
- ``normalise``: ``shardio.to_device`` with no augmentation (float32 NCHW of the stored side);
- ``train f32`` / ``train bf16``: ``TrainAugment(224)`` (RandomResizedCrop + flip + normalise);
- ``eval``: ``EvalTransform(224)`` (centre crop 0.875 + resize + normalise).

Reported: samples/s (median over rounds) and the ratio of each path's time to the copy's. Absolute rates
drift 2x on a shared machine; ratios taken in the same rounds much less.

Quality (``--no-quality`` skips it): the mean absolute difference (0-255 scale) of the crop resampled by
grid_sample (bilinear, no antialias) and by ``F.interpolate(crop, antialias=True)`` (torchvision's
RandomResizedCrop default), for the largest crop of each stored side (the strongest downscale), on
random-pixel images (the worst case: half the energy above the new Nyquist) and on 1/f noise (the
amplitude spectrum of photographs); beside it, for scale, how far antialiased bicubic is from
antialiased bilinear on the same crops (a choice of filter that training recipes make freely).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from shardio.train.augment import CropParams, EvalTransform, TrainAugment, resized_crop
from shardio.train.loader import to_device

OUTPUT = 224
SIDES = (256, 288)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def throughput(side: int, batch: int, seconds: float, device: torch.device) -> dict[str, float]:
    """Samples/s per path for one stored side, paths interleaved so load drifts hit them alike."""
    generator = torch.Generator().manual_seed(side)
    images = torch.randint(0, 256, (batch, side, side, 3), dtype=torch.uint8, generator=generator).to(device)
    positions = torch.arange(batch, device=device)
    buffer = torch.empty_like(images)
    train, train_bf16 = TrainAugment(OUTPUT), TrainAugment(OUTPUT, dtype=torch.bfloat16)
    evaluate = EvalTransform(OUTPUT)
    paths: dict[str, Callable[[], Any]] = {
        "copy": lambda: buffer.copy_(images),
        "normalise": lambda: to_device({"image": images}, device),
        "train f32": lambda: train(images, epoch=0, positions=positions),
        "train bf16": lambda: train_bf16(images, epoch=0, positions=positions),
        "eval": lambda: evaluate(images),
    }
    times: dict[str, list[float]] = {name: [] for name in paths}
    for run in paths.values():  # warm-up: allocator, lazily built constants
        run()
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times["copy"]) < 3:
        for name, run in paths.items():
            _synchronize(device)
            start = time.perf_counter()
            run()
            _synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: batch / statistics.median(values) for name, values in times.items()}


def _one_over_f(batch: int, side: int, generator: torch.Generator) -> torch.Tensor:
    """Octaves of noise with amplitude proportional to their wavelength: the 1/f amplitude spectrum of
    photographs, down to single-pixel detail (one octave per factor of 2, bilinear-upsampled)."""
    image = torch.zeros(batch, 3, side, side)
    cells = side
    while cells >= 2:
        noise = torch.rand(batch, 3, cells, cells, generator=generator) - 0.5
        image += F.interpolate(noise, (side, side), mode="bilinear", align_corners=False) * (side / cells)
        cells //= 2
    low, high = image.amin(dim=(1, 2, 3), keepdim=True), image.amax(dim=(1, 2, 3), keepdim=True)
    return (image - low) / (high - low) * 255


def quality(sides: tuple[int, ...] = (*SIDES, 512), batch: int = 8) -> list[dict[str, Any]]:
    """Mean |grid_sample bilinear - antialiased bilinear| of each stored side's full-image crop to 224."""
    generator = torch.Generator().manual_seed(0)
    identity = {"mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)}
    rows = []
    for side in sides:
        crop = torch.full((batch,), float(side), dtype=torch.float64)
        full = CropParams(torch.zeros(batch, dtype=torch.float64), torch.zeros(batch, dtype=torch.float64),
                          crop, crop, torch.zeros(batch, dtype=torch.bool))
        row: dict[str, Any] = {"side": side, "downscale": side / OUTPUT}
        textures = {"random": torch.randint(0, 256, (batch, 3, side, side), generator=generator).float(),
                    "1/f": _one_over_f(batch, side, generator)}
        for name, images in textures.items():
            ours = resized_crop(images, full, (OUTPUT, OUTPUT), **identity)
            reference = F.interpolate(images, (OUTPUT, OUTPUT), mode="bilinear", align_corners=False,
                                      antialias=True)
            row[name] = (ours - reference).abs().mean().item()
            bicubic = F.interpolate(images, (OUTPUT, OUTPUT), mode="bicubic", align_corners=False,
                                    antialias=True)
            row[f"{name} bicubic"] = (bicubic - reference).abs().mean().item()
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="total timing budget (both sides)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-quality", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    result: dict[str, Any] = {"device": str(device), "batch": args.batch, "threads": torch.get_num_threads(),
                              "throughput": {}, "quality": []}
    print(f"augmentation to {OUTPUT}x{OUTPUT} on {device} ({torch.get_num_threads()} threads), "
          f"batches of {args.batch}; samples/s (time / copy's time)")
    print(f"{'stored':>8} " + " ".join(f"{name:>20}" for name in ("copy", "normalise", "train f32",
                                                                   "train bf16", "eval")))
    for side in SIDES:
        rates = throughput(side, args.batch, args.seconds / len(SIDES), device)
        result["throughput"][side] = rates
        cells = [f"{rate:>10,.0f} ({rates['copy'] / rate:5.1f}x)" for rate in rates.values()]
        print(f"{side:>6}^2 " + " ".join(f"{cell:>20}" for cell in cells))
    if not args.no_quality:
        result["quality"] = quality()
        print(f"\nresampling error vs antialiased bilinear, mean |diff| on 0-255, largest crop to {OUTPUT}")
        print("(in brackets: antialiased bicubic vs antialiased bilinear, the choice of filter alone)")
        print(f"{'stored':>8} {'downscale':>10} {'random pixels':>16} {'1/f noise':>14}")
        for row in result["quality"]:
            print(f"{row['side']:>6}^2 {row['downscale']:>9.2f}x {row['random']:>8.2f} "
                  f"({row['random bicubic']:5.2f}) {row['1/f']:>6.2f} ({row['1/f bicubic']:5.2f})")
    return result


if __name__ == "__main__":
    main()
