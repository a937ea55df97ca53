"""Does a device decode write into memory that queued work still reads? The harness of pytorch/vision#9606,
pointed at shardio's own decode path.

Each trial, on the stream the decode runs on:
  1. fills ``tensors`` tensors of one decoded image's size with known values, and synchronises;
  2. queues a long kernel (``torch.cuda._sleep``), then one reduction per tensor;
  3. frees the tensors while the reductions are still queued (the caching allocator may now hand their
     blocks out again on this stream);
  4. decodes a batch of JPEGs (each output the size of one freed tensor, so the allocator hands them out);
  5. synchronises and checks each reduction against its exact value.
Nothing is racy by itself: a wrong sum means the decoder wrote a block before the kernels queued on its
stream had finished reading it. A trial is corrupted if any sum is wrong.

Rows: ``DeviceLoader`` end to end (the decode inside ``DeviceDecoder``, barrier on, on the prefetch thread's
own stream; the decoded pixels also checked against the CPU decode), ``DeviceDecoder`` with the barrier off
(what shardio would do without it), and each library called raw, to show the harness bites.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from bench.gpu_data import encoded_batches
from shardio import DeviceLoader, ShardDataset
from shardio.errors import MissingExtra
from shardio.read.jpeg_pixels import EncodedImages
from shardio.train import device_decode
from shardio.train.device_decode import DeviceDecoder

SLEEP_CYCLES = 20_000_000  # ~10 ms at 1.98 GHz: long enough that the reductions are still queued at step 4


class Trial:
    """Steps 1-3 before ``decode`` and step 5 after it, on the current stream; counts corrupted trials."""

    def __init__(self, device: torch.device, tensors: int, numel: int) -> None:
        self.device, self.tensors, self.numel = device, tensors, numel
        self.trials = self.corrupted = 0
        self.pending: list[tuple[torch.Tensor, int]] = []

    def before(self) -> None:
        filled = [torch.full((self.numel,), (index % 250) + 1, dtype=torch.uint8, device=self.device)
                  for index in range(self.tensors)]
        torch.cuda.current_stream(self.device).synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        self.pending = [(tensor.sum(dtype=torch.int64), ((index % 250) + 1) * self.numel)
                        for index, tensor in enumerate(filled)]
        del filled  # freed with the reductions still queued: their blocks go back to this stream's pool

    def after(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()
        wrong = sum(int(total.item()) != expected for total, expected in self.pending)
        self.pending = []
        self.trials += 1
        self.corrupted += wrong > 0

    def around(self, decode: Callable[[], Any]) -> Any:
        self.before()
        out = decode()
        self.after()
        return out


def _backend(name: str) -> device_decode.JpegBackend | None:
    return device_decode.library(name)[0]


def _trials(images: list[EncodedImages], device: torch.device, trials: int,
            decode: Callable[[EncodedImages], Any]) -> tuple[Trial, float]:
    first = images[0]
    trial = Trial(device, len(first), 3 * first.height * first.width)
    start = time.perf_counter()
    for index in range(trials):
        trial.around(lambda: decode(images[index % len(images)]))
    return trial, round(time.perf_counter() - start, 2)


def raw_library(name: str, images: list[EncodedImages], device: torch.device, trials: int) -> dict[str, Any]:
    """The library's batched decode called directly, no barrier of shardio's."""
    backend = _backend(name)
    if backend is None:
        return {"decoder": f"{name} (raw)", "skipped": f"{name} is not available"}
    trial, seconds = _trials(images, device, trials,
                             lambda batch: backend.decode([torch.from_numpy(j) for j in batch.jpegs], device))
    return {"decoder": f"{name} {backend.version} (raw)", "trials": trial.trials, "corrupted": trial.corrupted,
            "seconds": seconds}


def shardio_decoder(name: str, images: list[EncodedImages], device: torch.device, trials: int,
                    barrier: bool) -> dict[str, Any]:
    """``DeviceDecoder`` over library ``name`` with its barrier on or off."""
    backend = _backend(name)
    label = f"DeviceDecoder ({name}{' ' + backend.version if backend else ''}), barrier {'on' if barrier else 'off'}"
    if backend is None:
        return {"decoder": label, "skipped": f"{name} is not available"}
    synchronize = device_decode.stream_barrier if barrier else (lambda device: None)
    decoder = DeviceDecoder(device, decode=backend.decode, synchronize=synchronize)
    trial, seconds = _trials(images, device, trials, decoder)
    return {"decoder": label, "trials": trial.trials, "corrupted": trial.corrupted, "seconds": seconds}


def under_device_loader(jpeg_dir: str, device: torch.device, batch: int, trials: int) -> dict[str, Any]:
    """``DeviceLoader`` over the JPEG dataset, every batch's decode wrapped in a trial on the stream it runs
    on (the prefetch thread's own); each decoded batch also compared with the CPU decode of its bytes."""
    decoder = DeviceDecoder(device)
    trial: Trial | None = None
    pixel_errors: list[float] = []

    def wrapped(images: EncodedImages) -> torch.Tensor:
        nonlocal trial
        if trial is None:
            trial = Trial(device, len(images), 3 * images.height * images.width)
        decoded = trial.around(lambda: decoder(images))
        try:
            reference = torch.from_numpy(images.decode())
        except MissingExtra:  # the CPU decode's extension is not built here: the sums still tell
            return decoded
        pixel_errors.append(float((decoded.cpu().float() - reference.float()).abs().max()))
        return decoded

    identity = {"mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)}
    start = time.perf_counter()
    seen = epoch = 0
    while seen < trials:
        dataset = ShardDataset(jpeg_dir, batch, shuffle=True, seed=epoch)
        for _ in DeviceLoader(dataset, device, device_decoder=wrapped, **identity):
            seen += 1
            if seen == trials:
                break
        epoch += 1
    torch.cuda.synchronize(device)
    assert trial is not None
    return {"decoder": f"DeviceLoader + DeviceDecoder ({decoder.backend.name} {decoder.backend.version}), "
                       "barrier on", "trials": trial.trials, "corrupted": trial.corrupted,
            "max_abs_vs_cpu_decode": max(pixel_errors, default=None), "seconds": round(time.perf_counter() - start, 2)}


def subsampled_batches(batch: int, count: int, side: int = 256) -> list[EncodedImages]:
    """``count`` batches of photo-like JPEGs at 4:2:0 (the layout nvJPEG's hardware engine takes on every
    card that has one; the datasets are 4:4:4, shardio's default), in memory."""
    import io

    from preprocess.sample_data import photo_like

    out = []
    for number in range(count):
        jpegs = []
        for index in range(batch):
            data = io.BytesIO()
            photo_like(np.random.default_rng(number * batch + index), side, side).save(
                data, "JPEG", quality=90, subsampling=2)
            jpegs.append(np.frombuffer(data.getvalue(), np.uint8).copy())
        out.append(EncodedImages(jpegs, side, side, [(f"in-memory-4:2:0-{number}", 0, batch)]))
    return out


def run(jpeg_dir: str, device: torch.device, trials: int = 200, batch: int = 64) -> dict[str, Any]:
    layouts = {"4:4:4 (the dataset)": encoded_batches(jpeg_dir, batch, 16),
               "4:2:0": subsampled_batches(batch, 4)}
    rows = [{**under_device_loader(jpeg_dir, device, batch, trials), "jpeg": "4:4:4 (the dataset)"}]
    for layout, images in layouts.items():
        for name in ("torchvision", "torchcodec"):
            for row in (shardio_decoder(name, images, device, trials, barrier=True),
                        shardio_decoder(name, images, device, trials, barrier=False),
                        raw_library(name, images, device, trials)):
                rows.append({**row, "jpeg": layout})
    return {"trials": trials, "batch": batch, "sleep_cycles": SLEEP_CYCLES, "rows": rows,
            "images_mean_bytes": {layout: float(np.mean([len(j) for j in images[0].jpegs]))
                                  for layout, images in layouts.items()}}
