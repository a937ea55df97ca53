"""``preprocess run ... --rewrite-output NAME``: a new model for one output of an existing dataset. Every input's
output is the new model's, committed in one generation under new file names (the root records the new identity,
dtype and shapes); a reader of the old generation reads it whole, old outputs included, until retention collects
it; the other outputs keep their model; a rewrite that cannot be whole is refused before anything is touched,
and one that does not finish commits nothing."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from preprocess.cli import app
from shardio import ShardDataset
from shardio.format.manifests import load_manifest
from shardio.format.model_outputs import output_path
from tests.dataset_compare import assert_clean, dataset_state
from tests.preprocess.models.job_models import wide_latent_of
from tests.preprocess.models.toy_models import caption_hash, latent_of
from tests.preprocess.test_job_models import JOB, LATENT, TOY, make_tars, root_of, run, shard_rows, write_config
from typer.testing import CliRunner

pytestmark = pytest.mark.ray

FLAGS = ["--size", "16", "--samples-per-shard", "2"]
TEXT = {"fn": f"{TOY}:make_text", "input": "text"}
WIDE = {"fn": f"{JOB}:make_wide_latent", "device": "cpu"}


def made(tars, tmp_path, counts=(5, 4)) -> tuple[str, str]:
    """A dataset of ``counts`` inputs with the ``latent`` (LatentNet) and ``text`` outputs; (its pattern, path)."""
    pattern = make_tars(tars, list(counts))
    out = str(tmp_path / "out")
    config = write_config(tmp_path / "old.yaml", {"latent": LATENT, "text": TEXT})
    result = run(pattern, "--output", out, "--config", config, *FLAGS)
    assert result.exit_code == 0, result.output
    return pattern, out


def test_a_rewrite_replaces_one_output_everywhere_in_one_generation_and_the_old_one_stays_whole(ray_cluster, tars,
                                                                                                 tmp_path):
    pattern, out = made(tars, tmp_path)
    before = root_of(out)
    old_paths = {shard.path for shard in load_manifest(out).shards}
    mid_epoch = iter(ShardDataset(out, 3))  # a reader mid-epoch on the old generation
    batches = [next(mid_epoch)]
    new = write_config(tmp_path / "new.yaml", {"latent": WIDE, "text": TEXT})
    result = run(pattern, "--output", out, "--config", new, *FLAGS, "--rewrite-output", "latent")
    assert result.exit_code == 0, result.output
    root = root_of(out)
    assert root["generation"] == before["generation"] + 1  # one commit
    latent, text = root["outputs"]
    assert latent["identity"]["function"] == f"{JOB}:make_wide_latent"
    assert latent["dtype"] == "float32" and latent["shapes"] == [[2, 2, 2]]
    assert text == before["outputs"][1]  # the other output keeps its model and record
    assert root["config"]["models"]["latent"]["fn"] == f"{JOB}:make_wide_latent"
    samples = 0
    for shard, pixels, captions in shard_rows(out):
        assert shard.path not in old_paths  # new names: nothing a kept generation lists is written again
        values = np.load(os.path.join(out, output_path(shard.path, "latent")))
        for row, sample in enumerate(pixels):
            np.testing.assert_array_equal(values[row], wide_latent_of(sample))
        np.testing.assert_array_equal(np.load(os.path.join(out, output_path(shard.path, "text"))),
                                      caption_hash(captions).numpy())
        samples += shard.samples
    assert samples == 9
    # The reader mid-epoch when the rewrite committed: its epoch ends on its generation, whole, with the old
    # model's outputs.
    seen = 0
    for batch in batches + list(mid_epoch):
        assert batch["latent"].dtype.is_floating_point and batch["latent"].shape[1:] == (4, 2, 2)
        for image, value in zip(batch["image"].numpy(), batch["latent"].numpy()):
            np.testing.assert_array_equal(value, latent_of(image))
        seen += len(batch["latent"])
    assert seen == 9
    # A rerun with the new model has nothing to do; the old model is now the one refused.
    assert run(pattern, "--output", out, "--config", new, *FLAGS).exit_code == 0
    old = write_config(tmp_path / "old-again.yaml", {"latent": LATENT, "text": TEXT})
    refused = run(pattern, "--output", out, "--config", old, *FLAGS)
    assert refused.exit_code == 2, refused.output
    # Retention at its narrowest collects the old generation's files: what is left is what the root lists.
    gc = CliRunner().invoke(app, ["gc", out, "--retain-hours", "0", "--retain-generations", "1"])
    assert gc.exit_code == 0, gc.output
    assert_clean(out)


@pytest.mark.parametrize("case", ["input-not-listed", "not-in-models", "no-such-output", "with-prune"])
def test_a_rewrite_that_cannot_be_whole_is_refused_before_anything_is_touched(case, ray_cluster, tars, tmp_path):
    pattern, out = made(tars, tmp_path)
    state, listing = dataset_state(out), sorted(os.listdir(out))
    models = {"latent": WIDE, "text": TEXT}
    args = [pattern, "--output", out, *FLAGS, "--rewrite-output", "latent"]
    if case == "input-not-listed":
        args[0] = os.path.join(os.path.dirname(pattern), "00.tar")
        expected = "not among the inputs"
    elif case == "not-in-models":
        models = {"text": TEXT, "latent": LATENT}
        args[-1] = "other"
        expected = "models: has no output 'other'"
    elif case == "no-such-output":
        models = {**models, "extra": {"fn": f"{TOY}:make_text", "input": "text"}}
        args[-1] = "extra"
        expected = "the dataset has no output 'extra'"
    else:
        args.append("--prune")
        expected = "not with --prune"
    config = write_config(tmp_path / "new.yaml", models)
    result = run(*args, "--config", config)
    assert result.exit_code == 2, result.output
    assert expected in " ".join(result.output.split()), result.output
    assert dataset_state(out) == state and sorted(os.listdir(out)) == listing, "a refused rewrite touched the dataset"


def test_a_rewrite_with_an_input_failing_commits_nothing_and_leaves_no_file(ray_cluster, tars, tmp_path):
    pattern, out = made(tars, tmp_path)
    state = dataset_state(out)
    with open(os.path.join(os.path.dirname(pattern), "01.tar"), "wb") as f:
        f.write(b"no longer a tar")  # listed, changed, unreadable: its outputs cannot be rewritten
    new = write_config(tmp_path / "new.yaml", {"latent": WIDE, "text": TEXT})
    report = str(tmp_path / "report.json")
    result = run(pattern, "--output", out, "--config", new, *FLAGS, "--rewrite-output", "latent", "--report", report)
    assert result.exit_code == 1, result.output
    assert any("nothing was committed" in w for w in json.load(open(report))["warnings"])
    assert dataset_state(out) == state  # the dataset as it was: the other input's new files removed again


def test_kill_9_mid_rewrite_then_rerun_gives_the_uninterrupted_rewrite(ray_cluster, tars, tmp_path):
    """SIGKILL at a random moment of a rewrite (mid-task, mid-commit, after it), then the same command again:
    the dataset is the uninterrupted rewrite's byte for byte and name for name (the fence is drawn from the
    committed generation and the model, not at random), nothing left behind; a rewrite already committed is
    not done twice."""
    import shutil

    from tests.preprocess.test_crash_safety import kill_while_writing_then_rerun, start_run, watch

    pattern = make_tars(tars, [30, 21, 9])
    old = write_config(tmp_path / "old.yaml", {"latent": LATENT, "text": TEXT})
    new = write_config(tmp_path / "new.yaml", {"latent": WIDE, "text": TEXT})
    sized = ("--size", "32", "--samples-per-shard", "8")  # what start_run passes
    narrow = ("--retain-hours", "0", "--retain-generations", "1")  # the old files collected when it ends
    base = str(tmp_path / "base")
    assert run(pattern, "--output", base, "--config", old, *sized).exit_code == 0
    rewrite = ("--config", new, "--rewrite-output", "latent", *narrow)
    log = str(tmp_path / "runs.log")

    def start(out: str):
        shutil.copytree(base, out)  # the same dataset (its identity too) as the reference was rewritten from
        return start_run(pattern, out, ray_cluster, log, rewrite)

    reference = str(tmp_path / "reference")
    uninterrupted = start(reference)
    _, whole_s = watch(uninterrupted, reference)  # the kills fall anywhere in a run this long, start-up included
    assert uninterrupted.returncode == 0, open(log).read()
    assert_clean(reference)

    kill_while_writing_then_rerun(start, lambda out: run(pattern, "--output", out, *rewrite, *sized), reference,
                                  tmp_path, seed=47, write_s=whole_s, attempts=3)


def test_a_rewrite_of_a_dataset_without_pixels_gives_what_a_run_with_the_new_model_gives(ray_cluster, tars, tmp_path):
    """``encoding: none`` keeps no pixels to run an image model on: the rewrite reads the inputs again, and each
    shard's new latent is the one a fresh run with the new model writes."""
    pattern = make_tars(tars, [5, 4])
    flags = [*FLAGS, "--encoding", "none"]
    out, fresh = str(tmp_path / "out"), str(tmp_path / "fresh")
    old = write_config(tmp_path / "old.yaml", {"latent": LATENT, "text": TEXT})
    new = write_config(tmp_path / "new.yaml", {"latent": WIDE, "text": TEXT})
    assert run(pattern, "--output", out, "--config", old, *flags).exit_code == 0
    result = run(pattern, "--output", out, "--config", new, *flags, "--rewrite-output", "latent")
    assert result.exit_code == 0, result.output
    assert run(pattern, "--output", fresh, "--config", new, *flags).exit_code == 0
    rewritten, made_fresh = load_manifest(out).shards, load_manifest(fresh).shards
    assert [s.samples for s in rewritten] == [s.samples for s in made_fresh] and sum(s.samples for s in made_fresh) == 9
    for one, two in zip(rewritten, made_fresh):
        for name in ("latent", "text"):
            np.testing.assert_array_equal(np.load(os.path.join(out, output_path(one.path, name))),
                                          np.load(os.path.join(fresh, output_path(two.path, name))))
    assert root_of(out)["outputs"] == root_of(fresh)["outputs"]
