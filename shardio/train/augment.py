"""Batched augmentation on the device: RandomResizedCrop + flip + normalise, and the eval centre crop.

A whole batch is augmented in a handful of tensor ops, with no Python loop over samples: each sample's
crop (and flip) becomes its row and column sample coordinates, and one ``F.grid_sample`` (bilinear,
``align_corners=False``) resamples every crop to the output size at once. The coordinates are clamped to
each crop's outer pixel centres, so a sample is exactly ``interpolate(crop, size, mode="bilinear")`` of
its own crop (edges replicated, as a resize of the cropped image does) and never reads a pixel outside it.
Output: ``(x - mean) / std`` float32 or bfloat16 N×3×H×W in channels_last memory, like ``to_device``.
The output keeps each batch's own (H, W) unless a size is given (``TrainAugment(size=None)``, the
default: a bucketed dataset's batches keep their bucket's shape), or is that size for every batch.

Crop parameters follow torchvision's ``RandomResizedCrop.get_params``: up to 10 tries of an area fraction
uniform in ``scale`` and an aspect ratio log-uniform in ``ratio``, rounded to whole pixels, the first that
fits wins, with a uniform integer offset; if none fits, the centre crop clamped to ``ratio``. All 10 tries
are drawn for every sample and the first fitting one is picked with ``argmax``: the same distribution,
vectorised. With ``mode: pad`` datasets, each image's ``content_box`` (x0, y0, x1, y1 in pixels,
end-exclusive) keeps crops inside it, as if the letterboxed image were the content alone: the job stores
it per sample and every batch of such a dataset carries it as ``"content_box"``, which
``DeviceLoader(..., transform=...)`` and ``transform_batch`` pass on by themselves.

Randomness is counter-based: every number is splitmix64 of (seed, epoch, sample position, draw index), in
int64 tensor ops on the batch's device. A sample's crop depends on nothing else, not on the batch it lands
in, the world size or the device, so a resumed or re-run epoch augments identically. The position is the
sample's place in the epoch order (``ShardDataset``'s global order, the same on every rank):
``DeviceLoader(..., transform=...)`` works it out from the batch count, and ``PositionedBatches`` adds it
to each batch as ``"__position__"`` for loops that apply the transform themselves (Lightning's
``on_after_batch_transfer``).

SDXL's size and crop conditioning. A batch's ``original_size`` and ``crop_top_left`` (``shardio.format``,
"Metadata") pass through the transforms unchanged: they describe the stored image, the crop the job made.
A model conditioned on the crop it sees takes ``TrainAugment.apply`` (the batch and the crops it drew) and
``source_crop_top_left``, which moves each sample's (top, left) by the further crop, in source pixels.

Antialiasing. torchvision resizes the crop with ``antialias=True``; bilinear ``grid_sample`` does not
antialias. Storing a side a little larger than the output keeps that cheap: from 256² or 288² to 224 a
crop is at most 1.14× or 1.29× larger than the output along a side (ratio ≤ 4/3 caps the long side at
the image's), where a triangle filter spans little more than bilinear's 2 taps. ``python -m bench.augment``
measures it on the largest crop against ``interpolate(..., antialias=True)`` (mean |difference| on the
0-255 scale; in brackets, antialiased bicubic against the same reference, a filter choice recipes make
freely): random pixels, the worst case, 7.1 (9.5) at 1.14×, 12.9 (8.0) at 1.29×, 29.8 (4.6) at 2.29×
(512² → 224); 1/f noise, the spectrum of photographs, 0.08 (0.12), 0.10 (0.10), 0.14 (0.08). On photo
statistics the missing antialias is within the spread of filter choices at every factor; on pixel-level
texture it is at 1.14×, 1.6× that spread at 1.29× and 6.5× at 2.29×: store a side near the output (256
or 288 for 224), not 512. No area pre-filter is applied.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from shardio.read.dataset import ShardDataset
from shardio.read.prefetch import PassPrefetch, prefetched
from shardio.read.resume import EpochPass
from shardio.train.batch_transform import BatchTransform, batch_positions, transform_batch
from shardio.train.loader import IMAGENET_MEAN, IMAGENET_STD, ShardLoader

__all__ = [
    "BatchTransform",
    "CropParams",
    "EvalTransform",
    "PositionedBatches",
    "TrainAugment",
    "batch_positions",
    "crop_params",
    "resized_crop",
    "source_crop_top_left",
    "splitmix64_uniforms",
    "transform_batch",
]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment: 2^64 / golden ratio
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_TRIES = 10  # torchvision's get_params tries 10 random crops before the centre-crop fallback
# Per sample: 10 area draws, 10 ratio draws, top offset, left offset, flip.
_DRAWS = 2 * _TRIES + 3


class CropParams(NamedTuple):
    """Per-sample crops in pixels of the stored image: left, top, width, height (float64 [B]), flip (bool)."""

    x0: torch.Tensor
    y0: torch.Tensor
    width: torch.Tensor
    height: torch.Tensor
    flip: torch.Tensor


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


def _splitmix64_int(value: int) -> int:
    z = value & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    # torch's >> on int64 is arithmetic; splitmix64 needs the logical shift.
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    # int64 multiplication wraps modulo 2^64 on CPU and CUDA: the same bits as the unsigned algorithm.
    z = (z ^ _shr(z, 30)) * _signed(_MIX1)
    z = (z ^ _shr(z, 27)) * _signed(_MIX2)
    return z ^ _shr(z, 31)


def splitmix64_uniforms(seed: int, epoch: int, positions: torch.Tensor, draws: int,
                        dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Uniforms in [0, 1) of shape [B, draws]: draw ``d`` of the sample at ``positions[b]`` is
    splitmix64(key(seed, epoch) + position·φ, then + (d + 1)·φ), its top 53 bits over 2^53."""
    key = _splitmix64_int(_splitmix64_int(seed + _GOLDEN) ^ (epoch & _MASK64))
    positions = positions.to(torch.int64)
    stream = _mix(positions * _signed(_GOLDEN) + _signed(key))
    counters = torch.arange(1, draws + 1, dtype=torch.int64, device=positions.device) * _signed(_GOLDEN)
    bits = _shr(_mix(stream[:, None] + counters[None, :]), 11)  # 53 bits: exact in float64
    return bits.to(dtype) * (1.0 / (1 << 53))


