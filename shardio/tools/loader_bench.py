"""How fast ``ShardDataset`` feeds batches on this machine, and whether a consumer would wait for them.

Each setting runs for a fixed time after a short warm-up (the first batches map shards and fault in
pages). Every batch is copied once into a reusable buffer, as pinning or a host-to-device copy would: an
unshuffled batch is a view of the page cache, and timing only the view would time nothing. The rates are
for a warm page cache; a dataset larger than RAM runs at the disk's speed on the first epoch.

One measurement is not a rate: on a shared 2-core VM, single 3 s runs of the sample dataset read
anywhere from 3k to 50k samples/s from one run to the next (other processes, torch's intra-op threads
waiting for a busy core, worker start-up all move it), and a verdict drawn from one of them flipped with
it. So every setting is measured in ``repeats`` rounds, interleaved (round 1 of every setting, then
round 2, ...) so that a slow spell hits all settings alike, after one discarded warm-up round; the
report gives the median, the min-max range and the spread, and a verdict is only "keeps up" or "waits"
when the whole range is on one side of the target ("uncertain" otherwise).

Whether a consumer waits: the README's fast path is ``num_workers=0`` with ``DeviceLoader``, whose
prefetch thread assembles (and pins) the next batches while the step runs, so the consumer waits only if
that one thread makes fewer samples per second than it consumes. A bare ``for batch in dataset`` loop
assembles between steps instead and waits for every batch. Workers (``ShardLoader``) help only when one
thread is too slow, and their shared-memory hand-over costs bandwidth.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from shardio.read.dataset import ShardDataset
from shardio.train.loader import ShardLoader

__all__ = ["LoaderRate", "SettingRate", "measure", "summarise", "suggest", "workers_to_measure", "run_bench",
           "format_bench"]

# A spread above this says the machine was busy while measuring. On the shared 2-core VM, with other
# jobs running, 2 torch threads gave 1k-16k samples/s (64x64, batches of 256) and 1 thread 45k-150k: the
# intra-op threads of the batch copy spin-wait for each other.
NOISY_SPREAD = 0.5

# Workers to suggest for a target: enough for 1.5× the target at the slowest round's rate, so a slow
# epoch start or a busy core does not stall the step.
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
    # Flat, viewed as each batch's shape: a bucketed dataset's batches differ in (h, w) from step to step.
    sink = torch.empty(batch_size * math.prod(dataset.snapshot.shape), dtype=torch.uint8)
    batches = samples = nbytes = 0
    started: float | None = None
    epoch = 0
    while True:
        dataset.set_epoch(epoch)
        for batch in loader:
            image = batch["image"]
            if image.numel() > sink.numel():  # not while buckets stay within the pixel budget (`shape`)
                sink = torch.empty(image.numel(), dtype=torch.uint8)
            sink[: image.numel()].view(image.shape).copy_(image)
            if started is None:
                warmup_batches -= 1
                if warmup_batches <= 0:
                    started = time.perf_counter()
                continue
            batches += 1
            samples += len(image)
            nbytes += image.numel()
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
        samples_per_s=round(samples / elapsed, 1), mb_per_s=round(nbytes / elapsed / 1e6, 1),
        epochs=epoch + 1,
    )


@dataclass
class SettingRate:
    """One setting's rounds: the median is the rate, min-max the range, spread = (max - min) / median."""

    batch_size: int
    num_workers: int
    shuffle: bool
    rounds: list[float]  # samples/s of each round
    samples_per_s: float  # median
    samples_per_s_min: float
    samples_per_s_max: float
    spread: float
    batches_per_s: float  # median
    mb_per_s: float  # median
    samples: int  # over all rounds
    epochs: int  # most epochs one round started (with workers, each one starts them again)


def summarise(rounds: list[LoaderRate]) -> SettingRate:
    rates = [r.samples_per_s for r in rounds]
    median = statistics.median(rates)
    first = rounds[0]
    return SettingRate(
        batch_size=first.batch_size, num_workers=first.num_workers, shuffle=first.shuffle, rounds=rates,
        samples_per_s=round(median, 1), samples_per_s_min=min(rates), samples_per_s_max=max(rates),
        spread=round((max(rates) - min(rates)) / max(median, 1e-9), 3),
        batches_per_s=round(statistics.median(r.batches_per_s for r in rounds), 2),
        mb_per_s=round(statistics.median(r.mb_per_s for r in rounds), 1),
        samples=sum(r.samples for r in rounds), epochs=max(r.epochs for r in rounds),
    )


