"""``preprocess diagnose``: where the job's time goes, per image and per stage, on one core.

It runs the job's own code on a sample of the inputs, in this process: the tar reader, the transform and
a real ``ShardWriter`` into a scratch directory (committed, so the fsync and checksum a real shard costs are
counted, spread over its images; then deleted). Stages per image:

- ``index``: the tar's index pass (``index_tar``: every member header, no data), spread over its images
- ``read``: reading the sample's members out of the tar: one byte range each (disk, page cache or network)
- ``decode``: opening the image and decoding it (for JPEG at the draft scale, 1/2 to 1/8, that
  libjpeg-turbo's DCT scaling allows, and only the part the resize reads: ``preprocess.image.jpeg_region``;
  the report's ``jpeg_decoder`` says whether that compiled decoder is in use)
- ``convert``: to RGB (palette, alpha, CMYK, 16-bit); ``resize``: crop/resize/orient to the target
- ``encode``: ``encoding: jpeg`` only, the resized image encoded as the job does (``stored_pixels``)
- ``write``: appending the pixels and metadata to a shard (a copy into the page cache)
- ``commit``: the shard's commit (checksum of the file, fsync, rename), spread over its images
- ``other``: the rest of the wall time of the sample (metadata parsing, Python, bookkeeping)

The rate is per core: the job runs one task per core, so C cores go about C times as fast while the
disk and memory bandwidth keep up; the projection assumes they do, and excludes Ray's start-up (seconds).

What the shards will hold is measured too (``pixels`` in the report): bytes per image and the projected
size of the pixel files; for ``encoding: jpeg`` each sample's JPEG decoded again and scored against its raw
pixels (``preprocess.image.pixel_quality``: PSNR median, 5th percentile and minimum, max abs error), outside the
timings: the quality of this dataset's images at this config, not a number from a different corpus.
In ``mode: bucket`` the report's ``aspect`` says how much of each picture's shape is kept: the aspect error
|log(stored w/h) - log(source w/h)| (median, p95, max) beside what a centre crop to the budget's
``width`` x ``height`` would have changed, and the samples each bucket took.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from preprocess.image import jpeg_region
from preprocess.config import JobConfig
from preprocess.image.jpeg_encode import stored_pixels
from preprocess.image.pixel_quality import QualityTally, decode_jpeg
from preprocess.inputs.kinds import input_kind
from preprocess.image.resize_modes import resize_mode
from preprocess.inputs.tar_samples import SampleProblem, index_tar, iter_tar_samples
from preprocess.image.transform import process_image
from preprocess.image.versions import pillow_build
from preprocess.worker import parse_fields
from shardio.errors import InputError, SampleError
from shardio.failure_reasons import count_by_category
from shardio.format import JPEG, RAW, YUV420
from shardio.format.yuv_shard import yuv420_to_rgb
from shardio.write.shard_writer import SHARD_WRITERS, ShardWriter
from shardio.store.root import open_input

__all__ = ["STAGES", "diagnose", "render_text"]

_JPEG_DECODER = {
    True: "region decode (libjpeg-turbo, only the part the resize reads: preprocess.image._jpeg_region)",
    False: "Pillow's load, whole image (preprocess.image._jpeg_region is not built: ~5% slower, same pixels)",
}

STAGES = ("index", "read", "decode", "convert", "resize", "encode", "write", "commit", "other")


@dataclass
class _Sample:
    key: str
    tar: str
    member: str
    nbytes: int
    width: int
    height: int
    format: str
    mode: str
    draft_scale: int
    stored: tuple[int, int]  # (height, width) of the stored pixels: the bucket's in mode: bucket
    bucket: int = 0
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


class _ScratchWriter:
    """Shards of ``samples_per_shard`` in a scratch directory: each committed (timed) and deleted at once,
    so diagnosing 10,000 images needs the disk space of one shard (one a bucket in ``mode: bucket``, as the
    job keeps one open shard a bucket)."""

    def __init__(self, directory: str, cfg: JobConfig) -> None:
        self.directory, self.cfg = directory, cfg
        self.writers: dict[int, ShardWriter] = {}
        self.pending: dict[int, list[_Sample]] = {}
        self.shards = 0

    def add(self, pixels: np.ndarray | bytes, meta: dict[str, Any], sample: _Sample) -> None:
        started = time.perf_counter()
        writer = self.writers.get(sample.bucket)
        if writer is None:
            name = f"diagnose-{self.shards:05d}"
            self.shards += 1
            shard_class = SHARD_WRITERS[self.cfg.encoding]
            writer = self.writers[sample.bucket] = shard_class(self.directory, name, *sample.stored)
            self.pending[sample.bucket] = []
        writer.add(pixels, meta)  # type: ignore[arg-type]  # bytes for a JpegShardWriter
        sample.seconds["write"] = time.perf_counter() - started
        self.pending[sample.bucket].append(sample)

    def flush_if_full(self, bucket: int) -> None:
        """Commit a full shard; called after the sample's own wall time is taken, so none of the commit
        lands in that sample's ``other``."""
        writer = self.writers.get(bucket)
        if writer is not None and writer.count >= self.cfg.samples_per_shard:
            self._flush(bucket)

    def flush(self) -> None:
        for bucket in sorted(self.writers):
            self._flush(bucket)

    def _flush(self, bucket: int) -> None:
        writer, pending = self.writers.pop(bucket), self.pending.pop(bucket)
        started = time.perf_counter()
        entry = writer.commit("diagnose")
        share = (time.perf_counter() - started) / len(pending)
        for sample in pending:
            sample.seconds["commit"] = share
        for rel in (entry.path, entry.meta_path):
            os.remove(os.path.join(self.directory, rel))

    def abort(self) -> None:
        for writer in self.writers.values():
            writer.abort()
        self.writers, self.pending = {}, {}


