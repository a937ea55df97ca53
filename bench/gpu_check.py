"""``make gpu-check``: the GPU path measured in one call on a GPU machine (~6 minutes on one H100 with 16
cores), writing ``gpu_check.json`` and ``gpu_check.md`` (a table) into ``--out``.

Parts, each timed and recorded on its own (a part that fails is recorded with its error; the rest run):
  env            the card, driver, torch / CUDA, the decode library chosen (torchcodec or torchvision)
  datasets       the same photo-like 256x256 images as a raw, a JPEG and a yuv420 dataset, and a small JPEG
                 dataset at 512x512 (``bench.gpu_data``)
  cuda_tests     ``pytest -m cuda`` over the tests that need a GPU (all must pass)
  stream_safety  the corruption harness of pytorch/vision#9606 against shardio's decode path under
                 ``DeviceLoader`` (0 of 200 corrupted), and the libraries without the barrier
                 (``bench.gpu_safety``)
  decode         batched 256x256 JPEG decode samples/s per library and through ``DeviceLoader``, against the
                 CPU reader on every core (goal: >= 20k/s on one H100 with one CPU core busy); the decoder's
                 ceiling: the library alone over host bytes with 1, 2, 4 and 8 host threads at 256² and 512²,
                 the backends each library lets a caller choose, and ``DeviceLoader`` against the ceiling
                 (goal: >= 0.8; ``bench.gpu_decode``)
  h2d            ``DeviceLoader``'s raw batches to the device against pinned bandwidth (goal: >= 0.8)
  gather         the raw dataset's batches with 1, 2 and all cores copying each (``gather_threads``): the
                 host side alone, and ``DeviceLoader`` to the device against a pinned copy (goal: >= 0.5)
  yuv420         ``DeviceLoader`` epochs of the yuv420 and the raw dataset: samples/s yuv420 / raw (goal:
                 >= 1.8), and the PSNR of yuv420 against raw on those photos (median; ``bench.gpu_yuv``)
  train_step     ``DeviceLoader`` + ``TrainAugment`` feeding a ResNet-50 bf16 step: the share of step time
                 waiting for data, raw, JPEG and yuv420 (goal: < 1%)
  train_step_resnet18  the same with ResNet-18
  lightning_wait a Lightning ``Trainer`` (default logging) fed by ``ShardDataModule`` training ResNet-50 bf16:
                 the share of step time waiting for data, raw, JPEG and yuv420 (goal: < 0.5%;
                 ``bench.gpu_lightning``)
  models         ``preprocess run`` with a bf16 encoder on the GPU against the encoder alone on the same decoded
                 batches (goal: >= 0.8; ``bench.gpu_models``)
  object_store   the reader's cold epoch from a SeaweedFS S3 server on loopback against raw GET, raw and
                 JPEG shards (goal: >= 0.7), where ``weed`` and obstore are installed (``bench.gpu_store``)

``--dry-run`` runs here, on the CPU: it builds tiny datasets, collects the CUDA tests, runs the CPU reader and
the parts that run on a CPU at tiny sizes, and prints what the GPU run would do with its estimated seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CUDA_TEST_FILES = ["tests/train/test_cuda_path.py", "tests/train/test_device_decode.py",
                   "tests/train/test_dataset_device.py", "tests/read/test_content_box_reader.py"]

# (part, seconds on one H100 with 16 cores, what it does at full size); the dry run prints these.
PLAN = [
    ("env", 5, "card, driver, torch/CUDA, chosen decode library"),
    ("datasets", 30, "8,192 photo-like 256x256 images (2,048 distinct) as raw (1.6 GB), JPEG q90 4:4:4 and yuv420 "
                     "(0.8 GB); 2,048 at 512x512 (256 distinct) as JPEG"),
    ("cuda_tests", 60, "pytest -m cuda over " + ", ".join(CUDA_TEST_FILES)),
    ("stream_safety", 40, "200 trials x (DeviceLoader; DeviceDecoder barrier on/off and raw, per library)"),
    ("decode", 45, "40 batches of 256 per library (DeviceDecoder and raw), DeviceLoader epoch, CPU reader epoch; "
                   "the ceiling per library: 32 batches at 256² and 16 at 512² on 1, 2, 4 and 8 host threads"),
    ("h2d", 15, "20 pinned copies of a 50 MB batch; a DeviceLoader epoch of uint8 raw batches"),
    ("gather", 20, "per 1, 2 and all gather threads: 2 epochs of pinned raw batches, 2 of DeviceLoader's uint8"),
    ("yuv420", 15, "DeviceLoader epochs of the yuv420 and raw datasets, normalised and uint8, 3 rounds; the "
                   "PSNR of the 2,048 distinct images on the CPU"),
    ("train_step", 70, "ResNet-50 bf16, batch 256 at 224: synthetic, raw, JPEG and yuv420, 5 warm-up + 30 steps "
                       "each"),
    ("train_step_resnet18", 40, "ResNet-18 bf16, batch 256 at 224: the same rows as train_step (less compute to "
                                "hide the data wait behind)"),
    ("lightning_wait", 35, "Trainer (default logging, bf16-mixed) + ShardDataModule + TrainAugment, ResNet-50, "
                           "batch 256 at 224: raw, JPEG and yuv420, 5 warm-up + 40 steps each"),
    ("models", 45, "preprocess run with a bf16 encoder (160 GFLOP an image) on the GPU over 3,200 LAION-like "
                   "images at 256² against the encoder alone on the same decoded batches"),
    ("object_store", 60, "SeaweedFS on loopback: raw GET, cold epoch of the raw and JPEG datasets"),
]


def _log(message: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {message}", flush=True)


def environment() -> dict[str, Any]:
    from shardio.train import device_decode

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cuda": torch.version.cuda, "cpu_count": os.cpu_count(),
                            "cuda_available": torch.cuda.is_available(),
                            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if torch.cuda.is_available():
        info["card"] = torch.cuda.get_device_name(0)
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as error:
            info["driver"] = f"unknown ({error})"
    for name in device_decode.LIBRARIES:
        backend, why = device_decode.library(name)
        info[name] = backend.version if backend else why
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        try:
            info["chosen_decoder"] = device_decode.choose_backend().name
        except Exception as error:  # noqa: BLE001 - recorded
            info["chosen_decoder"] = f"none: {error}"
    try:
        from shardio.read import _jpeg_batch  # noqa: F401
        info["cpu_jpeg_extension"] = True
    except ImportError as error:
        info["cpu_jpeg_extension"] = f"not built: {error}"
    return info


def cuda_tests(collect_only: bool) -> dict[str, Any]:
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", *CUDA_TEST_FILES]
    if collect_only:
        command.append("--collect-only")
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    tail = (done.stdout + done.stderr)[-4000:]
    counts = {word: int(number) for number, word in
              re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|selected|tests? collected)", tail)}
    return {"exit": done.returncode, "counts": counts, "tail": tail[-1500:]}


def _part(results: dict[str, Any], name: str, run: Callable[[], Any], out: str) -> None:
    _log(f"{name} ...")
    started = time.perf_counter()
    try:
        results[name] = run()
    except Exception as error:  # noqa: BLE001 - one part's failure is recorded; the others still run
        traceback.print_exc()
        results[name] = {"error": f"{type(error).__name__}: {error}"}
    results.setdefault("seconds", {})[name] = round(time.perf_counter() - started, 1)
    _log(f"{name}: {results['seconds'][name]} s")
    _save(results, out)  # after each part: a call cut short still brings back what it measured


def _recorded(run: Callable[[], Any]) -> Any:
    """``run()``, or its error recorded in its place: a figure added to a part does not lose the part's others."""
    try:
        return run()
    except Exception as error:  # noqa: BLE001 - recorded
        traceback.print_exc()
        return {"error": f"{type(error).__name__}: {error}"}


