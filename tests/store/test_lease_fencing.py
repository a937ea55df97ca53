"""Whatever happens to a writer's lease, no committed generation names a file that is not there (the directory
protocol's "Fencing", ``shardio.write.directory.writing``; the lease, ``shardio.store.lease``).

Writer A (tests/lease_writer.py, its own process) commits one input, promotes the files of a second one and
waits; the test then cuts it off from the store (its lease requests failing, or every request), pauses it
(SIGSTOP), kills it (SIGKILL) or jumps B's wall clock an hour ahead, while writer B takes the lease over once
it has expired, cleans the dataset as a run does after a killed run (A's uncommitted files go) and, for the
kill, commits. A is then let go and told to commit: it must be refused, and every generation on storage must
be whole. The steps wait for events (A's ``staged`` line, the lease's expiry as B polls for it, A's exit),
never for a fixed time. Locally the lock is a flock, which a paused process keeps: B is refused and nothing is
deleted."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import pytest

from shardio.errors import OutputLocked
from shardio.format.index import FENCE_MEMBER, Delta, encode_segment, segment_path
from shardio.format.manifests import list_generations, load_index
from shardio.format.shard_check import shard_problems
from shardio.store import lease
from shardio.store.backends import for_path
from shardio.store.root import open_root
from shardio.write import directory as dataset_dir
from tests import lease_writer
from tests.fault_proxy import FaultProxy
from tests.paths import REPO_ROOT

T = TypeVar("T")
LEASE_SECONDS = "2"  # A renews every 0.67 s; B takes over once 2 s pass without a renewal
ROOT = REPO_ROOT


def start_writer(out: str, env: dict[str, str]) -> subprocess.Popen:
    """Writer A, returned once it has committed input-0 and promoted input-1's files ("staged")."""
    writer = subprocess.Popen([sys.executable, "-m", "tests.lease_writer", out], cwd=ROOT, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**os.environ, **env, "SHARDIO_LEASE_SECONDS": LEASE_SECONDS})
    line = writer.stdout.readline()
    assert line == "staged\n", line + writer.stdout.read()
    return writer


def finish(writer: subprocess.Popen) -> tuple[int, str]:
    """Tell A to commit input-1; its exit code and what it printed."""
    output, _ = writer.communicate("commit\n", timeout=120)
    return writer.returncode, output


def take_over_and_clean(out: str) -> None:
    """Writer B, as a run starts: the lock (polling until A's lease expired), what is committed, the
    leftover cleaning."""
    take_over(out, lambda existing: dataset_dir.clean_after_runs(out, existing))


def take_over(out: str, work: Callable[[Any], T]) -> T:
    """Writer B: the lock (polling until A's lease expired), then ``work(what is committed)`` under it."""
    deadline = time.monotonic() + 60
    while True:
        try:
            with dataset_dir.writing(out):
                existing, _ = dataset_dir.load_committed(out)
                return work(existing)
        except OutputLocked:
            assert time.monotonic() < deadline, "A's lease never expired: its renewals got through"
            time.sleep(0.1)


def assert_every_generation_whole(out: str) -> None:
    """Every kept root and ``manifest.json`` name only shard files that are there, whole."""
    for generation in [*list_generations(out), None]:
        index = load_index(out, generation)
        assert shard_problems(open_root(out), index) == [], f"generation {index.generation} names missing or bad shards"


def input_files(out: str, number: int) -> set[str]:
    store = for_path(out)
    return {name for name in store.list_dir(store.join(out, "shards")) if name.startswith(f"input-{number}-")}


class _ClockAnHourAhead:
    """The wall clock of writer B's host jumped an hour ahead (its monotonic clock did not)."""

    monotonic, sleep = staticmethod(time.monotonic), staticmethod(time.sleep)

    @staticmethod
    def time() -> float:
        return time.time() + 3600


@pytest.mark.parametrize("fault", ["lease-requests-failing", "every-request-failing", "paused", "clock-jump"])
def test_a_writer_that_lost_its_lease_never_commits_what_the_new_holder_cleaned(s3_server, s3_bucket, fault,
                                                                                  monkeypatch):
    out = f"s3://{s3_bucket}/ds"
    proxy = FaultProxy(s3_server.ports["s3"])
    writer = None
    try:
        writer = start_writer(out, {"AWS_ENDPOINT_URL": proxy.endpoint})
        assert input_files(out, 1), "A promoted input-1's files"
        if fault == "lease-requests-failing":
            proxy.fail_matching("/.lock")  # A's renewals answered 503; its commits would still get through
        elif fault == "every-request-failing":
            proxy.fail_matching("/")  # every request of A answered 503
        elif fault == "paused":
            os.kill(writer.pid, signal.SIGSTOP)
        else:  # A lives and renews, but B reads its lease as long expired and takes it over at once
            monkeypatch.setattr(lease, "time", _ClockAnHourAhead)
        take_over_and_clean(out)  # B waits until A's lease expired, then takes it over
        assert not input_files(out, 1), "B's cleaning removed A's uncommitted files"
        if fault == "lease-requests-failing":
            proxy.fail_matching(None)
        elif fault == "every-request-failing":
            proxy.fail_matching(None)
        elif fault == "paused":
            os.kill(writer.pid, signal.SIGCONT)
        code, output = finish(writer)
    finally:
        if writer is not None and writer.poll() is None:
            writer.kill()
        proxy.close()
    assert code == 3 and "refused" in output, output
    assert_every_generation_whole(out)
    assert load_index(out).committed_inputs().keys() == {"input-0.tar"}