def _workers_for(rate: SettingRate, target_rate: float) -> int:
    return max(1, math.ceil(HEADROOM * target_rate / max(rate.samples_per_s_min, 1e-9)))


def workers_to_measure(rates: list[SettingRate], target_rate: float | None) -> int:
    """The worker count worth measuring when no measured setting keeps up with ``target_rate``: enough for
    the target at one thread's slowest rate, a core left for the training process; 0 when one keeps up."""
    if not target_rate or any(r.samples_per_s_min >= target_rate for r in rates):
        return 0
    return min(_workers_for(rates[0], target_rate), max(1, (os.cpu_count() or 1) - 1))


def suggest(rates: list[SettingRate], target_rate: float | None) -> dict[str, Any]:
    """Loader settings for ``target_rate`` samples/s: the fast path (``num_workers=0`` + ``DeviceLoader``)
    unless even its slowest round falls short and a measured worker count does better. Only a measured
    setting is suggested: when none keeps up, the best median measured (a worker count that measured
    slower than one thread is never the advice), and the note says how many workers the target would need."""
    in_process = rates[0]
    cores = os.cpu_count() or 1
    device = "cuda" if torch.cuda.is_available() else "cpu"
    settings: dict[str, Any] = {"batch_size": in_process.batch_size, "num_workers": 0, "device": device,
                                "shuffle_block": 16}
    fast = (f"DeviceLoader(ShardDataset(path, {in_process.batch_size}, shuffle=True), {device!r})"
            "  # num_workers=0: the prefetch thread reads while the step runs")
    if not target_rate or in_process.samples_per_s_min >= target_rate:
        settings["code"] = fast
        return settings
    keeping_up = [r for r in rates[1:] if r.samples_per_s_min >= target_rate]
    if keeping_up:
        workers = min(r.num_workers for r in keeping_up)
        settings["note"] = (f"one prefetch thread reads {in_process.samples_per_s:.0f} samples/s (median), "
                            f"below the target; {workers} workers measured at or above it in every round")
    else:
        needed = _workers_for(in_process, target_rate)
        best = max(rates, key=lambda r: r.samples_per_s)
        workers = best.num_workers
        untried = workers_to_measure(rates, target_rate)
        if needed > untried:
            more = f" but this machine has {cores} cores"
        elif any(r.num_workers == untried for r in rates):
            more = ""
        else:
            more = f": measure them with --workers {untried}"
        settings["note"] = (f"no setting measured reached {target_rate:g} samples/s in every round; suggested: "
                            f"the best median measured ({best.samples_per_s:.0f} samples/s, "
                            f"num_workers={workers}); ~{needed} workers would be needed{more}")
    settings["num_workers"] = workers
    if workers == 0:
        settings["code"] = fast
        return settings
    settings["code"] = (f"DeviceLoader(ShardLoader(ShardDataset(path, {in_process.batch_size}, shuffle=True), "
                        f"num_workers={workers}, pin_memory={device == 'cuda'}, prefetch_factor=2), {device!r})")
    return settings


def _verdict(rate: SettingRate, target_rate: float) -> tuple[str, str]:
    """("keeps up" | "waits" | "uncertain", why), from the range of the setting's rounds."""
    low, median, high = rate.samples_per_s_min, rate.samples_per_s, rate.samples_per_s_max
    how = ("num_workers=0 + DeviceLoader (one prefetch thread)" if rate.num_workers == 0
           else f"num_workers={rate.num_workers}")
    measured = f"{median:.0f} samples/s median ({low:.0f}-{high:.0f} over {len(rate.rounds)} rounds)"
    if low >= target_rate:
        return "keeps up", f"{how}: {measured}, every round at or above the target: the consumer would not wait"
    if high < target_rate:
        waits = 1 - median / target_rate
        return "waits", (f"{how}: {measured}, every round below the target: the consumer would wait for data "
                         f"about {waits:.0%} of the time")
    return "uncertain", (f"{how}: {measured}: the target is inside the range; measure longer "
                         "(--seconds, --repeats) on a quieter machine")


