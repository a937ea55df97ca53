"""How fast ``ShardDataset`` feeds batches on this machine, and whether a consumer would wait for them.

Each setting runs for a fixed time after a short warm-up (the first batches map shards and fault in
pages). Every batch is copied once into a reusable buffer, as pinning or a host-to-device copy would: an
unshuffled batch is a view of the page cache, and timing only the view would time nothing. The rates are
for a warm page cache; a dataset larger than RAM runs at the disk's speed on the first epoch.

Whether a consumer waits: a training step at R samples/s takes ``batch / R`` seconds; with
``num_workers=0`` batches are assembled in the training process, between steps, so the GPU idles for that
time whatever the rate; with workers, assembly overlaps the step and the consumer waits only if the
workers together make fewer than R samples/s.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from shardio.dataset import ShardDataset
from shardio.loader import ShardLoader

__all__ = ["LoaderRate", "measure", "suggest", "run_bench"]

# Workers to start for a target: enough for 1.5× the target, so a slow epoch start or a busy core does
# not stall the step.
HEADROOM = 1.5


@dataclass
class LoaderRate:
    batch_size: int
    num_workers: int
    shuffle: bool
    batches: int
    samples: int
    seconds: float
    batches_per_s: float
    samples_per_s: float
    mb_per_s: float
    epochs: int  # epochs started while measuring: with workers, each one starts them again


def measure(path: str, *, batch_size: int = 256, num_workers: int = 0, shuffle: bool = True,
            seconds: float = 3.0, warmup_batches: int = 2) -> LoaderRate:
    """Iterate epochs of ``ShardDataset(path, batch_size, shuffle=shuffle)`` for ``seconds``."""
    dataset = ShardDataset(path, batch_size, shuffle=shuffle)
    loader: Any = dataset if num_workers == 0 else ShardLoader(dataset, num_workers=num_workers)
    sink = torch.empty((batch_size, *dataset.snapshot.shape), dtype=torch.uint8)
    sample_bytes = math.prod(dataset.snapshot.shape)
    batches = samples = 0
    started: float | None = None
    epoch = 0
    while True:
        dataset.set_epoch(epoch)
        for batch in loader:
            image = batch["image"]
            sink[: len(image)].copy_(image)
            if started is None:
                warmup_batches -= 1
                if warmup_batches <= 0:
                    started = time.perf_counter()
                continue
            batches += 1
            samples += len(image)
            if time.perf_counter() - started >= seconds:
                break
        else:
            epoch += 1
            if started is None and epoch > 2:  # a dataset of fewer batches than the warm-up
                started = time.perf_counter()
            continue
        break
    elapsed = max(1e-9, time.perf_counter() - (started or time.perf_counter()))
    return LoaderRate(
        batch_size=batch_size, num_workers=num_workers, shuffle=shuffle, batches=batches, samples=samples,
        seconds=round(elapsed, 3), batches_per_s=round(batches / elapsed, 2),
        samples_per_s=round(samples / elapsed, 1), mb_per_s=round(samples * sample_bytes / elapsed / 1e6, 1),
        epochs=epoch + 1,
    )


def suggest(in_process: LoaderRate, target_rate: float | None) -> dict[str, Any]:
    """DataLoader settings for ``target_rate`` samples/s, from the measured one-process rate."""
    cores = os.cpu_count() or 1
    if target_rate:
        workers = max(1, math.ceil(HEADROOM * target_rate / max(in_process.samples_per_s, 1e-9)))
    else:
        workers = 2  # no target: two workers overlap assembly with the step and absorb jitter
    settings: dict[str, Any] = {
        "batch_size": in_process.batch_size,
        "num_workers": min(workers, max(1, cores - 1)),  # leave a core for the training process
        "pin_memory": torch.cuda.is_available(),
        "prefetch_factor": 2,
        "persistent_workers": False,  # ShardLoader refuses True: set_epoch must reach the workers
        "shuffle_block": 16,
    }
    settings["code"] = (
        f"ShardLoader(ShardDataset(path, {settings['batch_size']}, shuffle=True), "
        f"num_workers={settings['num_workers']}, pin_memory={settings['pin_memory']}, prefetch_factor=2)"
    )
    if workers > settings["num_workers"]:
        settings["note"] = (f"{workers} workers would be needed but this machine has {cores} cores: "
                            "the loader cannot reach the target here")
    return settings


def _verdict(rate: LoaderRate, target_rate: float) -> tuple[bool, str]:
    step_s = rate.batch_size / target_rate
    if rate.num_workers == 0:
        assemble_s = rate.batch_size / max(rate.samples_per_s, 1e-9)
        share = assemble_s / (assemble_s + step_s)
        return True, (f"num_workers=0: the consumer waits {assemble_s * 1e3:.1f} ms per batch for "
                      f"assembly in its own process ({share:.0%} of its time at {target_rate:g} samples/s)")
    if rate.samples_per_s >= target_rate:
        return False, (f"num_workers={rate.num_workers}: {rate.samples_per_s:.0f} samples/s is "
                       f"{rate.samples_per_s / target_rate:.1f}x the target: the consumer would not wait")
    waits = 1 - rate.samples_per_s / target_rate
    return True, (f"num_workers={rate.num_workers}: {rate.samples_per_s:.0f} samples/s, below the target: "
                  f"the consumer would wait for data about {waits:.0%} of the time")


def run_bench(path: str, *, batch_size: int = 256, workers: list[int] | None = None, shuffle: bool = True,
              seconds: float = 3.0, target_rate: float | None = None) -> dict[str, Any]:
    """Measure in-process, then each of ``workers`` (default: the suggested count); return a JSON report."""
    rates = [measure(path, batch_size=batch_size, num_workers=0, shuffle=shuffle, seconds=seconds)]
    settings = suggest(rates[0], target_rate)
    for count in workers if workers is not None else [settings["num_workers"]]:
        if count > 0:
            rates.append(measure(path, batch_size=batch_size, num_workers=count, shuffle=shuffle,
                                 seconds=seconds))
    verdicts = [_verdict(r, target_rate) for r in rates] if target_rate else []
    best = max(rates, key=lambda r: r.samples_per_s)
    return {
        "dataset": path,
        "cpu_count": os.cpu_count(),
        "rates": [asdict(r) for r in rates],
        "target_rate": target_rate,
        "would_wait": all(wait for wait, _ in verdicts) if verdicts else None,
        "verdicts": [text for _, text in verdicts],
        "best": asdict(best),
        "suggested": settings,
    }


def format_bench(report: dict[str, Any]) -> str:
    lines = [f"dataset {report['dataset']} ({report['cpu_count']} cores; warm page cache, "
             "one copy per batch)",
             f"{'workers':>8} {'shuffle':>8} {'batch':>6} {'batches/s':>10} {'samples/s':>10} {'MB/s':>8}"]
    for r in report["rates"]:
        lines.append(f"{r['num_workers']:>8} {str(r['shuffle']):>8} {r['batch_size']:>6} "
                     f"{r['batches_per_s']:>10.1f} {r['samples_per_s']:>10.0f} {r['mb_per_s']:>8.0f}")
    if report["target_rate"]:
        lines.append(f"target {report['target_rate']:g} samples/s:")
        lines += [f"  {text}" for text in report["verdicts"]]
        lines.append("verdict: " + ("the consumer would WAIT for data at every setting measured"
                                    if report["would_wait"] else "the loader keeps up (with workers)"))
    if any(r["num_workers"] and r["epochs"] > 2 for r in report["rates"]):
        lines.append("note: the dataset is only a few batches long, so starting the workers at every epoch "
                     "weighs on their rate; a real dataset amortises it")
    settings = report["suggested"]
    lines.append(f"suggested: {settings['code']}")
    if "note" in settings:
        lines.append(f"note: {settings['note']}")
    return "\n".join(lines)
