"""A writer in its own process, for the lease's fault-injection tests (tests/store/test_lease_fencing.py): it takes
the dataset's lock, marks a run as the job does, commits input ``input-0.tar`` (real shard files), promotes
the files of ``input-1.tar`` without committing them, prints ``staged``, and waits for a line on stdin
before it commits them: the test pauses it, cuts it off or kills it in between, while another writer takes
the lease over and cleans. It prints ``committed`` and exits 0, or prints the refusal and exits 3.

``python -m tests.lease_writer DIR`` (``SHARDIO_LEASE_SECONDS`` short; ``AWS_ENDPOINT_URL`` a proxy's)
"""

from __future__ import annotations

import sys

import numpy as np

import shardio.store.s3 as s3_backend
from shardio.errors import OutputLocked
from shardio.write import directory as dataset_dir
from preprocess.worker import shard_stem
from shardio.write.shard_writer import InputShardWriter

SIDE, PER_SHARD = 2, 3


def _one_retry() -> dict:
    """One retry, not a minute of them: the store is made to fail on purpose here."""
    options = _store_options()
    options["retry_config"]["max_retries"] = 1
    return options


_store_options = s3_backend._store_options


def write_input(directory: str, number: int, samples: int, name_fence: str = "") -> list:
    """Promote the shard files of ``input-N.tar`` (sample i's pixels all equal i), named as the job names
    them; their entries."""
    name = f"input-{number}.tar"
    writer = InputShardWriter(directory, shard_stem(name, 1, 1, "", name_fence), SIDE, SIDE, PER_SHARD)
    for i in range(samples):
        writer.add(np.full((SIDE, SIDE, 3), i, np.uint8), {"key": f"{number}-{i}"}, name)
    return writer.close(name)


def main(directory: str) -> int:
    s3_backend._store_options = _one_retry
    dataset_dir.ensure_output_dir(directory)
    with dataset_dir.writing(directory):
        existing, _ = dataset_dir.load_committed(directory)
        dataset_dir.clean_after_runs(directory, existing)
        committer = dataset_dir.Committer(directory, existing, run="writer-a", shape=(SIDE, SIDE, 3),
                                          config={"height": SIDE, "width": SIDE}, versions={})
        dataset_dir.mark_run(directory, "writer-a")
        committer.add_input("input-0.tar", size=1, mtime_ns=1, shards=write_input(directory, 0, 7))
        committer.commit()
        shards = write_input(directory, 1, 8)
        print("staged", flush=True)
        sys.stdin.readline()
        try:
            committer.add_input("input-1.tar", size=1, mtime_ns=1, shards=shards)
            committer.commit()
        except OutputLocked as e:  # CommitConflict included
            print(f"refused: {type(e).__name__}: {e}", flush=True)
            return 3
        print("committed", flush=True)
        dataset_dir.unmark_run(directory, "writer-a")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