def _save(results: dict[str, Any], out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(os.path.join(out, "gpu_check.md"), "w") as f:
        f.write(table(results))


def table(results: dict[str, Any]) -> str:
    """The figures as a markdown table (``gpu_check.md``)."""
    from bench.gpu_report import rows

    lines = ["| figure | value | goal |", "|---|---|---|"]
    lines += [f"| {name} | {value} | {goal} |" for name, value, goal in rows(results)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="on this machine's CPU: tiny sizes, the plan")
    parser.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "out", "gpu-check"))
    parser.add_argument("--work", default=None, help="where the datasets go (default: bench/out/gpu-check-data)")
    parser.add_argument("--skip", action="append", default=[], help="a part to leave out (repeatable)")
    parser.add_argument("--trials", type=int, default=200)
    args = parser.parse_args(argv)
    from bench import gpu_data, gpu_decode, gpu_figures, gpu_models, gpu_safety, gpu_store, gpu_yuv

    dry = args.dry_run
    device = torch.device("cuda" if torch.cuda.is_available() and not dry else "cpu")
    work = args.work or os.path.join(HERE, "out", "gpu-check-data")
    results: dict[str, Any] = {"dry_run": dry, "device": str(device)}
    if dry:
        total = sum(seconds for _, seconds, _ in PLAN)
        _log(f"dry run on the CPU; the GPU run would take ~{total} s:")
        for name, seconds, what in PLAN:
            _log(f"  {name:14s} ~{seconds:3d} s  {what}")
        results["plan"] = [{"part": name, "seconds": seconds, "what": what} for name, seconds, what in PLAN]
    elif device.type != "cuda":
        raise SystemExit("gpu-check: no CUDA device here (torch.cuda.is_available() is False); "
                         "run it on a GPU machine, or try --dry-run")
    samples, distinct, batch = (96, 24, 16) if dry else (8192, 2048, 256)
    side = 64 if dry else 256
    # The decoder's ceiling at a second size: twice the side, a quarter of the samples (a quarter as many
    # decode in the same time).
    large_samples, large_distinct = (48, 12) if dry else (2048, 256)
    datasets: dict[str, Any] = {}
    jpeg_sizes: dict[str, str] = {}
    _part(results, "env", environment, args.out)

    def build() -> dict[str, Any]:
        made = gpu_data.build(work, samples, distinct, side=side, samples_per_shard=32 if dry else 1024)
        datasets.update(raw=made.raw, jpeg=made.jpeg, yuv420=made.yuv420)
        large = os.path.join(work, f"jpeg{2 * side}")
        large_bytes = gpu_data.build_jpeg(large, large_samples, large_distinct, 2 * side,
                                          samples_per_shard=32 if dry else 1024)
        jpeg_sizes.update({f"{side}²": made.jpeg, f"{2 * side}²": large})
        return {"samples": made.samples, "side": made.side, "jpeg_bytes_mean": round(made.jpeg_bytes_mean),
                "encodings": sorted(datasets),
                "jpeg_large": {"samples": large_samples, "side": 2 * side, "jpeg_bytes_mean": round(large_bytes)}}

    _part(results, "datasets", build, args.out)
    parts: list[tuple[str, Callable[[], Any]]] = [("cuda_tests", lambda: cuda_tests(collect_only=dry))]
    lightning_work = os.path.join(work, "lightning")
    if dry:
        parts.append(("decode", lambda: {
            "cpu_reader_all_cores": gpu_figures.cpu_reader_rate(datasets["jpeg"], batch),
            "ceiling": _recorded(lambda: gpu_decode.ceiling(jpeg_sizes, device, batch=batch, batches=16))}))
        parts.append(("gather", lambda: gpu_figures.gather_rows(datasets["raw"], device, batch=batch)))
        parts.append(("yuv420", lambda: gpu_yuv.run(datasets["raw"], datasets["yuv420"], device, distinct,
                                                     batch=batch)))
        # The wait-share loops (every row: sync every step and every 10, switch interval; Lightning's Trainer)
        # at tiny size with a stand-in model: the ResNets are torchvision's, which only the GPU machine's
        # image has.
        parts.append(("train_step", lambda: {**gpu_figures.train_step_wait(
            datasets, device, _tiny_model, batch=4, size=32, warmup=1, steps=10), "model": TINY}))
        parts.append(("lightning_wait", lambda: _lightning_wait(
            datasets, device, _tiny_model, lightning_work, batch=4, size=32, warmup=2, steps=30, model=TINY)))
        parts.append(("models", lambda: gpu_models.run(os.path.join(work, "models"), device, dry=True)))
    else:
        parts += [
            ("stream_safety", lambda: gpu_safety.run(datasets["jpeg"], device, trials=args.trials, batch=64)),
            ("decode", lambda: {**gpu_figures.decode_rates(datasets["jpeg"], device, batch=batch),
                                "ceiling": _recorded(lambda: gpu_decode.ceiling(jpeg_sizes, device, batch=batch))}),
            ("h2d", lambda: gpu_figures.h2d(datasets["raw"], device, batch=batch)),
            ("gather", lambda: gpu_figures.gather_rows(datasets["raw"], device, batch=batch)),
            ("yuv420", lambda: gpu_yuv.run(datasets["raw"], datasets["yuv420"], device, distinct, batch=batch)),
            ("train_step", lambda: gpu_figures.train_step_wait(datasets, device, _resnet50, batch=batch)),
            ("train_step_resnet18",
             lambda: gpu_figures.train_step_wait(datasets, device, _resnet18, batch=batch)),
            ("lightning_wait", lambda: _lightning_wait(datasets, device, _resnet50, lightning_work, batch=batch)),
            ("models", lambda: gpu_models.run(os.path.join(work, "models"), device)),
        ]
    parts.append(("object_store", lambda: gpu_store.run(datasets, os.path.join(work, "s3"), batch, dry=dry)))
    for name, run in parts:
        if name not in args.skip and datasets:
            _part(results, name, run, args.out)
    print(table(results), flush=True)
    _log(f"wrote {args.out}/gpu_check.json and gpu_check.md")
    return results


def _lightning_wait(*args: Any, **kwargs: Any) -> dict[str, Any]:
    from bench import gpu_lightning  # Lightning, imported for its part alone: an image without it loses one part

    return gpu_lightning.run(*args, **kwargs)


def _resnet50() -> torch.nn.Module:
    import torchvision  # the model only; the GPU machine's training image has it

    return torchvision.models.resnet50()


TINY = "tiny stand-in model (the dry run)"


def _tiny_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=2), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten(), torch.nn.Linear(8, 1000))


def _resnet18() -> torch.nn.Module:
    import torchvision

    return torchvision.models.resnet18()


if __name__ == "__main__":
    main()
