"""Train a small CNN from shardio shards and report how much of each step is spent waiting for data.

    python examples/train.py --shards out/sample-shards            # `make shards` writes that
    python examples/train.py --demo                                 # synthetic shards in a temp dir
    python examples/train.py --demo --tars 'data/sample/*.tar'      # also: WebDataset + PIL, same loop
    torchrun --nproc-per-node 2 examples/train.py --shards DIR      # DDP: ranks come from torch.distributed

The loop is the same for both sources: ``next()`` on the loader (timed as *waiting for data*, including
the move to the device and normalisation), then forward, backward and the optimizer step. On CUDA the
step runs asynchronously, so waiting is what the host spends blocked on data while the GPU may be busy;
the share printed is ``wait / wall``. ``--checkpoint`` saves the model with the loader's position and
``--resume`` continues mid-epoch from exactly the next batch.
"""

from __future__ import annotations

import argparse
import glob
import io
import os
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from shardio import DeviceLoader, ShardDataset, ShardLoader
from shardio.read.resume import EpochPass
from shardio.format import InputEntry, Manifest
from shardio.write.shard_writer import InputShardWriter, write_manifest


def small_cnn(classes: int) -> nn.Module:
    """~25k parameters; 256×256 input is reduced 4× by the first convolution to keep CPU steps short."""
    def block(cin: int, cout: int, kernel: int, stride: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False), nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True)]
    return nn.Sequential(*block(3, 16, 5, 4), *block(16, 32, 3, 2), *block(32, 64, 3, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, classes))


def demo_shards(directory: str, samples: int = 2048, side: int = 256, classes: int = 10) -> str:
    """A learnable synthetic dataset: class ``c`` is a noisy image tinted towards colour ``c``."""
    rng = np.random.default_rng(0)
    palette = rng.integers(0, 256, (classes, 3))
    config = {"demo": True, "height": side, "width": side}
    manifest = Manifest(shape=(side, side, 3), config=config, versions={})
    writer = InputShardWriter(directory, "demo", side, side, samples_per_shard=256)
    for i in range(samples):
        label = int(rng.integers(classes))
        noise = rng.integers(0, 256, (side, side, 3))
        pixels = ((noise + 3 * palette[label]) // 4).astype(np.uint8)
        writer.add(pixels, {"key": f"{i:06d}", "cls": label, "txt": None}, "demo")
    manifest.shards = writer.close("demo")
    manifest.inputs["demo"] = InputEntry(0, 0, samples, 0, [s.path for s in manifest.shards])
    write_manifest(directory, manifest)
    return directory


def _decode(sample: dict[str, Any], side: int) -> dict[str, Any]:
    """What a typical WebDataset transform does per sample: full decode, resize the short side, crop."""
    from PIL import Image

    data = next(sample[k] for k in ("jpg", "jpeg", "png", "webp") if k in sample)
    image = Image.open(io.BytesIO(data)).convert("RGB")
    scale = side / min(image.size)
    width, height = max(side, round(image.width * scale)), max(side, round(image.height * scale))
    image = image.resize((width, height), Image.Resampling.BICUBIC)
    left, top = (width - side) // 2, (height - side) // 2
    image = image.crop((left, top, left + side, top + side))
    return {"image": torch.from_numpy(np.asarray(image).copy()), "cls": int(sample.get("cls", b"-1"))}


def webdataset_loader(pattern: str, batch_size: int, workers: int, side: int, pin_memory: bool) -> Any:
    """The baseline: WebDataset tars decoded by PIL in DataLoader workers (needs webdataset, Pillow)."""
    import functools

    import webdataset as wds

    urls = sorted(glob.glob(pattern))
    if not urls:
        raise SystemExit(f"--tars {pattern!r} matches no file")
    dataset = wds.WebDataset(urls, shardshuffle=False, empty_check=False).map(
        functools.partial(_decode, side=side), handler=wds.ignore_and_continue)  # bad images are dropped
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=workers,
                                       pin_memory=pin_memory)


