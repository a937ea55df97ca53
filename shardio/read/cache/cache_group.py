"""The processes that read through one cache directory, and the access sequence they plan together.

Ranks of one node sharing a ``cache_dir`` each used to plan only their own batches: a shard every rank had let go
was downloaded again when one needed it later, and each rank needed room for the whole shuffle window, since every
rank's batches draw from the same window. But the epoch order is a pure function of ``(seed, epoch, rank)``, so
every process can compute what its neighbours read. Here each process of a group (the ranks whose cache directory
is the same directory on the same machine, and their DataLoader workers) plans the *node's* sequence: at each step
of the pass, the batch of every rank of the group, in rank order, and advances by steps, not by its own batches.
They all keep by it the same files, downloaded once (the others adopt them) and kept until the node as a whole is
done with them (the group's keep set: ``shardio.read.cache.cache_room``).

The group is found when the dataset opens: under ``torch.distributed`` the ranks already gather what they opened
(``ShardDataset._check_same_snapshot``), and each adds the identity of its cache directory (``place_of``).
"""

from __future__ import annotations

import math
import os
import secrets
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

from shardio.read.order import DealtBatches

__all__ = ["CacheGroup", "NodeSteps", "hold_after", "new_name", "node_reads", "place_of", "shards_in_flight"]


def place_of(cache_dir: str) -> str:
    """What names ``cache_dir`` across processes: the running kernel (its boot id: containers on one machine share
    it, and files and locks too) and the directory's device and inode (two paths to one directory are one)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            machine = f.read().strip()
    except OSError:
        machine = socket.gethostname()
    info = os.stat(cache_dir)
    return f"{machine}:{info.st_dev}:{info.st_ino}"


def new_name() -> str:
    """A group's name: drawn by each rank when the dataset opens; the group takes its first rank's."""
    return secrets.token_hex(8)


@dataclass(frozen=True)
class CacheGroup:
    """The ranks reading through this process's cache directory (rank order), this rank's place among them, and
    the group's ``name`` (its positions file: ``shardio.read.cache.group_positions``)."""

    ranks: tuple[int, ...]
    index: int
    name: str = ""

    @classmethod
    def alone(cls, rank: int) -> CacheGroup:
        """A rank that shares its directory with no other rank (its DataLoader workers still plan together)."""
        return cls((rank,), 0, new_name())

    @classmethod
    def of(cls, rank: int, places: Sequence[str], names: Sequence[str]) -> CacheGroup:
        """The group of ``rank``, given every rank's ``place_of`` its cache directory and ``new_name``."""
        ranks = tuple(r for r, place in enumerate(places) if place == places[rank])
        return cls(ranks, ranks.index(rank), names[ranks[0]])


class NodeSteps(Sequence[tuple[range, ...]]):
    """The steps of a pass as the group reads them: step ``k`` is the ``k``-th batch of every rank of the group, in
    rank order; computed on demand. ``member`` is this process's rank's place in each step."""

    def __init__(self, passes: Sequence[Sequence[range]], member: int) -> None:
        self.passes, self.member = list(passes), member

    def __len__(self) -> int:
        return len(self.passes[0])

    @overload
    def __getitem__(self, index: int) -> tuple[range, ...]: ...
    @overload
    def __getitem__(self, index: slice) -> list[tuple[range, ...]]: ...
    def __getitem__(self, index: int | slice) -> tuple[range, ...] | list[tuple[range, ...]]:
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        return tuple(batches[index] for batches in self.passes)


def node_reads(batches: Sequence[range], group: CacheGroup) -> tuple[NodeSteps, Sequence[int]]:
    """(The steps of this pass as every process of ``group`` reads them; the step of each of ``batches``, this
    process's: a rank's pass, or a DataLoader worker's share of it). A cache planned on the steps keeps what any rank
    reads in the step it is in: ranks in lockstep (DDP) are all somewhere in one step. Batches that are not a rank's
    deal (a plain list) are planned alone."""
    if not isinstance(batches, DealtBatches):
        return NodeSteps([batches], 0), range(len(batches))
    return NodeSteps([batches.of_rank(rank) for rank in group.ranks], group.index), batches.steps


def hold_after(spread: int) -> int:
    """How many steps past the group's slowest process one reads without waiting for room in the directory
    (``CacheRoom._held_back``), so that no process ever waits for one that waits for it: ranks meet at every step (a
    rank's consumer is at most one step past the slowest's), and a process's place may be up to ``spread`` steps
    behind its consumer (its next batch not begun; a rank's ``spread`` DataLoader workers take its steps in turn, one
    idle since its last step)."""
    return spread + 1


def shards_in_flight(ranks: int, batch_size: int, samples_per_shard: float) -> int:
    """About how many shards the steps a group of ``ranks`` reads at once (the slowest's and ``hold_after`` more,
    each a batch on every rank) span beyond the two windows a rank alone needs; none for a rank alone."""
    if ranks < 2:
        return 0
    return math.ceil((hold_after(1) + 1) * ranks * batch_size / max(samples_per_shard, 1.0))