def run_bench(path: str, *, batch_size: int = 256, workers: list[int] | None = None, shuffle: bool = True,
              seconds: float = 1.0, repeats: int = 5, target_rate: float | None = None) -> dict[str, Any]:
    """Measure in-process (what ``DeviceLoader``'s thread does) and each of ``workers`` (default: the
    suggested count when one thread falls short of the target), ``repeats`` interleaved rounds of
    ``seconds`` each after one discarded warm-up round; return a JSON report."""
    measure(path, batch_size=batch_size, num_workers=0, shuffle=shuffle, seconds=seconds)  # warm-up
    counts = [0] + [c for c in workers or [] if c > 0]
    rounds: dict[int, list[LoaderRate]] = {c: [] for c in counts}
    for _ in range(repeats):
        for count in counts:
            rounds[count].append(measure(path, batch_size=batch_size, num_workers=count, shuffle=shuffle,
                                         seconds=seconds))
    rates = [summarise(rounds[c]) for c in counts]
    count = workers_to_measure(rates, target_rate)
    if workers is None and count and count not in counts:
        # One thread falls short: measure the worker count the target needs, the same way; the advice is
        # then whichever measured best.
        more = [measure(path, batch_size=batch_size, num_workers=count, shuffle=shuffle, seconds=seconds)
                for _ in range(repeats)]
        rates.append(summarise(more))
    settings = suggest(rates, target_rate)
    verdicts = [_verdict(r, target_rate) for r in rates] if target_rate else []
    outcomes = {outcome for outcome, _ in verdicts}
    best = max(rates, key=lambda r: r.samples_per_s)
    return {
        "dataset": path,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "repeats": repeats,
        "seconds_per_round": seconds,
        "rates": [asdict(r) for r in rates],
        "target_rate": target_rate,
        # True: every setting waits in every round; False: one keeps up in every round; None: no target,
        # or the target lies inside a range (the machine is too noisy to say).
        "would_wait": (None if not verdicts or ("keeps up" not in outcomes and "uncertain" in outcomes)
                       else "keeps up" not in outcomes),
        "verdicts": [text for _, text in verdicts],
        "best": asdict(best),
        "suggested": settings,
    }


def format_bench(report: dict[str, Any]) -> str:
    lines = [f"dataset {report['dataset']} ({report['cpu_count']} cores; warm page cache, one copy per batch; "
             f"{report['repeats']} interleaved rounds of {report['seconds_per_round']:g} s per setting)",
             f"{'workers':>8} {'shuffle':>8} {'batch':>6} {'samples/s median':>17} {'min-max':>15} "
             f"{'spread':>7} {'MB/s':>8}"]
    for r in report["rates"]:
        span = f"{r['samples_per_s_min']:.0f}-{r['samples_per_s_max']:.0f}"
        lines.append(f"{r['num_workers']:>8} {str(r['shuffle']):>8} {r['batch_size']:>6} "
                     f"{r['samples_per_s']:>17.0f} {span:>15} {r['spread']:>7.0%} {r['mb_per_s']:>8.0f}")
    if report["target_rate"]:
        lines.append(f"target {report['target_rate']:g} samples/s:")
        lines += [f"  {text}" for text in report["verdicts"]]
        lines.append("verdict: " + {
            True: "the consumer would WAIT for data at every setting measured",
            False: "the loader keeps up",
            None: "uncertain: the target lies inside the measured range",
        }[report["would_wait"]])
    if any(r["num_workers"] and r["epochs"] > 2 for r in report["rates"]):
        lines.append("note: the dataset is only a few batches long, so starting the workers at every epoch "
                     "weighs on their rate; a real dataset amortises it")
    if any(r["spread"] > NOISY_SPREAD for r in report["rates"]):
        lines.append(
            f"note: rounds differ by over {NOISY_SPREAD:.0%}: other processes share the cores. torch's "
            f"{report['torch_threads']} intra-op threads (the batch copy takes half of them) compete for the busy "
            "cores; compare --torch-threads 1"
        )
    settings = report["suggested"]
    lines.append(f"suggested: {settings['code']}")
    if "note" in settings:
        lines.append(f"note: {settings['note']}")
    return "\n".join(lines)
