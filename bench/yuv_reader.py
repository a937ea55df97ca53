"""yuv420 datasets (``encoding: yuv420``), measured in one run: quality against raw, and the CPU reader against
the raw reader on the same images.

``python -m bench.yuv_reader [--images N] [--copies K] [--rounds R]`` makes N LAION-like originals
(``bench.jpeg_quality.originals``: 1-2.5 MP photo-like JPEGs, ``preprocess.sample_data.photo_like``), runs each
through the job's transform (256², centre crop), and reports:

- quality: each image's yuv420 planes (``preprocess.image.jpeg_encode.stored_pixels``, what the job stores)
  read back as the reader converts them, scored against the raw pixels (``preprocess.image.pixel_quality``:
  PSNR median / p5 / min, max abs error, bytes per image), with the nearest upsampling the reader uses and,
  beside it, libjpeg's "fancy" (bilinear 3/4 + 1/4) upsampling (numpy, not used by the reader: the choice's
  cost in dB); goal median >= 38 dB;
- the conversion alone: ``shardio.read.yuv_pixels.convert_batch`` over batches of 256 on one thread against
  ``np.copyto`` of the same batches' raw pixels (what the raw reader's gather costs);
- the CPU reader: ``ShardDataset`` over the yuv420 and the raw dataset of the same pixels (``K`` copies,
  shards of 1,000), shuffled batches of 256, no prefetch thread, page cache warm, rounds alternating which
  goes first; median samples/s of each and the median of the rounds' ratios yuv / raw (goal >= 0.8).

Prints a table and writes ``bench/out/yuv_reader.json``. Ratios from one run hold on a loaded machine better
than rates.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from bench.jpeg_quality import originals
from preprocess.config import JobConfig
from preprocess.image.jpeg_encode import stored_pixels
from preprocess.image.pixel_quality import QualityTally
from preprocess.image.transform import process_image
from shardio import ShardDataset
from shardio.format import InputEntry, Manifest
from shardio.format.yuv_shard import split_planes, yuv420_to_rgb
from shardio.read import yuv_pixels
from shardio.read.batches import gather_threads
from shardio.write.shard_writer import InputShardWriter, write_manifest

OUT_DIR = os.path.join(os.path.dirname(__file__), "out")
BATCH = 256
PSNR_GOAL = 38.0
READER_GOAL = 0.8  # yuv420 reader / raw reader, samples/s


def fancy_rgb(planes: np.ndarray, height: int, width: int) -> np.ndarray:
    """libjpeg's "fancy" upsampling (triangle filter: 3/4 the nearer chroma sample, 1/4 the farther, edges
    repeated) then the exact inverse, rounded: what the reader would give with bilinear chroma."""
    y, cb, cr = split_planes(planes, height, width)

    def up(plane: np.ndarray) -> np.ndarray:
        padded = np.pad(plane.astype(np.float64) - 128, 1, mode="edge")
        rows = np.empty((2 * plane.shape[0], padded.shape[1]))
        rows[0::2] = 0.75 * padded[1:-1] + 0.25 * padded[:-2]
        rows[1::2] = 0.75 * padded[1:-1] + 0.25 * padded[2:]
        out = np.empty((rows.shape[0], 2 * plane.shape[1]))
        out[:, 0::2] = 0.75 * rows[:, 1:-1] + 0.25 * rows[:, :-2]
        out[:, 1::2] = 0.75 * rows[:, 1:-1] + 0.25 * rows[:, 2:]
        return out[:height, :width]

    u, v, luma = up(cb), up(cr), y.astype(np.float64)
    rgb = np.stack([luma + 1.402 * v, luma - 0.344136 * u - 0.714136 * v, luma + 1.772 * u], axis=-1)
    return np.clip(np.floor(rgb + 0.5), 0, 255).astype(np.uint8)


def quality(raw: list[np.ndarray]) -> dict[str, Any]:
    cfg = JobConfig(encoding="yuv420")
    nearest, fancy = QualityTally(), QualityTally()
    for image in raw:
        planes = stored_pixels(image, cfg)
        nearest.add(image, yuv420_to_rgb(planes, *image.shape[:2]), planes.nbytes)
        fancy.add(image, fancy_rgb(planes, *image.shape[:2]), planes.nbytes)
    return {"nearest": nearest.summary().to_json(), "fancy": fancy.summary().to_json(),
            "goal_psnr_median_db": PSNR_GOAL}


def write_dataset(directory: str, pixels: list[np.ndarray], encoding: str) -> None:
    side = pixels[0].shape[0]
    writer = InputShardWriter(directory, "bench", side, side, 1000, encoding)
    for i, image in enumerate(pixels):
        writer.add(image, {"key": f"{i}", "tar": "bench"}, "bench")
    entries = writer.close("bench")
    config: dict[str, Any] = {"height": side, "width": side}
    if encoding != "raw":
        config["encoding"] = encoding
    manifest = Manifest(shape=(side, side, 3), config=config, versions={}, shards=entries,
                        inputs={"bench": InputEntry(0, 0, len(pixels), 0, [e.path for e in entries])})
    write_manifest(directory, manifest)


def epoch_rates(ds: ShardDataset) -> tuple[float, float]:
    """Samples/s of one epoch by the wall clock and by this thread's CPU time (with one gather thread and no
    prefetch thread every byte is copied or converted on this thread: on a machine other work loads, CPU
    time is the steadier measure of what the reader costs)."""
    started, cpu, count = time.perf_counter(), time.thread_time(), 0
    for batch in ds:
        count += len(batch["image"])
    return count / (time.perf_counter() - started), count / max(1e-9, time.thread_time() - cpu)


def conversion_rates(raw: list[np.ndarray], copies: int, rounds: int) -> dict[str, Any]:
    """The conversion alone on one thread against np.copyto of the raw batch (both into reused buffers)."""
    cfg = JobConfig(encoding="yuv420")
    side = raw[0].shape[0]
    planes = np.stack([stored_pixels(image, cfg) for image in raw] * copies)
    pixels = np.stack(raw * copies)
    out = np.empty((BATCH, side, side, 3), np.uint8)
    batches = [(a, min(a + BATCH, len(planes))) for a in range(0, len(planes) - BATCH + 1, BATCH)]
    converts, copies_per_s = [], []
    for _ in range(rounds):  # by this thread's CPU time (steadier than the wall clock on a loaded machine)
        started = time.thread_time()
        for a, b in batches:
            yuv_pixels.convert_batch([yuv_pixels.YuvPixels("bench", planes[a:b], side, side)], out, threads=1)
        converts.append(len(batches) * BATCH / (time.thread_time() - started))
        started = time.thread_time()
        for a, b in batches:
            np.copyto(out, pixels[a:b])
        copies_per_s.append(len(batches) * BATCH / (time.thread_time() - started))
    convert, copy = statistics.median(converts), statistics.median(copies_per_s)
    return {"convert_per_s": round(convert, 1), "copyto_per_s": round(copy, 1),
            "convert_over_copyto": round(convert / copy, 3), "native": yuv_pixels.native(),
            "simd": yuv_pixels.simd()}


def reader_rates(raw: list[np.ndarray], copies: int, rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as root:
        paths = {name: os.path.join(root, name) for name in ("raw", "yuv420")}
        for name, path in paths.items():
            write_dataset(path, raw * copies, name)
        datasets = {name: ShardDataset(path, BATCH, shuffle=True, seed=0, prefetch=0) for name, path in paths.items()}
        for ds in datasets.values():  # warm the page cache, the maps and the buffers
            epoch_rates(ds)
        rates: dict[str, list[float]] = {"raw": [], "yuv420": []}
        ratios, cpu_ratios = [], []
        for number in range(rounds):
            order = ("raw", "yuv420") if number % 2 == 0 else ("yuv420", "raw")
            measured = {name: epoch_rates(datasets[name]) for name in order}
            for name, (wall, _) in measured.items():
                rates[name].append(wall)
            ratios.append(measured["yuv420"][0] / measured["raw"][0])
            cpu_ratios.append(measured["yuv420"][1] / measured["raw"][1])
    return {"raw_per_s": round(statistics.median(rates["raw"]), 1),
            "yuv420_per_s": round(statistics.median(rates["yuv420"]), 1),
            "yuv420_over_raw": round(statistics.median(ratios), 3),
            "yuv420_over_raw_min_max": [round(min(ratios), 3), round(max(ratios), 3)],
            "yuv420_over_raw_cpu_time": round(statistics.median(cpu_ratios), 3),
            "yuv420_over_raw_cpu_time_min_max": [round(min(cpu_ratios), 3), round(max(cpu_ratios), 3)],
            "gather_threads": gather_threads(),
            "goal": READER_GOAL, "samples": len(raw) * copies, "rounds": rounds,
            "load_average": round(os.getloadavg()[0], 2)}


def measure(images: int, copies: int, rounds: int) -> dict[str, Any]:
    cfg = JobConfig()
    raw = [process_image(data, cfg).pixels for data in originals(images)]
    return {"images": len(raw), "side": int(raw[0].shape[0]), "quality": quality(raw),
            "conversion": conversion_rates(raw, max(1, 1024 // len(raw)), rounds),
            "reader": reader_rates(raw, copies, rounds)}


def print_result(result: dict[str, Any]) -> None:
    side = result["side"]
    print(f"{result['images']} photo-like images, {side}x{side}: raw {side * side * 3:,} bytes, yuv420 "
          f"{side * side * 3 // 2:,} bytes an image")
    print("upsampling  PSNR median  PSNR p5  PSNR min  max|err|")
    for name in ("nearest", "fancy"):
        q = result["quality"][name]
        print(f"{name:10}  {q['psnr_db']['median']:11.2f}  {q['psnr_db']['p5']:7.2f}  {q['psnr_db']['min']:8.2f}  "
              f"{q['max_abs_error']:8d}" + ("   (the reader's)" if name == "nearest" else "   (not used)"))
    c = result["conversion"]
    print(f"\nconversion alone, 1 thread ({c['simd'] if c['native'] else 'numpy'}, CPU time): "
          f"{c['convert_per_s']:,.0f} samples/s; "
          f"np.copyto of the raw batch {c['copyto_per_s']:,.0f}/s; ratio {c['convert_over_copyto']:.2f}")
    r = result["reader"]
    print(f"CPU reader, shuffled batches of {BATCH}, {r['gather_threads']} copy/convert thread(s): yuv420 "
          f"{r['yuv420_per_s']:,.0f} samples/s, raw {r['raw_per_s']:,.0f}/s; yuv420 / raw = {r['yuv420_over_raw']:.3f} "
          f"(rounds {r['yuv420_over_raw_min_max'][0]:.3f}-{r['yuv420_over_raw_min_max'][1]:.3f}; goal >= {r['goal']}); "
          f"by CPU time {r['yuv420_over_raw_cpu_time']:.3f} (rounds {r['yuv420_over_raw_cpu_time_min_max'][0]:.3f}-"
          f"{r['yuv420_over_raw_cpu_time_min_max'][1]:.3f}); load average {r['load_average']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=96)
    parser.add_argument("--copies", type=int, default=16, help="reader: the 256² images repeated this many times")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    result = measure(args.images, args.copies, args.rounds)
    print_result(result)
    os.makedirs(OUT_DIR, exist_ok=True)
    with open(os.path.join(OUT_DIR, "yuv_reader.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
