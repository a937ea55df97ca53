"""Shared fixtures: one 2-node local Ray cluster per test session, and generated WebDataset tars.

Ray starts once (~4 s a node) and every Ray test shares it; the job reuses an initialised Ray instead of
starting its own, and subprocess runs join it with ``--ray-address``. Two nodes (1 CPU each) make every
job test a multi-node test: tasks land on both raylets.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from collections.abc import Iterator

import numpy as np
import pytest

from tests.tar_factory import TarFactory


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[str]:
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