def test_a_writer_killed_with_sigkill_is_taken_over_at_once_and_its_files_go(s3_bucket):
    out = f"s3://{s3_bucket}/ds"
    writer = start_writer(out, {})
    writer.kill()
    writer.wait()
    started = time.monotonic()
    take_over_and_clean(out)  # a dead holder on this host: no wait for its expiry
    assert time.monotonic() - started < 30
    assert not input_files(out, 1) and input_files(out, 0)
    assert_every_generation_whole(out)


def test_a_paused_local_writer_keeps_its_flock_and_commits_after_it(tmp_path):
    out = str(tmp_path / "ds")
    writer = start_writer(out, {})
    os.kill(writer.pid, signal.SIGSTOP)
    try:
        with pytest.raises(OutputLocked, match="another run is writing"):
            with dataset_dir.writing(out):
                pass
    finally:
        os.kill(writer.pid, signal.SIGCONT)
    assert input_files(out, 1)
    code, output = finish(writer)
    assert code == 0 and "committed" in output, output
    assert_every_generation_whole(out)
    assert load_index(out).committed_inputs().keys() == {"input-0.tar", "input-1.tar"}


def test_a_local_writer_killed_with_sigkill_leaves_what_the_next_cleaning_removes(tmp_path):
    out = str(tmp_path / "ds")
    writer = start_writer(out, {})
    writer.kill()
    writer.wait()
    take_over_and_clean(out)
    assert not input_files(out, 1) and input_files(out, 0)
    assert_every_generation_whole(out)


# --- the lease handle alone -------------------------------------------------------------------------------


def test_a_holder_cut_off_past_its_proven_life_refuses_until_a_renewal_succeeds(s3_server, s3_bucket, monkeypatch):
    import shardio.store.s3 as backend

    real = backend._store_options

    def one_retry():  # a renewal meeting 503s fails within a second, not after a minute of retries
        options = real()
        options["retry_config"]["max_retries"] = 1
        return options

    monkeypatch.setattr(backend, "_store_options", one_retry)
    proxy = FaultProxy(s3_server.ports["s3"])
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        store = backend.S3Storage()
        path = f"s3://{s3_bucket}/ds/.lock"
        handle = lease._acquire(store, path, wait=False, ttl_s=1.5, poll_s=0.1)
        try:
            handle.check()
            proxy.fail_matching("/.lock")
            while time.monotonic() < handle.valid_until:  # the proven life runs out (renewals answered 503)
                time.sleep(0.05)
            with pytest.raises(OutputLocked, match="cannot prove it still holds the lease"):
                handle.check()
            proxy.fail_matching(None)
            deadline = time.monotonic() + 60
            while True:  # a renewal now (or the one in flight): the lease was not taken, it is still its holder's
                try:
                    handle.check()
                    break
                except OutputLocked:
                    assert time.monotonic() < deadline and handle.lost is None
            assert handle.lost is None
        finally:
            proxy.fail_matching(None)
            handle.release()
    finally:
        proxy.close()


def test_a_renewal_whose_answer_was_lost_is_recognised_by_the_holders_token(store, s3_bucket):
    path = f"s3://{s3_bucket}/ds/.lock"
    handle = lease._acquire(store, path, wait=False, ttl_s=60, poll_s=0.1)
    try:
        # A renewal that landed but whose answer never came back: the object is the holder's, its ETag new.
        handle.etag = store.publish(path, lease._body(60, handle.token))
        handle.etag = "an-etag-the-holder-never-saw"
        handle.valid_until = 0  # past: check() renews at once
        handle.check()
        assert handle.lost is None and handle.etag != "an-etag-the-holder-never-saw"
    finally:
        handle.release()
    assert not store.exists(path)


@pytest.fixture
def store(s3_server):
    from shardio.store.s3 import S3Storage

    return S3Storage()


