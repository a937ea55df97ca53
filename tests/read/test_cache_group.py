"""The processes sharing a cache directory plan one sequence (``shardio.read.cache.cache_group``): a rank's deal
gives any other rank's batches of the same pass (fresh, resumed, bucketed, a worker's share), the node's steps put
every rank's batch of a step together, each process finds its own batches in them, the ranks sharing a
directory are those whose directory is the same one (another path to it included), and the group's positions file
says where its slowest process is. The processes themselves, under
torch.distributed, are in ``tests/read/test_remote_faults.py`` (four ranks, one cache directory)."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest

from shardio.read.bucket_order import Buckets
from shardio.read.cache.cache_group import CacheGroup, NodeSteps, node_reads, place_of
from shardio.read.cache.group_positions import GroupPositions, prune
from shardio.read.order import Deal, DealtBatches, rank_batches


@pytest.mark.parametrize("samples,start,drop_last", [(117, 0, False), (117, 0, True), (117, 45, False),
                                                    (3, 0, False), (1000, 333, True)])
def test_a_rank_deal_gives_every_other_rank_of_its_pass(samples, start, drop_last):
    world = 4
    mine = rank_batches(samples, 8, 1, world, drop_last, start)
    for rank in range(world):
        assert list(mine.of_rank(rank)) == list(rank_batches(samples, 8, rank, world, drop_last, start))
    share = mine[1::3]  # a DataLoader worker's share: still the whole pass of the other rank
    assert list(share.of_rank(2)) == list(rank_batches(samples, 8, 2, world, drop_last, start))
    assert list(share.steps) == list(range(len(mine)))[1::3]
    assert isinstance(mine, DealtBatches) and not isinstance([range(0, 8)], DealtBatches)


@pytest.mark.parametrize("skip", [0, 3])
def test_a_bucketed_deal_gives_every_other_rank_of_its_pass(skip):
    layout = Buckets(((16, 16), (8, 32), (32, 8)), (70, 41, 9))
    deal = Deal(4, 2, 3, False, shuffle=True, seed=7)
    start = [12, 0, 4]
    mine = layout.rank_batches(deal, 5, start, skip)
    for rank in range(3):
        assert list(mine.of_rank(rank)) == list(layout.rank_batches(replace(deal, rank=rank), 5, start, skip))
    share = mine[0::2]
    assert list(share.steps) == list(range(len(mine)))[0::2]
    assert list(share.of_rank(0)) == list(layout.rank_batches(replace(deal, rank=0), 5, start, skip))


def test_the_node_steps_hold_each_rank_batch_and_each_process_finds_its_own():
    world, group = 6, CacheGroup((2, 3, 5), 1)  # the ranks sharing one directory need not be neighbours
    mine = rank_batches(200, 5, 3, world, False)
    for share in (mine, mine[1::2]):  # the rank itself, and one of its two workers
        node, steps = node_reads(share, group)
        assert len(node) == len(mine) and node.member == 1
        for step in range(len(node)):
            assert node[step] == tuple(rank_batches(200, 5, r, world, False)[step] for r in group.ranks)
        assert [node[step][node.member] for step in steps] == list(share)


def test_batches_that_are_no_deal_are_planned_alone():
    batches = [range(0, 4), range(4, 8)]
    node, steps = node_reads(batches, CacheGroup((0, 1), 0))
    assert list(steps) == [0, 1] and [node[s][node.member] for s in steps] == batches
    assert isinstance(node, NodeSteps) and len(node[0]) == 1


def test_the_group_is_the_ranks_of_one_directory_named_by_its_first():
    places, names = ["a", "b", "a", "c", "a"], ["n0", "n1", "n2", "n3", "n4"]
    assert CacheGroup.of(2, places, names) == CacheGroup((0, 2, 4), 1, "n0")
    assert CacheGroup.of(3, places, names) == CacheGroup((3,), 0, "n3")
    alone, other = CacheGroup.alone(5), CacheGroup.alone(5)
    assert alone.ranks == (5,) and alone.index == 0 and alone.name != other.name  # a run never meets another's


def test_the_slowest_process_of_the_group_bounds_the_pass(tmp_path):
    cache = str(tmp_path / "cache")
    slots = [GroupPositions(cache, "g", 3, slot) for slot in range(3)]
    first, second, third = slots
    first.begin(4, 0)
    first.at(9)
    assert first.slowest() == 0  # the others have not begun epoch 4: all they will read is kept
    second.begin(4, 0)
    second.at(7)
    third.begin(4, 0)
    third.at(12)
    assert first.slowest() == second.slowest() == 7
    second.begin(5, 0)  # done with epoch 4, in the next one
    assert first.slowest() == 9 and second.slowest() == 0
    again = GroupPositions(cache, "g", 3, 0)  # a process of the group mapping the file afresh sees the same
    again.begin(4, 0)
    again.at(10)
    assert third.slowest() == 10


def test_a_process_that_does_not_begin_the_pass_in_time_is_taken_for_one_reading_something_else(tmp_path,
                                                                                                  monkeypatch):
    from shardio.read.cache import group_positions

    cache = str(tmp_path / "cache")
    first, second = (GroupPositions(cache, "g", 2, slot) for slot in range(2))
    first.begin(0, 0)  # the first pass: a slot never written (all zeros) is no process reading it
    first.at(6)
    assert first.slowest() == 0 and first.slowest_reading() == 6  # within the grace: the other may be about to begin
    monkeypatch.setattr(group_positions, "BEGIN_GRACE_S", 0.0)
    assert first.slowest() == 6  # past it: no longer waited for
    second.begin(0, 0)
    second.at(2)
    assert first.slowest() == 2  # once it begins, it counts again


def test_the_slowest_reading_leaves_out_processes_yet_to_begin_the_pass(tmp_path):
    """What a process ahead waits for (``CacheRoom._held_back``): the slowest of those reading the pass now. A process
    that never begins it (a rank that opened the dataset and reads another) holds no one back; one done with it
    neither."""
    cache = str(tmp_path / "cache")
    first, second, third = (GroupPositions(cache, "g", 3, slot) for slot in range(3))
    first.begin(2, 0)
    first.at(9)
    assert first.slowest_reading() == 9 and first.slowest() == 0
    second.begin(2, 0)
    second.at(4)
    assert first.slowest_reading() == second.slowest_reading() == 4
    second.begin(3, 0)
    third.begin(1, 0)  # still in an earlier pass: not reading this one
    third.at(50)
    assert first.slowest_reading() == 9


def test_positions_files_a_day_old_are_pruned_others_kept(tmp_path):
    cache = str(tmp_path / "cache")
    old, new = GroupPositions(cache, "old", 1, 0), GroupPositions(cache, "new", 1, 0)
    day_ago = time.time() - 2 * 24 * 3600
    os.utime(old.path, (day_ago, day_ago))
    prune(cache)
    assert not os.path.exists(old.path) and os.path.exists(new.path)


def test_a_directory_is_named_by_what_it_is_not_by_its_path(tmp_path):
    one, other = tmp_path / "cache", tmp_path / "other"
    one.mkdir()
    other.mkdir()
    os.symlink(one, tmp_path / "link")
    assert place_of(str(one)) == place_of(str(tmp_path / "link")) == place_of(str(tmp_path / "cache") + "/")
    assert place_of(str(one)) != place_of(str(other))
