"""A batch's slices gathered into one buffer (``shardio.read.gather``): the compiled extension and the numpy
fallback write the same bytes in the same places, whatever the pieces (awkward sizes, empty ones, across
shards, a partial last shard, split over threads mid-piece, misaligned), refuse the same bad calls, and
give the same batches; without the extension the fallback is what reads."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest
import torch
from dataset_fixtures import AWKWARD_INPUTS, assert_exactly_once, indices, make_dataset

from shardio import ShardDataset
from shardio.read import batches, gather
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
SIDE = 160  # 76.8 KB a sample: a batch of 117 is 9 MB, over the extension's streaming and thread sizes

needs_extension = pytest.mark.skipif(
    not gather.native(), reason="shardio.read._gather is not built (python setup.py build_ext --inplace)")


def native(pieces: list[np.ndarray], out: np.ndarray, threads: int = 1) -> None:
    gather._gather.gather_into(pieces, out, threads)


def fallback(pieces: list[np.ndarray], out: np.ndarray, threads: int = 1) -> None:
    gather._gather_numpy(pieces, out)


@pytest.fixture(scope="module")
def shard_maps(tmp_path_factory: pytest.TempPathFactory) -> list[np.ndarray]:
    """Three memory-mapped "shards" of random 1x1000x3 samples (3,000 bytes: no multiple of 16 or 64), the
    last one partial (5 samples of 8)."""
    rng = np.random.default_rng(7)
    maps = []
    for number, samples in enumerate((8, 8, 5)):
        path = str(tmp_path_factory.mktemp("maps") / f"shard-{number}.bin")
        rng.integers(0, 256, (samples, 1, 1000, 3), dtype=np.uint8).tofile(path)
        maps.append(np.asarray(np.memmap(path, np.uint8, mode="c", shape=(samples, 1, 1000, 3))))
    return maps


def gathered(how: Callable[..., None], pieces: list[np.ndarray], threads: int = 1) -> np.ndarray:
    count = sum(len(p) for p in pieces)
    out = np.full((count, *pieces[0].shape[1:]), 0xAB, np.uint8)  # poisoned: an unwritten byte shows
    how(pieces, out, threads)
    return out


@needs_extension
@pytest.mark.parametrize("threads", [1, 2, 5])
def test_slices_of_shards_gather_alike(shard_maps: list[np.ndarray], threads: int) -> None:
    a, b, last = shard_maps
    pieces = [a[3:4], b[0:8], a[5:5], last[2:5], a[0:3], b[7:8], last[4:5], last[0:0], a[4:5], b[1:3]]
    expected = np.concatenate(pieces)
    assert (gathered(native, pieces, threads) == expected).all()
    assert (gathered(fallback, pieces) == expected).all()


@needs_extension
@pytest.mark.parametrize("threads", [1, 3, 64, 1000])
def test_large_misaligned_pieces_gather_alike(threads: int) -> None:
    """13 MB in pieces of odd lengths at odd addresses: the extension's streaming stores (over 8 MB) and its
    threads (4 MB each at least, split wherever the bytes fall) write what numpy writes."""
    rng = np.random.default_rng(threads)
    source = rng.integers(0, 256, 14 << 20, dtype=np.uint8)
    cuts = np.sort(rng.choice(13 << 20, 40, replace=False)) + 1
    bounds = np.concatenate([[1], cuts, [(13 << 20) + 3]])
    pieces = [source[int(x) : int(y)] for x, y in zip(bounds[:-1], bounds[1:])]
    pieces.insert(7, source[5:5])
    total = sum(p.nbytes for p in pieces)
    backing = np.full(total + 1, 0xAB, np.uint8)
    out = backing[1:]  # misaligned destination too
    native(pieces, out, threads)
    assert (out == source[1 : (13 << 20) + 3]).all()
    assert backing[0] == 0xAB
    again = np.full(total, 0xCD, np.uint8)
    fallback(pieces, again)
    assert (again == out).all()


@pytest.mark.parametrize("how", [pytest.param(native, marks=needs_extension), fallback], ids=["native", "numpy"])
def test_bad_calls_are_refused_alike(how: Callable[..., None]) -> None:
    pieces = [np.arange(10, dtype=np.uint8), np.arange(6, dtype=np.uint8)]
    with pytest.raises(ValueError, match="16 bytes, out 17"):
        how(pieces, np.empty(17, np.uint8))
    with pytest.raises(ValueError, match="16 bytes, out 15"):
        how(pieces, np.empty(15, np.uint8))
    with pytest.raises(TypeError, match="C-contiguous"):
        how([np.arange(20, dtype=np.uint8)[::2]], np.empty(10, np.uint8))
    with pytest.raises(TypeError, match="writable C-contiguous"):
        how(pieces, np.empty(32, np.uint8)[::2])
    read_only = np.empty(16, np.uint8)
    read_only.flags.writeable = False
    with pytest.raises(TypeError, match="writable C-contiguous"):
        how(pieces, read_only)
    out = np.empty(0, np.uint8)
    how([], out)  # nothing to copy: nothing written, nothing raised
    how([np.empty(0, np.uint8)], out)


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = str(tmp_path_factory.mktemp("gather"))
    make_dataset(directory, AWKWARD_INPUTS, samples_per_shard=8, height=SIDE, width=SIDE)  # 117: partial shards
    return directory


SETTINGS = [
    {},  # sequential: batches across shard ends
    {"shuffle": True},  # the default order: a piece per sample
    {"shuffle": True, "shuffle_window": 2, "shuffle_block": 3},  # pieces of 1-3 samples, cut at shard ends
]


def epoch(directory: str, batch_size: int, prefetch: int, settings: dict) -> list[dict]:
    ds = ShardDataset(directory, batch_size, prefetch=prefetch, **settings)
    # Clones: a batch's buffer is reused once it is released.
    return [{"image": b["image"].clone(), "__key__": b["__key__"], "cls": b["cls"].clone()} for b in ds]


@needs_extension
@pytest.mark.parametrize("settings", SETTINGS, ids=["sequential", "default-shuffle", "blocks-of-3"])
@pytest.mark.parametrize("batch_size", [10, 117])
@pytest.mark.parametrize("threads", [1, 3])
def test_batches_identical_with_and_without_the_extension(dataset_dir: str, settings: dict, batch_size: int,
                                                         threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # A batch of 117 (9 MB): streaming stores on one thread, two threads of plain copies when given three.
    monkeypatch.setattr(batches, "gather_threads", lambda: threads)
    with_extension = epoch(dataset_dir, batch_size, 2, settings)
    monkeypatch.setattr(gather, "_gather", None)
    assert not gather.native()
    without = epoch(dataset_dir, batch_size, 0, settings)
    assert len(with_extension) == len(without)
    for one, other in zip(with_extension, without):
        assert torch.equal(one["image"], other["image"])
        assert one["__key__"] == other["__key__"] and torch.equal(one["cls"], other["cls"])
    assert_exactly_once(np.concatenate([indices(b) for b in with_extension]), 117)


def test_fallback_reads_when_the_extension_is_absent(dataset_dir: str) -> None:
    """An install without a compiler: ``shardio.read._gather`` cannot be imported, numpy gathers, and the
    epoch's bytes are those read here (with the extension, where it is built)."""
    script = (
        "import sys, hashlib\n"
        "sys.modules['shardio.read._gather'] = None  # as if it had never been built\n"
        "from shardio import ShardDataset\n"
        "from shardio.read import gather\n"
        "assert not gather.native(), 'the extension was imported'\n"
        "digest = hashlib.sha256()\n"
        "for batch in ShardDataset(sys.argv[1], 10, shuffle=True, seed=5):\n"
        "    digest.update(batch['image'].numpy().tobytes()); digest.update(str(batch['__key__']).encode())\n"
        "print(digest.hexdigest())\n"
    )
    done = subprocess.run([sys.executable, "-c", script, dataset_dir], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    digest = hashlib.sha256()
    for batch in ShardDataset(dataset_dir, 10, shuffle=True, seed=5):
        digest.update(batch["image"].numpy().tobytes())
        digest.update(str(batch["__key__"]).encode())
    assert done.stdout.strip() == digest.hexdigest()


@needs_extension
def test_read_ahead_skips_what_the_page_cache_holds(shard_maps: list[np.ndarray]) -> None:
    """``will_need`` asks the kernel only for slices whose first page is not in memory: slices just read
    are not asked for again (the probe that keeps the read-ahead cheap on a dataset in memory)."""
    a, b, last = shard_maps
    pieces = [a[0:2], b[3:4], last[4:5], a[5:5]]
    np.concatenate(pieces)  # read now: in the page cache
    assert gather.will_need(pieces) == 0
    assert gather.will_need([np.ones(10, np.uint8)]) == 0  # anonymous memory, just written
    assert gather.will_need([]) == 0


def test_read_ahead_is_advice_without_the_extension(shard_maps: list[np.ndarray],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gather, "_gather", None)
    assert gather.will_need([shard_maps[0][0:3]]) == 0
