"""Train a small CNN on a bucketed dataset (``mode: bucket``): each batch is one bucket's shape, whole pictures.

    python examples/train_buckets.py --shards DIR              # a dataset written with `mode: bucket`
    python examples/train_buckets.py --demo                    # synthetic bucketed shards in a temp dir
    python examples/train_buckets.py --demo --size 64          # every batch resized to 64x64 instead
    torchrun --nproc-per-node 2 examples/train_buckets.py --shards DIR   # DDP: one bucket per step on all ranks

Every batch the reader yields holds samples of one bucket (``image`` uint8 [B, h, w, 3], ``bucket`` its id);
``TrainAugment()`` crops and flips each batch back to its own shape on the device, and the network
(convolutions, then global average pooling) takes any shape, so nothing is cropped to a square. Under DDP
all ranks get the same bucket at each step, so no rank waits on another's larger batch. ``--checkpoint``
saves the model with the loader's position and ``--resume`` continues from exactly the next batch.

Objective: classification where a sample has a label (``cls``), else predicting whether the image was
turned by 180 degrees (a turn keeps any shape), so caption-only data trains too.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from shardio import DeviceLoader, ShardDataset
from shardio.format import InputEntry, Manifest
from shardio.train.augment import TrainAugment
from shardio.write.shard_writer import InputShardWriter, write_manifest

TURNS = 2  # the self-supervised head: turned by 0 or 180 degrees


def small_cnn(outputs: int) -> nn.Module:
    """~25k parameters; global average pooling at the end, so any (h, w) goes through."""
    def block(cin: int, cout: int, kernel: int, stride: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False), nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True)]
    return nn.Sequential(*block(3, 16, 5, 2), *block(16, 32, 3, 2), *block(32, 64, 3, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, outputs))


def demo_shards(directory: str, buckets: tuple[tuple[int, int], ...] = ((48, 96), (64, 64), (96, 48)),
                samples: int = 768, classes: int = 10) -> str:
    """A learnable synthetic bucketed dataset at a 64x64 budget: class ``c`` is a noisy image tinted towards
    colour ``c``, each sample's bucket drawn at random (as a corpus's aspect ratios spread). Written as the
    job writes one (``mode: bucket``, the resolved list stored in the config; one bucket per shard)."""
    rng = np.random.default_rng(0)
    palette = rng.integers(0, 256, (classes, 3))
    config = {"demo": True, "height": 64, "width": 64, "mode": "bucket",
              "buckets": [list(shape) for shape in buckets]}
    manifest = Manifest(shape=(64, 64, 3), config=config, versions={})
    writer = InputShardWriter(directory, "demo", 64, 64, samples_per_shard=64, buckets=list(buckets))
    for i in range(samples):
        label, bucket = int(rng.integers(classes)), int(rng.integers(len(buckets)))
        noise = rng.integers(0, 256, (*buckets[bucket], 3))
        pixels = ((noise + 3 * palette[label]) // 4).astype(np.uint8)
        writer.add(pixels, {"key": f"{i:06d}", "cls": label, "txt": None}, "demo", bucket=bucket)
    manifest.shards = writer.close("demo")
    manifest.inputs["demo"] = InputEntry(0, 0, samples, 0, [s.path for s in manifest.shards])
    write_manifest(directory, manifest)
    return directory


def objective(model: nn.Module, batch: dict[str, Any], classes: int, loss_fn: nn.Module,
              step: int) -> tuple[torch.Tensor, int]:
    """(loss, labelled samples): classification where ``cls`` >= 0, else 0/180-degree turn prediction."""
    images = batch["image"]
    labels = batch.get("cls")
    if labels is None:
        labels = torch.full((len(images),), -1, dtype=torch.int64, device=images.device)
    has_label = labels >= 0
    labelled = int(has_label.sum())
    unlabelled = images[~has_label]
    generator = torch.Generator().manual_seed(step)
    turned = torch.randint(TURNS, (len(unlabelled),), generator=generator).to(images.device)
    unlabelled = torch.where(turned[:, None, None, None] == 1, unlabelled.flip(2, 3), unlabelled)
    logits = model(torch.cat([images[has_label], unlabelled]).contiguous(memory_format=torch.channels_last))
    loss = images.new_zeros((), dtype=logits.dtype)
    if labelled:
        loss = loss + labelled * loss_fn(logits[:labelled, :classes], labels[has_label] % classes)
    if len(unlabelled):
        loss = loss + len(unlabelled) * loss_fn(logits[labelled:, classes:], turned)
    return loss / len(images), labelled


def batches_forever(loader: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Epoch after epoch (a resumed loader first finishes the state's epoch)."""
    while True:
        yield from loader


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", help="a bucketed shardio dataset directory")
    parser.add_argument("--demo", action="store_true", help="write synthetic bucketed shards into a temp dir")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--size", type=int, help="resize every batch to SIZE x SIZE (default: keep each "
                                                 "batch's bucket shape)")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--checkpoint", help="save model, optimizer and loader position here at the end")
    parser.add_argument("--resume", action="store_true", help="start from --checkpoint")
    args = parser.parse_args(argv)

    distributed = "WORLD_SIZE" in os.environ
    if distributed:  # torchrun: ShardDataset takes rank and world size from the process group
        torch.distributed.init_process_group("nccl" if args.device == "cuda" else "gloo")
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    with tempfile.TemporaryDirectory(prefix="shardio-buckets-") as tmp:
        if args.demo:
            shards = demo_shards(tmp, classes=args.classes)
        elif args.shards:
            shards = args.shards
        else:
            parser.error("give --shards DIR (a dataset written with `mode: bucket`) or --demo")
        dataset = ShardDataset(shards, args.batch_size, shuffle=True, drop_last=True)
        augment = TrainAugment(args.size, seed=0) if args.size else TrainAugment(seed=0)
        loader = DeviceLoader(dataset, device, transform=augment)

        torch.manual_seed(0)
        model = small_cnn(args.classes + TURNS).to(device, memory_format=torch.channels_last)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        if args.resume and args.checkpoint:
            state = torch.load(args.checkpoint, map_location=device)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            loader.load_state_dict(state["loader"])
            print(f"resumed at epoch {state['loader']['epoch']}, batch {state['loader']['batches_seen']}")
        if distributed:
            model = nn.parallel.DistributedDataParallel(model)

        buckets = ", ".join(f"{h}x{w}: {n}" for (h, w), n in zip(dataset.buckets, dataset.bucket_sizes))
        print(f"shards: {len(dataset.snapshot)} samples in {len(dataset.buckets)} buckets ({buckets}); "
              f"{len(dataset)} batches of {args.batch_size} per epoch on rank {dataset.rank}/"
              f"{dataset.world_size}, device {device}", flush=True)
        loss_fn = nn.CrossEntropyLoss()
        shapes: Counter[tuple[int, int]] = Counter()
        samples = classified = 0
        losses: list[float] = []
        batches = batches_forever(loader)
        for step in range(args.steps):
            batch = next(batches)
            shapes[tuple(batch["image"].shape[2:])] += 1
            loss, labelled = objective(model, batch, args.classes, loss_fn, step)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            samples += len(batch["image"])
            classified += labelled
            losses.append(loss.item())
            if step % 50 == 0 or step == args.steps - 1:
                print(f"  step {step:4d} loss {losses[-1]:.3f} batch {tuple(batch['image'].shape)}", flush=True)
        seen = ", ".join(f"{h}x{w}: {n}" for (h, w), n in sorted(shapes.items()))
        print(f"batch shapes: {seen}")
        print(f"trained {args.steps} steps, {samples} samples; objective: {classified} with labels "
              f"(classification), {samples - classified} without (turn prediction)", flush=True)
        if args.checkpoint and (not distributed or dataset.rank == 0):
            torch.save({"model": getattr(model, "module", model).state_dict(),
                        "optimizer": optimizer.state_dict(), "loader": loader.state_dict()}, args.checkpoint)
            print(f"saved {args.checkpoint}")
    if distributed:
        torch.distributed.destroy_process_group()
    return {"shapes": dict(shapes), "samples": samples, "labelled": classified,
            "first_loss": float(np.mean(losses[:5])), "last_loss": float(np.mean(losses[-5:]))}


if __name__ == "__main__":
    main()
