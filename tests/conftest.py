"""Shared fixtures: one 2-node local Ray cluster and one S3 server per test session, and generated tars.

Ray starts once (~4 s a node) and every Ray test shares it; the job reuses an initialised Ray instead of
starting its own, and subprocess runs join it with ``--ray-address``. Two nodes (1 CPU each) make every
job test a multi-node test: tasks land on both raylets.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from tests.s3_server import S3Server
from tests.tar_factory import TarFactory


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Iterator[S3Server]:
    """One SeaweedFS server for the session (tests/s3_server.py). Its AWS variables go into this process's
    environment (and so into every subprocess and every Ray worker started after it): the product reads
    credentials and endpoint from the standard AWS environment, as it would on a real cluster."""
    server = S3Server(str(tmp_path_factory.mktemp("s3-server")))
    server.start()
    saved = {key: os.environ.get(key) for key in server.env()}
    os.environ.update(server.env())
    try:
        yield server
    finally:
        server.stop(crash=True)  # its data is a temp dir: no graceful 5 s stop at the end of every session
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def s3_bucket(s3_server) -> str:
    """A new, empty bucket on the session's server (its name; URLs are ``s3://NAME/...``)."""
    return s3_server.new_bucket()


@pytest.fixture(scope="session")
def ray_cluster(s3_server) -> Iterator[str]:
    # After s3_server: the raylets (and so every Ray worker) inherit the AWS variables, as the nodes of a
    # real cluster read their own credentials.
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, include_dashboard=False, logging_level="WARNING")
    cluster.wait_for_nodes()
    session_dir = cluster.head_node.get_session_dir_path()  # every node of a Cluster shares it
    try:
        yield cluster.address
    finally:
        ray.shutdown()
        cluster.shutdown()
        # The session's logs and sockets: a test session must not leave a /tmp/ray directory behind each time.
        shutil.rmtree(session_dir, ignore_errors=True)


@pytest.fixture
def tars(tmp_path) -> TarFactory:
    """Build WebDataset tars in a temp dir: ``tars.make(name, samples=[...])``; see tests/tar_factory.py."""
    return TarFactory(str(tmp_path / "tars"))


@pytest.fixture(scope="module", params=["raw", "jpeg"])
def encoding(request) -> str:
    """The pixel encoding of a test dataset: the reader's behavioural tests run on both (a module fixture, so
    module-scoped datasets are written once per encoding)."""
    return request.param
