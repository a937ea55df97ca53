"""JPEG reader benchmark (reader side): how close the CPU reader of a JPEG dataset comes to what
the cores can decode, what it costs against a raw dataset, and (``--device cuda``) the GPU decode.

``python -m bench.jpeg_reader [--images N] [--copies K] [--rounds R] [--device cpu|cuda]`` makes N LAION-like
originals (``bench.jpeg_quality.originals``: 1-2.5 MP photo-like JPEGs), runs each through the job's transform
(256², centre crop) and encoder (the config's defaults, q90 4:4:4), repeats them K times into one JPEG
dataset and the same pixels into one raw dataset (shards of 1,000), warms the page cache, and reports
medians of R rounds:

- (a) ``single-core decode``: the reader's extension (``shardio.read._jpeg_batch``, libjpeg-turbo) decoding
  every JPEG on 1 thread: what one core can do;
- (a') ``all-core batch decode``: the same call on batches of 256 with every core, no reader: what the
  machine's cores give together (on a shared machine, less than cores × (a));
- (b) ``jpeg reader``: ``ShardDataset`` over the JPEG dataset, shuffled batches of 256, every core
  (``decode_threads()``, ``SHARDIO_DECODE_THREADS``), no prefetch thread (the decode itself is timed);
  ``(b) / (cores x a)``, goal >= 0.85: the batch decode's parallel efficiency with the reader's overhead in;
  ``(b) / (a')``: the reader's own share (order, slicing, metadata), apart from how the cores scale;
- (c) ``raw reader``: the same pixels as a raw dataset, same settings; ``jpeg / raw``.

``--device cuda`` measures instead, on shuffled batches of 256 through ``DeviceLoader`` to
``TrainAugment(224)`` (RandomResizedCrop + flip + normalise), samples/s of: the batch's JPEGs decoded on
the GPU (batched nvJPEG, ``shardio.train.device_decode``), decoded on the CPU and copied, the raw dataset
copied, and the bare ``DeviceDecoder`` call. It needs CUDA and torchvision >= 0.19, and says so when either
is missing.

Prints a table and writes ``bench/out/jpeg_reader[_cuda].json``. Ratios from one run hold on a loaded
machine better than rates.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from bench.jpeg_quality import originals, write_dataset
from preprocess.config import JobConfig
from preprocess.image.jpeg_encode import encode_jpeg
from preprocess.image.transform import process_image
from shardio import DeviceLoader, ShardDataset
from shardio.read import jpeg_pixels

OUT_DIR = os.path.join(os.path.dirname(__file__), "out")
BATCH = 256
SIDE = 256
GOAL = 0.85  # (b) / (cores x a)


def make_datasets(root: str, images: int, copies: int) -> tuple[str, str, list[bytes]]:
    """The JPEG and raw datasets of the same 256² pixels (``images`` × ``copies`` samples)."""
    cfg = JobConfig()
    pixels = [process_image(data, cfg).pixels for data in originals(images)]
    jpegs = [encode_jpeg(p, cfg.quality, cfg.subsampling) for p in pixels]
    jpeg_dir, raw_dir = os.path.join(root, "jpeg"), os.path.join(root, "raw")
    write_dataset(jpeg_dir, pixels * copies, jpegs * copies,
                  {"encoding": "jpeg", "quality": cfg.quality, "subsampling": cfg.subsampling})
    write_dataset(raw_dir, pixels * copies, None, {})
    return jpeg_dir, raw_dir, jpegs * copies


def rounds_rate(run: Callable[[], int], rounds: int) -> float:
    """Median samples/s of ``rounds`` calls of ``run`` (which returns the samples it handled), after one warm-up."""
    run()
    rates = []
    for _ in range(rounds):
        started = time.perf_counter()
        count = run()
        rates.append(count / (time.perf_counter() - started))
    return statistics.median(rates)


def decode_rate(jpegs: list[bytes], threads: int, rounds: int) -> float:
    """The extension alone on batches of ``BATCH`` with ``threads`` threads."""
    out = np.empty((BATCH, SIDE, SIDE, 3), np.uint8)
    decoder = jpeg_pixels._decoder()
    batches = [jpegs[i:i + BATCH] for i in range(0, len(jpegs), BATCH)]

    def run() -> int:
        for batch in batches:
            decoder.decode_into(batch, out[:len(batch)], SIDE, SIDE, threads)
        return len(jpegs)

    return rounds_rate(run, rounds)


def reader_rate(directory: str, rounds: int) -> float:
    ds = ShardDataset(directory, BATCH, shuffle=True, seed=0, prefetch=0)
    return rounds_rate(lambda: sum(len(batch["image"]) for batch in ds), rounds)


def cpu_bench(jpeg_dir: str, raw_dir: str, jpegs: list[bytes], rounds: int) -> dict[str, Any]:
    cores = jpeg_pixels.decode_threads()
    single = decode_rate(jpegs, 1, rounds)
    together = decode_rate(jpegs, cores, rounds)
    jpeg = reader_rate(jpeg_dir, rounds)
    raw = reader_rate(raw_dir, rounds)
    return {"cores": cores, "single_core_decode_per_s": round(single, 1),
            "all_core_decode_per_s": round(together, 1), "jpeg_reader_per_s": round(jpeg, 1),
            "raw_reader_per_s": round(raw, 1), "efficiency": round(jpeg / (cores * single), 3),
            "efficiency_goal": GOAL, "reader_over_decode": round(jpeg / together, 3),
            "jpeg_over_raw": round(jpeg / raw, 4), "load_average": round(os.getloadavg()[0], 2)}


def print_cpu(result: dict[str, Any]) -> None:
    cores = result["cores"]
    rows = [("(a) single-core decode (libjpeg-turbo, 1 thread)", result["single_core_decode_per_s"], ""),
            (f"(a') batch decode alone, {cores} threads", result["all_core_decode_per_s"],
             f"(a') / ({cores} x a) = "
             f"{result['all_core_decode_per_s'] / (cores * result['single_core_decode_per_s']):.2f}"),
            (f"(b) jpeg reader, {cores} cores", result["jpeg_reader_per_s"],
             f"(b) / ({cores} x a) = {result['efficiency']:.2f} (goal >= {GOAL}); (b) / (a') = "
             f"{result['reader_over_decode']:.2f}"),
            ("(c) raw reader, same images", result["raw_reader_per_s"],
             f"jpeg / raw = {result['jpeg_over_raw']:.3f}")]
    print(f"{'':50s} {'samples/s':>11s}")
    for name, rate, note in rows:
        print(f"{name:50s} {rate:11,.0f}  {note}")
    print(f"load average during the run: {result['load_average']} on {os.cpu_count()} CPUs")


def _drain(batches: Iterable[dict[str, Any]]) -> int:
    count = 0
    for batch in batches:
        count += len(batch["image"])
    torch.cuda.synchronize()
    return count


def cuda_bench(jpeg_dir: str, raw_dir: str, rounds: int) -> dict[str, Any]:
    from shardio.train.augment import TrainAugment
    from shardio.train.device_decode import DeviceDecoder

    augment = TrainAugment(224)

    def loader(directory: str, decode_on_device: bool | None) -> DeviceLoader:
        return DeviceLoader(ShardDataset(directory, BATCH, shuffle=True, seed=0), "cuda", transform=augment,
                            decode_on_device=decode_on_device)

    gpu = loader(jpeg_dir, True)
    cpu = loader(jpeg_dir, False)
    raw = loader(raw_dir, None)
    decoder = DeviceDecoder("cuda")
    encoded = [batch["image"] for batch in ShardDataset(jpeg_dir, BATCH, shuffle=True, decode="device")]
    return {
        "device": torch.cuda.get_device_name(),
        "gpu_decode_augment_per_s": round(rounds_rate(lambda: _drain(gpu), rounds), 1),
        "cpu_decode_augment_per_s": round(rounds_rate(lambda: _drain(cpu), rounds), 1),
        "raw_augment_per_s": round(rounds_rate(lambda: _drain(raw), rounds), 1),
        "bare_gpu_decode_per_s": round(rounds_rate(lambda: _drain({"image": decoder(images)} for images in encoded),
                                                   rounds), 1),
        "cpu_cores": jpeg_pixels.decode_threads(),
    }


def print_cuda(result: dict[str, Any]) -> None:
    print(f"{result['device']}, batches of {BATCH}, 256² JPEG -> TrainAugment(224)   samples/s")
    for name, key in (("jpeg, decoded on the GPU (batched nvJPEG)", "gpu_decode_augment_per_s"),
                      (f"jpeg, decoded on the CPU ({result['cpu_cores']} cores)", "cpu_decode_augment_per_s"),
                      ("raw, copied", "raw_augment_per_s"),
                      ("bare DeviceDecoder call (no loader, no augment)", "bare_gpu_decode_per_s")):
        print(f"  {name:55s} {result[key]:11,.0f}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=128, help="distinct 256² images")
    parser.add_argument("--copies", type=int, default=16, help="times each is repeated in the datasets")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("bench.jpeg_reader --device cuda: CUDA is not available on this machine (torch "
                     f"{torch.__version__}); the GPU decode figure needs a CUDA GPU and torchvision >= 0.19")
        from shardio.train.device_decode import _torchvision_io

        _torchvision_io()  # MissingExtra saying what to install, before minutes of set-up
    with tempfile.TemporaryDirectory() as root:
        jpeg_dir, raw_dir, jpegs = make_datasets(root, args.images, args.copies)
        print(f"{args.images} images x {args.copies} = {len(jpegs)} samples, 256²: JPEG "
              f"{statistics.mean(map(len, jpegs)) / 1e3:.1f} KB each, raw {SIDE * SIDE * 3 / 1e3:.0f} KB")
        if args.device == "cuda":
            result = cuda_bench(jpeg_dir, raw_dir, args.rounds)
            print_cuda(result)
        else:
            result = cpu_bench(jpeg_dir, raw_dir, jpegs, args.rounds)
            print_cpu(result)
    result.update({"samples": len(jpegs), "jpeg_kb_mean": round(statistics.mean(map(len, jpegs)) / 1e3, 2),
                   "batch": BATCH, "rounds": args.rounds, "machine": platform.processor() or platform.machine(),
                   "when": time.strftime("%Y-%m-%d %H:%M:%S")})
    os.makedirs(OUT_DIR, exist_ok=True)
    path = os.path.join(OUT_DIR, "jpeg_reader_cuda.json" if args.device == "cuda" else "jpeg_reader.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
