"""Resume while the dataset grows: a state pins its generation, the resumed epoch finishes on it even
after new drops were committed, the next epoch moves to the newest generation (``follow_updates``), in either
layout."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
from torch.utils.data import DataLoader
from typer.testing import CliRunner
from tests.dataset_fixtures import assert_exactly_once, indices, make_dataset, retire_input
from tests.layout_fixtures import Layout, every_key

from preprocess.cli import app as preprocess_app
from shardio import ShardDataset, ShardFormatError, ShardLoader
from shardio.errors import ShardError, ShardIntegrityError
from shardio.format import manifests
from shardio.format.manifests import generation_path, read_root
from tests.index_steps import compacted_and_collected
from shardio.format import InputEntry
from shardio.format.manifests import load_manifest
from shardio.write.shard_writer import InputShardWriter, write_manifest

FIRST = 117


def add_input(directory: str, name: str, first: int, count: int) -> int:
    """Commit a drop of ``count`` self-identifying samples ``first..`` (as make_dataset writes them)."""
    manifest = load_manifest(directory)
    writer = InputShardWriter(directory, name.removesuffix(".tar"), 8, 8, 8)
    for index in range(first, first + count):
        pixels = np.full((8, 8, 3), index % 251, dtype=np.uint8)
        pixels.reshape(-1)[:3] = [index & 255, (index >> 8) & 255, (index >> 16) & 255]
        writer.add(pixels, {"key": f"s{index:06d}", "tar": name, "member": f"{index}.jpg", "width": 8,
                            "height": 8, "cls": index, "txt": None, "json": None}, name)
    entries = writer.close(name)
    manifest.shards.extend(entries)
    manifest.inputs[name] = InputEntry(size=count, mtime_ns=0, samples=count, failed=0,
                                       shards=[e.path for e in entries])
    return write_manifest(directory, manifest)



def make(directory: str, **kwargs) -> ShardDataset:
    return ShardDataset(directory, 5, shuffle=True, seed=2, **kwargs)


def epoch_of(source) -> np.ndarray:
    return np.concatenate([indices(b) for b in source])


def test_resumed_epoch_finishes_on_its_generation_and_the_next_moves_on(tmp_path) -> None:
    directory = str(tmp_path)
    make_dataset(directory)
    ds = make(directory)
    first_generation = ds.snapshot.generation
    batches = iter(ds)
    head = [indices(next(batches)) for _ in range(7)]
    state = ds.state_dict()
    assert state["generation"] == first_generation

    newer = add_input(directory, "input-3.tar", FIRST, 20)  # drops committed while the run was down
    newest = retire_input(directory, "input-0.tar")
    assert newest > newer > first_generation

    resumed = make(directory)  # opens the newest generation ...
    assert resumed.snapshot.generation == newest
    resumed.load_state_dict(state)  # ... and finishes the state's epoch on the state's generation
    tail = epoch_of(ShardLoader(resumed, num_workers=2))
    assert resumed.snapshot.generation == first_generation
    assert_exactly_once(np.concatenate(head + [tail]), FIRST)

    # The next epoch is on the newest generation: inputs 1, 2 and 3, every sample once.
    after = epoch_of(resumed)
    assert resumed.snapshot.generation == newest and resumed.epoch == 1
    expected = np.arange(40, FIRST + 20)
    assert sorted(after) == expected.tolist()
    assert_exactly_once(after - 40, len(expected))


def test_follow_updates_false_stays_on_the_opened_generation(tmp_path) -> None:
    directory = str(tmp_path)
    make_dataset(directory)
    following, staying = make(directory), make(directory, follow_updates=False)
    assert len(epoch_of(following)) == len(epoch_of(staying)) == FIRST
    add_input(directory, "input-3.tar", FIRST, 20)
    assert_exactly_once(epoch_of(following), FIRST + 20)
    assert_exactly_once(epoch_of(staying), FIRST)
    assert len(following) == -(-(FIRST + 20) // 5) and len(staying) == -(-FIRST // 5)


def test_a_pinned_generation_does_not_follow_by_default(tmp_path) -> None:
    directory = str(tmp_path)
    make_dataset(directory)
    generation = load_manifest(directory).generation
    add_input(directory, "input-3.tar", FIRST, 20)
    pinned = make(directory, generation=generation)
    for _ in range(2):
        assert_exactly_once(epoch_of(pinned), FIRST)


def test_a_state_of_a_generation_no_longer_kept_says_so(tmp_path) -> None:
    directory = str(tmp_path)
    make_dataset(directory)
    state = {**make(directory).state_dict(), "generation": 99}
    with pytest.raises(ShardFormatError, match="generation 99 is not kept"):
        make(directory).load_state_dict(state)


def test_ddp_ranks_move_to_the_newest_generation_they_all_see(tmp_path, monkeypatch) -> None:
    """A commit landing between two ranks' reads: the rank that saw it takes the older one too (kept by
    retention), so both deal the same epoch."""
    directory = str(tmp_path)
    make_dataset(directory)
    ds = make(directory)
    older = ds.snapshot.generation
    epoch_of(ds)
    add_input(directory, "input-3.tar", FIRST, 20)
    gathered = []

    def all_gather_object(out: list, mine: int) -> None:  # the other rank has not seen the commit yet
        gathered.append(mine)
        out[:] = [mine, older]

    monkeypatch.setattr(ds, "_from_dist", True)
    monkeypatch.setattr(ds, "world_size", 2)
    monkeypatch.setattr("torch.distributed.all_gather_object", all_gather_object)
    ds.begin_pass()
    assert gathered == [older + 1] and ds.snapshot.generation == older


def test_spawned_workers_read_the_opened_generation_after_retention_deleted_its_index(tmp_path) -> None:
    """A trainer opened a generation; retention then deleted its root and index segments (a passing root
    of the run that committed it). DataLoader workers started with ``spawn`` (as with CUDA) unpickle the
    dataset after that: they get the index by descriptor, not by path, and read every sample once."""
    directory = str(tmp_path)
    make_dataset(directory)
    dataset = ShardDataset(directory, 5)
    for folder in ("index", "manifests"):
        for name in os.listdir(os.path.join(directory, folder)):
            os.remove(os.path.join(directory, folder, name))
    os.remove(os.path.join(directory, "manifest.json"))
    loader = DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    assert_exactly_once(epoch_of(loader), FIRST)


# --- what a reader says when retention collected what it read ----------------------------------------------


@pytest.fixture
def compacted(tmp_path) -> tuple[str, dict]:
    """A dataset a compaction merged into one segment, its earlier roots and their segments collected,
    and a root that names collected segments (as a reader read it just before)."""
    directory = str(tmp_path / "ds")
    return directory, compacted_and_collected(directory)


def stale_reads(monkeypatch, old_root: dict, stale: Callable[[int], bool]) -> None:
    """``manifest.json`` read as ``old_root`` on the calls ``stale(n)`` says (n from 0): a reader on a slow
    link that read it before the run that followed committed and collected."""
    real = manifests._read_document
    calls = []

    def read_document(store, path):
        calls.append(path)
        if path.endswith("manifest.json") and stale(len(calls) - 1):
            return old_root, "old-version"
        return real(store, path)
    monkeypatch.setattr(manifests, "_read_document", read_document)


def test_a_reader_that_read_a_root_retention_then_collected_reads_the_newest(compacted, monkeypatch) -> None:
    directory, old_root = compacted
    stale_reads(monkeypatch, old_root, lambda n: n == 0)
    index = manifests.load_index(directory)
    assert index.generation == read_root(directory)["generation"] > old_root["generation"]
    assert len(index.shards) == read_root(directory)["shard_count"]


def test_a_dataset_that_keeps_moving_while_read_says_so_not_repair(compacted, monkeypatch) -> None:
    directory, old_root = compacted
    stale_reads(monkeypatch, old_root, lambda n: n % 2 == 0)  # every read of the root, one run behind
    with pytest.raises(ShardError, match=r"moved on 6 times while this read its index .* nothing is damaged") as e:
        manifests.load_index(directory)
    assert "--repair" not in str(e.value)


def test_a_segment_missing_from_the_current_root_is_damage(compacted) -> None:
    directory, _ = compacted
    for ref in read_root(directory)["segments"]:
        os.remove(os.path.join(directory, ref["path"]))
    with pytest.raises(ShardIntegrityError, match=r"index segment missing .*--repair"):
        manifests.load_index(directory)


def test_a_generation_collected_while_read_says_so_not_repair(compacted, monkeypatch) -> None:
    directory, _ = compacted
    generation = read_root(directory)["generation"]
    add = manifests.open_segment

    def collected_meanwhile(store, folder, ref, *cache):  # retention deletes the root and its segments mid-read
        os.remove(generation_path(directory, generation))
        os.remove(os.path.join(directory, ref.path))
        return add(store, folder, ref, *cache)
    monkeypatch.setattr(manifests, "open_segment", collected_meanwhile)
    with pytest.raises(ShardError, match=rf"gone: generation {generation} was collected by retention while this "
                                         "read it") as e:
        manifests.load_index(directory, generation=generation)
    assert "--repair" not in str(e.value)


def test_gc_deleting_an_open_readers_files_says_so_not_repair(tmp_path) -> None:
    """``gc --retain-hours 0`` collects what only older generations list, at once, by design: a reader
    still on one of them is told that, and what to do, not to repair a healthy dataset."""
    directory = str(tmp_path)
    make_dataset(directory)
    reader = ShardDataset(directory, 5, follow_updates=False, cache_shards=1)
    retire_input(directory, "input-0.tar")
    collected = CliRunner().invoke(preprocess_app, ["gc", directory, "--retain-hours", "0",
                                                    "--retain-generations", "1"])
    assert collected.exit_code == 0, collected.output
    with pytest.raises(ShardError, match=r"input-0-\d+\.(npy|jsonl): deleted by retention: this reader opened "
                                         r"generation 1, which is no longer kept") as e:
        for _ in reader:
            pass
    assert "--repair" not in str(e.value)
    assert sorted(epoch_of(make(directory))) == list(range(40, FIRST))  # the dataset itself is whole


def test_a_state_resumes_its_generation_after_a_committed_drop(layout: Layout, tmp_path) -> None:
    """In either layout: the resumed epoch (through workers) finishes on the state's generation, every
    sample once; the next epoch moves to the newest generation, without the dropped input."""
    data = layout.make(str(tmp_path / "ds"))
    directory = data.path
    before = every_key(ShardDataset(directory, 4))
    ds = ShardDataset(directory, 4, shuffle=True, seed=1)
    iterator = iter(ds)
    head = [next(iterator)["__key__"] for _ in range(6)]
    state = ds.state_dict()
    newer = retire_input(directory, "input-0.tar")  # the fixture's first input
    assert newer > state["generation"]
    resumed = ShardDataset(directory, 4, shuffle=True, seed=1)
    resumed.load_state_dict(state)
    tail = [b["__key__"] for b in ShardLoader(resumed, num_workers=2)]
    seen = Counter(k for batch in head + tail for k in batch)
    assert set(seen) == set(before) and set(seen.values()) == {1}
    assert resumed.snapshot.generation == state["generation"]
    after = list(resumed)  # the next epoch moves to the newest generation
    assert resumed.snapshot.generation == newer
    assert sum(len(b["__key__"]) for b in after) == resumed.num_samples < len(before)
