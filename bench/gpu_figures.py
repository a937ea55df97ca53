"""The GPU check's rates: JPEG decode per library against the CPU reader, host-to-device bandwidth, and the
share of a ResNet-50 bf16 step spent waiting for data (``bench.gpu_check`` runs them and writes the table).

Each function takes the device and sizes, returns a dict of figures, and runs on a CPU too (the dry run: the
same calls on tiny sizes, rates meaningless), except where it needs CUDA, which it says.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from bench.gpu_data import encoded_batches
from shardio import DeviceLoader, ShardDataset
from shardio.errors import MissingExtra
from shardio.read.batches import gather_threads
from shardio.read.jpeg_pixels import decode_threads
from shardio.train import device_decode
from shardio.train.augment import TrainAugment
from shardio.train.device_decode import DeviceDecoder


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(run: Callable[[], int], device: torch.device) -> dict[str, float]:
    """Wall seconds, this process's CPU seconds (all threads) and the count ``run`` returns."""
    _sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    count = run()
    _sync(device)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"samples": count, "seconds": round(wall, 3), "samples_per_s": round(count / wall, 1),
            "cpu_cores_busy": round(cpu / wall, 2)}


def decode_rates(jpeg_dir: str, device: torch.device, batch: int = 256, batches: int = 40) -> dict[str, Any]:
    """Batched decode samples/s per library (through ``DeviceDecoder``, barrier on, and the library raw),
    ``DeviceLoader`` end to end on the JPEG dataset, and the CPU reader on every core."""
    images = encoded_batches(jpeg_dir, batch, min(batches, 16))
    out: dict[str, Any] = {"batch": batch, "batches": batches}
    for name in device_decode.LIBRARIES:
        backend = device_decode.library(name)[0]
        if backend is None:
            out[name] = "not available"
            continue
        decoder = DeviceDecoder(device, decode=backend.decode)
        decoder(images[0])  # warm-up: nvJPEG handles, the allocator's blocks

        def through_shardio() -> int:
            return sum(len(decoder(images[i % len(images)])) for i in range(batches))

        def raw() -> int:
            total = 0
            for i in range(batches):
                total += len(backend.decode([torch.from_numpy(j) for j in images[i % len(images)].jpegs], device))
            return total

        out[name] = {"version": backend.version, "device_decoder": _timed(through_shardio, device),
                     "raw": _timed(raw, device)}

    def loader() -> int:
        count = 0
        for item in DeviceLoader(ShardDataset(jpeg_dir, batch, shuffle=True), device):
            count += len(item["image"])
        return count

    loader()  # warm: page cache
    out["device_loader_jpeg"] = _timed(loader, device)

    out["cpu_reader_all_cores"] = cpu_reader_rate(jpeg_dir, batch)
    return out


def cpu_reader_rate(jpeg_dir: str, batch: int) -> dict[str, Any] | str:
    """A shuffled epoch of the JPEG dataset decoded by the CPU reader (native threads on every core)."""
    def epoch() -> int:
        count = 0
        for item in ShardDataset(jpeg_dir, batch, shuffle=True):
            count += len(item["image"])
        return count

    try:
        epoch()  # warm: page cache, memory maps
        return {**_timed(epoch, torch.device("cpu")), "threads": decode_threads()}
    except MissingExtra as error:  # the extension may not be built on the GPU machine
        return f"not available: {error}"


