"""Compact shards (`encoding: jpeg`), measured in one run on the bench corpus's kind of image.

``python -m bench.jpeg_quality [--images N]`` makes N LAION-like originals (``preprocess.sample_data.photo_like``,
1.05-2.46 MP, JPEG q80-95 as the corpus), runs each through the job's transform exactly as a run does (256²,
centre crop, Pillow-SIMD), and reports:

- the size/quality curve: KB per image (mean), PSNR against the raw pixels (median, 5th percentile) and the
  max abs error, for qualities and both subsamplings (what the config's defaults were chosen from), scored
  by ``preprocess.image.pixel_quality`` as ``preprocess diagnose`` scores a dataset;
- the job's cost: ms per image to decode + resize the original, and to encode the 256² result (the job's
  images/s ratio jpeg/raw is transform / (transform + encode), every other step being the same);
- the CPU reader: decoded samples/s with all cores (``ShardDataset``, shuffled batches of 256, the batch decode
  in ``shardio.read._jpeg_batch``) against cores × the single-core decode rate of the same JPEGs, and
  against the raw reader's samples/s from the page cache.

Ratios hold on a loaded machine better than times: quote ratios from one run.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from bench.corpus import WEB_SIZES
from preprocess.config import JobConfig
from preprocess.image.jpeg_encode import encode_jpeg
from preprocess.image.pixel_quality import QualityTally
from preprocess.sample_data import encode_jpeg as encode_original
from preprocess.sample_data import photo_like
from preprocess.image.transform import process_image
from shardio import ShardDataset
from shardio.read import jpeg_pixels
from shardio.write.shard_writer import InputShardWriter, write_manifest
from shardio.format import InputEntry, Manifest

CURVE = [(85, "4:2:0"), (90, "4:2:0"), (95, "4:2:0"), (85, "4:4:4"), (90, "4:4:4"), (92, "4:4:4"), (95, "4:4:4")]


def originals(count: int) -> list[bytes]:
    rng = np.random.default_rng(25)
    out = []
    for i in range(count):
        width, height = WEB_SIZES[i % len(WEB_SIZES)]
        out.append(encode_original(photo_like(rng, width, height), quality=int(rng.integers(80, 96))))
    return out


def write_dataset(directory: str, pixels: list[np.ndarray], jpegs: list[bytes] | None, cfg: dict) -> None:
    side = pixels[0].shape[0]
    writer = InputShardWriter(directory, "bench", side, side, 1000, "jpeg" if jpegs else "raw")
    for i, image in enumerate(pixels):
        writer.add(jpegs[i] if jpegs else image, {"key": f"{i}", "tar": "bench"}, "bench")
    entries = writer.close("bench")
    manifest = Manifest(shape=(side, side, 3), config=cfg, versions={}, shards=entries,
                        inputs={"bench": InputEntry(0, 0, len(pixels), 0, [e.path for e in entries])})
    write_manifest(directory, manifest)


def reader_rate(directory: str, epochs: int) -> float:
    ds = ShardDataset(directory, 256, shuffle=True, seed=0, prefetch=0)
    for _ in ds:  # warm the page cache and the buffers
        pass
    count, started = 0, time.perf_counter()
    for _ in range(epochs):
        for batch in ds:
            count += len(batch["image"])
    return count / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=120)
    parser.add_argument("--copies", type=int, default=8, help="reader: the 256² images repeated this many times")
    args = parser.parse_args()
    cfg = JobConfig()
    sources = originals(args.images)

    started = time.perf_counter()
    raw = [process_image(data, cfg).pixels for data in sources]
    transform_ms = (time.perf_counter() - started) * 1e3 / len(raw)

    print(f"{len(raw)} images, 256x256 (raw: {256 * 256 * 3 / 1e3:.0f} KB each)")
    print("quality  subsampling  KB/img  PSNR median  PSNR p5  max|err|  encode ms")
    jpegs_at = {}
    for quality, subsampling in CURVE:
        started = time.perf_counter()
        jpegs = [encode_jpeg(p, quality, subsampling) for p in raw]
        encode_ms = (time.perf_counter() - started) * 1e3 / len(raw)
        jpegs_at[(quality, subsampling)] = (jpegs, encode_ms)
        decoded = np.empty((len(raw), 256, 256, 3), np.uint8)
        jpeg_pixels._decoder().decode_into(jpegs, decoded, 256, 256, 1)
        tally = QualityTally()
        for reference, image, jpeg in zip(raw, decoded, jpegs):
            tally.add(reference, image, len(jpeg))
        q = tally.summary()
        print(f"{quality:7d}  {subsampling:>11}  {q.bytes_per_image / 1e3:6.1f}  {q.psnr_median_db:11.1f}  "
              f"{q.psnr_p5_db:7.1f}  {q.max_abs_error:8d}  {encode_ms:9.2f}")

    jpegs, encode_ms = jpegs_at[(cfg.quality, cfg.subsampling)]
    print(f"\njob, per image: decode + resize {transform_ms:.2f} ms, encode {encode_ms:.2f} ms at the default "
          f"(q{cfg.quality} {cfg.subsampling}): jpeg job / raw job images/s = "
          f"{transform_ms / (transform_ms + encode_ms):.3f}")

    cores = jpeg_pixels.decode_threads()
    many = jpegs * args.copies
    out = np.empty((len(many), 256, 256, 3), np.uint8)
    started = time.perf_counter()
    jpeg_pixels._decoder().decode_into(many, out, 256, 256, 1)
    single = len(many) / (time.perf_counter() - started)
    with tempfile.TemporaryDirectory() as root:
        write_dataset(os.path.join(root, "raw"), raw * args.copies, None, {})
        write_dataset(os.path.join(root, "jpeg"), raw * args.copies, many,
                      {"encoding": "jpeg", "quality": cfg.quality, "subsampling": cfg.subsampling})
        jpeg_rate = reader_rate(os.path.join(root, "jpeg"), 2)
        raw_rate = reader_rate(os.path.join(root, "raw"), 2)
    print(f"\nCPU reader ({cores} cores, batches of 256, shuffled): jpeg {jpeg_rate:,.0f} samples/s; "
          f"single-core libjpeg-turbo decode {single:,.0f}/s -> jpeg / (cores x single) = "
          f"{jpeg_rate / (cores * single):.2f}; raw reader {raw_rate:,.0f} samples/s (jpeg / raw = "
          f"{jpeg_rate / raw_rate:.3f})")


if __name__ == "__main__":
    main()
