"""Cache a diffusion model's inputs once, as shards: VAE latents per aspect-ratio bucket and text embeddings,
computed by the job for new data only, then train from them with no VAE or text encoder in the loop.

    python examples/cache_latents.py cache 'tars/*.tar' --output latents/      # the job, models in the config
    python examples/cache_latents.py train latents/ --steps 100                # a denoiser on the cached latents
    python examples/cache_latents.py --demo                                    # both, tiny random models

``cache`` writes a job config with two outputs and runs ``preprocess run`` with it::

    mode: bucket                 # every shard one bucket: a latent per bucket is one shape, a batch a slice
    models:
      latent: {fn: examples.cache_latents:make_vae_encoder, input: image, dtype: bfloat16, batch_size: 16}
      text_embedding: {fn: examples.cache_latents:make_text_encoder, input: text, dtype: bfloat16}

The models come from diffusers and transformers (``pip install diffusers transformers``: an optional extra,
never needed to read the shards). Their weights: ``CACHE_LATENTS_VAE`` (a local folder or a hub id in your hub
cache, default ``stabilityai/sdxl-vae``) and ``CACHE_LATENTS_TEXT_ENCODER`` (default
``openai/clip-vit-large-patch14``); ``tiny`` builds small random-weight models from a config instead, seeded,
so the same ``tiny`` model is the same model in every process (the tests and ``--demo`` use it). Each output
records its model's identity (a digest of the weights): rerun the job with another VAE and it refuses, naming
both, rather than mixing latents of two models. A rerun over a new drop of tars encodes the new tars only.

``train`` reads ``latent`` ([B, 4, h/8, w/8] of the batch's bucket) and ``text_embedding`` ([B, 77, D]) and
fits a small conditional denoiser: the loop a diffusion trainer runs, without the encoders.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

TINY = "tiny"
VAE_ENV, TEXT_ENV = "CACHE_LATENTS_VAE", "CACHE_LATENTS_TEXT_ENCODER"
DEFAULT_VAE, DEFAULT_TEXT_ENCODER = "stabilityai/sdxl-vae", "openai/clip-vit-large-patch14"
TOKENS = 77  # CLIP's context: every caption padded or cut to it, so an embedding is one shape
TINY_VOCAB = 512


class VaeEncoder(nn.Module):
    """uint8 pixels [B, h, w, 3] (what the reader yields) -> the VAE's scaled latent mean [B, C, h/8, w/8]: the
    latent a diffusion model is trained on (``scaling_factor`` applied, as diffusers' training scripts do)."""

    def __init__(self, vae: nn.Module) -> None:
        super().__init__()
        self.vae = vae
        self.scale = float(vae.config.scaling_factor)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = pixels.permute(0, 3, 1, 2).to(self.vae.dtype) / 127.5 - 1.0
        return self.vae.encode(x).latent_dist.mean * self.scale


class TextEncoder(nn.Module):
    """Captions (a list of str) -> the text encoder's last hidden state [B, 77, D], every caption padded or cut
    to 77 tokens. The tokenizer is part of the model: its vocabulary is in the identity's ``version``."""

    def __init__(self, tokenizer: Any, encoder: nn.Module) -> None:
        super().__init__()
        self.tokenizer, self.encoder = tokenizer, encoder
        self.version = f"hashed-words:{TINY_VOCAB}" if tokenizer is None else \
            f"{type(tokenizer).__name__}:{len(tokenizer)}"

    def forward(self, captions: list[str]) -> torch.Tensor:
        device = next(self.encoder.parameters()).device
        if self.tokenizer is None:
            ids = _hashed_tokens(captions).to(device)
        else:
            ids = self.tokenizer(captions, padding="max_length", max_length=TOKENS, truncation=True,
                                 return_tensors="pt").input_ids.to(device)
        return self.encoder(input_ids=ids).last_hidden_state


def _hashed_tokens(captions: list[str]) -> torch.Tensor:
    """The ``tiny`` model's tokenizer: each word hashed into the vocabulary (stable across processes), padded
    with 0 to 77 tokens; a stand-in with no files to download, for the demo and the tests."""
    import zlib

    rows = []
    for caption in captions:
        words = [1 + zlib.crc32(w.encode()) % (TINY_VOCAB - 1) for w in caption.lower().split()][:TOKENS]
        rows.append(words + [0] * (TOKENS - len(words)))
    return torch.tensor(rows, dtype=torch.long)


def make_vae_encoder() -> VaeEncoder:
    """The ``latent`` model: ``CACHE_LATENTS_VAE``'s AutoencoderKL (``tiny``: a small one with seeded random
    weights), in eval mode, float32 on the CPU (the job moves it to the output's device)."""
    from diffusers import AutoencoderKL

    source = os.environ.get(VAE_ENV, DEFAULT_VAE)
    if source == TINY:
        torch.manual_seed(0)
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16, 16, 16),
                            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                            layers_per_block=1, norm_num_groups=8)
    else:
        vae = AutoencoderKL.from_pretrained(source)
    return VaeEncoder(vae.eval())


