"""``make gpu-check``'s CPU side: the dry run plans and runs what a CPU can (datasets, the CUDA tests collected,
the CPU reader, the decode ceiling's threads with the CPU decoder, yuv420 against raw, the wait-share loops and
a Lightning Trainer with a stand-in model, the S3 part), the environment script parses, and the table reads a
GPU run's results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Literal

import pytest
import torch

from bench.gpu_check import PLAN
from bench.gpu_decode import choice_in_signature, threaded_rate
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
    assert results["datasets"]["encodings"] == ["jpeg", "raw", "yuv420"]
    decode = results["decode"]
    assert decode["cpu_reader_all_cores"]["samples_per_s"] > 0  # the CPU reader over the JPEG dataset
    # The decoder's ceiling by host threads at two sizes (the CPU decoder stands in off CUDA), DeviceLoader
    # against it, and what each library says of a backend choice (here: neither is installed).
    ceiling = decode["ceiling"]
    side = results["datasets"]["side"]
    assert list(ceiling["sizes"]) == [f"{side}²", f"{2 * side}²"]
    for size in ceiling["sizes"].values():
        rows_by_threads = size["cpu (stand-in off CUDA)"]["by_threads"]
        assert list(rows_by_threads) == ["1", "2", "4", "8"]
        assert all(row["samples_per_s"] > 0 and row["samples"] > 0 for row in rows_by_threads.values())
        assert size["device_loader"]["samples_per_s"] > 0 and size["device_loader_over_ceiling"] > 0
    assert set(ceiling["backend_choice"]) == {"torchcodec", "torchvision"}
    assert all("exposed" in choice for choice in ceiling["backend_choice"].values())
    yuv = results["yuv420"]  # DeviceLoader epochs of yuv420 against raw, and the read-back's quality
    for way in ("normalised", "uint8"):
        assert yuv[way]["ratio"] > 0 and len(yuv[way]["rounds"]) == yuv["rounds"]
        assert yuv[way]["raw_samples_per_s"] > 0 and yuv[way]["yuv420_samples_per_s"] > 0
    quality = yuv["quality"]
    assert quality["images"] == 24 and quality["psnr_db"]["median"] >= 30, quality
    assert quality["bytes_per_image"] == quality["raw_bytes_per_image"] / 2  # 1.5 bytes a pixel against 3
    gather = results["gather"]  # the host side of the raw rows, per number of gather threads
    assert "1" in gather["rows"] and all(row["host_GBps"] > 0 for row in gather["rows"].values())
    steps = results["train_step"]  # the wait-share loop with a stand-in model: each sync and interval row
    for row in ("raw", "jpeg", "yuv420", "raw, host sync every 10 steps", "jpeg, switch interval 0.5 ms",
                "yuv420, host sync every 10 steps"):
        assert 0 <= steps[row]["wait_share"] <= 1 and steps[row]["samples_per_s"] > 0, row
    planned = [part["part"] for part in results["plan"]]
    assert {"train_step_resnet18", "yuv420", "lightning_wait", "models"} <= set(planned)
    models = results["models"]  # the job with the stand-in encoder on the CPU, and the encoder alone
    assert models["samples"] == 48 and models["job_samples_per_s"] > 0 and models["model_alone_samples_per_s"] > 0
    assert models["ratio"] == round(models["job_samples_per_s"] / models["model_alone_samples_per_s"], 3)
    lightning = results["lightning_wait"]  # a Trainer over each dataset, the tiny model on the CPU
    for name in ("raw", "jpeg", "yuv420"):
        row = lightning[name]
        assert row["steps"] == lightning["steps"] - 1, row  # the warm-up left out, each step to the next start
        assert 0 <= row["data_wait_share"] <= row["between_steps_share"] <= 1, row
        assert row["step_ms"] > 0 and row["samples_per_s"] > 0, row
    for name in ("raw", "jpeg"):
        row = results["object_store"][name]
        assert row["samples"] == results["datasets"]["samples"] and row["ratio"] > 0
    assert "| CUDA tests | exit 0" in (out / "gpu_check.md").read_text()
    table = (out / "gpu_check.md").read_text()
    assert "| host side alone, 1 gather thread(s)" in table
    for figure in (f"| decode ceiling {side}² JPEG, cpu (stand-in off CUDA), samples/s by host threads | 1: ",
                   f"| DeviceLoader {2 * side}² JPEG / the decoder's ceiling |",
                   "| yuv420 / raw samples/s to the device, DeviceLoader, normalised (cpu) |",
                   "| yuv420 against raw, PSNR on the photos | median ",
                   "| Lightning Trainer, tiny stand-in model (the dry run) from the yuv420 dataset: time waiting"):
        assert figure in table, figure
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


def test_the_ceiling_splits_the_batches_over_threads_each_with_its_own_decoder():
    prepared = [list(range(5)), list(range(7)), list(range(3))]
    made_on = []

    def make():
        made_on.append(threading.get_ident())
        return len

    row = threaded_rate(prepared, make, threads=4, batches=10, device=torch.device("cpu"))
    # threads 0, 1 take 3 batches, 2 and 3 take 2; thread i decodes batches i, i + 4, i + 8 (cycled over 3)
    expected = sum(len(prepared[(index + number * 4) % 3]) for index, count in enumerate((3, 3, 2, 2))
                   for number in range(count))
    assert row["samples"] == expected and row["samples_per_s"] > 0
    assert len(made_on) == 4 and len(set(made_on)) == 4, "one decoder made on each thread"


def test_the_ceiling_says_whether_a_library_exposes_the_decode_backend():
    def plain(input, mode=None, device="cpu"):
        return input

    def chooser(input, mode=None, device="cpu", backend: Literal["hardware", "cuda"] = "hardware"):
        return input

    assert choice_in_signature(plain, "lib") == {
        "exposed": False, "parameters": ["input", "mode", "device"],
        "note": "lib's decode_jpeg takes no backend: nvJPEG picks it (measured once, as it picks)"}
    choice = choice_in_signature(chooser, "lib")
    assert choice["exposed"] and choice["parameter"] == "backend"
    assert choice["default"] == "'hardware'" and choice["values"] == ["'hardware'", "'cuda'"]


def test_the_table_reads_the_ceiling_yuv420_and_lightning_rows():
    by_threads = {str(n): {"samples": 8192, "seconds": 1.0, "samples_per_s": 10000.0 * n, "cpu_cores_busy": n}
                  for n in (1, 2, 4, 8)}
    by_threads["8"] = {"error": "RuntimeError: nvJPEG refused"}
    results = {
        "decode": {"ceiling": {"sizes": {"512²": {
            "torchcodec 0.17.0": {"by_threads": by_threads, "best_threads": 4, "best_samples_per_s": 40000.0},
            "torchvision": "not available: torchvision is not installed",
            "device_loader": {"samples_per_s": 34000.0}, "device_loader_over_ceiling": 0.85}},
            "backend_choice": {"torchcodec": {"exposed": False, "parameters": ["input"]}}}},
        "yuv420": {"device": "cuda", "normalised": {"ratio": 1.9, "raw_samples_per_s": 50000.0,
                                                    "yuv420_samples_per_s": 95000.0},
                   "quality": {"images": 2048, "bytes_per_image": 98304.0, "raw_bytes_per_image": 196608,
                               "psnr_db": {"median": 45.1, "p5": 41.0, "min": 38.2}, "max_abs_error": 40}},
        "lightning_wait": {"jpeg": {"data_wait_share": 0.004, "between_steps_share": 0.01, "step_ms": 65.0,
                                    "samples_per_s": 3900.0}},
    }
    table = {name: (value, goal) for name, value, goal in rows(results)}
    assert table["decode ceiling 512² JPEG, torchcodec 0.17.0, samples/s by host threads"][0] == (
        "1: 10,000, 2: 20,000, 4: 40,000, 8: RuntimeError: nvJPEG refused (best 4 threads)")
    assert table["decode ceiling 512² JPEG, torchvision"][0].startswith("not available")
    assert table["DeviceLoader 512² JPEG / the decoder's ceiling"] == ("34,000 samples/s = 0.85", ">= 0.8")
    assert table["decode backend choice (hardware / CUDA), torchcodec"][0].startswith("not exposed")
    assert table["yuv420 / raw samples/s to the device, DeviceLoader, normalised (cuda)"] == (
        "95,000 / 50,000 = 1.9", ">= 1.8")
    assert table["yuv420 against raw, PSNR on the photos"][0].startswith("median 45.1 dB, p5 41.0, min 38.2")
    value, goal = table["Lightning Trainer, ResNet-50 bf16 from the jpeg dataset: time waiting for data"]
    assert value.startswith("0.40% (step 65.0 ms") and goal == "< 0.5%"
