"""Lightning benchmark: the share of the epoch a Trainer spends in ``train_dataloader_next``.

``python -m bench.lightning [--shards DIR] [--tars 'GLOB'] [--steps N] [--batch-size B]`` trains
``examples/train_lightning.py``'s small CNN on CPU (``--accelerator`` to change) under Lightning's
``SimpleProfiler`` three times, one per data path, and prints for each the share of the training time
spent in ``[_TrainingEpochLoop].train_dataloader_next`` (the Trainer blocked on the next batch; the
figure of the issue's 63% profile) and samples/s:

- ``datamodule``: the documented path, ``shardio.train.lightning.ShardDataModule`` (``ShardLoader``, epochs and
  checkpointed position, normalisation in ``on_after_batch_transfer``);
- ``dataloader``: a plain ``DataLoader(ShardDataset(...), batch_size=None)`` (normalised in the step);
- ``webdataset+PIL``: ``examples/train.py``'s WebDataset loader over the source tars, each JPEG decoded,
  resized and cropped by PIL in ``--tar-workers`` DataLoader workers (needs ``webdataset``).

Defaults: ``out/sample-shards`` and ``data/sample/*.tar`` (what ``make shards`` writes) when they exist;
``--demo`` writes 512 synthetic 256² images as both shards and JPEG tars into a temp dir instead (a
smoke run: ~20 s with ``--steps 10``). The first ``--warmup`` steps (default 3: model init, worker
start-up) are excluded from both the share and the rate. Absolute rates drift 20-30% on a shared
machine; the shares of one run are comparable with each other.
"""

from __future__ import annotations

import argparse
import glob
import io
import os
import sys
import tarfile
import tempfile
import time
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.profilers import SimpleProfiler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from train import demo_shards, webdataset_loader  # noqa: E402
from train_lightning import SmallCNN  # noqa: E402

from shardio.read.dataset import ShardDataset  # noqa: E402
from shardio.train.lightning import ShardDataModule  # noqa: E402

NEXT = "[_TrainingEpochLoop].train_dataloader_next"


def demo_tars(shards: str, directory: str, per_tar: int = 128) -> str:
    """The demo shards' images as WebDataset tars of JPEGs (q90) with ``.cls``: the same pixels, encoded."""
    from PIL import Image

    from shardio.read.snapshot import open_dataset

    snapshot = open_dataset(shards)
    os.makedirs(directory, exist_ok=True)
    index = 0
    for shard in range(len(snapshot.shards)):
        pixels, meta = snapshot.pixels(shard), snapshot.meta(shard)
        for start in range(0, len(pixels), per_tar):
            with tarfile.open(os.path.join(directory, f"{index // per_tar:05d}.tar"), "w") as tar:
                for i in range(start, min(start + per_tar, len(pixels))):
                    encoded = io.BytesIO()
                    Image.fromarray(np.asarray(pixels[i])).save(encoded, "JPEG", quality=90)
                    for suffix, data in (("jpg", encoded.getvalue()), ("cls", str(meta.cls[i]).encode())):
                        info = tarfile.TarInfo(f"{meta.keys[i]}.{suffix}")
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
                    index += 1
    return os.path.join(directory, "*.tar")


class _SkipWarmup(pl.Callback):
    """Drops the profiler's records of the first ``warmup`` steps and times the rest."""

    def __init__(self, profiler: SimpleProfiler, warmup: int) -> None:
        self.profiler, self.warmup = profiler, warmup
        self.start = self.end = 0.0
        self.samples = 0

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self.warmup:
            self.profiler.recorded_durations.clear()
            self.start, self.samples = time.perf_counter(), 0
        elif trainer.global_step > self.warmup:
            self.samples += len(batch["image"])
            self.end = time.perf_counter()


def profile(name: str, steps: int, warmup: int, accelerator: str, fit: Any,
            report_dir: str) -> dict[str, float]:
    """Run ``fit(trainer, model)`` for ``warmup + steps`` steps; the share of the time spent fetching.
    The profiler's full table goes to ``report_dir/fit-NAME.txt``."""
    profiler = SimpleProfiler(dirpath=report_dir, filename=name.replace("+", "-"))
    timing = _SkipWarmup(profiler, warmup)
    trainer = pl.Trainer(accelerator=accelerator, devices=1, max_steps=warmup + steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         profiler=profiler, callbacks=[timing])
    torch.manual_seed(0)
    fit(trainer, SmallCNN())
    # From the end of the last warm-up step to the end of the last step: exactly ``steps`` fetches and
    # steps, in one or more epochs. (The profiler's run_training_epoch record of an epoch that began
    # during the warm-up would include the warm-up.)
    wall = timing.end - timing.start
    waiting = sum(profiler.recorded_durations[NEXT])
    result = {"steps": steps, "samples/s": timing.samples / wall, "next share": waiting / wall}
    print(f"{name:>16}: {result['samples/s']:8.1f} samples/s, {100 * result['next share']:5.1f}% of the "
          f"time in train_dataloader_next ({steps} steps)", flush=True)
    return result


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", default=os.path.join(ROOT, "out", "sample-shards"))
    parser.add_argument("--tars", default=os.path.join(ROOT, "data", "sample", "*.tar"))
    parser.add_argument("--demo", action="store_true", help="synthetic shards and tars in a temp dir")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--tar-workers", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="shardio-bench-lightning-") as tmp:
        shards, tars = args.shards, args.tars
        if args.demo:
            shards = demo_shards(os.path.join(tmp, "shards"), samples=512)
            tars = demo_tars(shards, os.path.join(tmp, "tars"))
        if not os.path.exists(os.path.join(shards, "manifest.json")):
            parser.error(f"no dataset at {shards}: run `make shards`, pass --shards DIR, or --demo")
        side = ShardDataset(shards, 1).snapshot.shape[0]
        pinned = args.accelerator in ("gpu", "cuda") or (args.accelerator == "auto"
                                                         and torch.cuda.is_available())

        def datamodule(trainer: pl.Trainer, model: SmallCNN) -> None:
            trainer.fit(model, ShardDataModule(shards, args.batch_size, shuffle=True, drop_last=True))

        def dataloader(trainer: pl.Trainer, model: SmallCNN) -> None:
            dataset = ShardDataset(shards, args.batch_size, shuffle=True, drop_last=True)
            loader = torch.utils.data.DataLoader(dataset, batch_size=None, pin_memory=pinned)
            trainer.fit(model, train_dataloaders=loader)

        def webdataset(trainer: pl.Trainer, model: SmallCNN) -> None:
            trainer.fit(model, train_dataloaders=webdataset_loader(tars, args.batch_size, args.tar_workers,
                                                                   side, pinned))

        paths = {"datamodule": datamodule, "dataloader": dataloader}
        if glob.glob(tars):
            paths["webdataset+PIL"] = webdataset
        else:
            print(f"no tars match {tars!r}: skipping webdataset+PIL (pass --tars or --demo)")
        return {name: profile(name, args.steps, args.warmup, args.accelerator, fit, tmp)
                for name, fit in paths.items()}


if __name__ == "__main__":
    main()