def diagnose(
    paths: list[str],
    cfg: JobConfig,
    *,
    limit: int | None = None,
    project_images: int = 1_000_000,
    cores: int | None = None,
    slowest: int = 5,
    write_dir: str | None = None,
) -> dict[str, Any]:
    """Time up to ``limit`` samples of ``paths`` stage by stage; return the report (JSON data).

    Inputs that cannot be read are listed under ``inputs_failed``; bad samples are counted by reason.
    For ``encoding: jpeg`` every sample's JPEG is also decoded and scored against its raw pixels (untimed).
    """
    cores = cores or os.cpu_count() or 1
    samples: list[_Sample] = []
    failures: list[dict[str, str]] = []  # {code, reason}, as a run report's failures
    inputs_failed: list[dict[str, str]] = []
    inputs_read: list[str] = []
    quality = QualityTally()
    encoded = cfg.encoding != RAW  # jpeg, yuv420: an encode stage, and its pixels scored against raw
    scratch_dir = tempfile.mkdtemp(prefix="shardio-diagnose-", dir=write_dir)
    scratch = _ScratchWriter(scratch_dir, cfg)
    clock = time.perf_counter
    try:
        for path in paths:
            if limit is not None and len(samples) >= limit:
                break
            first = len(samples)
            try:
                source = open_input(path)  # once: its kind, its index and its reader are given it
                kind = input_kind(source)
                t0 = clock()
                if kind.name == "tar":
                    index = index_tar(source)
                    index_s = clock() - t0
                    items = iter_tar_samples(source, cfg.image_extensions, index=index)
                else:  # a Parquet file, a folder: no index pass; their reads are in "read"
                    index_s = 0.0
                    items = kind.samples(source, cfg, None, "")
                while limit is None or len(samples) < limit:
                    t0 = clock()
                    item = next(items, None)
                    t1 = clock()
                    if item is None:
                        break
                    if isinstance(item, SampleProblem):
                        failures.append({"code": item.code.value, "reason": item.reason})
                        continue
                    timings: dict[str, float] = {}
                    try:
                        fields = parse_fields(item.fields)
                        image = process_image(item.image, cfg, timings)
                    except SampleError as e:
                        failures.append({"code": e.code.value, "reason": str(e)})
                        continue
                    t2 = clock()
                    stored = stored_pixels(image.pixels, cfg)
                    encode_s = clock() - t2
                    sample = _Sample(
                        key=item.key, tar=path, member=item.image_member, nbytes=len(item.image),
                        width=image.width, height=image.height, format=image.format, mode=image.mode,
                        draft_scale=image.draft_scale, stored=image.pixels.shape[:2], bucket=image.bucket,
                        seconds={"read": t1 - t0, "decode": timings["open"] + timings["decode"],
                                 "convert": timings["convert"], "resize": timings["resize"]},
                    )
                    if encoded:
                        sample.seconds["encode"] = encode_s
                    meta = {"key": item.key, "tar": path, "member": item.image_member, "width": image.width,
                            "height": image.height, **fields}
                    scratch.add(stored, meta, sample)
                    sample.seconds["other"] = max(0.0, clock() - t0 - sample.total)
                    samples.append(sample)
                    scratch.flush_if_full(sample.bucket)
                    if isinstance(stored, bytes):  # after the sample's wall time: the job does not decode
                        quality.add(image.pixels, decode_jpeg(stored), len(stored))
                    elif cfg.encoding == YUV420:
                        height, width = image.pixels.shape[:2]
                        quality.add(image.pixels, yuv420_to_rgb(stored, height, width), stored.nbytes)
                for sample in samples[first:]:
                    sample.seconds["index"] = index_s / (len(samples) - first)
                inputs_read.append(path)
            except InputError as e:
                inputs_failed.append({"input": path, "reason": e.reason})
        scratch.flush()
    finally:
        scratch.abort()
        shutil.rmtree(scratch_dir, ignore_errors=True)
    report = _report(samples, count_by_category(failures), inputs_read, inputs_failed, cfg,
                     project_images, cores, slowest)
    if samples:
        report["pixels"] = _pixels_report(cfg, samples, quality, project_images)
        if resize_mode(cfg.mode).picks_bucket:
            report["aspect"] = _aspect_report(cfg, samples)
    return report


