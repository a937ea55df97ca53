"""The job with its inputs in a bucket (and its output there too), on the 2-node test cluster.

What a user of a cluster without a shared disk relies on: the same tars give the same shard bytes whether
they come from local disk or from the bucket; a no-op rerun over committed objects costs LIST requests
only (counted); an object re-uploaded with the same bytes is still recognised (ETag), a changed one is
processed again; an input that cannot be downloaded fails alone; tasks land on both nodes and nothing is
written under a local dataset directory.
"""

from __future__ import annotations

import gzip
import io
import json
import os

import numpy as np
import pytest

from preprocess.config import JobConfig
from preprocess.job import RunOptions, run_job
from shardio.store.s3 import S3Storage
from tests.ray_helpers import occupy_node_cpu
from tests.tar_factory import decode_index
from tests.legacy_format import legacy_doc

pytestmark = pytest.mark.ray

CFG = JobConfig(height=16, width=16, samples_per_shard=4)


def _upload(s3_server, bucket: str, prefix: str, paths: list[str]) -> list[str]:
    client = s3_server.client()
    urls = []
    for path in paths:
        key = f"{prefix}/{os.path.basename(path)}"
        with open(path, "rb") as f:
            client.put_object(Bucket=bucket, Key=key, Body=f.read())
        urls.append(f"s3://{bucket}/{key}")
    return urls


def _object(s3_server, url: str) -> bytes:
    bucket, key = url[len("s3://"):].split("/", 1)
    return s3_server.client().get_object(Bucket=bucket, Key=key)["Body"].read()


def _manifest(s3_server, out: str) -> dict:
    return legacy_doc(out)  # the dataset's content, whatever the format version


def _samples_of(s3_server, out: str) -> list[int]:
    """Every sample index of the dataset at ``out``, in dataset order, read with boto3 and numpy alone."""
    indices = []
    for shard in _manifest(s3_server, out)["shards"]:
        pixels = np.load(io.BytesIO(_object(s3_server, f"{out}/{shard['path']}")))
        indices += [decode_index(p) for p in pixels]
    return indices


@pytest.fixture
def requests(monkeypatch) -> dict[str, list[str]]:
    """The URLs each request-making storage call was made for, in this process."""
    calls: dict[str, list[str]] = {name: [] for name in
                                   ("list_files", "info", "read_range", "open_read", "download", "read_versioned")}
    for name in calls:
        real = getattr(S3Storage, name)

        def counted(self, path, *args, _real=real, _name=name, **kwargs):
            calls[_name].append(path)
            return _real(self, path, *args, **kwargs)

        monkeypatch.setattr(S3Storage, name, counted)
    return calls


def test_the_same_tars_from_disk_or_bucket_give_the_same_shard_bytes(ray_cluster, s3_server, s3_bucket, tars,
                                                                      tmp_path):
    local = [tars.make(f"{i:05d}.tar", range(i * 20, i * 20 + n)) for i, n in enumerate((5, 9, 7))]
    local.append(tars.derive("00003.tar.gz", tars.make("gz-source.tar", range(60, 66)), gzip.compress))
    os.remove(tars.made[-1])
    _upload(s3_server, s3_bucket, "in", local)
    out_local, out_s3 = str(tmp_path / "out"), f"s3://{s3_bucket}/out"
    for inputs, out in (([f"{tars.directory}/*.tar*"], out_local), ([f"s3://{s3_bucket}/in/*.tar*"], out_s3)):
        report = run_job(RunOptions(inputs=inputs, output=out, config=CFG))
        assert report.exit_code == 0 and report.samples_written == 27, report.inputs_failed
    on_disk = legacy_doc(out_local)
    in_bucket = _manifest(s3_server, out_s3)
    assert len(on_disk["shards"]) == len(in_bucket["shards"]) == 2 + 3 + 2 + 2  # the .tar.gz streams too
    for disk, remote in zip(on_disk["shards"], in_bucket["shards"]):
        assert os.path.basename(disk["input"]) == os.path.basename(remote["input"])
        with open(os.path.join(out_local, disk["path"]), "rb") as f:
            assert f.read() == _object(s3_server, f"{out_s3}/{remote['path']}")  # byte for byte
        assert (disk["xxh3_128"], disk["samples"]) == (remote["xxh3_128"], remote["samples"])
        disk_rows = open(os.path.join(out_local, disk["meta_path"]), encoding="utf-8").read().splitlines()
        remote_rows = _object(s3_server, f"{out_s3}/{remote['meta_path']}").decode().splitlines()
        assert [{**json.loads(r), "tar": None} for r in disk_rows] == [{**json.loads(r), "tar": None}
                                                                       for r in remote_rows]
    entry = in_bucket["inputs"][f"s3://{s3_bucket}/in/00001.tar"]
    assert entry["etag"] and entry["samples"] == 9  # the ETag it was read at, for the next run
    assert "etag" not in on_disk["inputs"][local[1]]  # local entries are as before


