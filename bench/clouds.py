"""S3, Google Cloud Storage and Azure Blob side by side, each against its emulator on loopback (SeaweedFS,
fake-gcs-server, Azurite: the servers the tests start): the job's rate writing to each (local tars in, the
dataset out to the bucket) and the reader's cold epoch from each (a fresh cache every time), as ratios to S3
on the same machine in the same run. The emulators are not the clouds: the ratios say what shardio's own
code costs per backend here, not what the clouds serve.

fake-gcs-server takes no writes from obstore (it lacks GCS's XML upload): its job row is the refusal, and
its reader row reads a dataset seeded through the emulator's JSON API.

    python -m bench.clouds [--repeats 3] [--samples 4000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from shardio.read.dataset import ShardDataset
from tests.azure_server import AzureServer
from tests.dataset_fixtures import make_dataset
from tests.gcs_server import GCSServer
from tests.object_stores import CloudBucket
from tests.s3_server import BENCH_VOLUME_MB, S3Server
from tests.tar_factory import TarFactory


def _cold_epoch(url: str, cache: str, samples: int) -> float:
    """Samples per second of one epoch through an empty cache."""
    began = time.perf_counter()
    ds = ShardDataset(url, 64, cache_dir=cache, shuffle=True, seed=0, shuffle_window=4)
    seen = sum(len(batch["__key__"]) for batch in ds)
    assert seen == samples, (url, seen)
    return samples / (time.perf_counter() - began)


def _job(tar_dir: str, url: str, samples: int) -> float | str:
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "preprocess.cli", "run", f"{tar_dir}/*.tar", "--output", url,
                           "--size", "64", "--samples-per-shard", "100", "-q"], capture_output=True, text=True)
    if done.returncode:
        return "refused: " + " ".join(done.stderr.split())[:160]
    return samples / (time.perf_counter() - began)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=4000)
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="shardio-clouds-")
    servers = {"s3": S3Server(os.path.join(root, "s3"), volume_size_mb=BENCH_VOLUME_MB),
               "gcs": GCSServer(os.path.join(root, "gcs")), "azure": AzureServer(os.path.join(root, "azure"))}
    try:
        for server in servers.values():
            os.makedirs(server.root, exist_ok=True)
            server.start()
            os.environ.update(server.env())
        local = os.path.join(root, "local")
        make_dataset(local, inputs=(args.samples // 2, args.samples - args.samples // 2), samples_per_shard=100,
                     height=64, width=64)
        buckets = {name: CloudBucket(server, server.new_bucket()) for name, server in servers.items()}
        remote = {name: bucket.upload_dir(local) for name, bucket in buckets.items()}
        tars = TarFactory(os.path.join(root, "tars"))
        per_tar = args.samples // 4
        for number in range(4):
            tars.make(f"{number:02d}.tar", range(number * per_tar, (number + 1) * per_tar))
        reader: dict[str, list[float]] = {name: [] for name in servers}
        job: dict[str, list[float | str]] = {name: [] for name in servers}
        for repeat in range(args.repeats):  # alternated, so a busy moment of the machine hits every backend
            for name in servers:
                reader[name].append(_cold_epoch(remote[name], os.path.join(root, f"cache-{name}-{repeat}"),
                                                args.samples))
                job[name].append(_job(tars.directory, buckets[name].url(f"job{repeat}"), 4 * per_tar))
        base_reader = statistics.median(reader["s3"])
        base_job = statistics.median(v for v in job["s3"] if isinstance(v, float))
        print(f"{args.samples} samples of 64x64, {args.repeats} runs each, median (ratio to S3):")
        for name in servers:
            cold = statistics.median(reader[name])
            rates = [v for v in job[name] if isinstance(v, float)]
            job_text = (f"{statistics.median(rates):8.0f} samples/s ({statistics.median(rates) / base_job:.2f})"
                        if rates else str(job[name][0]))
            print(f"  {name:5s} reader cold {cold:8.0f} samples/s ({cold / base_reader:.2f}); job {job_text}")
    finally:
        for server in servers.values():
            server.stop(crash=True)


if __name__ == "__main__":
    main()