def _float64(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


def _boxes(content_box: torch.Tensor | None, batch: int, height: int, width: int,
           device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if content_box is None:
        return torch.tensor([0, 0, width, height], dtype=dtype, device=device).expand(batch, 4)
    box = content_box.to(device=device, dtype=dtype)
    if box.shape != (batch, 4):
        raise ValueError(f"content_box must be [{batch}, 4] (x0, y0, x1, y1), got {list(box.shape)}")
    bad = (box[:, 0] < 0) | (box[:, 1] < 0) | (box[:, 2] > width) | (box[:, 3] > height) \
        | (box[:, 2] <= box[:, 0]) | (box[:, 3] <= box[:, 1])
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        raise ValueError(f"content_box[{first}] = {box[first].tolist()} is empty or outside the "
                         f"{width}x{height} image; boxes are (x0, y0, x1, y1) pixels, end-exclusive")
    return box


def crop_params(
    image_size: tuple[int, int], *, seed: int, epoch: int, positions: torch.Tensor,
    scale: tuple[float, float] = (0.08, 1.0), ratio: tuple[float, float] = (3 / 4, 4 / 3),
    flip_p: float = 0.5, content_box: torch.Tensor | None = None,
) -> CropParams:
    """torchvision's ``RandomResizedCrop.get_params`` for every sample at once (see the module docstring);
    ``image_size`` is (height, width); crops lie inside ``content_box`` when given."""
    height, width = image_size
    device = positions.device
    real = _float64(device)
    box = _boxes(content_box, len(positions), height, width, device, real)
    box_w, box_h = (box[:, 2] - box[:, 0])[:, None], (box[:, 3] - box[:, 1])[:, None]
    u = splitmix64_uniforms(seed, epoch, positions, _DRAWS, real)
    area = box_w * box_h * (scale[0] + (scale[1] - scale[0]) * u[:, :_TRIES])
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(log_lo + (log_hi - log_lo) * u[:, _TRIES:2 * _TRIES])
    tries_w = torch.round(torch.sqrt(area * aspect))  # round half to even, as Python's round()
    tries_h = torch.round(torch.sqrt(area / aspect))
    fits = (tries_w > 0) & (tries_w <= box_w) & (tries_h > 0) & (tries_h <= box_h)
    first = fits.to(torch.uint8).argmax(dim=1, keepdim=True)  # the first fitting try, as the loop takes
    found = fits.any(dim=1)
    w, h = tries_w.gather(1, first)[:, 0], tries_h.gather(1, first)[:, 0]
    box_w, box_h = box_w[:, 0], box_h[:, 0]
    top = torch.floor(u[:, 2 * _TRIES] * (box_h - h + 1))  # torch.randint(0, H - h + 1)
    left = torch.floor(u[:, 2 * _TRIES + 1] * (box_w - w + 1))
    # No try fitted: the whole box, clamped to the ratio range, centred.
    in_ratio = box_w / box_h
    narrow, wide = in_ratio < min(ratio), in_ratio > max(ratio)
    fallback_w = torch.where(wide, torch.round(box_h * max(ratio)), box_w)
    fallback_h = torch.where(narrow, torch.round(box_w / min(ratio)), box_h)
    w, h = torch.where(found, w, fallback_w), torch.where(found, h, fallback_h)
    top = torch.where(found, top, torch.div(box_h - h, 2, rounding_mode="floor"))
    left = torch.where(found, left, torch.div(box_w - w, 2, rounding_mode="floor"))
    flip = u[:, 2 * _TRIES + 2] < flip_p
    return CropParams(box[:, 0] + left, box[:, 1] + top, w, h, flip)


def source_crop_top_left(
    crops: CropParams, original_size: torch.Tensor, crop_top_left: torch.Tensor, image_size: tuple[int, int],
    content_box: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDXL's crop conditioning after ``crops`` (``TrainAugment.params``) cut the stored images further:
    (top, left) of what the model sees, in the upright source's pixels (int64 [B, 2], halves rounded up),
    from each sample's ``original_size`` and stored ``crop_top_left`` (a batch's). A flipped crop shows the
    source mirrored, so its left is what the crop leaves on the source's right. A row with a -1 (a dataset
    that does not record its crops) stays (-1, -1).

    The stored picture (``content_box``, else the whole ``image_size`` (height, width)) shows the source
    region the job kept: a centre crop (a non-zero ``crop_top_left``) scales both sides alike, by the larger
    of the two ratios; ``pad`` and ``stretch`` keep the whole source, each side at its own ratio."""
    height, width = image_size
    device = crops.x0.device
    real = _float64(device)
    box = _boxes(content_box, len(crops.x0), height, width, device, real)
    size, cut = original_size.to(device, real), crop_top_left.to(device, real)
    box_w, box_h = box[:, 2] - box[:, 0], box[:, 3] - box[:, 1]
    ratio_x, ratio_y = box_w / size[:, 1], box_h / size[:, 0]
    cropped = (cut > 0).any(dim=1)
    ratio_x, ratio_y = (torch.where(cropped, torch.maximum(ratio_x, ratio_y), ratio_x),
                        torch.where(cropped, torch.maximum(ratio_x, ratio_y), ratio_y))
    x0, y0 = crops.x0.to(real) - box[:, 0], crops.y0.to(real) - box[:, 1]
    x1 = torch.minimum(x0 + crops.width.to(real), box_w)
    top = cut[:, 0] + y0.clamp(min=0) / ratio_y
    left = torch.where(crops.flip.to(device), size[:, 1] - (cut[:, 1] + x1 / ratio_x),
                       cut[:, 1] + x0.clamp(min=0) / ratio_x)
    # The float error (~1e-13) dropped before rounding, as the job rounds the stored crop.
    out = torch.floor(torch.round(torch.stack([top, left], dim=1) * 1e6) / 1e6 + 0.5).clamp(min=0)
    unknown = (size < 0).any(dim=1) | (cut < 0).any(dim=1)
    return torch.where(unknown[:, None], torch.full_like(out, -1), out).to(torch.int64)


def resized_crop(image: torch.Tensor, crops: CropParams, size: tuple[int, int], *,
                 mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Every sample's crop resized to ``size`` (bilinear), flipped where asked, normalised: float
    N×3×H×W, channels_last. ``image``: uint8 (or 0-255 float) NHWC [B, H, W, 3] or NCHW [B, 3, H, W]."""
    if image.ndim != 4 or 3 not in (image.shape[1], image.shape[-1]):
        raise ValueError(f"expected images [B, H, W, 3] or [B, 3, H, W], got {list(image.shape)}")
    nchw = image.permute(0, 3, 1, 2) if image.shape[-1] == 3 else image  # NHWC: a channels_last view
    batch, channels, height, width = nchw.shape
    out_h, out_w = size
    crops = CropParams(*(field.to(nchw.device) for field in crops))
    work = torch.float32  # grid_sample's reference precision; bfloat16 only at the end
    # No rotation: the grid is an outer product of per-sample column and row coordinates, built from
    # [B, W] and [B, H] vectors (affine_grid's batched matmul over B×H×W×2 was a third of the CPU time).
    columns = _sample_points(crops.x0, crops.width, out_w, width).to(work)
    columns = torch.where(crops.flip[:, None], columns.flip(1), columns)  # a flip mirrors the columns
    rows = _sample_points(crops.y0, crops.height, out_h, height).to(work)
    grid = torch.stack([columns[:, None, :].expand(batch, out_h, out_w),
                        rows[:, :, None].expand(batch, out_h, out_w)], dim=-1)
    sampled = F.grid_sample(nchw.to(work), grid, mode="bilinear", padding_mode="border", align_corners=False)
    scale, shift = _affine(tuple(mean), tuple(std), sampled.device)
    out = torch.empty((batch, channels, out_h, out_w), dtype=dtype, device=sampled.device,
                      memory_format=torch.channels_last)
    return torch.addcmul(shift, sampled, scale, out=out)  # normalised, cast and made channels_last at once


def _sample_points(start: torch.Tensor, length: torch.Tensor, points: int, size: int) -> torch.Tensor:
    """grid_sample's normalised coordinates (align_corners=False) of ``points`` evenly spaced samples of
    each crop ``[start, start + length)``, as a resize of the crop samples it ([B, points]).

    Clamped to the crop's outer pixel centres: upsampling a 72-pixel crop to 224 would otherwise blend
    up to half of the neighbouring pixel (letterbox padding, at a content-box edge) into the border."""
    steps = (torch.arange(points, dtype=start.dtype, device=start.device) + 0.5) / points
    pixels = start[:, None] + steps[None, :] * length[:, None]
    pixels = torch.minimum(torch.maximum(pixels, (start + 0.5)[:, None]), (start + length - 0.5)[:, None])
    return pixels * (2 / size) - 1


@functools.lru_cache(maxsize=16)
def _affine(mean: tuple[float, ...], std: tuple[float, ...],
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    scale = torch.tensor([1.0 / s for s in std]).view(1, -1, 1, 1).to(device)
    shift = torch.tensor([-m / s for m, s in zip(mean, std)]).view(1, -1, 1, 1).to(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # cached for every stream: let no stream see them half-copied
    return scale, shift


def _size(size: int | tuple[int, int] | None) -> tuple[int, int] | None:
    if size is None:
        return None
    out = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    if min(out) < 1:
        raise ValueError(f"size must be positive (height, width), got {size}")
    return out


def _image_size(image: torch.Tensor) -> tuple[int, int]:
    """(height, width) of a batch of NHWC (``[B, H, W, 3]``) or NCHW (``[B, 3, H, W]``) images."""
    if image.ndim != 4 or 3 not in (image.shape[1], image.shape[-1]):
        raise ValueError(f"expected images [B, H, W, 3] or [B, 3, H, W], got {list(image.shape)}")
    return (image.shape[1], image.shape[2]) if image.shape[-1] == 3 else (image.shape[2], image.shape[3])


class TrainAugment:
    """RandomResizedCrop (torchvision's ``scale``/``ratio``) + horizontal flip + normalise, batched.

    ``augment(image, epoch=e, positions=p)`` → float N×3×H×W (channels_last); ``positions`` are the
    samples' places in the epoch order (int64 [B]); ``content_box`` [B, 4] keeps crops off letterboxing.

    **Output size.** ``size=None`` (the default) keeps each batch's own (H, W): the shape a batch came in,
    so a bucketed dataset's batches (``mode: bucket``, each one bucket's shape) keep their bucket's shape
    and aspect ratio, and a single-shape dataset's keep the stored shape. ``ratio`` is then relative to the
    batch's aspect ratio (the crop's width/height is the image's times a draw in ``ratio``), so a crop is
    stretched by at most ``ratio`` when resized back, as torchvision's is on a square output. An explicit
    ``size`` (an int for a square, or (height, width)) resizes every batch to that one shape (the fixed
    input a model with a flatten or a fixed positional embedding needs); ``ratio`` is then torchvision's,
    the crop's own width/height.
    """

    def __init__(self, size: int | tuple[int, int] | None = None, *, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), flip_p: float = 0.5, seed: int = 0,
                 mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                 dtype: torch.dtype = torch.float32) -> None:
        if not (0 < scale[0] <= scale[1] and 0 < ratio[0] <= ratio[1]):
            raise ValueError(f"need 0 < scale[0] <= scale[1] and 0 < ratio[0] <= ratio[1], "
                             f"got scale={scale}, ratio={ratio}")
        self.size, self.scale, self.ratio, self.flip_p, self.seed = _size(size), scale, ratio, flip_p, seed
        self.mean, self.std, self.dtype = tuple(mean), tuple(std), dtype

    def params(self, image_size: tuple[int, int], *, epoch: int, positions: torch.Tensor,
               content_box: torch.Tensor | None = None) -> CropParams:
        """The crops of a batch of ``image_size`` (height, width) images (see the class docstring)."""
        ratio = self.ratio
        if self.size is None:  # the batch's shape kept: the crop's aspect relative to the batch's
            aspect = image_size[1] / image_size[0]
            ratio = (self.ratio[0] * aspect, self.ratio[1] * aspect)
        return crop_params(image_size, seed=self.seed, epoch=epoch, positions=positions, scale=self.scale,
                           ratio=ratio, flip_p=self.flip_p, content_box=content_box)

    def __call__(self, image: torch.Tensor, *, epoch: int, positions: torch.Tensor,
                 content_box: torch.Tensor | None = None) -> torch.Tensor:
        return self.apply(image, epoch=epoch, positions=positions, content_box=content_box)[0]

    def apply(self, image: torch.Tensor, *, epoch: int, positions: torch.Tensor,
              content_box: torch.Tensor | None = None) -> tuple[torch.Tensor, CropParams]:
        """The augmented batch (as a call gives it) and the crops it took, for SDXL's crop conditioning of
        what the model sees (``source_crop_top_left``)."""
        positions = torch.as_tensor(positions, device=image.device)
        if positions.shape != (image.shape[0],):
            raise ValueError(f"positions must be [{image.shape[0]}] (one per image), "
                             f"got {list(positions.shape)}")
        height, width = _image_size(image)
        crops = self.params((height, width), epoch=epoch, positions=positions, content_box=content_box)
        out_size = (height, width) if self.size is None else self.size
        return resized_crop(image, crops, out_size, mean=self.mean, std=self.std, dtype=self.dtype), crops


class EvalTransform:
    """Centre crop of ``crop_fraction`` of the content's short side, resized to ``size``, normalised.

    ``crop_fraction=0.875`` is "resize to 256, centre-crop 224" of the original: from 256² shards the crop
    is 224 pixels (no resampling: bilinear at exact pixel centres), from 288² shards 252 resized to 224.
    ``size=None`` (the default) keeps each batch's own (H, W), as ``TrainAugment``'s does: the centre
    ``crop_fraction`` of the image, of its aspect ratio, resized back to its shape (``crop_fraction=1.0``:
    the whole image, only normalised); an explicit ``size`` resizes every batch to that shape.
    """

    def __init__(self, size: int | tuple[int, int] | None = None, *, crop_fraction: float = 0.875,
                 mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                 dtype: torch.dtype = torch.float32) -> None:
        if not 0 < crop_fraction <= 1:
            raise ValueError(f"crop_fraction must be in (0, 1], got {crop_fraction}")
        self.size, self.crop_fraction = _size(size), crop_fraction
        self.mean, self.std, self.dtype = tuple(mean), tuple(std), dtype

    def __call__(self, image: torch.Tensor, *, epoch: int = 0, positions: torch.Tensor | None = None,
                 content_box: torch.Tensor | None = None) -> torch.Tensor:
        height, width = _image_size(image)
        real = _float64(image.device)
        box = _boxes(content_box, image.shape[0], height, width, image.device, real)
        box_w, box_h = box[:, 2] - box[:, 0], box[:, 3] - box[:, 1]
        out_h, out_w = (height, width) if self.size is None else self.size
        # The largest box of the output's aspect ratio in the content, times crop_fraction, centred.
        h = torch.round(self.crop_fraction * torch.minimum(box_h, box_w * out_h / out_w)).clamp_(min=1)
        w = torch.round(h * out_w / out_h).clamp_(1, None).minimum(box_w)
        x0 = box[:, 0] + torch.div(box_w - w, 2, rounding_mode="floor")
        y0 = box[:, 1] + torch.div(box_h - h, 2, rounding_mode="floor")
        crops = CropParams(x0, y0, w, h, torch.zeros_like(w, dtype=torch.bool))
        return resized_crop(image, crops, (out_h, out_w), mean=self.mean, std=self.std, dtype=self.dtype)


# --- where positions come from ---------------------------------------------------------------------

class PositionedBatches:
    """Iterate a ``ShardLoader`` (or a ``ShardDataset``) adding ``"__position__"`` (int64 [B], the samples'
    epoch positions) and ``"__epoch__"`` to each batch, for a transform applied later (Lightning's
    ``on_after_batch_transfer``: ``transform_batch(augment, batch, device)`` there also passes a
    ``mode: pad`` batch's ``"content_box"``, which this leaves in the batch). ``len``, ``state_dict`` and
    ``load_state_dict`` pass through; this is the layer that hands batches out, so it counts them
    (``shardio.read.resume``).

    ``prepare`` (e.g. the device decode of a JPEG batch handed out ``encoded``) runs on a prefetch thread
    ``prefetch`` batches ahead; a batch still counts only when this yields it. Iterated epoch after epoch
    (without DataLoader workers), that thread prepares the next epoch's first batches while this epoch's last
    ones are consumed (``shardio.read.prefetch.PassPrefetch``)."""

    def __init__(self, loader: ShardLoader | ShardDataset, *,
                 prepare: Callable[[dict[str, Any]], dict[str, Any]] | None = None, prefetch: int = 2,
                 encoded: bool | None = None) -> None:
        if not isinstance(loader, (ShardLoader, ShardDataset)):
            raise TypeError("PositionedBatches takes a ShardLoader or ShardDataset, "
                            f"got {type(loader).__name__}")
        self.loader = loader
        self.dataset: ShardDataset = loader if isinstance(loader, ShardDataset) else loader.dataset
        self.prepare, self.prefetch, self.encoded = prepare, prefetch, encoded
        self.passes = PassPrefetch()

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        epoch_pass = self.loader.begin_pass()
        # Asked for only when set: a loader subclass's iter_pass from before JPEG datasets keeps working.
        encoded = {} if self.encoded is None else {"encoded": self.encoded}
        batches = self._prepared(epoch_pass, encoded)
        for index, batch in enumerate(self.dataset.cursor.handed_out(epoch_pass, batches)):
            positions = epoch_pass.batches[index]
            yield {**batch, "__position__": torch.arange(positions.start, positions.stop, dtype=torch.int64),
                   "__epoch__": epoch_pass.epoch}

    def _prepared(self, epoch_pass: EpochPass, encoded: dict[str, bool]) -> Iterator[dict[str, Any]]:
        """The pass's batches, ``prepare``d on the prefetch thread."""
        prepare, loader = self.prepare, self.loader
        if prepare is None or self.prefetch <= 0:
            batches: Iterator[dict[str, Any]] = loader.iter_pass(epoch_pass, **encoded)
            return batches if prepare is None else map(prepare, batches)
        if isinstance(loader, ShardLoader) and loader.num_workers > 0:
            return prefetched(loader.iter_pass(epoch_pass, **encoded), prepare, self.prefetch)
        how = ("positioned", *sorted(encoded.items()))

        def ahead() -> tuple[tuple[Any, ...], Iterator[dict[str, Any]]] | None:  # at the end of this pass
            following = self.dataset.pass_ahead()
            if following is None:
                return None
            return self.dataset.pass_key(following, *how), loader.iter_pass(following, prefetch=0, **encoded)

        return self.passes.passes(self.dataset.pass_key(epoch_pass, *how),
                                  lambda: loader.iter_pass(epoch_pass, prefetch=0, **encoded), prepare,
                                  self.prefetch, ahead, len(epoch_pass.batches))

    def state_dict(self, batches_seen: int | None = None) -> dict[str, Any]:
        return self.loader.state_dict(batches_seen)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
