"""How well an epoch order mixes, from the order alone (no pixels), against a uniform permutation.

Two statistics per full batch of ``batch_size`` consecutive epoch positions, averaged over the epoch:

- ``sources_per_batch``: distinct *sources* in the batch (a source is whatever the caller labels each
  stored sample with: its shard, or its input tar). Samples that share a source were often collected
  together (one crawl, one class, one page); a batch drawn from few sources is a biased gradient.
- ``neighbours_per_batch``: pairs of stored neighbours (stored samples ``i`` and ``i + 1``) that land in the
  same batch. A run of consecutive keys in a batch of 16 has 15. ``neighbour_rate`` is that over the
  ``batch_size - 1`` pairs a batch could hold at most: 1.0 for the stored order, ``batch_size / N`` for
  a permutation.

``permutation_quality`` gives both exactly for a uniform permutation of the same samples (hypergeometric:
a batch misses a source of ``c`` of ``N`` samples with probability ``C(N - c, b) / C(N, b)``; a given pair
of samples shares a batch with probability ``b (b - 1) / (N (N - 1))``), which is the yardstick
docs/reader.md measures shardio's order and Mosaic Streaming's py1e against (``python -m bench.shuffle``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["ShuffleQuality", "permutation_quality", "runs_order", "shuffle_quality"]


@dataclass(frozen=True)
class ShuffleQuality:
    """Mixing of one epoch order in batches of ``batch_size`` (the module docstring says what each means)."""

    batch_size: int
    batches: int  # full batches measured (a last, partial batch is left out)
    sources_per_batch: float
    neighbours_per_batch: float

    @property
    def neighbour_rate(self) -> float:
        return self.neighbours_per_batch / max(1, self.batch_size - 1)

    def sources_share(self, reference: ShuffleQuality) -> float:
        """Distinct sources per batch as a share of ``reference``'s (a permutation's: 1.0 is as mixed)."""
        return self.sources_per_batch / reference.sources_per_batch


def runs_order(runs: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Global stored sample indices (shard ``s``'s samples start at ``sum(counts[:s])``) of an epoch
    given as runs ``(shard, start, stop)`` (``shardio.read.order.epoch_runs``)."""
    runs = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    lengths = runs[:, 2] - runs[:, 1]
    firsts = offsets[runs[:, 0]] + runs[:, 1]
    run_start = np.cumsum(lengths) - lengths
    return np.repeat(firsts - run_start, lengths) + np.arange(int(lengths.sum()))


def shuffle_quality(order: np.ndarray, source_of: np.ndarray, batch_size: int) -> ShuffleQuality:
    """The statistics of ``order`` (stored sample indices in epoch order) cut into batches of
    ``batch_size``; ``source_of[i]`` is stored sample ``i``'s source (shard or tar number)."""
    order = np.asarray(order, dtype=np.int64)
    batches = len(order) // batch_size
    if batches == 0:
        raise ValueError(f"{len(order)} samples make no full batch of {batch_size}")
    grid = np.sort(order[: batches * batch_size].reshape(batches, batch_size), axis=1)
    neighbours = np.count_nonzero(np.diff(grid, axis=1) == 1, axis=1)
    sources = np.sort(np.asarray(source_of)[grid], axis=1)
    distinct = 1 + np.count_nonzero(np.diff(sources, axis=1), axis=1)
    return ShuffleQuality(batch_size, batches, float(distinct.mean()), float(neighbours.mean()))


def permutation_quality(source_sizes: np.ndarray, batch_size: int) -> ShuffleQuality:
    """The exact expectation of both statistics for a uniform permutation of ``sum(source_sizes)``
    samples, ``source_sizes[j]`` of them from source ``j``."""
    sizes = np.asarray(source_sizes, dtype=np.int64)
    sizes = sizes[sizes > 0]
    total, b = int(sizes.sum()), batch_size
    if total < b:
        raise ValueError(f"{total} samples make no full batch of {batch_size}")

    def log_choose(n: int, k: int) -> float:
        return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)

    sources = 0.0
    for size, how_many in zip(*np.unique(sizes, return_counts=True)):
        rest = total - int(size)
        missed = math.exp(log_choose(rest, b) - log_choose(total, b)) if rest >= b else 0.0
        sources += int(how_many) * (1.0 - missed)
    neighbours = b * (b - 1) / total  # (N - 1) stored pairs, each in one batch with b(b-1)/(N(N-1))
    return ShuffleQuality(b, total // b, sources, neighbours)
