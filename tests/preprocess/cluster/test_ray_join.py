"""Joining a Ray cluster (``--ray-address``): every way of failing to connect exits 2 before the output is
touched, naming the cause and the fix, in about a second (``preprocess.cluster.ray_cluster.check_cluster_address``).

The cluster here is a real ``ray start --head`` with token authentication (Ray's default for a head it
starts), on loopback, with no CPUs (nothing is run on it), its own temp dir and its token in the
environment; it is stopped by its process ids, never by ``ray stop`` (which stops every Ray on the machine).
A client that does not set ``RAY_AUTH_MODE=token`` once retried ~20 s, printed a 217-line traceback,
exited 1 and left a run mark and reports in the output.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import psutil
import pytest

from preprocess.cluster.ray_cluster import GCS_PROBE_TIMEOUT_S, _connect_failure
from tests.tar_factory import TarFactory

pytestmark = [pytest.mark.ray, pytest.mark.slow]

RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _stop(marker: str) -> None:
    """Kill the processes of the head started with ``marker`` in its command line, and their children."""
    started = [p for p in psutil.process_iter(["cmdline"]) if any(marker in a for a in p.info["cmdline"] or ())]
    every = set(started)
    for process in started:
        try:
            every |= set(process.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    for process in every:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(list(every), timeout=30)


@pytest.fixture(scope="module")
def token_cluster() -> Iterator[tuple[str, str, str]]:
    """(address, token, a HOME with no ~/.ray) of a head with token authentication."""
    root = tempfile.mkdtemp(prefix="rtok", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    home, temp_dir = os.path.join(root, "home"), os.path.join(root, "ray")
    os.makedirs(home)
    token, port = secrets.token_hex(32), _free_port()
    env = {**os.environ, "HOME": home, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    env.pop("RAY_ADDRESS", None)
    started = subprocess.run(
        [RAY, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "0",
         "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", temp_dir],
        env=env, capture_output=True, text=True, timeout=180)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        yield f"127.0.0.1:{port}", token, home
    finally:
        _stop(temp_dir)
        shutil.rmtree(root, ignore_errors=True)


def _client_env(home: str, **settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    return {**env, "HOME": home, **settings}


@pytest.mark.parametrize("client, why", [
    ({}, "RAY_AUTH_MODE is not set here, so this client sent no token"),
    ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64},
     "the token this client sent is missing or not the cluster's"),
])
def test_a_client_the_token_cluster_refuses_exits_2_and_touches_nothing(token_cluster, tmp_path, client, why):
    address, _, home = token_cluster
    tar = TarFactory(str(tmp_path / "tars")).make("a.tar", range(2))
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "preprocess.cli", "run", tar, "--output", str(out), "--size", "16",
                          "--ray-address", address, "-q"],
                         env=_client_env(home, **client), capture_output=True, text=True, timeout=120)
    said = " ".join(run.stderr.split())
    assert run.returncode == 2, run.stderr
    assert f"Ray cluster at {address} uses token authentication and refused this client: {why}" in said, said
    assert "Set RAY_AUTH_MODE=token and give the cluster's token: RAY_AUTH_TOKEN=" in said, said
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert not out.exists(), "the output was touched by a run that could not join its cluster"


def test_the_right_token_joins(token_cluster):
    address, token, home = token_cluster
    code = f"from preprocess.cluster.ray_cluster import check_cluster_address\ncheck_cluster_address({address!r})\n"
    run = subprocess.run([sys.executable, "-c", code],
                         env=_client_env(home, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_a_port_that_is_no_ray_gcs_is_refused_after_the_probe_timeout(tmp_path):
    """Something else listens there (a web server): Ray's client would wait 40 s, then say only that it
    timed out."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        code = ("from preprocess.cluster.ray_cluster import check_cluster_address\n"
                f"check_cluster_address({address!r})\n")
        run = subprocess.run([sys.executable, "-c", code], env=_client_env(str(tmp_path)), capture_output=True,
                             text=True, timeout=120)
    assert run.returncode != 0
    assert f"accepts connections but no Ray GCS answered in {GCS_PROBE_TIMEOUT_S:g} s" in run.stderr, run.stderr


def test_a_failure_past_the_check_is_said_by_its_cause():
    """What ``ray_session`` raises if ``ray.init`` fails after the check passed (a cluster gone since, another
    Ray version): the cause in Ray's words, and what to check."""
    import ray

    auth = _connect_failure("h:6379", ray.exceptions.AuthenticationError("RPC error: InvalidAuthToken: x"))
    assert "uses token authentication" in auth and "RAY_AUTH_MODE=token" in auth
    other = _connect_failure("h:6379", RuntimeError("Version mismatch: The cluster was started with Ray 2.9"))
    assert other.startswith("cannot join the Ray cluster at h:6379 (RuntimeError: Version mismatch") and \
        "Ray and Python versions" in other
