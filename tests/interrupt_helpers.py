"""Runs of ``preprocess run`` as subprocesses that a test interrupts (signals, SIGKILL), and inputs slow
enough to interrupt: helpers for tests/preprocess/cluster/test_signals.py and
tests/preprocess/cluster/test_local_ray.py."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from tests.tar_factory import TarFactory

SAMPLES_PER_TAR = 40
# Full decodes (no JPEG draft) of 1200x900 images: ~10 ms each, ~0.4 s per tar on one core, so a run of
# 30 tars lasts seconds after its first input finishes, far longer than the driver takes to react (0.5 s).
CONFIG_YAML = "height: 64\nwidth: 64\ndraft: false\nsamples_per_shard: 16\n"


def slow_inputs(tars: TarFactory, count: int) -> list[str]:
    """``count`` tars with the same 40 self-identifying samples (one tar encoded, then copied)."""
    first = tars.make("in-000.tar", range(SAMPLES_PER_TAR), size=(1200, 900), with_meta=False)
    paths = [first]
    for i in range(1, count):
        paths.append(tars.path(f"in-{i:03d}.tar"))
        shutil.copyfile(first, paths[-1])
    return paths


def config_file(directory: str) -> str:
    path = os.path.join(directory, "slow.yaml")
    with open(path, "w") as f:
        f.write(CONFIG_YAML)
    return path


def start(args: list[str], stderr_path: str, local_ray: bool = False) -> subprocess.Popen:
    env = dict(os.environ)
    if local_ray:
        env.pop("RAY_ADDRESS", None)  # a run that starts its own Ray
    with open(stderr_path, "wb") as stderr:
        return subprocess.Popen([sys.executable, "-m", "preprocess.cli", "run", *args],
                                stdout=subprocess.DEVNULL, stderr=stderr, env=env)


def wait_until(condition, run: subprocess.Popen, timeout_s: float = 120.0, what: str = "") -> None:
    """Poll ``condition()`` every 10 ms while ``run`` is alive (never a fixed sleep)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert run.poll() is None, f"the run ended (rc {run.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def log_events(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f.read().splitlines() if line.endswith("}")]


def has_event(path: str, event: str) -> bool:
    return any(r["event"] == event for r in log_events(path))


def session_dirs_of(pid: int) -> list[str]:
    """Ray's session directories created by the process ``pid`` (Ray names them ``session_..._PID``)."""
    return glob.glob(os.path.join(tempfile.gettempdir(), "ray", f"session_*_{pid}"))
