"""Shared fixtures: one 2-node local Ray cluster, one server per object store (S3, GCS, Azure emulators) per
test session, and generated tars.

Ray starts once (~4 s a node) and every Ray test shares it; the job reuses an initialised Ray instead of
starting its own, and subprocess runs join it with ``--ray-address``. Two nodes (1 CPU each) make every
job test a multi-node test: tasks land on both raylets.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from tests.azure_server import AzureServer
from tests.gcs_server import GCSServer
from tests.layout_fixtures import LAYOUTS, Layout, LayoutDataset
from tests.object_stores import CloudBucket, point_environment_at, restore_environment
from tests.s3_server import S3Server
from tests.tar_factory import TarFactory


def _serve(server) -> Iterator:
    """Start ``server``; its variables go into this process's environment (and so into every subprocess and
    every Ray worker started after it): the product reads credentials and endpoint from each cloud's
    standard environment, as it would on a real cluster. A server that cannot start fails its tests (never
    a skip: ``make test`` installs every emulator)."""
    server.start()
    saved = point_environment_at(server)
    try:
        yield server
    finally:
        server.stop(crash=True)  # its data is a temp dir: no graceful stop at the end of every session
        restore_environment(saved)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Iterator[S3Server]:
    """One SeaweedFS server for the session (tests/s3_server.py), with the AWS variables."""
    yield from _serve(S3Server(str(tmp_path_factory.mktemp("s3-server"))))


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory) -> Iterator[GCSServer]:
    """One fake-gcs-server for the session (tests/gcs_server.py), with a key file naming it."""
    yield from _serve(GCSServer(str(tmp_path_factory.mktemp("gcs-server"))))


@pytest.fixture(scope="session")
def azure_server(tmp_path_factory) -> Iterator[AzureServer]:
    """One Azurite for the session (tests/azure_server.py), with the AZURE_* variables."""
    yield from _serve(AzureServer(str(tmp_path_factory.mktemp("azure-server"))))


@pytest.fixture(params=["s3", "gcs", "azure"])
def cloud_bucket(request) -> CloudBucket:
    """A new, empty bucket (GCS) or container (Azure) on each cloud's emulator in turn."""
    server = request.getfixturevalue(f"{request.param}_server")
    return CloudBucket(server, server.new_bucket())


@pytest.fixture(params=["s3", "azure"])
def writable_cloud_bucket(request) -> CloudBucket:
    """As ``cloud_bucket``, on the emulators that take the product's writes: fake-gcs-server does not serve
    GCS's XML upload, so a commit there is refused (tests/store/test_clouds.py proves it)."""
    server = request.getfixturevalue(f"{request.param}_server")
    return CloudBucket(server, server.new_bucket())


@pytest.fixture
def s3_bucket(s3_server) -> str:
    """A new, empty bucket on the session's server (its name; URLs are ``s3://NAME/...``)."""
    return s3_server.new_bucket()


@pytest.fixture(scope="session")
def ray_cluster(s3_server, gcs_server, azure_server) -> Iterator[str]:
    # After the servers: the raylets (and so every Ray worker) inherit their variables, as the nodes of a
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


@pytest.fixture(scope="module", params=["raw", "jpeg", "yuv420"])
def encoding(request) -> str:
    """The pixel encoding of a test dataset: the reader's behavioural tests run on each (a module fixture, so
    module-scoped datasets are written once per encoding)."""
    return request.param


@pytest.fixture(scope="module", params=LAYOUTS)
def layout(request) -> Layout:
    """The layout of a test dataset, single shape or aspect-ratio buckets (tests/layout_fixtures.py):
    ``layout.make(directory, encoding)`` writes it. A module fixture, like ``encoding``; a test that runs
    only some pairs parametrises ``layout`` itself (``indirect=True``)."""
    return Layout(request.param)


@pytest.fixture(scope="module")
def layout_dataset(tmp_path_factory, layout: Layout, encoding: str) -> LayoutDataset:
    """The reader suites' dataset of each layout and encoding, written once per module (``Layout.make``'s
    defaults: 117 samples of one shape, or 73 in three buckets)."""
    return layout.make(str(tmp_path_factory.mktemp(f"{layout}-{encoding}") / "ds"), encoding)
