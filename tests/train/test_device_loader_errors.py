"""``DeviceLoader``'s prefetch thread: an error propagates as itself with exit status 1 (never SIGABRT,
134, which schedulers and torchrun read as a crash), and the thread stops whenever the iterator ends.

The exit tests run a small program in a subprocess: the abort came at interpreter shutdown, when the
iterator (kept alive by the exception's traceback) still had a daemon thread inside a torch op.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from dataset_fixtures import make_dataset
from tests.paths import REPO_ROOT, TESTS_DIR

from shardio import DeviceLoader, ShardDataset, ShardFormatError

TESTS = TESTS_DIR
ROOT = REPO_ROOT

# Registered before shardio is imported, so it runs after shardio's own exit hook (atexit is LIFO): a
# prefetch thread still alive here is one the interpreter would tear down mid-work.
EXIT_PROBE = """
import atexit, os, threading
def _probe():
    alive = [t.name for t in threading.enumerate() if t.name == "shardio-prefetch" and t.is_alive()]
    if alive:
        os.write(2, b"prefetch thread alive at exit\\n")
        os._exit(3)
atexit.register(_probe)
"""


def _run(program: str, directory: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS])}
    source = EXIT_PROBE + textwrap.dedent(program)
    return subprocess.run([sys.executable, "-c", source, directory], env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture
def corrupt_dataset(tmp_path) -> str:
    directory = str(tmp_path / "ds")
    make_dataset(directory, (400,), height=32, width=32, samples_per_shard=100)
    path = os.path.join(directory, "shards", "input-0-00002.jsonl")  # the third shard's metadata
    with open(path, "r+b") as f:
        f.write(b"x")  # line 1 is no longer JSON; the size (checked at open) is unchanged
    return directory


def test_a_read_error_propagates_with_exit_1(corrupt_dataset):
    result = _run("""
        import sys
        from shardio import DeviceLoader, ShardDataset

        def main():
            batches = iter(DeviceLoader(ShardDataset(sys.argv[1], 8), "cpu"))
            while True:
                next(batches)

        main()
    """, corrupt_dataset)
    assert result.returncode == 1, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("shardio.errors.ShardFormatError: ") and "input-0-00002.jsonl: line 1" in last


def test_an_error_in_the_training_loop_exits_1_with_the_thread_stopped(tmp_path):
    directory = str(tmp_path / "ds")
    make_dataset(directory, (600,), height=64, width=64, samples_per_shard=100)
    result = _run("""
        import sys
        from shardio import DeviceLoader, ShardDataset

        def main():
            batches = iter(DeviceLoader(ShardDataset(sys.argv[1], 64), "cpu", prefetch=4))
            next(batches)
            raise ValueError("step failed")  # the thread is still prefetching

        main()
    """, directory)
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == "ValueError: step failed"


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "shardio-prefetch"]


def test_dropping_the_iterator_stops_the_thread_and_frees_its_batches(tmp_path):
    directory = str(tmp_path / "ds")
    make_dataset(directory, (200,), height=16, width=16)
    ds = ShardDataset(directory, 4)
    loader = DeviceLoader(ds, "cpu", prefetch=3)
    batches = iter(loader)
    first = next(batches)
    assert _prefetch_threads()
    del batches
    gc.collect()
    assert not _prefetch_threads()
    from shardio.train.loader import _Prefetcher

    assert not _Prefetcher.live
    # the loader still works afterwards, from the start of the epoch
    again = [b["cls"] for b in loader]
    assert torch.equal(again[0], first["cls"]) and sum(len(c) for c in again) == 200
    loader.passes.join_ahead()  # after the epoch's end, the next one's first batches; then it ends by itself
    assert not _prefetch_threads()


def test_a_read_error_in_process_is_the_shard_error(corrupt_dataset):
    with pytest.raises(ShardFormatError, match=r"input-0-00002\.jsonl: line 1"):
        for _ in DeviceLoader(ShardDataset(corrupt_dataset, 8), "cpu"):
            pass
    assert not _prefetch_threads()