def batches_forever(loader: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Epoch after epoch: each new iteration of a shardio loader is the dataset's next epoch (a resumed
    one first finishes the state's epoch)."""
    while True:
        yield from loader


class Stopwatch:
    """Adds up the time spent blocked in ``next()`` of the iterators it times: the loader's own work."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def time(self, iterator: Iterable[Any]) -> Iterator[Any]:
        iterator = iter(iterator)
        while True:
            before = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            finally:
                self.seconds += time.perf_counter() - before
            yield batch


class TimedShardLoader(ShardLoader):
    """A ``ShardLoader`` whose passes ``stopwatch`` times. A subclass, not a wrapper: ``DeviceLoader``
    still drives it through the resume protocol (``begin_pass``, ``iter_pass``, ``cursor``), so the
    checkpoint counts the batches handed to the training loop, not those its thread prefetched."""

    def __init__(self, dataset: ShardDataset, stopwatch: Stopwatch, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.stopwatch = stopwatch

    def iter_pass(self, epoch_pass: EpochPass, **options: Any) -> Iterator[Any]:
        return self.stopwatch.time(super().iter_pass(epoch_pass, **options))


class Timed:
    """Any batch source (here the WebDataset loader, which has no resume state) timed by ``stopwatch``."""

    def __init__(self, loader: Iterable[Any], stopwatch: Stopwatch) -> None:
        self.loader, self.stopwatch = loader, stopwatch

    def __iter__(self) -> Iterator[Any]:
        return self.stopwatch.time(self.loader)


ROTATIONS = 4  # the self-supervised head: which of 0/90/180/270 degrees the image was turned


def objective(model: nn.Module, batch: dict[str, Any], classes: int, loss_fn: nn.Module,
              step: int) -> tuple[torch.Tensor, int]:
    """(loss, labelled samples): classification where a sample has a label, rotation prediction
    (RotNet, Gidaris et al. 2018) where it has none.

    A dataset of caption-only tars has no ``cls`` at all, and one mixing labelled and caption-only tars
    has ``cls`` in some batches (``-1`` for the unlabelled samples) and not in others: indexing
    ``batch["cls"]`` blindly died there with ``KeyError: 'cls'``. Rotation prediction needs no label and
    still trains the convolutions on the images; the model's last ``ROTATIONS`` outputs are its head.
    """
    images = batch["image"]
    labels = batch.get("cls")
    if labels is None:
        labels = torch.full((len(images),), -1, dtype=torch.int64, device=images.device)
    has_label = labels >= 0
    labelled = int(has_label.sum())
    parts, targets = [images[has_label]], [labels[has_label] % classes]
    unlabelled = images[~has_label]
    if len(unlabelled):
        # Square images turn by quarters; others only by 180 degrees, which keeps their shape.
        turns = (0, 1, 2, 3) if unlabelled.shape[2] == unlabelled.shape[3] else (0, 2)
        generator = torch.Generator().manual_seed(step)
        rotation = torch.tensor(turns)[torch.randint(len(turns), (len(unlabelled),), generator=generator)]
        parts += [torch.rot90(unlabelled[(rotation == k).to(images.device)], k, dims=(2, 3)) for k in turns]
        targets += [rotation[rotation == k].to(images.device) for k in turns]
    # One forward pass for both objectives: DDP expects one per backward.
    logits = model(torch.cat(parts).contiguous(memory_format=torch.channels_last))
    target = torch.cat(targets)
    loss = images.new_zeros((), dtype=logits.dtype)
    if labelled:
        loss = loss + labelled * loss_fn(logits[:labelled, :classes], target[:labelled])
    if len(unlabelled):
        loss = loss + len(unlabelled) * loss_fn(logits[labelled:, classes:], target[labelled:])
    loss = loss / len(images)
    return loss, labelled


def train(name: str, batches: Iterable[dict[str, Any]], stopwatch: Stopwatch, model: nn.Module,
          optimizer: torch.optim.Optimizer, steps: int, classes: int,
          device: torch.device) -> dict[str, float]:
    """``batches``: on the device (a DeviceLoader over a loader that ``stopwatch`` times)."""
    iterator = iter(batches)
    loss_fn = nn.CrossEntropyLoss()
    prepare = 0.0
    samples = classified = 0
    stopwatch.seconds = 0.0
    start = time.perf_counter()
    for step in range(steps):
        before = time.perf_counter()
        batch = next(iterator)
        prepare += time.perf_counter() - before
        loss, labelled = objective(model, batch, classes, loss_fn, step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        samples += len(batch["image"])
        classified += labelled
        if step % 50 == 0 or step == steps - 1:
            print(f"  [{name}] step {step:4d} loss {loss.item():.3f}", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - start
    # ``prepare``: the loop blocked on the next batch. ``stopwatch.seconds``: the loader's own time, spent in
    # DeviceLoader's prefetch thread, overlapped with the steps (as is the conversion to normalised float:
    # in that thread on CPU, on a side stream on CUDA).
    result = {"steps": steps, "samples/s": samples / wall, "step ms": 1000 * wall / steps,
              "waiting for data": prepare / wall, "loader busy": stopwatch.seconds / wall}
    print(f"{name}: {steps} steps, {result['samples/s']:.0f} samples/s, {result['step ms']:.1f} ms/step; "
          f"{100 * result['waiting for data']:.1f}% of the time waiting for data "
          f"(the loader itself was busy {100 * result['loader busy']:.0f}% of the time, in the background)",
          flush=True)
    print(f"{name}: objective: {classified} samples with labels (classification), {samples - classified} "
          "without (rotation prediction)", flush=True)
    return result


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", help="shardio dataset directory")
    parser.add_argument("--demo", action="store_true", help="write synthetic shards into a temp dir")
    parser.add_argument("--tars", help="also train from these WebDataset tars, decoded with PIL")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tar-steps", type=int, default=30, help="steps for --tars (it is slow)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=0, help="0: read in the main process (no decode)")
    parser.add_argument("--tar-workers", type=int, default=2)
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
    with tempfile.TemporaryDirectory(prefix="shardio-demo-") as tmp:
        if args.demo:
            shards = demo_shards(tmp, classes=args.classes)
        elif args.shards:
            shards = args.shards
        else:
            parser.error("give --shards DIR (e.g. after `make shards`: out/sample-shards) or --demo")
        dataset = ShardDataset(shards, args.batch_size, shuffle=True, drop_last=True)
        stopwatch = Stopwatch()
        loader = TimedShardLoader(dataset, stopwatch, num_workers=args.workers,
                                  pin_memory=device.type == "cuda")
        batches = DeviceLoader(loader, device)

        torch.manual_seed(0)
        model = small_cnn(args.classes + ROTATIONS).to(device, memory_format=torch.channels_last)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        if args.resume and args.checkpoint:
            state = torch.load(args.checkpoint, map_location=device)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            batches.load_state_dict(state["loader"])
            print(f"resumed at epoch {state['loader']['epoch']}, batch {state['loader']['batches_seen']}")
        if distributed:
            model = nn.parallel.DistributedDataParallel(model)

        print(f"shards: {len(dataset.snapshot)} samples {dataset.snapshot.shape}, {len(dataset)} batches of "
              f"{args.batch_size} per epoch on rank {dataset.rank}/{dataset.world_size}, device {device}")
        results = {"shards": train("shards", batches_forever(batches), stopwatch, model, optimizer,
                                   args.steps, args.classes, device)}
        if args.checkpoint and (not distributed or dataset.rank == 0):
            torch.save({"model": getattr(model, "module", model).state_dict(),
                        "optimizer": optimizer.state_dict(), "loader": batches.state_dict()}, args.checkpoint)
            print(f"saved {args.checkpoint}")
        if args.tars:
            side = dataset.snapshot.shape[0]
            tar_stopwatch = Stopwatch()
            tars = Timed(_Repeat(webdataset_loader(args.tars, args.batch_size, args.tar_workers, side,
                                                   device.type == "cuda")), tar_stopwatch)
            results["webdataset+PIL"] = train("webdataset+PIL", DeviceLoader(tars, device), tar_stopwatch,
                                              model, optimizer, args.tar_steps, args.classes, device)
            ratio = results["shards"]["samples/s"] / results["webdataset+PIL"]["samples/s"]
            print(f"shards / webdataset+PIL samples/s: {ratio:.1f}x")
    if distributed:
        torch.distributed.destroy_process_group()
    return results


class _Repeat:
    """Epochs of a DataLoader back to back (the tars may hold fewer samples than the steps need)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        while True:
            yield from self.loader


if __name__ == "__main__":
    main()