def _aspect_report(cfg: JobConfig, samples: list[_Sample]) -> dict[str, Any]:
    """How much of the pictures' shape bucket mode keeps, beside a centre crop to the budget's shape."""
    source = np.log(np.array([x.width / x.height for x in samples]))
    stored = np.log(np.array([x.stored[1] / x.stored[0] for x in samples]))
    counts = np.bincount([x.bucket for x in samples], minlength=len(cfg.shapes))

    def spread(errors: np.ndarray) -> dict[str, float]:
        return {"median": round(float(np.median(errors)), 4), "p95": round(float(np.percentile(errors, 95)), 4),
                "max": round(float(errors.max()), 4)}

    return {"bucket": spread(np.abs(stored - source)),
            "center_crop": spread(np.abs(np.log(cfg.width / cfg.height) - source)),
            "budget": f"{cfg.width}x{cfg.height}", "buckets": len(cfg.shapes),
            "samples_per_bucket": {f"{h}x{w}": int(n) for (h, w), n in zip(cfg.shapes, counts) if n}}


def _pixels_report(cfg: JobConfig, samples: list[_Sample], quality: QualityTally,
                   project_images: int) -> dict[str, Any]:
    """What the shards hold per image and in all; for JPEG, measured on the samples diagnosed. In bucket
    mode a raw image's bytes are its bucket's, so the mean over the samples diagnosed."""
    raw_bytes = round(sum(x.stored[0] * x.stored[1] * 3 for x in samples) / len(samples))
    pixels: dict[str, Any] = {"encoding": cfg.encoding, "raw_bytes_per_image": raw_bytes}
    if cfg.encoding == JPEG:
        pixels.update(quality=cfg.quality, subsampling=cfg.subsampling, **quality.summary().to_json())
    elif cfg.encoding == YUV420:
        pixels.update(**quality.summary().to_json())
    else:
        pixels["bytes_per_image"] = raw_bytes
    projected = round(pixels["bytes_per_image"] * project_images)
    pixels["projection"] = {"images": project_images, "bytes": projected, "human": _bytes_human(projected)}
    return pixels


def _bytes_human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if nbytes < 1000 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return ""


