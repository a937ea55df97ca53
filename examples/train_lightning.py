"""Train the small CNN of examples/train.py with Lightning, fed by ``shardio.train.lightning.ShardDataModule``.

    python examples/train_lightning.py --shards out/sample-shards --max-steps 300
    python examples/train_lightning.py --demo --max-steps 50 --profile      # share in train_dataloader_next
    python examples/train_lightning.py --shards DIR --augment 224          # TrainAugment on the device
    python examples/train_lightning.py --shards DIR --checkpoint-dir ckpt --resume ckpt/last.ckpt
    torchrun --nproc-per-node 2 examples/train_lightning.py --shards DIR   # DDP: one process per device

Epochs follow the Trainer (each its own shuffle order), a checkpoint carries the loader's position and
``--resume`` continues at exactly the next batch, batches are pinned and augmented on the GPU when there
is one. Samples with a label train the classifier; samples without one (caption-only tars) train the
rotation-prediction head instead (see ``objective`` in examples/train.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train import ROTATIONS, demo_shards, objective, small_cnn  # noqa: E402

from shardio import TrainAugment  # noqa: E402
from shardio.train.lightning import ShardDataModule  # noqa: E402
from shardio.train.loader import to_device  # noqa: E402


class SmallCNN(pl.LightningModule):
    """examples/train.py's model and objective as a LightningModule."""

    def __init__(self, classes: int = 10, lr: float = 0.05) -> None:
        super().__init__()
        self.classes, self.lr = classes, lr
        self.net = small_cnn(classes + ROTATIONS).to(memory_format=torch.channels_last)
        self.loss_fn = nn.CrossEntropyLoss()
        self.labelled = self.samples = 0

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        if batch["image"].dtype == torch.uint8:  # a loader without the DataModule (bench.lightning)
            batch = to_device(batch, self.device)
        loss, labelled = objective(self.net, batch, self.classes, self.loss_fn, self.global_step)
        self.labelled += labelled
        self.samples += len(batch["image"])
        self.log("loss", loss, prog_bar=True, batch_size=len(batch["image"]))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def trainer_devices() -> int | str:
    # Under torchrun, Lightning takes rank and world from the environment; it wants one device per process.
    return int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else "auto"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", help="shardio dataset directory")
    parser.add_argument("--demo", action="store_true", help="write synthetic shards into a temp dir")
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--max-epochs", type=int, default=-1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--augment", type=int, help="random-resized-crop to this side on the device")
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--checkpoint-dir", help="save a checkpoint here every --checkpoint-every steps")
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--resume", help="a checkpoint to continue from (mid-epoch: at the next batch)")
    parser.add_argument("--profile", action="store_true", help="Lightning's SimpleProfiler summary")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="shardio-demo-") as tmp:
        if args.demo:
            shards = demo_shards(tmp, samples=512, classes=args.classes)
        elif args.shards:
            shards = args.shards
        else:
            parser.error("give --shards DIR (e.g. after `make shards`: out/sample-shards) or --demo")
        augment = TrainAugment(args.augment, seed=0) if args.augment else None
        data = ShardDataModule(shards, args.batch_size, shuffle=True, seed=0, drop_last=True,
                               train_transform=augment)
        torch.manual_seed(0)
        model = SmallCNN(args.classes, args.lr)
        # Lightning's default bar when `rich` is installed (typer brings it), RichProgressBar, titles an
        # epoch "Epoch 1/-2" when --max-steps bounds the run (max_epochs -1: it prints max_epochs - 1;
        # lightning 2.6 rich_progress.py). TQDM's title is "Epoch 1", and its total the batches left.
        callbacks: list[pl.Callback] = [pl.callbacks.TQDMProgressBar()]
        if args.checkpoint_dir:
            callbacks.append(pl.callbacks.ModelCheckpoint(
                dirpath=args.checkpoint_dir, every_n_train_steps=args.checkpoint_every, save_top_k=-1,
                save_last=True))
        trainer = pl.Trainer(accelerator=args.accelerator, devices=trainer_devices(),
                             max_steps=args.max_steps, max_epochs=args.max_epochs, logger=False,
                             enable_checkpointing=bool(args.checkpoint_dir), callbacks=callbacks,
                             enable_model_summary=False, profiler="simple" if args.profile else None,
                             log_every_n_steps=10)
        trainer.fit(model, data, ckpt_path=args.resume)
    unlabelled = model.samples - model.labelled
    print(f"trained {trainer.global_step} steps; objective: {model.labelled} samples with labels "
          f"(classification), {unlabelled} without (rotation prediction)", flush=True)
    # Lightning leaves the process group up under torchrun; closing it here keeps torch's gloo threads
    # from racing interpreter exit (a rank can abort there after a good run).
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return {"steps": trainer.global_step, "labelled": model.labelled, "unlabelled": unlabelled}


if __name__ == "__main__":
    main()
