"""The training examples run end to end on CPU, on labelled, caption-only and mixed data.

``examples/train.py --shards`` on caption-only data used to die with ``KeyError: 'cls'`` (then SIGABRT from
the prefetch thread): a dataset of img2dataset tars without class files has no ``cls`` at all, and one
mixing both kinds has it in some batches only. Each example runs as its own process here, as a user
runs it, so a crash at exit shows as a non-zero return code.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.training_helpers import make_mixed_dataset
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT

KINDS = {"labelled": (True, True, True), "caption-only": (False, False, False),
         "mixed": (True, False, True)}


def run_example(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args], env=env,
                          capture_output=True, text=True, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_train_py_trains_on_labelled_caption_only_and_mixed_data(tmp_path, kind):
    make_mixed_dataset(str(tmp_path / "ds"), labelled=KINDS[kind], side=32)
    done = run_example("train.py", "--shards", str(tmp_path / "ds"), "--steps", "6", "--batch-size", "16",
                       "--device", "cpu")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    objective = next(line for line in done.stdout.splitlines() if "objective:" in line)
    labelled, unlabelled = (int(objective.split(": ")[2].split()[0]),
                            int(objective.split(", ")[1].split()[0]))
    assert labelled + unlabelled == 6 * 16
    if kind == "labelled":
        assert unlabelled == 0
    elif kind == "caption-only":
        assert labelled == 0
    else:
        assert labelled > 0 and unlabelled > 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_train_lightning_py_trains_on_labelled_caption_only_and_mixed_data(tmp_path, kind):
    pytest.importorskip("lightning")
    make_mixed_dataset(str(tmp_path / "ds"), labelled=KINDS[kind], side=32)
    done = run_example("train_lightning.py", "--shards", str(tmp_path / "ds"), "--max-steps", "4",
                       "--batch-size", "16", "--accelerator", "cpu")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    # The progress bar names the epoch, never "Epoch 0/-2" (max_epochs -1 when --max-steps bounds the run).
    bars = done.stdout + done.stderr
    assert "Epoch 0" in bars and not re.search(r"Epoch \d+/-", bars), bars[-2000:]
    summary = next(line for line in done.stdout.splitlines() if "objective:" in line)
    assert summary.startswith("trained 4 steps")
    labelled = int(summary.split("objective: ")[1].split()[0])
    unlabelled = int(summary.split(", ")[1].split()[0])
    assert labelled + unlabelled == 4 * 16
    assert (labelled > 0) == (kind != "caption-only") and (unlabelled > 0) == (kind != "labelled")


def test_train_py_checkpoint_counts_only_the_batches_the_loop_took(tmp_path):
    """``train.py`` times its ShardLoader inside DeviceLoader, whose thread prefetches: the loader's state
    must count the batches the loop took (resume at exactly the next one), not those prefetched."""
    import importlib.util

    from shardio import DeviceLoader, ShardDataset

    spec = importlib.util.spec_from_file_location("train_example", os.path.join(ROOT, "examples", "train.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    make_mixed_dataset(str(tmp_path / "ds"))

    def loader() -> DeviceLoader:
        dataset = ShardDataset(str(tmp_path / "ds"), 8, shuffle=True)
        return DeviceLoader(example.TimedShardLoader(dataset, example.Stopwatch()), "cpu", prefetch=3)

    reference = example.batches_forever(loader())
    # 25 batches run into the second epoch; the images are normalised floats, so the keys tell
    everything = [next(reference)["__key__"] for _ in range(25)]
    interrupted = loader()
    batches = example.batches_forever(interrupted)
    for _ in range(18):
        next(batches)
    resumed = loader()
    resumed.load_state_dict(interrupted.state_dict())
    again = example.batches_forever(resumed)
    assert [next(again)["__key__"] for _ in range(7)] == everything[18:]


@pytest.mark.slow
def test_train_buckets_py_trains_on_a_bucketed_dataset_and_resumes(tmp_path):
    """``examples/train_buckets.py``: each batch one bucket's shape through ``TrainAugment()`` and a net with
    global pooling; ``--size`` fixes the shape; a checkpoint resumes at the next batch."""
    from bucket_fixtures import BUCKETS, make_bucketed_dataset

    directory = make_bucketed_dataset(str(tmp_path / "ds"), samples=(40, 54, 26))
    checkpoint = str(tmp_path / "ckpt.pt")
    done = run_example("train_buckets.py", "--shards", directory, "--steps", "8", "--batch-size", "4",
                       "--device", "cpu", "--checkpoint", checkpoint)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "3 buckets (20x12: 40, 16x16: 54, 12x20: 26)" in done.stdout
    shapes = next(line for line in done.stdout.splitlines() if line.startswith("batch shapes:"))
    counts = {tuple(map(int, part.split(":")[0].split("x"))): int(part.split(": ")[1])
              for part in shapes.removeprefix("batch shapes: ").split(", ")}
    assert set(counts) <= set(BUCKETS) and len(counts) >= 2 and sum(counts.values()) == 8
    assert "trained 8 steps, 32 samples; objective: 32 with labels" in done.stdout
    resumed = run_example("train_buckets.py", "--shards", directory, "--steps", "2", "--batch-size", "4",
                          "--device", "cpu", "--checkpoint", checkpoint, "--resume", "--size", "8")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "resumed at epoch 0, batch 8" in resumed.stdout
    assert "batch shapes: 8x8: 2" in resumed.stdout


@pytest.mark.slow
def test_cache_latents_py_caches_latents_per_bucket_and_trains_from_them(tmp_path):
    """examples/cache_latents.py with its tiny random-weight diffusers VAE and CLIP text encoder: the job stores
    a latent per bucket and a text embedding per sample, the reader yields them, and its loop trains on them."""
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    import torch

    from preprocess.sample_data import make_sample_dataset
    from shardio import ShardDataset

    make_sample_dataset(str(tmp_path / "tars"), tars=2, samples_per_tar=16)
    env = {"CACHE_LATENTS_VAE": "tiny", "CACHE_LATENTS_TEXT_ENCODER": "tiny"}
    out = str(tmp_path / "latents")
    done = run_example_env(env, "cache_latents.py", "cache", str(tmp_path / "tars" / "*.tar"), "--output", out,
                           "--size", "256", "--device", "cpu")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    ds = ShardDataset(out, batch_size=4, shuffle=True)
    assert [o.name for o in ds.outputs] == ["latent", "text_embedding"]
    assert ds.outputs[0].identity["weights"].startswith("xxh3_128:")
    buckets = set()
    for batch in ds:
        h, w = batch["image"].shape[1:3]
        assert batch["latent"].dtype == torch.bfloat16 and batch["latent"].shape[1:] == (4, h // 8, w // 8)
        assert batch["text_embedding"].shape[1:] == (77, 32) and batch["text_embedding"].dtype == torch.bfloat16
        assert torch.isfinite(batch["latent"].float()).all()
        buckets.add(batch["bucket"])
    assert len(buckets) > 1, "the sample images should fall into several buckets"
    done = run_example_env(env, "cache_latents.py", "train", out, "--steps", "4")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert re.search(r"4 steps, loss [0-9.]+ -> [0-9.]+", done.stdout), done.stdout


def run_example_env(extra: dict[str, str], script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, **extra}
    return subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args], env=env,
                          capture_output=True, text=True, timeout=400)