def _report(samples: list[_Sample], failures: dict[str, int], inputs_read: list[str],
            inputs_failed: list[dict[str, str]], cfg: JobConfig, project_images: int, cores: int,
            slowest: int) -> dict[str, Any]:
    build = pillow_build()
    report: dict[str, Any] = {
        "inputs_read": inputs_read, "inputs_failed": inputs_failed, "samples": len(samples),
        "samples_failed": sum(failures.values()),
        "failures_by_reason": failures,
        "config": cfg.to_dict(), "pillow": build,
        "jpeg_decoder": _JPEG_DECODER[jpeg_region.available()],
    }
    if not samples:
        report.update(stages={}, verdict="no sample could be decoded: nothing to time")
        return report
    stages = STAGES if cfg.encoding != RAW else tuple(s for s in STAGES if s != "encode")
    per_stage = {s: np.array([x.seconds.get(s, 0.0) for x in samples]) for s in stages}
    total_s = float(sum(arr.sum() for arr in per_stage.values()))
    report["stages"] = {
        stage: {
            "mean_ms": round(float(arr.mean()) * 1e3, 3),
            "p50_ms": round(float(np.percentile(arr, 50)) * 1e3, 3),
            "p95_ms": round(float(np.percentile(arr, 95)) * 1e3, 3),
            "share": round(float(arr.sum()) / total_s, 4) if total_s else 0.0,
        }
        for stage, arr in per_stage.items()
    }
    totals = np.array([x.total for x in samples])
    report["per_image"] = {"mean_ms": round(float(totals.mean()) * 1e3, 3),
                           "p50_ms": round(float(np.percentile(totals, 50)) * 1e3, 3),
                           "p95_ms": round(float(np.percentile(totals, 95)) * 1e3, 3)}
    rate = len(samples) / total_s
    report["images_per_s_per_core"] = round(rate, 2)
    read_bytes = sum(x.nbytes for x in samples)
    report["read_mb_per_s"] = round(read_bytes / max(1e-9, float(per_stage["read"].sum())) / 1e6, 1)
    projected_s = project_images / (rate * cores)
    report["projection"] = {"images": project_images, "cores": cores, "seconds": round(projected_s, 3),
                            "human": _duration(projected_s)}
    scales: dict[str, int] = {}
    formats: dict[str, int] = {}
    for x in samples:
        scales[f"1/{x.draft_scale}"] = scales.get(f"1/{x.draft_scale}", 0) + 1
        formats[f"{x.format} {x.mode}"] = formats.get(f"{x.format} {x.mode}", 0) + 1
    report["draft_scales"] = dict(sorted(scales.items(), key=lambda kv: int(kv[0][2:])))
    report["formats"] = dict(sorted(formats.items(), key=lambda kv: -kv[1]))
    report["slowest"] = [
        {"key": x.key, "tar": x.tar, "member": x.member, "bytes": x.nbytes, "size": f"{x.width}x{x.height}",
         "format": x.format, "mode": x.mode, "draft_scale": x.draft_scale,
         "total_ms": round(x.total * 1e3, 2),
         "slowest_stage": max(x.seconds, key=lambda s: x.seconds[s])}
        for x in sorted(samples, key=lambda x: -x.total)[:slowest]
    ]
    report["bottleneck"] = max(report["stages"], key=lambda s: report["stages"][s]["share"])
    report["verdict"] = _verdict(report, samples, cfg, build)
    return report


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def _verdict(report: dict[str, Any], samples: list[_Sample], cfg: JobConfig, build: dict[str, Any]) -> str:
    stage = report["bottleneck"]
    share = report["stages"][stage]["share"]
    head = f"bottleneck: {stage} ({share:.0%} of the time)"
    jpeg = [x for x in samples if x.format in ("JPEG", "MPO")]
    if stage == "read":
        return (f"{head}: reading the tars at {report['read_mb_per_s']} MB/s; the job is I/O-bound - put the "
                "tars on a local SSD, or read them over a faster link")
    if stage == "decode":
        if not jpeg:
            return f"{head}: no JPEGs here, and PNG/WebP have no draft (DCT) scaling; more cores help"
        reduced = sum(x.draft_scale > 1 for x in jpeg) / len(jpeg)
        if not cfg.draft:
            return f"{head}: draft decoding is off (draft: false); on, it decodes JPEGs at 1/2-1/8 size"
        if reduced < 0.5:
            return (f"{head}: only {reduced:.0%} of the JPEGs could be decoded at a reduced scale (they are "
                    f"less than twice the {cfg.width}x{cfg.height} target); more cores are the remedy")
        return (f"{head}: expected - JPEG decoding at the draft scale is the irreducible cost "
                f"({reduced:.0%} of JPEGs decoded reduced); more cores are the remedy")
    if stage == "resize":
        if not build["pillow_simd"]:
            return (f"{head}: stock Pillow is active; `make install` builds Pillow-SIMD, on which `make bench` "
                    "measured a full decode + resize 1.7-2.0x faster per image")
        return (f"{head}: with Pillow-SIMD; the '{cfg.resample}' filter costs most - 'bilinear' or 'box' are "
                "cheaper if the pixels may change")
    if stage == "encode" and cfg.encoding == YUV420:
        return (f"{head}: the yuv420 conversion outweighs decoding the originals, which happens only when they "
                "are small; more cores are the remedy")
    if stage == "encode":
        return (f"{head}: the JPEG encode (encoding: jpeg, q{cfg.quality} {cfg.subsampling}) outweighs "
                "decoding the originals, which happens only when they are small; it is what the compact "
                "shards cost, and more cores are the remedy")
    if stage == "convert":
        return f"{head}: many images are not RGB ({report['formats']}); converting them costs the most"
    if stage in ("write", "commit"):
        return (f"{head}: the scratch directory's disk is slow; time writes on the output's disk with "
                "--write-dir, and write shards to a local SSD")
    return f"{head}: per-sample Python overhead (metadata, bookkeeping) outweighs the image work"


