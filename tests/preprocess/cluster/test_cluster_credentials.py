"""A cluster whose worker node was started without the AWS variables (as ``ray start`` on another machine
would be): the driver's endpoint and region reach the tasks by themselves, a node with no credentials stops
the run before any task naming the node (exit 2, nothing committed), and ``--pass-credentials`` makes it work.

One extra Ray cluster for this module (the session's one inherits the driver's environment): a head with no
CPUs, so every task and probe runs on the one worker node each test adds with its own environment.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.preprocess.test_crash_safety import FLAGS

pytestmark = pytest.mark.ray

SETTINGS = ("AWS_ENDPOINT_URL", "AWS_REGION", "AWS_ALLOW_HTTP")  # what the driver has and the node lacks
CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


@pytest.fixture(scope="module")
def bare_cluster(s3_server) -> Iterator:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    session_dir = cluster.head_node.get_session_dir_path()
    try:
        yield cluster
    finally:
        cluster.shutdown()
        shutil.rmtree(session_dir, ignore_errors=True)


@contextlib.contextmanager
def worker_without(cluster, names: tuple[str, ...]) -> Iterator[str]:
    """A 1-CPU node whose processes start with ``names`` removed from the environment; yields its name as
    the job's messages give it (host/node id)."""
    saved = {name: os.environ.pop(name) for name in names if name in os.environ}
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"  # no instance role to ask for on this machine
    try:
        node = cluster.add_node(num_cpus=1)
    finally:
        os.environ.pop("AWS_EC2_METADATA_DISABLED")
        os.environ.update(saved)
    cluster.wait_for_nodes()
    try:
        yield f"{os.uname().nodename}/{node.node_id[:8]}"
    finally:
        cluster.remove_node(node)


@pytest.fixture
def inputs(s3_server, s3_bucket, tars) -> str:
    client = s3_server.client()
    for i, count in enumerate((5, 7, 3)):
        with open(tars.make(f"{i:05d}.tar", range(i * 10, i * 10 + count)), "rb") as f:
            client.put_object(Bucket=s3_bucket, Key=f"in/{i:05d}.tar", Body=f.read())
    return f"s3://{s3_bucket}/in/*.tar"


def run(cluster, inputs: str, out: str, *extra: str) -> subprocess.CompletedProcess:
    """``preprocess run`` as a user types it on the head, with the AWS variables of the session's server."""
    args = [sys.executable, "-m", "preprocess.cli", "run", inputs, "--output", out, *FLAGS, "-q",
            "--ray-address", cluster.address, *extra]
    return subprocess.run(args, capture_output=True, text=True, timeout=300)


def test_the_drivers_endpoint_and_region_reach_a_node_without_them(bare_cluster, s3_server, s3_bucket, inputs):
    out = f"s3://{s3_bucket}/out"
    with worker_without(bare_cluster, SETTINGS):
        done = run(bare_cluster, inputs, out)
    assert done.returncode == 0, done.stderr
    assert s3_server.list_keys(s3_bucket, "out/manifest.json") == ["out/manifest.json"]


def test_a_node_without_credentials_stops_the_run_before_any_task_naming_it(bare_cluster, s3_server, s3_bucket,
                                                                            inputs):
    out = f"s3://{s3_bucket}/out"
    with worker_without(bare_cluster, SETTINGS + CREDENTIALS) as node:
        done = run(bare_cluster, inputs, out)
    assert done.returncode == 2, done.stderr
    message = " ".join(done.stderr.split())  # the CLI wraps long lines
    print(message)
    assert f"1 of 1 Ray node(s) cannot reach what this run reads or writes: node {node}: " in message
    assert "no S3 credentials on this machine" in message and "--pass-credentials" in message
    assert "Nothing was processed" in message
    written = s3_server.list_keys(s3_bucket, "out/")
    assert not [k for k in written if k.startswith(("out/shards/", "out/manifest"))], written


def test_pass_credentials_gives_the_node_the_drivers(bare_cluster, s3_server, s3_bucket, inputs):
    out = f"s3://{s3_bucket}/out"
    with worker_without(bare_cluster, SETTINGS + CREDENTIALS):
        done = run(bare_cluster, inputs, out, "--pass-credentials")
    assert done.returncode == 0, done.stderr
    assert s3_server.list_keys(s3_bucket, "out/manifest.json") == ["out/manifest.json"]


AZURE_SETTINGS = ("AZURE_STORAGE_ACCOUNT_NAME", "AZURE_ENDPOINT")
AZURE_CREDENTIALS = ("AZURE_STORAGE_ACCOUNT_KEY",)


def test_an_azure_node_without_credentials_is_named_and_pass_credentials_gives_it_the_drivers(
        bare_cluster, azure_server, tars):
    container = azure_server.new_bucket()
    for i, count in enumerate((5, 7)):
        azure_server.put_file(container, f"in/{i:05d}.tar", tars.make(f"{i:05d}.tar", range(i * 10, i * 10 + count)))
    inputs, out = f"az://{container}/in/*.tar", f"az://{container}/out"
    with worker_without(bare_cluster, AZURE_SETTINGS + AZURE_CREDENTIALS) as node:
        refused = run(bare_cluster, inputs, out)
        passed = run(bare_cluster, inputs, out, "--pass-credentials")
    assert refused.returncode == 2, refused.stderr
    message = " ".join(refused.stderr.split())
    assert f"1 of 1 Ray node(s) cannot reach what this run reads or writes: node {node}: " in message
    # Said at once, or (where a metadata service answers at 169.254.169.254) its refusal, naming the fix.
    assert ("no Azure credentials on this machine" in message
            or "(not the store: a credential service): HTTP 403" in message), message
    assert "AZURE_STORAGE_ACCOUNT_KEY" in message and "--pass-credentials" in message
    assert "AZURE_ENDPOINT" in message and "AZURE_STORAGE_ACCOUNT_KEY" not in message.split("The tasks get")[1]
    assert passed.returncode == 0, passed.stderr  # the account and endpoint travelled; the key with the flag
    assert azure_server.list_keys(container, "out/manifest.json") == ["out/manifest.json"]