@pytest.mark.parametrize("fault", ["paused", "lease-requests-failing"])
def test_a_late_deletion_by_the_previous_holder_removes_none_of_the_new_holders_files(s3_server, s3_bucket, fault):
    """The store cannot fence a deletion: A's DELETE of a file it staged may land after B took the lease
    over and wrote that input again (A paused between its lease check and its request, or the request held
    back). B, having taken over from a holder that may live, names its files with its fence, so A's late
    deletions (made here by the test, by A's names, after B's commit) remove nothing B's generations name."""
    out = f"s3://{s3_bucket}/ds"
    proxy = FaultProxy(s3_server.ports["s3"])
    writer = None
    try:
        writer = start_writer(out, {"AWS_ENDPOINT_URL": proxy.endpoint})
        staged_by_a = input_files(out, 1)
        if fault == "paused":
            os.kill(writer.pid, signal.SIGSTOP)
        else:
            proxy.fail_matching("/.lock")

        def clean_and_write_input_1_again(existing) -> str:
            dataset_dir.clean_after_runs(out, existing)
            fence = dataset_dir.shard_name_fence(out, existing)
            committer = dataset_dir.Committer(out, existing, run="writer-b")
            committer.add_input("input-1.tar", size=1, mtime_ns=1, shards=lease_writer.write_input(out, 1, 8, fence))
            committer.commit()
            return fence

        fence = take_over(out, clean_and_write_input_1_again)
        written_by_b = input_files(out, 1)
        store = for_path(out)
        for name in staged_by_a:  # A's deletions, landing late
            store.remove(store.join(out, "shards", name))
    finally:
        if writer is not None:
            if fault == "paused":
                os.kill(writer.pid, signal.SIGCONT)
            writer.kill()
            writer.wait()
        proxy.close()
    assert_every_generation_whole(out)
    assert load_index(out).committed_inputs().keys() == {"input-0.tar", "input-1.tar"}
    assert len(fence) == 16 and load_index(out).name_fence == fence, "B's root carries its fence"
    assert written_by_b.isdisjoint(staged_by_a), "B wrote none of the names A staged"
    with dataset_dir.writing(out):  # a later run, holding a lease of its own, keeps the dataset's fence
        existing, _ = dataset_dir.load_committed(out)
        assert dataset_dir.shard_name_fence(out, existing) == fence


def test_a_holder_proven_dead_on_this_host_leaves_no_fence_so_a_rerun_writes_the_same_names(s3_bucket):
    out = f"s3://{s3_bucket}/ds"
    writer = start_writer(out, {})
    staged_by_a = input_files(out, 1)
    writer.kill()
    writer.wait()
    with dataset_dir.writing(out):  # taken over at once: the holder's pid is gone on this host
        existing, _ = dataset_dir.load_committed(out)
        dataset_dir.clean_after_runs(out, existing)
        assert dataset_dir.shard_name_fence(out, existing) == ""
        committer = dataset_dir.Committer(out, existing, run="writer-b")
        committer.add_input("input-1.tar", size=1, mtime_ns=1, shards=lease_writer.write_input(out, 1, 8))
        committer.commit()
    assert input_files(out, 1) == staged_by_a
    assert load_index(out).name_fence == ""
    assert_every_generation_whole(out)


def test_a_late_deletion_of_a_segment_the_previous_holder_wrote_spares_the_new_holders_segments(s3_server,
                                                                                                s3_bucket):
    """Segments are named by their content: a drop of the same input by A (refused, its segment left
    behind, then deleted late by A's cleaning) and by B would be the same bytes, the same name. B's
    segments carry its fence (spec, "Fencing names"), so A's late deletion of its own segment's name leaves
    B's index whole."""
    out = f"s3://{s3_bucket}/ds"
    writer = start_writer(out, {})
    os.kill(writer.pid, signal.SIGSTOP)
    try:

        def drop_input_0(existing) -> str:
            committer = dataset_dir.Committer(out, existing, run="writer-b")
            committer.drop_input("input-0.tar")
            committer.commit()
            return dataset_dir.shard_name_fence(out, existing)

        fence = take_over(out, drop_input_0)
        a_would_write = segment_path(encode_segment(Delta(inputs={}, removed={"input-0.tar"})))
        store = for_path(out)
        store.remove(store.join(out, a_would_write))  # A's deletion of the segment of its own drop, late
    finally:
        os.kill(writer.pid, signal.SIGCONT)
        writer.kill()
        writer.wait()
    index = load_index(out)
    assert index.committed_inputs() == {}
    assert a_would_write not in [ref.path for ref in index.segments]
    for ref in index.segments:
        with np.load(io.BytesIO(store.read_bytes(store.join(out, ref.path))), allow_pickle=False) as z:
            if "removed_blob" in z and z["removed_blob"].tobytes() == b"input-0.tar":
                assert z[FENCE_MEMBER].tobytes().decode() == fence
