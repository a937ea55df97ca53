"""Per-core decode paths on the same images: the floor, the job's transform, and the two baselines.

Every path turns one encoded JPEG into the job's target (256×256 centre crop, the job's resample filter) or,
for the floor, stops after the one step nothing can skip. They run in a ``multiprocessing.Pool`` of one
process per core over the same images (each process holds the encoded bytes, so only decoding is timed),
which is how the Ray job uses the machine too: the pool's rate divided by the cores is the per-core rate.

- ``floor``: ``draft("RGB", size)`` + ``load()``: libjpeg-turbo's DCT scaling to the smallest scale that
  still covers the target; Huffman decoding of the whole file cannot be skipped, so no path goes faster.
- ``floor_libjpeg``: the same decode through the job's own decoder (``preprocess.image._jpeg_region``) over the
  whole drafted image: libjpeg-turbo at Pillow's settings without Pillow's image allocation, row copies
  and load loop (~6% of the floor). A stricter floor: the job decodes less than this (only the region its
  resize reads) but pays for the rest of its work.
- ``transform``: ``preprocess.image.transform.process_image`` alone (the job without tar reading, Ray, writing).
- ``naive_stock`` / ``naive_simd``: what a DataLoader transform does: full-size decode with stock settings,
  ``convert("RGB")``, resize the short side, centre crop (as ``examples/train.py``'s WebDataset baseline).
  ``naive_stock`` is the baseline: stock Pillow, as torchvision installs it, run by ``bench.stock_pillow``
  in a child interpreter with its own pool (this venv only has Pillow-SIMD); ``naive_simd`` is the same
  code on this venv's Pillow-SIMD (stock / SIMD naive time: 1.7-2.0x in `make bench`, mostly the resize).
- ``floor_stock``: the floor on stock Pillow (same child): what libjpeg-turbo 3.1.3, bundled in the stock
  wheel, would change against the 2.1.5 Pillow-SIMD links here (the draft + load code is Pillow's, alike).
- ``worker``: ``preprocess.worker.process_input`` over whole tars (read the tar, transform, write and
  commit shards): the job's task without Ray, so the job's rate over this one is what Ray costs.
- ``img2dataset``: img2dataset's resizer: ``cv2.imdecode`` at full size, ``INTER_AREA`` down to the short
  side, centre crop, ``cv2.setNumThreads(1)``; only when OpenCV is installed.
"""

from __future__ import annotations

import io
import os
import shutil
import statistics
import time
from collections.abc import Callable
from multiprocessing import Pool
from typing import Protocol, Self

import numpy as np
from PIL import Image

from preprocess.image import jpeg_region
from preprocess.config import JobConfig
from preprocess.image.resize_modes import resize_mode
from preprocess.image.transform import _RESAMPLE, process_image
from preprocess.worker import process_input

__all__ = ["PATHS", "PathPool", "RemotePath", "available_paths"]

_images: list[bytes] = []
_cfg = JobConfig()
CHUNK = 8  # images per pool task: amortises the IPC round trip (~0.1 ms) over ~30-80 ms of work


def _floor(data: bytes) -> None:
    im = Image.open(io.BytesIO(data))
    im.draft("RGB", resize_mode(_cfg.mode).draft_request(im.size, (_cfg.width, _cfg.height)))
    im.load()


def _floor_libjpeg(data: bytes) -> None:
    im = Image.open(io.BytesIO(data))
    im.draft("RGB", resize_mode(_cfg.mode).draft_request(im.size, (_cfg.width, _cfg.height)))
    end = data.rfind(b"\xff\xd9")
    scale = im.decoderconfig[0] if im.decoderconfig else 1
    jpeg_region._decode_region(data, end if end > 0 else len(data), scale, *im.size, 0, im.width, 0, im.height)


def _transform(data: bytes) -> None:
    process_image(data, _cfg)


def _naive(data: bytes) -> None:
    image = Image.open(io.BytesIO(data)).convert("RGB")
    side = _cfg.width
    scale = side / min(image.size)
    width, height = max(side, round(image.width * scale)), max(side, round(image.height * scale))
    image = image.resize((width, height), _RESAMPLE[_cfg.resample])
    left, top = (width - side) // 2, (height - side) // 2
    np.asarray(image.crop((left, top, left + side, top + side)))