def test_a_noop_rerun_costs_list_requests_only_and_etags_recognise_objects(ray_cluster, s3_server, s3_bucket,
                                                                          tars, requests):
    count = 12
    urls = _upload(s3_server, s3_bucket, "in", [tars.make(f"{i:05d}.tar", [i], with_meta=False)
                                                for i in range(count)])
    pattern, out = f"s3://{s3_bucket}/in/{{00000..{count - 1:05d}}}.tar", f"s3://{s3_bucket}/out"
    first = run_job(RunOptions(inputs=[pattern], output=out, config=CFG))
    assert first.exit_code == 0 and len(first.inputs_processed) == count
    for calls in requests.values():
        calls.clear()
    again = run_job(RunOptions(inputs=[pattern], output=out, config=CFG))
    assert again.exit_code == 0 and sorted(again.inputs_skipped) == urls and again.inputs_processed == []
    on_inputs = {name: [u for u in calls if u.startswith(f"s3://{s3_bucket}/in")] for name, calls in requests.items()}
    assert on_inputs["list_files"] == [f"s3://{s3_bucket}/in"]  # one LIST for the 12 tars
    assert all(calls == [] for name, calls in on_inputs.items() if name != "list_files"), on_inputs

    # The same bytes uploaded again (new LastModified, same ETag) are the same input; new bytes are not.
    _upload(s3_server, s3_bucket, "in", [tars.made[3]])
    tars.make("00005.tar", [105], with_meta=False)
    _upload(s3_server, s3_bucket, "in", [tars.made[-1]])
    third = run_job(RunOptions(inputs=[pattern], output=out, config=CFG))
    assert third.inputs_processed == [urls[5]] and len(third.inputs_skipped) == count - 1
    assert sorted(_samples_of(s3_server, out)) == sorted([*range(count)][:5] + [105] + [*range(count)][6:])


def test_an_input_that_cannot_be_downloaded_fails_alone(ray_cluster, s3_server, s3_bucket, tars):
    urls = _upload(s3_server, s3_bucket, "in", [tars.make(f"{i}.tar", range(i * 3, i * 3 + 3)) for i in range(3)])
    out = f"s3://{s3_bucket}/out"

    def delete_one_once_planned(kind, payload):
        if kind == "plan":  # listed, fingerprinted, planned: now the object disappears before its task reads it
            bucket, key = urls[1][len("s3://"):].split("/", 1)
            s3_server.client().delete_object(Bucket=bucket, Key=key)

    report = run_job(RunOptions(inputs=[f"s3://{s3_bucket}/in/*.tar"], output=out, config=CFG),
                     on_event=delete_one_once_planned)
    assert report.exit_code == 1
    assert sorted(report.inputs_processed) == [urls[0], urls[2]]
    [failed] = report.inputs_failed
    assert failed["input"] == urls[1] and "download failed at byte 0" in failed["reason"]
    assert "the object is gone" in failed["reason"]
    assert sorted(_samples_of(s3_server, out)) == [0, 1, 2, 6, 7, 8]


