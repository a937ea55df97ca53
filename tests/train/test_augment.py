"""shardio.train.augment: batched crops that follow torchvision's RandomResizedCrop, flips, determinism per
(seed, epoch, position), content boxes, and the positions DeviceLoader / PositionedBatches hand over; batches
of varying shape (a bucketed dataset's) keep their own shape unless a size is given, each sample its own crop.

torchvision is not installed (it would reinstall stock Pillow): its ``RandomResizedCrop.get_params`` is
re-implemented below in plain Python as the reference, and distributions are compared with a two-sample
Kolmogorov-Smirnov statistic at a critical value derived from the sample sizes. Seeds are fixed, so the
statistics are the same on every run: nothing here depends on luck or timing.
"""

from __future__ import annotations

import math
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from bucket_fixtures import BUCKETS, key_bucket, key_index, make_bucketed_dataset
from dataset_fixtures import indices, make_dataset
from varying_batches import SHAPES, mixed_batches

from shardio import DeviceLoader, ShardDataset, ShardLoader
from shardio.train.augment import (
    CropParams,
    EvalTransform,
    PositionedBatches,
    TrainAugment,
    crop_params,
    resized_crop,
    source_crop_top_left,
    splitmix64_uniforms,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
IDENTITY = {"mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)}
SAMPLES = 20_000


def torchvision_get_params(rng: random.Random, height: int, width: int, scale: tuple[float, float],
                           ratio: tuple[float, float], *,
                           log_uniform: bool = True) -> tuple[int, int, int, int]:
    """torchvision.transforms.RandomResizedCrop.get_params, with Python's random for torch's
    (``log_uniform=False``: a plausible bug, for the test of the test's power)."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        if log_uniform:
            aspect_ratio = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        else:
            aspect_ratio = rng.uniform(ratio[0], ratio[1])
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = rng.randint(0, height - h)
            j = rng.randint(0, width - w)
            return i, j, h, w
    return torchvision_fallback(height, width, ratio)


def torchvision_fallback(height: int, width: int, ratio: tuple[float, float]) -> tuple[int, int, int, int]:
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w = width
        h = height
    return (height - h) // 2, (width - w) // 2, h, w


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.sort(a), np.sort(b)
    points = np.concatenate([a, b])
    cdf_a = np.searchsorted(a, points, side="right") / len(a)
    cdf_b = np.searchsorted(b, points, side="right") / len(b)
    return float(np.abs(cdf_a - cdf_b).max())


def ks_critical(n: int, m: int, alpha: float = 1e-4) -> float:
    """Two-sample KS critical value: c(alpha)·sqrt((n + m) / (n·m)); 0.022 for 20k vs 20k."""
    return math.sqrt(-0.5 * math.log(alpha / 2)) * math.sqrt((n + m) / (n * m))


def two_proportions_agree(p: float, q: float, n: int) -> bool:
    """Within 4.5 standard errors of the difference of two proportions of n samples each."""
    pooled = (p + q) / 2
    return abs(p - q) <= 4.5 * math.sqrt(max(pooled * (1 - pooled), 1e-12) * 2 / n) + 1e-12


# (image height, width), scale, ratio: square; wide (many tries rejected, fallback 0.04%); tall (fallback
# 97%: the clamped centre crop); a large minimum scale with wide ratios (fallback 44%).
CASES = [
    ((256, 256), (0.08, 1.0), (3 / 4, 4 / 3)),
    ((160, 288), (0.08, 1.0), (3 / 4, 4 / 3)),
    ((250, 60), (0.3, 1.0), (3 / 4, 4 / 3)),
    ((288, 288), (0.9, 1.0), (0.5, 2.0)),
]


@pytest.mark.parametrize(("size", "scale", "ratio"), CASES)
def test_crop_distribution_matches_torchvision(size: tuple[int, int], scale: tuple[float, float],
                                               ratio: tuple[float, float]) -> None:
    height, width = size
    rng = random.Random(1234)
    ref = np.array([torchvision_get_params(rng, height, width, scale, ratio) for _ in range(SAMPLES)], float)
    crops = crop_params(size, seed=7, epoch=3, positions=torch.arange(SAMPLES), scale=scale, ratio=ratio)
    ours = np.stack([crops.y0.numpy(), crops.x0.numpy(), crops.height.numpy(), crops.width.numpy()], 1)
    assert ((ours[:, 2] + ours[:, 0]) <= height).all() and ((ours[:, 3] + ours[:, 1]) <= width).all()
    assert (ours == np.round(ours)).all(), "torchvision crops whole pixels"
    critical = ks_critical(SAMPLES, SAMPLES)
    features = {
        "area fraction": lambda c: c[:, 2] * c[:, 3] / (height * width),
        "aspect": lambda c: c[:, 3] / c[:, 2],
        "width": lambda c: c[:, 3],
        "height": lambda c: c[:, 2],
        "top / room": lambda c: c[:, 0] / (height - c[:, 2] + 1),
        "left / room": lambda c: c[:, 1] / (width - c[:, 3] + 1),
    }
    for name, feature in features.items():
        statistic = ks_statistic(feature(ours), feature(ref))
        assert statistic < critical, f"{name}: KS {statistic:.4f} >= {critical:.4f}"
    # How often the centre-crop fallback is taken.
    fallback = np.array(torchvision_fallback(height, width, ratio), float)
    share_ref, share_ours = float((ref == fallback).all(1).mean()), float((ours == fallback).all(1).mean())
    assert two_proportions_agree(share_ours, share_ref, SAMPLES), (share_ours, share_ref)


def test_the_distribution_test_catches_a_uniform_ratio() -> None:
    """The KS check has the power to see a plausible bug: the ratio drawn uniform, not log-uniform."""
    ours = crop_params((256, 256), seed=0, epoch=0, positions=torch.arange(SAMPLES))
    rng = random.Random(5)
    buggy = np.array([torchvision_get_params(rng, 256, 256, (0.08, 1.0), (3 / 4, 4 / 3), log_uniform=False)
                      for _ in range(SAMPLES)], float)
    aspect = (ours.width / ours.height).numpy()
    assert ks_statistic(aspect, buggy[:, 3] / buggy[:, 2]) > ks_critical(SAMPLES, SAMPLES)


def test_splitmix64_matches_the_reference_bits() -> None:
    """The int64 tensor version gives splitmix64's unsigned bits: the same numbers on any device."""
    mask = (1 << 64) - 1

    def splitmix(z: int) -> int:
        z &= mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    golden = 0x9E3779B97F4A7C15
    seed, epoch, positions = 123, 4, [0, 1, 2**40 + 17]
    key = splitmix(splitmix(seed + golden) ^ epoch)
    got = splitmix64_uniforms(seed, epoch, torch.tensor(positions), 3)
    for row, position in enumerate(positions):
        stream = splitmix((position * golden + key) & mask)
        for draw in range(3):
            expected = (splitmix((stream + (draw + 1) * golden) & mask) >> 11) / 2**53
            assert got[row, draw].item() == expected


@pytest.mark.parametrize("flip_p", [0.5, 0.2])
def test_flip_rate(flip_p: float) -> None:
    crops = crop_params((256, 256), seed=0, epoch=0, positions=torch.arange(SAMPLES), flip_p=flip_p)
    rate = crops.flip.double().mean().item()
    assert abs(rate - flip_p) <= 4.5 * math.sqrt(flip_p * (1 - flip_p) / SAMPLES), rate


def textured(batch: int, height: int, width: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, height, width, 3), dtype=torch.uint8, generator=generator)


@pytest.mark.parametrize("device", DEVICES)
def test_each_sample_is_the_bilinear_resize_of_its_crop(device: str) -> None:
    images = textured(12, 96, 80).to(device)
    augment = TrainAugment(48, **IDENTITY)
    positions = torch.arange(12, device=device)
    out = augment(images, epoch=0, positions=positions)
    assert out.shape == (12, 3, 48, 48) and out.dtype == torch.float32
    assert out.is_contiguous(memory_format=torch.channels_last)
    crops = augment.params((96, 80), epoch=0, positions=positions)
    assert crops.flip.any() and not crops.flip.all()
    for b in range(12):
        x0, y0, w, h = (int(t[b]) for t in crops[:4])
        crop = images[b, y0:y0 + h, x0:x0 + w].permute(2, 0, 1)[None].float()
        expected = F.interpolate(crop, (48, 48), mode="bilinear", align_corners=False)[0]
        expected = expected.flip(-1) if crops.flip[b] else expected
        torch.testing.assert_close(out[b], expected, atol=0.05, rtol=0)
    # NCHW input and bfloat16 output: the same pixels.
    nchw = augment(images.permute(0, 3, 1, 2).contiguous(), epoch=0, positions=positions)
    torch.testing.assert_close(nchw, out)
    half = TrainAugment(48, dtype=torch.bfloat16, **IDENTITY)(images, epoch=0, positions=positions)
    assert half.dtype == torch.bfloat16 and half.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(half.float(), out, atol=1.0, rtol=0.01)


def test_normalisation_uses_mean_and_std() -> None:
    images = textured(4, 32, 32)
    positions = torch.arange(4)
    raw = TrainAugment(16, **IDENTITY)(images, epoch=0, positions=positions)
    normalised = TrainAugment(16, mean=(10.0, 20.0, 30.0), std=(2.0, 4.0, 8.0))(
        images, epoch=0, positions=positions)
    mean = torch.tensor([10.0, 20.0, 30.0]).view(1, 3, 1, 1)
    std = torch.tensor([2.0, 4.0, 8.0]).view(1, 3, 1, 1)
    torch.testing.assert_close(normalised, (raw - mean) / std)


def test_same_seed_epoch_and_positions_give_identical_output() -> None:
    images = textured(16, 64, 64)
    positions = torch.arange(100, 116)
    augment = TrainAugment(32, seed=3)
    first = augment(images, epoch=2, positions=positions)
    assert torch.equal(first, TrainAugment(32, seed=3)(images, epoch=2, positions=positions))
    # A sample's augmentation does not depend on the batch it lands in, or where in it.
    order = torch.randperm(16, generator=torch.Generator().manual_seed(1))
    halves = [augment(images[order[i:i + 8]], epoch=2, positions=positions[order[i:i + 8]]) for i in (0, 8)]
    torch.testing.assert_close(torch.cat(halves), first[order], atol=1e-4, rtol=0)


@pytest.mark.parametrize("change", ["epoch", "seed", "positions"])
def test_another_epoch_seed_or_position_gives_other_crops(change: str) -> None:
    positions = torch.arange(1000)
    base = crop_params((256, 256), seed=0, epoch=0, positions=positions)
    other = crop_params((256, 256), seed=int(change == "seed"), epoch=int(change == "epoch"),
                        positions=positions + 1000 * (change == "positions"))
    same = (base.x0 == other.x0) & (base.y0 == other.y0) & (base.width == other.width) \
        & (base.height == other.height) & (base.flip == other.flip)
    assert same.double().mean() < 0.01


def letterboxed(boxes: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Padding 255 around content in 0..100, so any padding that leaks into an output shows as > 100."""
    images = (textured(len(boxes), height, width) % 101).to(torch.uint8)
    for b, (x0, y0, x1, y1) in enumerate(boxes.tolist()):
        mask = torch.ones(height, width, dtype=torch.bool)
        mask[y0:y1, x0:x1] = False
        images[b][mask] = 255
    return images


def random_boxes(batch: int, height: int, width: int) -> torch.Tensor:
    rng = np.random.default_rng(0)
    boxes = []
    for _ in range(batch):
        w, h = int(rng.integers(3, width + 1)), int(rng.integers(3, height + 1))
        x0, y0 = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
        boxes.append([x0, y0, x0 + w, y0 + h])
    return torch.tensor(boxes, dtype=torch.int64)


@pytest.mark.parametrize("device", DEVICES)
def test_crops_stay_inside_the_content_box(device: str) -> None:
    boxes = random_boxes(64, 72, 64).to(device)
    images = letterboxed(boxes.cpu(), 72, 64).to(device)
    positions = torch.arange(64, device=device)
    augment = TrainAugment(40, scale=(0.05, 1.0), **IDENTITY)  # 40 > most boxes: upsampled edges too
    for epoch in range(5):
        crops = augment.params((72, 64), epoch=epoch, positions=positions, content_box=boxes)
        assert (crops.x0 >= boxes[:, 0]).all() and (crops.y0 >= boxes[:, 1]).all()
        assert (crops.x0 + crops.width <= boxes[:, 2]).all()
        assert (crops.y0 + crops.height <= boxes[:, 3]).all()
        out = augment(images, epoch=epoch, positions=positions, content_box=boxes)
        assert out.max().item() <= 100.01, "letterbox padding leaked into a crop"
    evaluated = EvalTransform(40, **IDENTITY)(images, content_box=boxes)
    assert evaluated.max().item() <= 100.01


def test_a_bad_content_box_is_refused() -> None:
    images = textured(2, 32, 32)
    with pytest.raises(ValueError, match=r"content_box\[1\]"):
        TrainAugment(16)(images, epoch=0, positions=torch.arange(2),
                         content_box=torch.tensor([[0, 0, 32, 32], [0, 0, 40, 32]]))
    with pytest.raises(ValueError, match=r"\[2, 4\]"):
        TrainAugment(16)(images, epoch=0, positions=torch.arange(2), content_box=torch.zeros(2, 3))


def test_eval_centre_crop_and_resize() -> None:
    images = textured(3, 256, 256)
    out = EvalTransform(224, **IDENTITY)(images)  # 0.875 of 256 = 224: exact pixels
    torch.testing.assert_close(out, images[:, 16:240, 16:240].permute(0, 3, 1, 2).float(), atol=0.01, rtol=0)
    larger = textured(3, 288, 288)
    out = EvalTransform(224, **IDENTITY)(larger)  # 252 centre pixels resized to 224
    crop = larger[:, 18:270, 18:270].permute(0, 3, 1, 2).float()
    torch.testing.assert_close(out, F.interpolate(crop, (224, 224), mode="bilinear", align_corners=False),
                               atol=0.05, rtol=0)


def test_a_further_crop_moves_sdxls_crop_conditioning_in_source_pixels() -> None:
    # Worked by hand. Row 0-1: a 400x100 source centre-cropped to 32x32 (scale 0.32, 150 columns cut on
    # the left); a 16x16 crop at (x 4, y 4) shows source columns 162.5.. and rows 12.5..: (13, 163); flipped,
    # what is left on the source's right is 400 - (150 + 20 / 0.32) = 187.5. Rows 2-3: a 200x100 source
    # padded into 32x32 (picture rows 8..24, scale 0.16); a crop at (8, 10) is 50 columns and 12.5 rows in,
    # flipped 200 - 16 / 0.16 = 100. Row 4: 64x128 stretched (0.5 across, 0.25 down). Row 5: no crop known.
    crops = CropParams(x0=torch.tensor([4.0, 4.0, 8.0, 8.0, 2.0, 3.0]),
                       y0=torch.tensor([4.0, 4.0, 10.0, 10.0, 3.0, 1.0]),
                       width=torch.tensor([16.0, 16.0, 8.0, 8.0, 8.0, 8.0]),
                       height=torch.tensor([16.0, 16.0, 8.0, 8.0, 8.0, 8.0]),
                       flip=torch.tensor([False, True, False, True, False, False]))
    original_size = torch.tensor([[100, 400], [100, 400], [100, 200], [100, 200], [128, 64], [50, 50]])
    crop_top_left = torch.tensor([[0, 150], [0, 150], [0, 0], [0, 0], [0, 0], [-1, -1]])
    content_box = torch.tensor([[0, 0, 32, 32]] * 2 + [[0, 8, 32, 24]] * 2 + [[0, 0, 32, 32]] * 2)
    moved = source_crop_top_left(crops, original_size, crop_top_left, (32, 32), content_box)
    assert moved.dtype == torch.int64
    assert moved.tolist() == [[13, 163], [13, 188], [13, 50], [13, 100], [12, 4], [-1, -1]]
    # Without a content box the whole image is the picture (centre crop, stretch, bucket).
    assert source_crop_top_left(CropParams(*(f[:2] for f in crops)), original_size[:2], crop_top_left[:2],
                                (32, 32)).tolist() == [[13, 163], [13, 188]]


def test_apply_gives_the_augmented_batch_and_the_crops_it_took() -> None:
    image = torch.randint(0, 256, (6, 24, 40, 3), dtype=torch.uint8)
    augment, positions = TrainAugment(seed=5), torch.arange(10, 16)
    out, crops = augment.apply(image, epoch=2, positions=positions)
    assert torch.equal(out, augment(image, epoch=2, positions=positions))
    expected = augment.params((24, 40), epoch=2, positions=positions)
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(crops, expected))


def test_resized_crop_flip_mirrors_the_output() -> None:
    images = textured(2, 40, 40)
    crop = [torch.tensor([3.0, 3.0], dtype=torch.float64), torch.tensor([5.0, 5.0], dtype=torch.float64),
            torch.tensor([30.0, 30.0], dtype=torch.float64), torch.tensor([20.0, 20.0], dtype=torch.float64)]
    plain = resized_crop(images, CropParams(*crop, torch.tensor([False, False])), (16, 24), **IDENTITY)
    flipped = resized_crop(images, CropParams(*crop, torch.tensor([True, False])), (16, 24), **IDENTITY)
    torch.testing.assert_close(flipped[0], plain[0].flip(-1), atol=1e-3, rtol=0)
    torch.testing.assert_close(flipped[1], plain[1])


# --- positions from the loaders --------------------------------------------------------------------

class Recorder:
    """A transform that records what it was given and returns the images as float NCHW."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[int]]] = []

    def __call__(self, image: torch.Tensor, *, epoch: int, positions: torch.Tensor,
                 content_box: torch.Tensor | None = None) -> torch.Tensor:
        self.calls.append((epoch, positions.tolist()))
        return image.permute(0, 3, 1, 2).float()


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = str(tmp_path_factory.mktemp("augment"))
    make_dataset(directory)
    return directory


def positions_of(ds: ShardDataset, epoch: int, stored: np.ndarray) -> list[int]:
    order = ds.sample_order(epoch)
    where = np.empty(len(order), dtype=np.int64)
    where[order] = np.arange(len(order))
    return where[stored].tolist()


@pytest.mark.parametrize(("wrap", "prefetch"),
                         [("dataset", 0), ("dataset", 2), ("loader", 0), ("loader", 2), ("workers", 2)])
def test_device_loader_hands_each_sample_its_epoch_position(dataset_dir: str, wrap: str,
                                                             prefetch: int) -> None:
    for world_size in (1, 2):
        for rank in range(world_size):
            ds = ShardDataset(dataset_dir, 10, shuffle=True, seed=5, rank=rank, world_size=world_size)
            ds.set_epoch(2)
            recorder = Recorder()
            source = ds if wrap == "dataset" else ShardLoader(ds, num_workers=2 if wrap == "workers" else 0)
            loader = DeviceLoader(source, "cpu", prefetch=prefetch, transform=recorder)
            batches = list(loader)
            assert len(recorder.calls) == len(batches) == len(ds)
            for batch, (epoch, positions) in zip(batches, recorder.calls):
                stored = indices({**batch, "image": batch["image"].permute(0, 2, 3, 1).to(torch.uint8)})
                assert epoch == 2 and positions == positions_of(ds, 2, stored)


def test_resumed_epoch_gets_the_same_positions(dataset_dir: str) -> None:
    ds = ShardDataset(dataset_dir, 10, shuffle=True)
    full = Recorder()
    list(DeviceLoader(ShardLoader(ds), "cpu", transform=full))
    head = Recorder()
    loader = DeviceLoader(ShardLoader(ShardDataset(dataset_dir, 10, shuffle=True)), "cpu", transform=head)
    for count, _ in enumerate(loader, 1):
        if count == 4:
            break
    tail = Recorder()
    resumed = DeviceLoader(ShardLoader(ShardDataset(dataset_dir, 10, shuffle=True)), "cpu", transform=tail)
    resumed.load_state_dict(loader.state_dict())
    list(resumed)
    assert head.calls[:4] + tail.calls == full.calls


def test_positioned_batches_for_on_after_batch_transfer(dataset_dir: str) -> None:
    ds = ShardDataset(dataset_dir, 10, shuffle=True)
    ds.set_epoch(1)
    tagged = PositionedBatches(ShardLoader(ds))
    assert len(tagged) == len(ds)
    for batch in tagged:
        assert batch["__epoch__"] == 1
        assert batch["__position__"].tolist() == positions_of(ds, 1, indices(batch))
    recorder = Recorder()
    ds.set_epoch(1)  # each iteration is the next epoch: this one repeats epoch 1
    list(DeviceLoader(PositionedBatches(ds), "cpu", transform=recorder))
    assert recorder.calls and all(epoch == 1 for epoch, _ in recorder.calls)


def test_transform_refuses_to_device_arguments_and_unknown_positions(dataset_dir: str) -> None:
    with pytest.raises(ValueError, match="mean"):
        DeviceLoader(ShardDataset(dataset_dir, 10), "cpu", transform=Recorder(), mean=(0.0, 0.0, 0.0))
    plain = list(ShardDataset(dataset_dir, 10))[:2]
    with pytest.raises(ValueError, match="epoch position"):
        list(DeviceLoader(plain, "cpu", transform=Recorder()))


def test_device_loader_with_train_augment_resumes_identically(dataset_dir: str) -> None:
    def loader(state: dict | None = None) -> DeviceLoader:
        ds = ShardDataset(dataset_dir, 10, shuffle=True)
        ds.set_epoch(1)
        made = DeviceLoader(ShardLoader(ds), "cpu", transform=TrainAugment(6, scale=(0.2, 1.0), seed=9))
        if state is not None:
            made.load_state_dict(state)
        return made

    full = list(loader())
    assert full[0]["image"].shape == (10, 3, 6, 6) and full[0]["image"].dtype == torch.float32
    assert full[0]["image"].is_contiguous(memory_format=torch.channels_last)
    head = loader()
    first = []
    for batch in head:
        first.append(batch)
        if len(first) == 3:
            break
    again = first + list(loader(head.state_dict()))
    assert len(again) == len(full)
    for got, expected in zip(again, full):
        assert torch.equal(got["image"], expected["image"]) and torch.equal(got["cls"], expected["cls"])


def test_augment_imports_torch_only() -> None:
    code = ("import sys, shardio.train.augment\n"
            "bad = [m for m in ('PIL', 'torchvision', 'ray', 'yaml', 'typer') if m in sys.modules]\n"
            "assert not bad, bad\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# --- batches of varying shape (a bucketed dataset's) -----------------------------------------------------------

@pytest.mark.parametrize("transform", [TrainAugment(seed=3, **IDENTITY), EvalTransform(**IDENTITY)],
                         ids=["train", "eval"])
def test_by_default_each_batch_keeps_its_own_shape(transform):
    for number, batch in enumerate(mixed_batches()):
        image = batch["image"]
        positions = torch.arange(number * 4, number * 4 + 4)
        out = transform(image, epoch=0, positions=positions)
        assert out.shape == (4, 3, image.shape[1], image.shape[2]) and out.dtype == torch.float32
        assert out.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("size, expected", [(12, (12, 12)), ((10, 18), (10, 18))])
@pytest.mark.parametrize("kind", ["train", "eval"])
def test_an_explicit_size_is_every_batchs_shape(size, expected, kind):
    transform = TrainAugment(size, seed=3) if kind == "train" else EvalTransform(size)
    for number, batch in enumerate(mixed_batches()):
        out = transform(batch["image"], epoch=0, positions=torch.arange(number * 4, number * 4 + 4))
        assert out.shape == (4, 3, *expected)


def test_eval_with_the_whole_image_kept_is_the_image_itself():
    for batch in mixed_batches():
        out = EvalTransform(crop_fraction=1.0, **IDENTITY)(batch["image"])
        # bilinear at exact pixel centres: the pixels, up to float rounding of the grid
        torch.testing.assert_close(out, batch["image"].permute(0, 3, 1, 2).float(), atol=1e-3, rtol=0)


def test_kept_shape_crops_keep_the_batchs_aspect_ratio_within_ratio():
    """With the shape kept, ``ratio`` is relative to the batch's aspect: a 1:2 bucket's crops are about
    1:2 (within 3/4..4/3 of it, and so stretched at most that much when resized back), not square."""
    augment = TrainAugment(seed=1)
    positions = torch.arange(4000)
    for height, width in [(32, 64), (64, 32), (48, 48)]:
        crops = augment.params((height, width), epoch=0, positions=positions)
        relative = (crops.width / crops.height) / (width / height)
        inside = (crops.x0 >= 0) & (crops.y0 >= 0) & (crops.x0 + crops.width <= width) \
            & (crops.y0 + crops.height <= height)
        assert bool(inside.all())
        # Rounding to whole pixels moves a small crop's aspect a little past the range.
        large = crops.width * crops.height >= 0.2 * height * width
        assert float(relative[large].min()) > 0.7 and float(relative[large].max()) < 1.43
        assert abs(float(torch.log(relative[large]).median())) < 0.05


def test_a_samples_crop_depends_on_its_position_not_on_the_batch_it_is_in():
    augment = TrainAugment(seed=5, **IDENTITY)
    image = mixed_batches()[0]["image"]
    whole = augment(image, epoch=2, positions=torch.arange(10, 14))
    parts = torch.cat([augment(image[:2], epoch=2, positions=torch.arange(10, 12)),
                       augment(image[2:], epoch=2, positions=torch.arange(12, 14))])
    assert torch.equal(whole, parts)


def test_device_loader_with_a_transform_carries_every_shape():
    batches = mixed_batches()
    for number, batch in enumerate(batches):
        batch["__position__"], batch["__epoch__"] = torch.arange(number * 4, number * 4 + 4), 0
    for transform, fixed in [(TrainAugment(seed=0), None), (TrainAugment(10, seed=0), (10, 10))]:
        out = list(DeviceLoader(batches, "cpu", transform=transform, prefetch=2))
        assert [tuple(b["image"].shape[2:]) for b in out] == [fixed or shape for shape in SHAPES]
        assert [b["bucket"] for b in out] == [b["bucket"] for b in batches]


@pytest.fixture(scope="module")
def bucketed(tmp_path_factory) -> str:
    """``make_bucketed_dataset``'s default: 60 samples in 3 shapes."""
    return make_bucketed_dataset(str(tmp_path_factory.mktemp("bucketed") / "ds"))  # 60 samples, 3 shapes


class PositionNoter:
    """A transform that notes each batch's positions around a ``TrainAugment``."""

    def __init__(self, inner) -> None:
        self.inner, self.positions = inner, []

    def __call__(self, image, *, epoch, positions, content_box=None):
        self.positions.append(positions.tolist())
        return self.inner(image, epoch=epoch, positions=positions, content_box=content_box)


def check_epoch(batches: list[dict], fixed: tuple[int, int] | None = None) -> None:
    keys = [key for batch in batches for key in batch["__key__"]]
    assert sorted(key_index(k) for k in keys) == list(range(60)), "every sample once"
    for batch in batches:
        assert {key_bucket(k) for k in batch["__key__"]} == {batch["bucket"]}, "one bucket per batch"
        assert tuple(batch["image"].shape[2:]) == (fixed or BUCKETS[batch["bucket"]])
    assert len({batch["bucket"] for batch in batches}) == 3


@pytest.mark.parametrize("wrap", ["dataset", "loader"])
@pytest.mark.parametrize("size", [None, 10])
def test_device_loader_with_augment_over_a_bucketed_dataset(bucketed, wrap, size):
    dataset = ShardDataset(bucketed, 8, shuffle=True, drop_last=False)
    source = dataset if wrap == "dataset" else ShardLoader(dataset)
    augment = PositionNoter(TrainAugment(size, seed=0))
    batches = list(DeviceLoader(source, "cpu", transform=augment, prefetch=2))
    check_epoch(batches, None if size is None else (size, size))
    positions = [p for batch in augment.positions for p in batch]
    assert sorted(positions) == list(range(60)), "each sample its own epoch position: its own crop"
