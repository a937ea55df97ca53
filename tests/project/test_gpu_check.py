"""``make gpu-check``'s CPU side: the dry run plans and runs what a CPU can (datasets, the CUDA tests collected,
the CPU reader, the S3 part), the environment script parses, and the table reads a GPU run's results."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.gpu_check import PLAN
from bench.gpu_report import rows
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT


@pytest.mark.slow
def test_the_dry_run_plans_the_gpu_run_and_runs_the_cpu_parts(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry-run", "--out", str(out),
                           "--work", str(tmp_path / "work")], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads((out / "gpu_check.json").read_text())
    assert results["dry_run"] and [part["part"] for part in results["plan"]] == [name for name, _, _ in PLAN]
    assert sum(part["seconds"] for part in results["plan"]) <= 8 * 60, "one call of at most 8 minutes"
    assert results["datasets"]["samples"] > 0
    tests = results["cuda_tests"]
    assert tests["exit"] == 0 and tests["counts"].get("tests collected", 0) > 0, tests["tail"]
    assert results["decode"]["samples_per_s"] > 0  # the CPU reader over the JPEG dataset
    gather = results["gather"]  # the host side of the raw rows, per number of gather threads
    assert "1" in gather["rows"] and all(row["host_GBps"] > 0 for row in gather["rows"].values())
    steps = results["train_step"]  # the wait-share loop with a stand-in model: each sync and interval row
    for row in ("raw", "jpeg", "raw, host sync every 10 steps", "jpeg, switch interval 0.5 ms"):
        assert 0 <= steps[row]["wait_share"] <= 1 and steps[row]["samples_per_s"] > 0, row
    assert "train_step_resnet18" in [part["part"] for part in results["plan"]]
    for name in ("raw", "jpeg"):
        row = results["object_store"][name]
        assert row["samples"] == results["datasets"]["samples"] and row["ratio"] > 0
    assert "| CUDA tests | exit 0" in (out / "gpu_check.md").read_text()
    assert "| host side alone, 1 gather thread(s)" in (out / "gpu_check.md").read_text()
    assert "would take" in done.stdout


def test_the_environment_script_parses():
    subprocess.run(["bash", "-n", os.path.join(ROOT, "bench", "gpu_env.sh")], check=True)


def test_the_table_reads_a_gpu_runs_results():
    with open(os.path.join(ROOT, "bench", "gpu_check.json")) as f:
        results = json.load(f)
    table = {name: value for name, value, _ in rows(results)}
    assert "H100" in table["machine"] and table["decode library chosen"].startswith("torchcodec")
    on = [value for name, value in table.items() if "DeviceLoader + DeviceDecoder" in name]
    assert on and all(value.startswith("0 of ") for value in on)
    raw = [value for name, value in table.items() if name.endswith("torchvision 0.26.0+cu130 (raw)")]
    assert raw and all(not value.startswith("0 of ") for value in raw), "the harness bites raw torchvision"
