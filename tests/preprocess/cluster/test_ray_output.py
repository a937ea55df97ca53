"""What Ray prints goes to the run's event hook: raw fd-2 writes (C++ core, child processes) and the
``ray`` logger, so that ``-q`` is quiet and JSON mode stays JSON (tests/preprocess/cluster/test_local_ray.py runs it
for real)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

from preprocess.cluster.ray_output import RayOutput


def _wait_for(lines: list[str], count: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(lines) < count and time.monotonic() < deadline:
        time.sleep(0.01)


def test_fd2_writes_of_this_process_and_its_children_and_ray_logging_reach_the_hook(capfd):
    lines: list[str] = []
    output = RayOutput(lines.append)
    with output.fd2():
        os.write(2, b"[core_worker.cc:123] a raw C++ line\n")
        # A process started meanwhile (as ray.init starts GCS and raylet) writes later, after the restore.
        child = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(0.3); "
                                  "sys.stderr.write('child line\\n')"])
        assert lines == [], "delivered while fd 2 was redirected: its own writes would loop back"
    output.take_python_logging()
    logging.getLogger("ray").warning("Token authentication is enabled for this Ray cluster.")
    child.wait()
    _wait_for(lines, 3)
    output.release()
    logging.getLogger("ray").warning("after release: Ray's own handlers again")

    # The three arrive by different paths (pipe reader thread, logging): their order is not guaranteed.
    assert sorted(lines) == sorted(["[core_worker.cc:123] a raw C++ line", "child line",
                                    "WARNING ray -- Token authentication is enabled for this Ray cluster."])
    assert "raw C++ line" not in capfd.readouterr().err
