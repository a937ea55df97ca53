"""Datasets for the training tests (Lightning, mixing, subsets, examples), written without Ray or Pillow.

Like ``tests/dataset_fixtures.py``, sample ``i`` carries ``i + first_index`` in its first three pixel bytes
and ``key = "s{i:06d}"``; here each input is labelled (``cls = i``) or caption-only (no ``cls``), so a
dataset can mix both as a drop of img2dataset tars with and without class files does.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from shardio.format import Manifest
from tests.dataset_fixtures import pixel_indices, write_inputs


def make_mixed_dataset(
    directory: str,
    inputs: tuple[int, ...] = (40, 45, 32),
    labelled: tuple[bool, ...] = (True, True, True),
    *,
    samples_per_shard: int = 8,
    side: int = 8,
    first_index: int = 0,
    encoding: str = "raw",
) -> Manifest:
    """``sum(inputs)`` self-identifying samples; input ``n`` has labels when ``labelled[n]``."""
    def meta_for(index: int, number: int, name: str) -> dict[str, Any]:
        meta: dict[str, Any] = {"key": f"s{index:06d}", "tar": name, "member": f"{index}.jpg",
                                "width": side, "height": side, "txt": f"caption {index}"}
        if labelled[number]:
            meta["cls"] = index
        return meta

    return write_inputs(directory, inputs, meta_for, height=side, width=side,
                        samples_per_shard=samples_per_shard, first_index=first_index, encoding=encoding)


def ids(batch: dict[str, Any]) -> np.ndarray:
    """The sample indices of a uint8 NHWC batch, read from the pixels; checks the keys agree."""
    image = batch["image"]
    assert image.dtype == torch.uint8 and image.ndim == 4 and image.shape[-1] == 3
    found = pixel_indices(image.cpu())
    assert list(batch["__key__"]) == [f"s{i:06d}" for i in found], "keys and pixels disagree"
    return found
