"""The GPU check's yuv420 row: the same images as a yuv420 and a raw dataset (``bench.gpu_data``), delivered by
``DeviceLoader`` to the device, and the yuv420 read-back's quality against raw.

- **Rate.** A shuffled ``DeviceLoader`` epoch of each dataset, page cache warm (an untimed epoch first),
  ``rounds`` rounds alternating which goes first (a loaded host drifts; the ratio of one round holds better
  than either rate), two ways: normalised (``to_device``'s float batch: for yuv420 the planes, half a raw
  batch's bytes, are copied and converted fused with the normalisation, ``shardio.train.yuv_device``) and
  uint8 (a transform that keeps the bytes: yuv420 converted to uint8 RGB on the device, raw as copied). The
  figure is the median of the rounds' ratios yuv420 / raw (goal on the GPU: >= 1.8). On the CPU (the dry
  run) the same loops run with the CPU conversion; the ratio is then the CPU reader's, not the GPU's.
- **Quality.** Each distinct image read back by the CPU reader from both datasets (unshuffled batches of RGB,
  the keys checked equal), scored with ``preprocess.image.pixel_quality`` (PSNR over three channels, peak
  255): median, p5, min, max abs error.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from bench.gpu_figures import _timed
from preprocess.image.pixel_quality import QualityTally
from shardio import DeviceLoader, ShardDataset
from shardio.format.yuv_shard import yuv_sample_bytes


class _Uint8:
    """The transform hand-off with no arithmetic: the batch's uint8 RGB as it reached the device."""

    def __call__(self, image: torch.Tensor, *, epoch: int, positions: torch.Tensor,
                 content_box: torch.Tensor | None = None) -> torch.Tensor:
        return image


def _loader(directory: str, device: torch.device, batch: int, uint8: bool) -> DeviceLoader:
    return DeviceLoader(ShardDataset(directory, batch, shuffle=True), device,
                        transform=_Uint8() if uint8 else None)


def rates(raw_dir: str, yuv_dir: str, device: torch.device, batch: int = 256, rounds: int = 3) -> dict[str, Any]:
    """Per way (``normalised``, ``uint8``): each round's samples/s of both datasets and the median ratio."""
    out: dict[str, Any] = {"batch": batch, "rounds": rounds}
    for way, uint8 in (("normalised", False), ("uint8", True)):
        loaders = {name: _loader(directory, device, batch, uint8)
                   for name, directory in (("raw", raw_dir), ("yuv420", yuv_dir))}

        def epoch(loader: DeviceLoader) -> int:
            return sum(len(item["image"]) for item in loader)

        for loader in loaders.values():
            epoch(loader)  # warm: page cache, maps, pinned buffers
        per_round = []
        for index in range(rounds):
            order = list(loaders) if index % 2 == 0 else list(reversed(loaders))
            timed = {name: _timed(lambda loader=loaders[name]: epoch(loader), device) for name in order}
            per_round.append({**timed, "ratio": round(timed["yuv420"]["samples_per_s"]
                                                      / timed["raw"]["samples_per_s"], 3)})
        out[way] = {"rounds": per_round, "ratio": round(statistics.median(r["ratio"] for r in per_round), 3),
                    "raw_samples_per_s": statistics.median(r["raw"]["samples_per_s"] for r in per_round),
                    "yuv420_samples_per_s": statistics.median(r["yuv420"]["samples_per_s"] for r in per_round)}
    return out


def quality(raw_dir: str, yuv_dir: str, images: int, batch: int = 256) -> dict[str, Any]:
    """The first ``images`` samples of both datasets (the distinct ones) read back as RGB on the CPU and
    scored: yuv420 against raw."""
    tally = QualityTally()
    raw = ShardDataset(raw_dir, batch, shuffle=False, drop_last=False)
    yuv = ShardDataset(yuv_dir, batch, shuffle=False, drop_last=False)
    sample_bytes, raw_bytes = 0, 0
    for raw_batch, yuv_batch in zip(raw, yuv):
        if list(raw_batch["__key__"]) != list(yuv_batch["__key__"]):
            raise ValueError(f"{raw_dir} and {yuv_dir} do not hold the same samples in the same order")
        reference, decoded = raw_batch["image"].numpy(), yuv_batch["image"].numpy()
        height, width = reference.shape[1:3]
        sample_bytes, raw_bytes = yuv_sample_bytes(height, width), height * width * 3
        for index in range(min(len(reference), images - len(tally.psnrs))):
            tally.add(reference[index], decoded[index], sample_bytes)
        if len(tally.psnrs) >= images:
            break
    summary = tally.summary().to_json()
    summary["raw_bytes_per_image"] = raw_bytes
    return summary


def run(raw_dir: str, yuv_dir: str, device: torch.device, distinct: int, batch: int = 256,
        rounds: int = 3) -> dict[str, Any]:
    """The yuv420 row: ``rates`` on ``device`` and ``quality`` of the ``distinct`` images on the CPU."""
    return {"device": str(device), **rates(raw_dir, yuv_dir, device, batch, rounds),
            "quality": quality(raw_dir, yuv_dir, distinct, batch)}
