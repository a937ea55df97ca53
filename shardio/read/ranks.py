"""Which rank this process reads for, of how many: explicit arguments, else ``torch.distributed``'s."""

from __future__ import annotations

import torch

__all__ = ["resolve_world"]


def resolve_world(rank: int | None, world_size: int | None) -> tuple[int, int, bool]:
    """(rank, world_size, both taken from torch.distributed); explicit arguments win."""
    dist = torch.distributed
    initialised = dist.is_available() and dist.is_initialized()
    from_dist = initialised and rank is None and world_size is None  # explicit arguments may simulate ranks
    if world_size is None:
        world_size = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    return rank, world_size, from_dist