def test_bucket_to_bucket_on_two_nodes_writes_nothing_locally(ray_cluster, s3_server, s3_bucket, tars, tmp_path,
                                                              monkeypatch):
    # Placement is Ray's: one node's CPU is held during each drop, so each node must take one drop's inputs.
    import ray

    monkeypatch.chdir(tmp_path)  # a URL mistaken for a path would land here as ./s3:/...
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    out = f"s3://{s3_bucket}/laion-16"
    used: dict[str, int] = {}
    for drop, busy in enumerate(nodes):
        made = [tars.make(f"{t:05d}.tar", range(t * 2, t * 2 + 2), with_meta=False)
                for t in range(drop * 3, drop * 3 + 3)]
        _upload(s3_server, s3_bucket, "laion", made)
        blocker = occupy_node_cpu(busy)
        try:
            report = run_job(RunOptions(inputs=[f"s3://{s3_bucket}/laion/*.tar"], output=out, config=CFG))
        finally:
            ray.kill(blocker)
        assert report.exit_code == 0 and len(report.inputs_processed) == 3, report.inputs_failed
        on = {node.rsplit("/", 1)[-1] for node in report.inputs_per_node}
        assert not any(busy.startswith(n) for n in on), f"drop {drop} ran on the occupied node: {on}"
        for node, count in report.inputs_per_node.items():
            used[node] = used.get(node, 0) + count
    assert len(used) == 2 and sum(used.values()) == 6, used
    assert _samples_of(s3_server, out) == list(range(12))
    assert os.listdir(tmp_path) == ["tars"]  # only the test's own input tars: no local dataset folder
    keys = s3_server.list_keys(s3_bucket, "laion-16/")
    assert "laion-16/manifest.json" in keys and sum(k.endswith(".npy") for k in keys) == 6


def test_a_run_that_takes_over_an_expired_lease_names_its_shards_with_its_fence(ray_cluster, s3_server,
                                                                                 s3_bucket, tars):
    """The previous holder (another host, its lease expired) may live and delete its staged files by name
    late: the run writes none of those names (spec, "Fencing names"), and later runs keep its fence."""
    local = [tars.make(f"{i:05d}.tar", range(i * 10, i * 10 + 5)) for i in range(2)]
    inputs = _upload(s3_server, s3_bucket, "in", local)
    out = f"s3://{s3_bucket}/out"
    bucket_key = "out/.lock"
    s3_server.client().put_object(Bucket=s3_bucket, Key=bucket_key, Body=json.dumps(
        {"holder": "run-elsewhere", "host": "another-host", "pid": 1, "expires": 0, "token": "0" * 16}).encode())
    report = run_job(RunOptions(inputs=inputs[:1], output=out, config=CFG))
    assert report.exit_code == 0, report.inputs_failed
    fence = _manifest(s3_server, out).get("fence") or json.loads(_object(s3_server, f"{out}/manifest.json"))["fence"]
    assert len(fence) == 16
    shards = [s["path"] for s in _manifest(s3_server, out)["shards"]]
    assert shards and all(p.rsplit("-", 1)[0].endswith(f"-{fence}") for p in shards), shards
    report = run_job(RunOptions(inputs=inputs, output=out, config=CFG))  # a later run, a lease of its own
    assert report.exit_code == 0 and report.samples_written == 5, report.inputs_failed
    assert json.loads(_object(s3_server, f"{out}/manifest.json"))["fence"] == fence
    shards = [s["path"] for s in _manifest(s3_server, out)["shards"]]
    assert len(shards) == 4 and all(p.rsplit("-", 1)[0].endswith(f"-{fence}") for p in shards), shards
    assert sorted(_samples_of(s3_server, out)) == list(range(5)) + list(range(10, 15))
