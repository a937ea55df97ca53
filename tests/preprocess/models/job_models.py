"""Models for the job's tests (tests/preprocess/test_job_models.py), importable as ``MODULE:FUNCTION`` by the Ray
workers of a run as by the driver.

``make_logged_text`` is ``toy_models.caption_hash`` that also appends every caption it is given to the file a
caption names (``LOG=PATH|text``): the test reads which samples the model saw, whichever process ran it.
``make_batch_logged_text`` appends the size of every batch it is called with, one line a batch, to the file its
first caption names the same way. ``make_fragile_text`` raises on a batch holding a caption with ``explode`` in
it; ``make_one_short_text`` returns a row fewer than its batch (a broken contract). ``make_other_latent`` is
``make_latent`` with other weights while ``OTHER_WEIGHTS`` is set (the driver's own process: the identity check).
"""

from __future__ import annotations

import fcntl

import torch

from tests.preprocess.models.toy_models import LatentNet, caption_hash

OTHER_WEIGHTS = {"on": False}


def _logged(captions: list[str]) -> torch.Tensor:
    for caption in captions:
        if caption.startswith("LOG="):
            path = caption[4:].partition("|")[0]
            with open(path, "a", encoding="utf-8") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                f.write(caption + "\n")
    return caption_hash(captions)


_logged.version = "logged-caption-hash-1"  # type: ignore[attr-defined]


def make_logged_text():
    return _logged


def _batch_logged(captions: list[str]) -> torch.Tensor:
    if captions and captions[0].startswith("LOG="):
        with open(captions[0][4:].partition("|")[0], "a", encoding="utf-8") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(f"{len(captions)}\n")
    return caption_hash(captions)


_batch_logged.version = "batch-logged-caption-hash-1"  # type: ignore[attr-defined]


def make_batch_logged_text():
    return _batch_logged


def _fragile(captions: list[str]) -> torch.Tensor:
    if any("explode" in caption for caption in captions):
        raise RuntimeError("this batch exploded")
    return caption_hash(captions)


_fragile.version = "fragile-1"  # type: ignore[attr-defined]


def make_fragile_text():
    return _fragile


def make_other_latent() -> LatentNet:
    net = LatentNet()
    if OTHER_WEIGHTS["on"]:
        with torch.no_grad():
            net.conv.bias.add_(1.0)
    return net


def _one_short(captions: list[str]) -> torch.Tensor:
    return caption_hash(captions)[1:]  # a row fewer than the batch's captions: the contract broken


_one_short.version = "one-short-1"  # type: ignore[attr-defined]


def make_one_short_text():
    """A text model breaking the contract: one row fewer than the batch holds."""
    return _one_short


class WideLatent(torch.nn.Module):
    """Another image model for the rewrite tests: a fixed 3x3 convolution to 2 channels, 8x8 average pooling,
    float32 [B, 2, h/8, w/8] (other weights, shape and dtype than ``LatentNet``; exact, as it is)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 2, 3, padding=1, bias=False)
        with torch.no_grad():
            self.conv.weight.copy_((torch.arange(2 * 3 * 3 * 3).reshape(2, 3, 3, 3) % 3 - 1).float())

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.avg_pool2d(self.conv(pixels.permute(0, 3, 1, 2).float()), 8)


def make_wide_latent() -> WideLatent:
    return WideLatent()


def wide_latent_of(pixels) -> torch.Tensor:
    """What ``WideLatent`` gives for one sample's pixels [h, w, 3], computed alone."""
    with torch.inference_mode():
        return WideLatent()(torch.from_numpy(pixels)[None]).numpy()[0]