def h2d(raw_dir: str, device: torch.device, batch: int = 256, copies: int = 20) -> dict[str, Any]:
    """Pinned host-to-device bandwidth (one batch's bytes, copied ``copies`` times) against ``DeviceLoader``
    delivering the raw dataset's uint8 batches to the device (no model)."""
    if device.type != "cuda":
        return {"skipped": "needs CUDA"}
    dataset = ShardDataset(raw_dir, batch, shuffle=True)
    side = dataset.snapshot.shape[0]
    pinned = torch.empty((batch, side, side, 3), dtype=torch.uint8).pin_memory()
    target = torch.empty_like(pinned, device=device)
    target.copy_(pinned, non_blocking=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(copies):
        target.copy_(pinned, non_blocking=True)
    end.record()
    end.synchronize()
    pinned_gbps = copies * pinned.numel() / (start.elapsed_time(end) / 1e3) / 1e9

    class Uint8:  # the transform hand-off with no arithmetic: the batch's bytes as they arrived
        def __call__(self, image, *, epoch, positions, content_box=None):
            return image

    def loader() -> int:
        count = 0
        for item in DeviceLoader(ShardDataset(raw_dir, batch, shuffle=True), device, transform=Uint8()):
            count += item["image"].numel()
        return count

    def assembly() -> int:  # the host side alone: shuffled batches gathered into pinned memory
        count = 0
        for item in ShardDataset(raw_dir, batch, shuffle=True, pin_memory=True):
            count += item["image"].numel()
        return count

    def copies() -> dict[str, float]:  # the H2D stage alone: each assembled pinned batch's copy, GPU-timed
        stream = torch.cuda.Stream(device)
        gpu_ms, nbytes = 0.0, 0
        for item in ShardDataset(raw_dir, batch, shuffle=True, pin_memory=True):
            image = item["image"]
            begin, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                begin.record(stream)
                image.to(device, non_blocking=True)
                done.record(stream)
            done.synchronize()
            gpu_ms += begin.elapsed_time(done)
            nbytes += image.numel()
        return {"GBps": nbytes / (gpu_ms / 1e3) / 1e9}

    loader()  # warm: page cache, pinned buffers
    timed = _timed(loader, device)
    host = _timed(assembly, torch.device("cpu"))
    copy_gbps = copies()["GBps"]
    loader_gbps = timed["samples"] / timed["seconds"] / 1e9
    return {"pinned_GBps": round(pinned_gbps, 2), "device_loader_GBps": round(loader_gbps, 2),
            "ratio": round(loader_gbps / pinned_gbps, 3), "loader_cpu_cores_busy": timed["cpu_cores_busy"],
            "copy_stage_GBps": round(copy_gbps, 2), "copy_stage_ratio": round(copy_gbps / pinned_gbps, 3),
            "host_assembly_GBps": round(host["samples"] / host["seconds"] / 1e9, 2),
            "host_assembly_cpu_cores_busy": host["cpu_cores_busy"]}


def gather_rows(raw_dir: str, device: torch.device, batch: int = 256) -> dict[str, Any]:
    """The raw dataset's shuffled batches with 1, 2 and all cores copying each one (``gather_threads``): the
    host side alone (batches assembled, pinned on CUDA) and, on CUDA, ``DeviceLoader`` delivering them to
    the device (uint8, no model) against a pinned copy of the same bytes. One dataset and one loader per
    thread count, an untimed epoch first (maps opened, pinned blocks made), then a timed one, as a run's
    second epoch reads."""
    cuda = device.type == "cuda"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    out: dict[str, Any] = {"default_threads": gather_threads(), "rows": {}}
    if cuda:
        side = ShardDataset(raw_dir, batch).snapshot.shape[0]
        out["pinned_GBps"] = round(_pinned_copy_gbps((batch, side, side, 3), device), 2)

    class Uint8:  # the transform hand-off with no arithmetic: the batch's bytes as they arrived
        def __call__(self, image, *, epoch, positions, content_box=None):
            return image

    for threads in sorted({1, min(2, cores), cores}):
        host = ShardDataset(raw_dir, batch, shuffle=True, pin_memory=cuda, gather_threads=threads)

        def assembly(host: ShardDataset = host) -> int:
            return sum(item["image"].numel() for item in host)

        assembly()
        timed = _timed(assembly, torch.device("cpu"))
        row = {"host_GBps": round(timed["samples"] / timed["seconds"] / 1e9, 2),
               "host_cpu_cores_busy": timed["cpu_cores_busy"]}
        if cuda:
            loader = DeviceLoader(ShardDataset(raw_dir, batch, shuffle=True, gather_threads=threads), device,
                                  transform=Uint8())

            def delivered(loader: DeviceLoader = loader) -> int:
                return sum(item["image"].numel() for item in loader)

            delivered()
            timed = _timed(delivered, device)
            gbps = timed["samples"] / timed["seconds"] / 1e9
            row.update(device_loader_GBps=round(gbps, 2), ratio=round(gbps / out["pinned_GBps"], 3),
                       loader_cpu_cores_busy=timed["cpu_cores_busy"])
        out["rows"][threads] = row
    return out


def _pinned_copy_gbps(shape: tuple[int, ...], device: torch.device, copies: int = 20) -> float:
    pinned = torch.empty(shape, dtype=torch.uint8).pin_memory()
    target = torch.empty_like(pinned, device=device)
    target.copy_(pinned, non_blocking=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(copies):
        target.copy_(pinned, non_blocking=True)
    end.record()
    end.synchronize()
    return copies * pinned.numel() / (start.elapsed_time(end) / 1e3) / 1e9


def _step_fn(model: torch.nn.Module, device: torch.device) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def step(image: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = loss_fn(model(image), label)
        loss.backward()
        optimizer.step()
        return loss

    return step


def _batches(dataset_dir: str, device: torch.device, batch: int, size: int) -> Iterator[tuple[dict[str, Any], bool]]:
    """(batch, whether it is its epoch's first) for ever, from one dataset and one ``DeviceLoader`` iterated
    epoch after epoch, as a training run does: the loader prepares each epoch's first batches while the last
    ones of the epoch before are consumed (an epoch's first batch waited 27-52 ms on an H100 host when each
    epoch made a new loader, which a bench's 32-batch epochs weigh 30x a real one's)."""
    loader = DeviceLoader(ShardDataset(dataset_dir, batch, shuffle=True), device, transform=TrainAugment(size))
    while True:
        for index, item in enumerate(loader):
            yield item, index == 0


def train_step_wait(datasets: dict[str, str], device: torch.device, make_model: Callable[[], torch.nn.Module],
                    batch: int = 256, size: int = 224, warmup: int = 5, steps: int = 30) -> dict[str, Any]:
    """Per dataset: the share of step time spent in ``next()`` of a ``DeviceLoader`` with ``TrainAugment``,
    each step ended by ``loss.item()`` (a host sync, as a logging loop has: time in ``next()`` is then time
    the GPU has no work), and the step time against the same step on one batch already on the device."""
    model = make_model().to(device).to(memory_format=torch.channels_last)
    step = _step_fn(model, device)
    fixed = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (batch,), device=device)
    for _ in range(warmup):
        step(fixed, labels).item()
    synthetic = []
    for _ in range(steps):
        begin = time.perf_counter()
        step(fixed, labels).item()
        synthetic.append(time.perf_counter() - begin)
    out: dict[str, Any] = {"batch": batch, "size": size, "steps": steps,
                           "synthetic_step_ms": round(1e3 * statistics.median(synthetic), 2)}
    # (row, dataset, interpreter switch interval or None for Python's 5 ms, host sync every N steps)
    variants = [(name, name, None, 1) for name in datasets]
    variants += [(f"{name}, switch interval 0.5 ms", name, 0.0005, 1) for name in datasets]
    variants += [(f"{name}, host sync every 10 steps", name, None, 10) for name in datasets]
    default_interval = sys.getswitchinterval()
    for row, name, interval, sync_every in variants:
        sys.setswitchinterval(interval or default_interval)
        try:
            out[row] = _wait_share(_batches(datasets[name], device, batch, size), step, device, warmup, steps,
                                   batch, sync_every)
        finally:
            sys.setswitchinterval(default_interval)
    return out


def _wait_share(batches: Iterator[tuple[dict[str, Any], bool]],
                step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], device: torch.device, warmup: int,
                steps: int, batch: int, sync_every: int) -> dict[str, Any]:
    from shardio.read import prefetch

    waits, totals, queue_waits = [], [], []
    real_get = prefetch.Prefetcher.get
    in_get = [0.0]

    def timed_get(self: Any) -> Any:  # the part of next() spent waiting for the prefetch thread's batch
        begin = time.perf_counter()
        try:
            return real_get(self)
        finally:
            in_get[0] += time.perf_counter() - begin

    prefetch.Prefetcher.get = timed_get  # type: ignore[method-assign]
    try:
        return _wait_loop(batches, step, device, warmup, steps, batch, sync_every, waits, totals, queue_waits,
                          in_get)
    finally:
        prefetch.Prefetcher.get = real_get  # type: ignore[method-assign]


def _wait_loop(batches: Iterator[tuple[dict[str, Any], bool]],
               step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], device: torch.device, warmup: int,
               steps: int, batch: int, sync_every: int, waits: list, totals: list, queue_waits: list,
               in_get: list) -> dict[str, Any]:
    firsts = []
    for index in range(warmup + steps):
        in_get[0] = 0.0
        begin = time.perf_counter()
        item, first = next(batches)
        got = time.perf_counter()
        if index >= warmup:
            queue_waits.append(in_get[0])
            firsts.append(first)
        loss = step(item["image"], item["cls"].to(device) % 1000)
        if (index + 1) % sync_every == 0:
            loss.item()
        if index >= warmup:
            waits.append(got - begin)
            totals.append(time.perf_counter() - begin)
    _sync(device)
    batches.close()  # type: ignore[attr-defined]
    steady = [(wait, total) for wait, total, first in zip(waits, totals, firsts) if not first]
    return {"wait_share": round(sum(waits) / sum(totals), 4), "step_ms": round(1e3 * statistics.median(totals), 2),
            "steady_wait_share": round(sum(w for w, _ in steady) / sum(t for _, t in steady), 4),
            "epoch_start_waits_ms": [round(1e3 * w, 2) for w, first in zip(waits, firsts) if first],
            "wait_ms_median": round(1e3 * statistics.median(waits), 3),
            "queue_wait_ms_median": round(1e3 * statistics.median(queue_waits), 3),
            "queue_wait_share_of_wait": round(sum(queue_waits) / max(sum(waits), 1e-9), 3),
            "waits_ms": [round(1e3 * w, 2) for w in waits],
            "samples_per_s": round(batch * len(totals) / sum(totals), 1)}