def make_text_encoder() -> TextEncoder:
    """The ``text_embedding`` model: ``CACHE_LATENTS_TEXT_ENCODER``'s CLIP text model and tokenizer (``tiny``:
    a two-layer one with seeded random weights and a hashing tokenizer)."""
    from transformers import CLIPTextConfig, CLIPTextModel

    source = os.environ.get(TEXT_ENV, DEFAULT_TEXT_ENCODER)
    if source == TINY:
        torch.manual_seed(0)
        config = CLIPTextConfig(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=2, max_position_embeddings=TOKENS, bos_token_id=1,
                                eos_token_id=2, pad_token_id=0)
        return TextEncoder(None, CLIPTextModel(config).eval())
    from transformers import CLIPTokenizer

    return TextEncoder(CLIPTokenizer.from_pretrained(source), CLIPTextModel.from_pretrained(source).eval())


def job_config(size: int, device: str) -> str:
    """The job's YAML: buckets at a ``size``² budget (sides multiples of 64, so a latent side is a multiple of
    8) and the two outputs."""
    lines = [f"height: {size}", f"width: {size}", "mode: bucket", "bucket_step: 64", "bucket_max_ratio: 2.0",
             "models:",
              "  latent:",
              "    fn: examples.cache_latents:make_vae_encoder",
              "    input: image",
              "    dtype: bfloat16",
              f"    device: {device}",
              "  text_embedding:",
              "    fn: examples.cache_latents:make_text_encoder",
              "    input: text",
              "    dtype: bfloat16",
              f"    device: {device}"]
    return "\n".join(lines) + "\n"


def cache(inputs: list[str], output: str, size: int, device: str) -> None:
    """Run the job over ``inputs`` with the models: new inputs only on a rerun."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(job_config(size, device))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    try:
        subprocess.run([sys.executable, "-m", "preprocess.cli", "run", *inputs, "--output", output, "--config",
                        f.name], check=True, env=env)
    finally:
        os.unlink(f.name)


class Denoiser(nn.Module):
    """A small conditional denoiser: predicts the noise added to a latent, given the caption's pooled
    embedding (a stand-in for a UNet: the same inputs, any latent shape)."""

    def __init__(self, channels: int, text_dim: int) -> None:
        super().__init__()
        self.film = nn.Linear(text_dim + 1, 2 * 32)
        self.inp = nn.Conv2d(channels, 32, 3, padding=1)
        self.out = nn.Conv2d(32, channels, 3, padding=1)

    def forward(self, noisy: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        scale, shift = self.film(torch.cat([text.mean(1), t[:, None]], 1)).chunk(2, 1)
        h = torch.relu(self.inp(noisy) * (1 + scale[:, :, None, None]) + shift[:, :, None, None])
        return self.out(h)


def train(dataset: str, steps: int, batch_size: int = 8) -> list[float]:
    """Fit the denoiser on the cached outputs for ``steps`` batches; returns the losses."""
    from shardio import ShardDataset

    ds = ShardDataset(dataset, batch_size=batch_size, shuffle=True, seed=0)
    model: Denoiser | None = None
    optimizer: torch.optim.Optimizer | None = None
    losses: list[float] = []
    while len(losses) < steps:
        for batch in ds:
            latent = batch["latent"].float()  # [B, C, h/8, w/8] of this batch's bucket
            text = batch["text_embedding"].float()  # [B, 77, D]
            if model is None:
                model = Denoiser(latent.shape[1], text.shape[2])
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            assert optimizer is not None
            t = torch.rand(len(latent))
            noise = torch.randn_like(latent)
            noisy = (1 - t[:, None, None, None]) * latent + t[:, None, None, None] * noise
            loss = nn.functional.mse_loss(model(noisy, t, text), noise)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
            if len(losses) >= steps:
                break
    return losses


def demo(directory: str, steps: int) -> list[float]:
    """Tiny random models over the sample tars (``preprocess.sample_data``): cache, then train."""
    os.environ.setdefault(VAE_ENV, TINY)
    os.environ.setdefault(TEXT_ENV, TINY)
    subprocess.run([sys.executable, "-m", "preprocess.sample_data", os.path.join(directory, "tars")], check=True)
    output = os.path.join(directory, "latents")
    cache([os.path.join(directory, "tars", "*.tar")], output, size=256, device="cpu")
    return train(output, steps)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", action="store_true", help="tiny random models over generated tars, in a temp dir")
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("cache", help="run the job with the VAE and the text encoder as outputs")
    run.add_argument("inputs", nargs="+")
    run.add_argument("--output", required=True)
    run.add_argument("--size", type=int, default=1024, help="the bucket budget's side (default 1024: SDXL)")
    run.add_argument("--device", default="auto", help="auto (a GPU when there is one), cpu, cuda:N")
    fit = sub.add_parser("train", help="train a small denoiser from the cached outputs")
    fit.add_argument("dataset")
    fit.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)
    if args.demo:
        with tempfile.TemporaryDirectory() as directory:
            losses = demo(directory, steps=20)
        print(f"demo: 20 steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    elif args.command == "cache":
        cache(args.inputs, args.output, args.size, args.device)
    elif args.command == "train":
        losses = train(args.dataset, args.steps)
        print(f"{len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    else:
        parser.print_help()


if __name__ == "__main__":
    main()
