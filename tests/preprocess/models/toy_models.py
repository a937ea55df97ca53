"""Small deterministic models for the model tests, importable as ``MODULE:FUNCTION`` (``tests.preprocess.models.
toy_models:make_latent``) in this process and in a subprocess.

``LatentNet`` is a fixed-weight 3x3 convolution then 8x8 average pooling: uint8 [B, h, w, 3] -> float16
[B, 4, h/8, w/8]. Its weights are small integers and its pixels whole numbers, so every sum is exact in float32
(|conv| <= 27 * 2 * 255 = 13,770; a pool's sum <= 64 * 13,770 < 2**24) and the divisions are by powers of two:
the output is the same bit for bit whatever the batch, so a sample run alone is what it gives in any batch.
``caption_hash`` hashes each caption's UTF-8 bytes into 8 float32 values.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from preprocess.models.identity import model_identity
from preprocess.models.loading import load_model
from preprocess.models.model_config import ModelSpec

CALLS = {"make_latent": 0}


class LatentNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1, bias=True)
        with torch.no_grad():
            self.conv.weight.copy_((torch.arange(4 * 3 * 3 * 3).reshape(4, 3, 3, 3) % 5 - 2).float())
            self.conv.bias.copy_(torch.tensor([0.0, 1.0, -1.0, 2.0]))
        self.register_buffer("scale", torch.tensor(1 / 64))
        self.batch_sizes: list[int] = []

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        self.batch_sizes.append(len(pixels))
        x = pixels.permute(0, 3, 1, 2).float()
        x = torch.nn.functional.avg_pool2d(self.conv(x), 8)
        return (x * self.scale).half()


def make_latent() -> LatentNet:
    CALLS["make_latent"] += 1
    return LatentNet()


def latent_of(pixels: np.ndarray) -> np.ndarray:
    """What ``LatentNet`` gives for one sample's pixels [h, w, 3], computed alone."""
    with torch.inference_mode():
        return LatentNet()(torch.from_numpy(pixels)[None]).numpy()[0]


def caption_hash(captions: list[str]) -> torch.Tensor:
    rows = [np.frombuffer(hashlib.sha256(c.encode()).digest(), np.uint8)[:8].astype(np.float32) / 255
            for c in captions]
    return torch.from_numpy(np.stack(rows))


caption_hash.version = "caption-hash-1"  # type: ignore[attr-defined]


def make_text():
    return caption_hash


def make_plain():
    return lambda batch: torch.zeros(len(batch), 2)


def identity_line(fn: str) -> str:
    """The identity of ``fn``'s model as one line (what a subprocess prints)."""
    spec = ModelSpec(name="latent", fn=fn)
    return str(model_identity(spec, load_model(spec)))
