"""Decoding a batch's JPEGs on the GPU in one call: ``DeviceDecoder`` turns a batch's ``EncodedImages``
(``ShardDataset(decode="device")``) into the uint8 [B, H, W, 3] tensor a decoded batch has, on the device.

The decode is ``torchvision.io.decode_jpeg`` on the list of the batch's JPEGs with ``device="cuda"``:
torchvision >= 0.19 decodes a list in one batched nvJPEG call (hardware decoder where the GPU has one).
Chosen over NVIDIA nvImageCodec because it comes with the torch install a training image already has (one
wheel from the same index, no separate CUDA library to match) and takes and returns torch tensors on
torch's streams; nvImageCodec is one more package with its own CUDA build matrix for the same decode.
torchvision is optional: imported here, when a decoder is made, never by ``import shardio``. It depends on
stock Pillow, which is fine in a training image but must never be installed into the preprocess job's
environment, where it would replace Pillow-SIMD (``preprocess/pillow_check.py`` tells).

nvJPEG's IDCT and chroma upsampling are not libjpeg-turbo's: the pixels may differ from the CPU decode
(``shardio.read.jpeg_pixels``) by a few levels; docs/reader.md, "Decoding JPEG batches on the GPU", has the
bound the CUDA test asserts. The decode function is injectable (``DeviceDecoder(device, decode=...)``) so
the stacking, layout and error paths run anywhere; the default is torchvision's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardio.errors import MissingExtra, ShardIntegrityError
from shardio.read.jpeg_pixels import EncodedImages

__all__ = ["DecodeFn", "DeviceDecoder", "MIN_TORCHVISION", "available", "torchvision_decode"]

DecodeFn = Callable[[list[torch.Tensor], torch.device], list[torch.Tensor]]
"""``decode(jpegs, device)``: each 1-D uint8 CPU tensor of JPEG bytes decoded to a uint8 (3, H, W) tensor on
``device``, in order (what ``torchvision.io.decode_jpeg(jpegs, mode=RGB, device=device)`` returns)."""

# The first torchvision whose decode_jpeg takes a list on a CUDA device in one batched nvJPEG call.
MIN_TORCHVISION = (0, 19)

INSTALL_HINT = (
    "pip install torchvision (the build matching your torch, from the same index) into the training image; "
    "torchvision pulls stock Pillow, which is fine there but must not go into the preprocess job's "
    "environment, where it would replace Pillow-SIMD. Or decode on the CPU: DeviceLoader(..., "
    "decode_on_device=False)"
)


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _torchvision_io() -> Any:
    """``torchvision.io``, imported now; MissingExtra naming what to install when absent or too old."""
    try:
        import torchvision
        import torchvision.io as io
    except ImportError as e:
        raise MissingExtra(f"decoding JPEG batches on the device needs torchvision >= "
                           f"{'.'.join(map(str, MIN_TORCHVISION))} (batched nvJPEG); it is not installed "
                           f"({e}): {INSTALL_HINT}") from e
    if _version(torchvision.__version__) < MIN_TORCHVISION:
        raise MissingExtra(f"decoding JPEG batches on the device needs torchvision >= "
                           f"{'.'.join(map(str, MIN_TORCHVISION))} (decode_jpeg on a list, batched nvJPEG); "
                           f"this one is {torchvision.__version__}: {INSTALL_HINT}")
    return io


def available() -> bool:
    """Whether ``torchvision_decode`` can run here (a recent enough torchvision imports)."""
    try:
        _torchvision_io()
    except MissingExtra:
        return False
    return True


def torchvision_decode(jpegs: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The batch in one ``torchvision.io.decode_jpeg`` call: batched nvJPEG on CUDA (RGB, 3×H×W uint8)."""
    io = _torchvision_io()
    return list(io.decode_jpeg(jpegs, mode=io.ImageReadMode.RGB, device=device))


class DeviceDecoder:
    """``decoder(images)``: an ``EncodedImages`` batch as uint8 [B, H, W, 3] (contiguous NHWC, as a decoded
    batch) on ``device``, decoded by ``decode`` (default ``torchvision_decode``; made without torchvision,
    the default says what to install). A sample that fails or decodes to another shape is a
    ShardIntegrityError naming its shard file and sample. Runs on the caller's current CUDA stream
    (``DeviceLoader``: its side stream, overlapping the step)."""

    def __init__(self, device: torch.device | str, decode: DecodeFn | None = None) -> None:
        self.device = torch.device(device)
        if decode is None:
            _torchvision_io()  # the missing install said now, not at the first batch
            decode = torchvision_decode
        self.decode = decode

    def __call__(self, images: EncodedImages) -> torch.Tensor:
        height, width = images.height, images.width
        if len(images) == 0:
            return torch.empty((0, height, width, 3), dtype=torch.uint8, device=self.device)
        jpegs = [torch.from_numpy(jpeg) for jpeg in images.jpegs]
        try:
            decoded = self.decode(jpegs, self.device)
        except RuntimeError as e:
            raise self._first_failure(images, jpegs, e) from e
        if len(decoded) != len(images):
            raise ShardIntegrityError(f"{images.sources[0][0]}: the {self.device} decoder returned "
                                      f"{len(decoded)} images for a batch of {len(images)}")
        for index, image in enumerate(decoded):
            if (tuple(image.shape) != (3, height, width) or image.dtype != torch.uint8
                    or image.device.type != self.device.type):
                raise images.bad_sample(index, f"decodes to {image.dtype} {tuple(image.shape)} on "
                                        f"{image.device}, not the dataset's uint8 (3, {height}, {width}) on "
                                        f"{self.device}")
        # One kernel: every CHW image written into its place of one contiguous NHWC batch.
        return torch.stack([image.permute(1, 2, 0) for image in decoded])

    def _first_failure(self, images: EncodedImages, jpegs: list[torch.Tensor],
                       error: RuntimeError) -> ShardIntegrityError:
        """The batched call says only that something failed: decode alone each sample until one fails."""
        for index, jpeg in enumerate(jpegs):
            try:
                self.decode([jpeg], self.device)
            except RuntimeError as alone:
                return images.bad_sample(index, f"corrupt JPEG ({self.device} decode: {alone})")
        shards = sorted({path for path, _, _ in images.sources})
        return ShardIntegrityError(f"{', '.join(shards)}: the {self.device} decode of a batch of {len(images)} "
                                   f"failed ({error}), though each sample decodes alone")
