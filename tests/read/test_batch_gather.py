"""A batch's slices gathered into one buffer (``shardio.read.gather``): the compiled extension (copying from
the maps, or reading the files with ``pread``) and the numpy fallback write the same bytes in the same
places, whatever the pieces (awkward sizes, empty ones, across shards, a partial last shard, split over
threads mid-piece, misaligned), refuse the same bad calls, and give the same batches, single-shape and
bucketed; without the extension the fallback is what reads."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest
import torch
from bucket_fixtures import make_bucketed_dataset
from dataset_fixtures import AWKWARD_INPUTS, assert_exactly_once, indices, make_dataset

from shardio import ShardDataset, ShardIntegrityError
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


def started(pieces: list[np.ndarray], out: np.ndarray, threads: int = 1) -> None:
    """The copy begun on the pool's threads and waited for (``gather_started``: a batch's metadata is built
    in between)."""
    gather.gather_started(pieces, out, threads)()


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
    assert (gathered(started, pieces, threads) == expected).all()
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
    begun = np.full(total, 0xEF, np.uint8)
    started(pieces, begun, threads)
    assert (begun == out).all()


@pytest.mark.parametrize("how", [pytest.param(native, marks=needs_extension),
                                 pytest.param(started, marks=needs_extension), fallback],
                         ids=["native", "started", "numpy"])
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


@pytest.fixture(scope="module")
def mapped_shards(tmp_path_factory: pytest.TempPathFactory) -> list[np.memmap]:
    """Three shards as np.memmap after a 128-byte header (as ``.npy`` shards are), the last partial: samples
    of 1x1000x3 (3,000 bytes: no multiple of 16 or 64)."""
    rng = np.random.default_rng(11)
    maps = []
    for number, samples in enumerate((8, 8, 5)):
        path = str(tmp_path_factory.mktemp("files") / f"shard-{number}.npy")
        with open(path, "wb") as f:
            f.write(b"h" * 128)
            rng.integers(0, 256, (samples, 1, 1000, 3), dtype=np.uint8).tofile(f)
        maps.append(np.memmap(path, np.uint8, mode="c", offset=128, shape=(samples, 1, 1000, 3)))
    return maps


@needs_extension
@pytest.mark.parametrize("threads", [1, 2, 5])
def test_pread_from_the_files_writes_what_the_maps_hold(mapped_shards: list[np.memmap], threads: int) -> None:
    """``read`` (pread into the batch) against the copy from the maps: pieces across shards, empty, the
    partial last shard, a slice of a map (a subset's view) whose rows start past the map's own start."""
    a, b, last = mapped_shards
    files = [gather.ShardFile.of(m) for m in mapped_shards]
    subset = gather.ShardFile.of(b[3:7])  # row 0 of this view is row 3 of the shard
    assert subset is not None and subset.first_row == files[1].first_row + 3 * 3000
    pieces = [(files[0], 3, 4), (files[1], 0, 8), (files[0], 5, 5), (files[2], 2, 5), (subset, 1, 3),
              (files[2], 4, 5), (files[0], 0, 3)]
    expected = np.concatenate([a[3:4], b[0:8], a[5:5], last[2:5], b[4:6], last[4:5], a[0:3]])
    out = np.full(expected.shape, 0xAB, np.uint8)
    gather.read(pieces, out, threads)
    assert (out == expected).all()
    begun = np.full(expected.shape, 0xAB, np.uint8)
    gather.read_started(pieces, begun, threads)()  # on the pool's threads, waited for after
    assert (begun == expected).all()
    assert gather.ShardFile.of(np.asarray(a)) is None and gather.ShardFile.of(np.ones((2, 3), np.uint8)) is None


def read_at_once(pieces, out: np.ndarray, threads: int = 1) -> None:
    gather.read(pieces, out, threads)


def read_begun(pieces, out: np.ndarray, threads: int = 1) -> None:
    gather.read_started(pieces, out, threads)()


@needs_extension
@pytest.mark.parametrize("how", [read_at_once, read_begun], ids=["read", "read_started"])
def test_pread_says_which_file_failed(how, tmp_path, mapped_shards: list[np.memmap]) -> None:
    path = tmp_path / "cut.npy"
    path.write_bytes(b"h" * 128 + bytes(range(256)) * 10)  # 2,560 bytes of samples: 2 of 1,000 and a part
    cut = gather.ShardFile(str(path), 128, 1000)
    with pytest.raises(ShardIntegrityError, match=r"cut\.npy: ends before sample 2's last byte \(at 3128\)"):
        how([(cut, 0, 2), (cut, 2, 3)], np.empty(3000, np.uint8), 2)
    out = np.empty(2000, np.uint8)
    how([(cut, 0, 2)], out)
    assert (out == np.frombuffer(bytes(range(256)) * 10, np.uint8)[:2000]).all()
    with pytest.raises(ValueError, match="2000 bytes, out 1999"):
        how([(cut, 0, 2)], np.empty(1999, np.uint8))
    with pytest.raises(TypeError, match="writable C-contiguous"):
        how([(cut, 0, 1)], np.empty(2000, np.uint8)[::2])
    how([], np.empty(0, np.uint8))


def read_epoch(directory: str, batch_size: int, settings: dict, **options) -> list[dict]:
    ds = ShardDataset(directory, batch_size, **settings, **options)
    return [{"image": b["image"].clone(), "__key__": b["__key__"], "cls": b["cls"].clone(),
             "reads_files": ds._assembler.reads_files} for b in ds]


@needs_extension
@pytest.mark.parametrize("settings", SETTINGS, ids=["sequential", "default-shuffle", "blocks-of-3"])
@pytest.mark.parametrize("threads", [1, 3])
def test_the_three_ways_give_the_same_batches(dataset_dir: str, settings: dict, threads: int,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """pread (more shards than maps kept: 15 shards, 4 kept), the maps (all kept), numpy (no extension):
    one epoch, byte for byte, batches of 117 across every shard end and the partial last shards."""
    by_pread = read_epoch(dataset_dir, 117, settings, cache_shards=4, gather_threads=threads)
    by_maps = read_epoch(dataset_dir, 117, settings, gather_threads=threads)
    monkeypatch.setattr(gather, "_gather", None)
    monkeypatch.setattr(batches, "native", gather.native)
    by_numpy = read_epoch(dataset_dir, 117, settings, cache_shards=4)
    assert by_pread[0]["reads_files"] and not by_maps[0]["reads_files"] and not by_numpy[0]["reads_files"]
    for one, two, three in zip(by_pread, by_maps, by_numpy, strict=True):
        assert torch.equal(one["image"], two["image"]) and torch.equal(one["image"], three["image"])
        assert one["__key__"] == two["__key__"] == three["__key__"]
    assert_exactly_once(np.concatenate([indices(b) for b in by_pread]), 117)


@needs_extension
def test_a_bucketed_dataset_reads_the_same_by_pread_maps_and_numpy(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = make_bucketed_dataset(str(tmp_path / "buckets"), buckets=[(8, 12), (12, 8), (10, 10)],
                                      samples=[23, 41, 9], samples_per_shard=6)
    settings = {"shuffle": True, "seed": 2}
    by_pread = read_epoch(directory, 7, settings, cache_shards=1, gather_threads=2)
    by_maps = read_epoch(directory, 7, settings, gather_threads=2)
    monkeypatch.setattr(gather, "_gather", None)
    monkeypatch.setattr(batches, "native", gather.native)
    by_numpy = read_epoch(directory, 7, settings, cache_shards=1)
    assert by_pread[0]["reads_files"] and not by_maps[0]["reads_files"]
    for one, two, three in zip(by_pread, by_maps, by_numpy, strict=True):
        assert torch.equal(one["image"], two["image"]) and torch.equal(one["image"], three["image"])
        assert one["__key__"] == two["__key__"] == three["__key__"]
    assert sum(len(b["__key__"]) for b in by_pread) == 73


@needs_extension
def test_a_second_copy_before_the_first_is_waited_for_is_refused_and_a_dropped_one_is_finished() -> None:
    """Waiting is what ends a started copy and gives the copy threads back: a second copy on the same thread
    before it would wait for ever, so it is refused; a job let go unwaited is waited for as it goes (its
    threads write into out)."""
    source = np.random.default_rng(5).integers(0, 256, 12 << 20, dtype=np.uint8)
    pieces = [source[i : i + (1 << 20)] for i in range(0, source.size, 1 << 20)]
    out, second = np.empty_like(source), np.empty_like(source)
    job = gather._gather.gather_start(pieces, out, 2)
    with pytest.raises(RuntimeError, match="not waited for"):
        gather._gather.gather_start(pieces, second, 2)
    with pytest.raises(RuntimeError, match="not waited for"):
        gather._gather.gather_into(pieces, second, 3)
    job.wait()
    job.wait()  # once is enough; again is nothing
    assert (out == source).all()
    out[:] = 0
    job = gather._gather.gather_start(pieces, out, 1)
    del job  # let go unwaited: finished as it goes, and the threads are free again
    assert (out == source).all()
    gather._gather.gather_into(pieces, second, 3)
    assert (second == source).all()


@needs_extension
def test_a_copy_on_another_thread_waits_for_a_started_one_then_runs() -> None:
    import threading

    source = np.random.default_rng(6).integers(0, 256, 24 << 20, dtype=np.uint8)
    pieces = [source[i : i + (1 << 20)] for i in range(0, source.size, 1 << 20)]
    first, second = np.empty_like(source), np.empty_like(source)
    job = gather._gather.gather_start(pieces, first, 4)
    other = threading.Thread(target=gather._gather.gather_into, args=(pieces, second, 4))
    other.start()  # its turn comes when the started copy is waited for, whatever runs first
    job.wait()
    other.join(120)
    assert not other.is_alive()
    assert (first == source).all() and (second == source).all()


def test_gather_threads_default_and_bad_values(dataset_dir: str) -> None:
    assert 1 <= batches.gather_threads() <= batches.MAX_GATHER_THREADS
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="gather_threads must be an int >= 1"):
            ShardDataset(dataset_dir, 10, gather_threads=bad)


def _gather_in_child(pieces: list[np.ndarray], expected_sum: int, result) -> None:
    out = np.empty(sum(p.nbytes for p in pieces), np.uint8)
    gather._gather.gather_into(pieces, out, 4)  # the pool's threads are the parent's: the child starts its own
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 4
    result.put((int(out.sum(dtype=np.int64)) == expected_sum, threads))


@needs_extension
def test_a_forked_child_copies_on_threads_of_its_own() -> None:
    """A DataLoader worker is a fork of a process whose copy threads are started: they do not exist in the
    child, which starts its own (it copies on 4 threads too, not alone) and never waits for the parent's."""
    import multiprocessing

    source = np.random.default_rng(3).integers(0, 256, 24 << 20, dtype=np.uint8)
    pieces = [source[i : i + (1 << 20)] for i in range(0, source.size, 1 << 20)]
    out = np.empty(source.size, np.uint8)
    gather._gather.gather_into(pieces, out, 4)  # the parent's pool: 3 threads besides the caller
    assert (out == source).all()
    context = multiprocessing.get_context("fork")
    result = context.Queue()
    child = context.Process(target=_gather_in_child, args=(pieces, int(source.sum(dtype=np.int64)), result))
    child.start()
    child.join(120)
    assert child.exitcode == 0
    same, threads = result.get(timeout=10)
    assert same and threads >= 4, threads  # the caller and 3 copy threads of its own


@needs_extension
def test_pread_only_where_the_process_may_open_a_file_per_kept_shard(dataset_dir: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Each kept map holds a descriptor; pread adds one a shard: not where that would pass the soft limit
    (1,024 in many shells, against 2 x 512 kept shards), which is left as it is."""
    limits = {"soft": 1024}
    monkeypatch.setattr(batches.resource, "getrlimit", lambda which: (limits["soft"], 1 << 20))
    assert not batches.room_for_files(512) and batches.room_for_files(384)
    assert ShardDataset(dataset_dir, 10, cache_shards=4)._assembler.reads_files
    limits["soft"] = 200
    ds = ShardDataset(dataset_dir, 10, cache_shards=4)
    assert not ds._assembler.reads_files
    assert_exactly_once(np.concatenate([indices(b) for b in ds]), 117)
