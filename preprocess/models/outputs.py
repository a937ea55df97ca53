"""What a model gives back for one input (``ModelOutputs``), without torch: a task whose models run in replicas
(``preprocess.models.replicas``) receives these and never imports torch."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shardio.errors import InputError

__all__ = ["ModelOutputs"]


@dataclass
class ModelOutputs:
    """One input's outputs of one model: sample ``indices[i]`` (of bucket ``buckets[i]``) gave ``values[i]``, in
    the order they were added; ``failure`` when a batch holding one of its samples failed (``values`` then
    holds what was computed before, and nothing should be stored for the input)."""

    input: str
    indices: list[int] = field(default_factory=list)
    buckets: list[int] = field(default_factory=list)
    values: list[np.ndarray] = field(default_factory=list)
    failure: InputError | None = None
