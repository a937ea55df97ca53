"""A yuv420 batch's planes converted on the device (``DeviceLoader`` on a yuv420 dataset): the copy to the
device moves the planes, half a raw batch's bytes, and the conversion runs there, fused with the
normalisation.

The arithmetic is the reader's, in torch integer ops (``shardio.format.yuv_shard``: libjpeg's 16-bit fixed
point, floor division as an arithmetic shift, each chroma sample repeated over its 2×2 block), so a batch
converted here is the uint8 RGB the CPU reader gives, bit for bit (``yuv420_rgb``), and ``yuv420_normalized``
is ``to_device``'s ``(x - mean) / std`` of it, the same float operations in the same order. Per batch: the
three offsets computed once per chroma sample (a quarter of the pixels; the upsampling is a view, no copy),
then the pixels' elementwise work: Y plus its block's offset, clamped, as float, scaled and shifted (in
eager torch a few kernels over the batch: the add and clamp on int16, the cast, the in-place multiply-add;
no uint8 RGB batch is made on the way). Everything runs on whatever device the planes are on: the CPU in
the tests, CUDA in training.
"""

from __future__ import annotations

import torch

from shardio.format.yuv_shard import FIX_CB_B, FIX_CB_G, FIX_CR_G, FIX_CR_R, chroma_shape, yuv_sample_bytes

__all__ = ["yuv420_rgb", "yuv420_normalized"]


def _offsets(planes: torch.Tensor, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Y (B, H, W, 1) int16 and the R, G, B offsets repeated over each 2×2 block, (B, H, W, 3) int16 (an
    expanded view until it is added: the upsampling copies nothing)."""
    if planes.dtype != torch.uint8 or planes.ndim != 2 or planes.shape[1] != yuv_sample_bytes(height, width):
        raise ValueError(f"planes {tuple(planes.shape)} {planes.dtype} are not (B, {yuv_sample_bytes(height, width)}) "
                         f"uint8: the yuv420 planes of {height}x{width} images")
    batch = planes.shape[0]
    chroma_h, chroma_w = chroma_shape(height, width)
    luma, chroma = height * width, chroma_h * chroma_w
    y = planes[:, :luma].view(batch, height, width, 1).to(torch.int16)
    x_cb = planes[:, luma:luma + chroma].to(torch.int32).sub_(128).view(batch, chroma_h, chroma_w)
    x_cr = planes[:, luma + chroma:].to(torch.int32).sub_(128).view(batch, chroma_h, chroma_w)
    half = 1 << 15
    red = (x_cr * FIX_CR_R + half) >> 16
    green = (x_cb * FIX_CB_G + x_cr * FIX_CR_G + half) >> 16
    blue = (x_cb * FIX_CB_B + half) >> 16
    offsets = torch.stack((red, green, blue), dim=-1).to(torch.int16)  # (B, CH, CW, 3)
    # Nearest upsampling as a view: each offset over its 2×2 block, cut to H×W for odd sides.
    full = offsets[:, :, None, :, None, :].expand(batch, chroma_h, 2, chroma_w, 2, 3)
    full = full.reshape(batch, 2 * chroma_h, 2 * chroma_w, 3)[:, :height, :width]
    return y, full


def yuv420_rgb(planes: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Planes (B, S) uint8 (``shardio.format.yuv_shard``) as RGB uint8 (B, H, W, 3) on their device: the
    bytes the CPU reader's conversion gives."""
    y, offsets = _offsets(planes, height, width)
    return (y + offsets).clamp_(0, 255).to(torch.uint8)


def yuv420_normalized(planes: torch.Tensor, height: int, width: int, scale: torch.Tensor, shift: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Planes (B, S) uint8 as ``rgb * scale + shift`` (``scale``, ``shift``: (1, 3, 1, 1), ``to_device``'s
    ``1 / std`` and ``-mean / std``), float (B, 3, H, W) in channels_last memory, as ``to_device`` gives for
    the converted batch."""
    y, offsets = _offsets(planes, height, width)
    rgb = (y + offsets).clamp_(0, 255)  # (B, H, W, 3) int16, the uint8 values
    # permute of NHWC memory is an NCHW view in channels_last strides; the arithmetic keeps them.
    return rgb.permute(0, 3, 1, 2).to(dtype).mul_(scale).add_(shift)