def _pixels_line(pixels: dict[str, Any]) -> str:
    proj = pixels["projection"]
    total = f"{proj['images']:,} images: about {proj['human']} of pixel files"
    if pixels["encoding"] == RAW:
        return f"pixels: raw, {pixels['bytes_per_image']:,} bytes an image (H x W x 3); {total}"

    def db(value: float | None) -> str:
        return "lossless" if value is None else f"{value:.1f} dB"

    score = pixels["psnr_db"]
    kind = "yuv420" if pixels["encoding"] == YUV420 else f"jpeg q{pixels['quality']} {pixels['subsampling']}"
    return (f"pixels: {kind}, {pixels['bytes_per_image']:,.0f} bytes an "
            f"image ({pixels['bytes_per_image'] / pixels['raw_bytes_per_image']:.1%} of raw); PSNR against raw over "
            f"{pixels['images']} images: median {db(score['median'])}, p5 {db(score['p5'])}, min {db(score['min'])}; "
            f"max abs error {pixels['max_abs_error']}; {total}")


def _aspect_line(aspect: dict[str, Any]) -> str:
    b, c = aspect["bucket"], aspect["center_crop"]
    taken = ", ".join(f"{shape}: {n}" for shape, n in aspect["samples_per_bucket"].items())
    return (f"aspect ratio |log(w/h)| changed by: buckets median {b['median']:.3f}, p95 {b['p95']:.3f}, max "
            f"{b['max']:.3f}; a centre crop to {aspect['budget']} would: median {c['median']:.3f}, p95 "
            f"{c['p95']:.3f}, max {c['max']:.3f}; samples per bucket (h x w, of {aspect['buckets']}): {taken}")


def render_text(report: dict[str, Any]) -> list[Any]:
    """The report as rich renderables (a stage table, then lines), for the CLI to print."""
    from rich import box
    from rich.table import Table

    out: list[Any] = []
    if report["samples"]:
        table = Table(title=f"per image, {report['samples']} samples, one core", title_justify="left",
                      box=box.SIMPLE_HEAD)
        for name in ("stage", "mean ms", "p50 ms", "p95 ms", "share"):
            table.add_column(name, justify="left" if name == "stage" else "right")
        for stage, s in report["stages"].items():
            table.add_row(stage, f"{s['mean_ms']:.2f}", f"{s['p50_ms']:.2f}", f"{s['p95_ms']:.2f}",
                          f"{s['share']:.0%}")
        p = report["per_image"]
        table.add_row("total", f"{p['mean_ms']:.2f}", f"{p['p50_ms']:.2f}", f"{p['p95_ms']:.2f}", "100%",
                      style="bold")
        out.append(table)
        proj = report["projection"]
        out.append(f"rate: {report['images_per_s_per_core']:.1f} images/s per core; "
                   f"{proj['images']:,} images on {proj['cores']} cores: about {proj['human']}")
        scales = ", ".join(f"{k}: {v}" for k, v in report["draft_scales"].items())
        out.append(f"decode scale (JPEG draft; 1/1 = full size): {scales}"
                   + "; formats: " + ", ".join(f"{k}: {v}" for k, v in report["formats"].items()))
        out.append(f"JPEG decoder: {report['jpeg_decoder']}")
        out.append(_pixels_line(report["pixels"]))
        if "aspect" in report:
            out.append(_aspect_line(report["aspect"]))
        slow = Table(title="slowest samples", title_justify="left", box=box.SIMPLE_HEAD)
        for name in ("key", "tar", "bytes", "size", "format", "mode", "draft", "ms", "most in"):
            slow.add_column(name, justify="right" if name in ("bytes", "ms") else "left")
        for x in report["slowest"]:
            slow.add_row(x["key"], os.path.basename(x["tar"]), f"{x['bytes']:,}", x["size"], x["format"],
                         x["mode"], f"1/{x['draft_scale']}",
                         f"{x['total_ms']:.1f}", x["slowest_stage"])
        out.append(slow)
    if report["samples_failed"]:
        out.append(f"failed samples: {report['samples_failed']} ("
                   + "; ".join(f"{n} x {r}" for r, n in report["failures_by_reason"].items()) + ")")
    for failed in report["inputs_failed"]:
        out.append(f"input failed: {failed['input']}: {failed['reason']}")
    out.append(f"verdict: {report['verdict']}")
    return out

