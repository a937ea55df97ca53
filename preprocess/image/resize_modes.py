"""The resize modes (the config's ``mode``) as one table: a row per mode, looked up once per image and asked.

A row says what its mode does to an image: the shape it resizes to (the config's one shape, or in
``bucket`` the bucket nearest the image's upright aspect ratio: ``image_config``), the region of the
decoded source it reads (``kept_box``: a centre crop, or the whole picture) and so the draft size that
region needs (``draft_request``), how it places the pixels on the target (``place``: resized onto it, or
letterboxed on ``fill`` with the picture at ``content_box``), whether that enlarges the picture
(``upscales``), and whether its ``.jsonl`` lines carry the ``crop`` offset (``writes_crop``: the format's
``UNCROPPED_MODES`` decide). ``bucket`` is a centre crop whose shape is picked per image. The transform
(``preprocess.image.transform``) and the worker ask the row; no module compares a mode's name. A new mode adds
its row here and its name to ``preprocess.config.RESIZE_MODES``.

Every size and box is in the stored (not upright) orientation, as the decoder sees the image: ``target``
(width, height) of the output, ``content`` (width, height) of the decoded picture, fractional for a
JPEG drafted at 1/s (``ceil(w / s)`` columns decoded, ``w / s`` of them picture: Pillow's draft box).
"""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from preprocess.config import BUCKET, JobConfig
from shardio.format import UNCROPPED_MODES

__all__ = ["ResizeMode", "RESIZE_MODE_TABLE", "resize_mode"]

Size = tuple[int, int]  # (width, height) in whole pixels
Extent = tuple[float, float]  # (width, height) of a decoded picture: fractional after a draft
Box = tuple[float, float, float, float]  # (x0, y0, x1, y1), end-exclusive


@dataclass(frozen=True)
class ResizeMode:
    """One resize mode. The base reads the whole picture at the target's draft size and fills none of the
    output; each kind of placement (the subclasses below) says how it resizes and what differs."""

    name: str
    picks_bucket: bool = False  # the target: the bucket nearest the image's aspect ratio, else the one shape

    @property
    def writes_crop(self) -> bool:
        """Whether a sample's ``.jsonl`` line carries ``crop`` (shardio.format, "Metadata")."""
        return self.name not in UNCROPPED_MODES

    def image_config(self, cfg: JobConfig, upright_w: int, upright_h: int) -> tuple[JobConfig, int]:
        """The config one image is resized by, and its bucket id: in ``mode: bucket`` a centre crop to the
        bucket nearest its upright aspect ratio (``JobConfig.bucket_config``), else ``cfg`` itself and 0."""
        if not self.picks_bucket:
            return cfg, 0
        bucket = cfg.bucket_of(upright_w, upright_h)
        return cfg.bucket_config(bucket), bucket

    def kept_box(self, target: Size, content: Extent) -> Box:
        """The region of the decoded image that the resize keeps, in decoded pixels: the whole picture."""
        width, height = content
        return 0.0, 0.0, width, height

    def draft_request(self, size: Size, target: Size) -> Size:
        """The size to ask ``Image.draft`` for, so that it picks the largest DCT scale s (8, 4, 2, 1) that
        keeps the kept region at or above the target: Pillow takes the largest s <= size // request per side.

        center_crop and stretch keep regions that need both decoded sides >= the target (pad: ``_Letterbox``).
        """
        return target

    def upscales(self, upright: Size, target: Size) -> bool:
        """Whether the resize enlarges the kept region (upright size against the upright target)."""
        raise NotImplementedError

    def content_box(self, target: Size, content: Extent) -> tuple[int, int, int, int] | None:
        """Where the picture lies on the output when part of it is ``fill`` (``pad``), else None."""
        return None

    def place(self, im: Image.Image, target: Size, content: Extent, resample: Image.Resampling,
              fill: tuple[int, int, int]) -> Image.Image:
        """One resize of the kept region (``kept_box``) onto the ``target``."""
        raise NotImplementedError


