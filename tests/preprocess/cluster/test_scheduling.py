"""Scheduling: the largest inputs are submitted first, so a run does not end on one big tar alone.

Order of submission, not timing: with one task in flight at a time, the tasks start in exactly the
order they are submitted, so the "started" events give that order.
"""

from __future__ import annotations

import os

import pytest

from preprocess.config import JobConfig
from preprocess.cluster.ray_tasks import TaskEvent, largest_first, stream_inputs
from preprocess.worker import InputResult

pytestmark = pytest.mark.ray


def test_largest_first_orders_by_size_then_path():
    items = [("b.tar", (10, 1)), ("a.tar", (10, 2)), ("c.tar", (30, 3)), ("d.tar", (5, 4))]
    assert [path for path, _ in largest_first(items)] == ["c.tar", "a.tar", "b.tar", "d.tar"]


def test_the_job_submits_the_largest_input_first(ray_cluster, tars, tmp_path):
    # Names in the opposite order of sizes: sorting by name would start the smallest first.
    sizes = {"a.tar": 1, "b.tar": 5, "c.tar": 3, "d.tar": 8}
    items = []
    for position, (name, samples) in enumerate(sizes.items()):
        path = tars.make(name, range(position * 10, position * 10 + samples), with_meta=False)
        stat = os.stat(path)
        items.append((path, (stat.st_size, stat.st_mtime_ns)))
    out = str(tmp_path / "out")
    os.makedirs(os.path.join(out, "shards"))
    started, finished = [], []
    for message in stream_inputs(items, out, JobConfig(height=16, width=16), max_in_flight=1):
        if isinstance(message, TaskEvent) and message.kind == "started":
            started.append(os.path.basename(message.input))
        elif isinstance(message, InputResult):
            assert message.error is None, message.error
            finished.append(os.path.basename(message.input))
    assert started == ["d.tar", "b.tar", "c.tar", "a.tar"]
    assert finished == started