def _img2dataset(data: bytes) -> None:
    import cv2

    image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    side = _cfg.width
    height, width = image.shape[:2]
    scale = side / min(width, height)
    new_w, new_h = max(side, round(width * scale)), max(side, round(height * scale))
    image = cv2.resize(image, (new_w, new_h), interpolation=cv2.INTER_AREA)
    left, top = (new_w - side) // 2, (new_h - side) // 2
    np.ascontiguousarray(image[top : top + side, left : left + side])


PATHS: dict[str, Callable[[bytes], None]] = {
    "floor": _floor,
    "floor_libjpeg": _floor_libjpeg,
    "transform": _transform,
    # The *_stock paths are only meaningful in bench.stock_pillow's child, where PIL is stock Pillow.
    "floor_stock": _floor,  # stock Pillow's libjpeg-turbo (3.1.3 bundled) vs the system's 2.1.5
    "naive_stock": _naive,
    "naive_simd": _naive,
    "img2dataset": _img2dataset,
}


def available_paths() -> list[str]:
    """The paths this interpreter runs itself (``naive_stock`` runs in ``bench.stock_pillow``'s child)."""
    local = [p for p in PATHS if not p.endswith("_stock") and (p != "floor_libjpeg" or jpeg_region.available())]
    try:
        import cv2  # noqa: F401
    except ImportError:
        return [p for p in local if p != "img2dataset"]
    return local


def _init(images: list[bytes], cfg_dict: dict) -> None:
    global _images, _cfg
    _images, _cfg = images, JobConfig(**cfg_dict)
    try:
        import cv2

        cv2.setNumThreads(1)  # one process per core, as img2dataset configures it
    except ImportError:
        pass


def _run_chunk(task: tuple[str, int, int]) -> int:
    name, start, stop = task
    fn = PATHS[name]
    for data in _images[start:stop]:
        fn(data)
    return stop - start


def _run_tar(task: tuple[str, str]) -> int:
    tar, root = task
    output = os.path.join(root, f"worker-{os.getpid()}")
    stat = os.stat(tar)
    result = process_input(tar, output, _cfg, (stat.st_size, stat.st_mtime_ns))
    shutil.rmtree(output, ignore_errors=True)  # after the timed commit; the next task starts clean
    return result.samples


class RemotePath(Protocol):
    """A path another interpreter runs (``bench.stock_pillow.StockPillowPath``)."""

    def warm(self) -> None: ...

    def rate(self) -> float: ...


class PathPool:
    """One process per core holding the images; ``rate(path)`` is images/s over all of them.

    ``remote`` paths run elsewhere (their own pool of as many processes) but are interleaved and recorded
    here like the local ones; only one pool works at a time."""

    def __init__(
        self,
        images: list[bytes],
        cfg: JobConfig,
        processes: int | None = None,
        remote: dict[str, RemotePath] | None = None,
    ) -> None:
        self.processes = processes or os.cpu_count() or 1
        self.count = len(images)
        self.pool = Pool(self.processes, initializer=_init, initargs=(images, cfg.to_dict()))
        self.samples: dict[str, list[float]] = {}
        self.remote = dict(remote or {})

    def rate(self, name: str) -> float:
        if name in self.remote:
            rate = self.remote[name].rate()
            self.samples.setdefault(name, []).append(rate)
            return rate
        tasks = [(name, i, min(i + CHUNK, self.count)) for i in range(0, self.count, CHUNK)]
        start = time.perf_counter()
        done = sum(self.pool.imap_unordered(_run_chunk, tasks))
        rate = done / (time.perf_counter() - start)
        self.samples.setdefault(name, []).append(rate)
        return rate

    def worker_rate(self, tars: list[str], root: str) -> float:
        """images/s of ``process_input`` over ``tars``, one tar per task (recorded as path "worker")."""
        start = time.perf_counter()
        done = sum(self.pool.imap_unordered(_run_tar, [(tar, root) for tar in tars]))
        rate = done / (time.perf_counter() - start)
        self.samples.setdefault("worker", []).append(rate)
        return rate

    def rounds(self, names: list[str], rounds: int) -> None:
        """Interleaved: drift on a shared machine then hits every path alike. The first pass warms up."""
        for name in names:
            if name in self.remote:
                self.remote[name].warm()
            else:
                self.pool.map(_run_chunk, [(name, 0, min(CHUNK, self.count))] * self.processes)
        for _ in range(rounds):
            for name in names:
                self.rate(name)

    def median(self, name: str) -> float:
        return statistics.median(self.samples[name])

    def close(self) -> None:
        self.pool.close()
        self.pool.join()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