class _Stretch(ResizeMode):
    """``stretch``: the whole picture, resized onto the target whatever its aspect ratio."""

    def upscales(self, upright: Size, target: Size) -> bool:
        width, height = upright
        return target[0] > width or target[1] > height

    def place(self, im: Image.Image, target: Size, content: Extent, resample: Image.Resampling,
              fill: tuple[int, int, int]) -> Image.Image:
        if im.size == target and content == target:
            return im
        return im.resize(target, resample, box=self.kept_box(target, content))


class _CentreCrop(ResizeMode):
    """``center_crop`` (and ``bucket``): the centred region of the target's aspect ratio, resized onto it."""

    def kept_box(self, target: Size, content: Extent) -> Box:
        width, height = content
        target_w, target_h = target
        scale = max(target_w / width, target_h / height)
        crop_w, crop_h = target_w / scale, target_h / scale
        # Clamped: 256 / (256 / 426.5) is 426.50000000000006, so a 1280x853 JPEG drafted to 640x426.5 got a
        # box offset of -3e-14, which Pillow refuses ("box offset can't be negative"): a failed sample.
        left, top = max(0.0, (width - crop_w) / 2), max(0.0, (height - crop_h) / 2)
        return left, top, min(width, left + crop_w), min(height, top + crop_h)

    def upscales(self, upright: Size, target: Size) -> bool:
        width, height = upright
        return max(target[0] / width, target[1] / height) > 1

    def place(self, im: Image.Image, target: Size, content: Extent, resample: Image.Resampling,
              fill: tuple[int, int, int]) -> Image.Image:
        return im.resize(target, resample, box=self.kept_box(target, content))


class _Letterbox(ResizeMode):
    """``pad``: the whole picture, scaled to fit inside the target, centred on ``fill``."""

    def draft_request(self, size: Size, target: Size) -> Size:
        """pad only needs the side that fits (the other is letterboxed anyway). Asking for the scaled-down
        kept size instead would round up and lose a scale: 1024x1025 -> 256 would decode at 1/2, not 1/4."""
        width, height = size
        target_w, target_h = target
        return (target_w, 1) if target_w / width <= target_h / height else (1, target_h)

    def upscales(self, upright: Size, target: Size) -> bool:
        width, height = upright
        return min(target[0] / width, target[1] / height) > 1

    def content_box(self, target: Size, content: Extent) -> tuple[int, int, int, int]:
        """Where ``pad`` pastes the resized picture on the ``target`` canvas (stored orientation): its size
        rounded, at least 1 pixel (a 1x5000 banner into 256² is 1 column, not 0), centred with the odd pixel
        of fill after it. The one place this is computed, so the stored box is where the pixels are."""
        target_w, target_h = target
        width, height = content
        scale = min(target_w / width, target_h / height)
        inner_w = max(1, min(target_w, round(width * scale)))
        inner_h = max(1, min(target_h, round(height * scale)))
        x0, y0 = (target_w - inner_w) // 2, (target_h - inner_h) // 2
        return x0, y0, x0 + inner_w, y0 + inner_h

    def place(self, im: Image.Image, target: Size, content: Extent, resample: Image.Resampling,
              fill: tuple[int, int, int]) -> Image.Image:
        x0, y0, x1, y1 = self.content_box(target, content)
        canvas = Image.new(im.mode, target, fill)
        content_im = im.resize((x1 - x0, y1 - y0), resample, box=self.kept_box(target, content))
        canvas.paste(content_im, (x0, y0))
        return canvas


# One row per name of ``preprocess.config.RESIZE_MODES``, in its order.
RESIZE_MODE_TABLE: tuple[ResizeMode, ...] = (
    _CentreCrop("center_crop"),
    _Letterbox("pad"),
    _Stretch("stretch"),
    _CentreCrop(BUCKET, picks_bucket=True),
)
_BY_NAME = {mode.name: mode for mode in RESIZE_MODE_TABLE}


def resize_mode(name: str) -> ResizeMode:
    """The row of a config's ``mode`` (``JobConfig`` accepts only the names this table has)."""
    return _BY_NAME[name]
