"""Folder classes (``folder_classes: true``) have one id per name in the whole dataset: the class table its
root keeps (``shardio.format.spec``, "Classes"), extended by each run with the new names of its folder
inputs (sorted, appended), copied by every commit, never renumbered; class folders given as inputs (images
with no class folder) are refused, not given ``cls`` -1."""

from __future__ import annotations

import json
import os

import pytest

from preprocess.config import JobConfig
from preprocess.job import RunOptions, run_job
from shardio import ShardDataset, ShardFormatError, open_dataset
from shardio.errors import NoInputsMatched
from shardio.format.manifests import read_root
from shardio.tools.info import dataset_info, format_info
from shardio.write.directory import drop_inputs
from tests.dataset_compare import assert_same_dataset
from tests.dataset_fixtures import make_dataset, set_root_field
from tests.folder_factory import class_drop, write_file
from tests.tar_factory import decode_index, index_image, jpeg_bytes
from tests.read.test_dataset_generations import add_input

CFG = JobConfig(height=16, width=16, samples_per_shard=4, folder_classes=True)


def labels(directory: str) -> dict[int, tuple[int, str]]:
    """Sample index (from its pixels) -> (cls, the class name its json carries), over the whole dataset."""
    dataset = ShardDataset(directory, 1000, shuffle=False, drop_last=False)
    found = {}
    for batch in dataset:
        for image, cls, meta in zip(batch["image"], batch["cls"].tolist(), batch["json"]):
            found[decode_index(image.numpy())] = (cls, (meta or {}).get("class"))
    return found


@pytest.mark.parametrize("value", [["cat", "cat"], ["cat", 3], "cat", ["cat", ""], {"cat": 0}])
def test_a_malformed_class_table_is_refused_at_load_naming_the_root(tmp_path, value) -> None:
    directory = str(tmp_path / "d")
    make_dataset(directory, (5,))
    set_root_field(directory, "classes", value)
    said = r"manifest\.json: \"classes\"(\[\d\])? is .* \(edited or forged\)"
    with pytest.raises(ShardFormatError, match=said):
        open_dataset(directory)


def test_the_class_table_is_read_by_the_reader_and_info_and_copied_by_every_commit(tmp_path) -> None:
    directory = str(tmp_path / "d")
    make_dataset(directory, (5,))
    assert ShardDataset(directory, 2).classes == [] and "classes" not in dataset_info(directory)
    set_root_field(directory, "classes", ["cat", "dog", "bird"])
    add_input(directory, "more.tar", 5, 3)  # a later commit (an ordinary run's) keeps the table
    assert read_root(directory)["classes"] == ["cat", "dog", "bird"]
    assert ShardDataset(directory, 2).classes == ["cat", "dog", "bird"]
    info = dataset_info(directory)
    assert info["classes"] == ["cat", "dog", "bird"]
    assert "classes      3: 0 cat, 1 dog, 2 bird" in format_info(info)


def test_class_folders_given_as_inputs_are_refused_before_anything_is_written(tmp_path) -> None:
    """``preprocess run data/folder/*``: each input is one class folder, its images at its top level, so
    none would have a class; refused, naming the inputs and the fix."""
    root = class_drop(tmp_path / "folder", {"cat": [0, 1], "dog": [2]})
    out = tmp_path / "out"
    inputs = [os.path.join(root, "cat"), os.path.join(root, "dog")]
    with pytest.raises(NoInputsMatched, match=r"cat: folder_classes is true but its images are not in class "
                                              r"sub-folders .* give the folder that holds the class folders"):
        run_job(RunOptions(inputs=inputs, output=str(out), config=CFG))
    assert not out.exists()


@pytest.mark.ray
def test_a_class_keeps_one_id_across_drops_reruns_prunes_and_drops(ray_cluster, tars, tmp_path) -> None:
    drops = tmp_path / "drops"
    d1 = class_drop(drops / "d1", {"cat": [0, 1], "dog": [2]})
    d2 = class_drop(drops / "d2", {"dog": [3, 4]})
    tar = tars.make("labelled.tar", [40, 41])  # a tar keeps its own .cls: the table numbers folders only
    out = str(tmp_path / "out")
    first = run_job(RunOptions(inputs=[d1, d2, tar], output=out, config=CFG))
    assert first.exit_code == 0 and first.samples_written == 7, first.inputs_failed
    assert ShardDataset(out, 2).classes == ["cat", "dog"]
    assert labels(out) == {0: (0, "cat"), 1: (0, "cat"), 2: (1, "dog"), 3: (1, "dog"), 4: (1, "dog"),
                           40: (40, None), 41: (41, None)}
    drop_inputs(out, [tar])
    # A third drop with a new class and an old one, and a class folder given as an input beside it: the
    # new name is appended, committed names keep their ids, the skipped drops are not renumbered, and the
    # class folder is a failed input that says why.
    d3 = class_drop(drops / "d3", {"bird": [5], "cat": [6]})
    stray = class_drop(tmp_path / "stray", {"fox": [7]})
    second = run_job(RunOptions(inputs=[d1, d2, d3, os.path.join(stray, "fox")], output=out, config=CFG))
    assert second.inputs_processed == [d3] and second.inputs_skipped_count == 2
    assert [f["input"] for f in second.inputs_failed] == [os.path.join(stray, "fox")]
    assert "not in class sub-folders" in second.inputs_failed[0]["reason"] and second.exit_code == 1
    assert ShardDataset(out, 2).classes == ["cat", "dog", "bird"]
    assert labels(out) == {0: (0, "cat"), 1: (0, "cat"), 2: (1, "dog"), 3: (1, "dog"), 4: (1, "dog"),
                           5: (2, "bird"), 6: (0, "cat")}
    # Dropping an input, or pruning one, never renumbers; a drop whose folder changed keeps its names' ids.
    drop_inputs(out, [d1])
    write_file(os.path.join(d2, "ant", "000008.jpg"), jpeg_bytes(index_image(8)))
    third = run_job(RunOptions(inputs=[d2, d3], output=out, config=CFG, prune=True, confirm_large_prune=True))
    assert third.exit_code == 0 and third.inputs_processed == [d2]
    assert ShardDataset(out, 2).classes == ["cat", "dog", "bird", "ant"]
    assert labels(out) == {3: (1, "dog"), 4: (1, "dog"), 5: (2, "bird"), 6: (0, "cat"), 8: (3, "ant")}


@pytest.mark.ray
def test_a_run_over_class_drops_killed_then_rerun_gives_the_uninterrupted_dataset_and_table(
        ray_cluster, tmp_path) -> None:
    """The table is extended before any task and committed with the first commit: a rerun after a kill -9
    numbers the classes as the uninterrupted run did, and writes the same bytes."""
    from tests.preprocess.test_crash_safety import run_cli, start_run, wait_for_dead_runs_tasks, watch

    drops = tmp_path / "drops"
    class_drop(drops / "d1", {"dog": range(0, 12), "cat": range(12, 20)})
    class_drop(drops / "d2", {"dog": range(20, 35)})
    class_drop(drops / "d3", {"cat": range(35, 40), "bird": range(40, 50)})
    config = tmp_path / "folder.yaml"
    config.write_text("folder_classes: true\n")
    pattern = f"{drops}/{{d1,d2,d3}}"
    reference = str(tmp_path / "reference")
    assert run_cli(pattern, "--output", reference, extra=("--config", str(config))).exit_code == 0
    out = str(tmp_path / "killed")
    run = start_run(pattern, out, ray_cluster, str(tmp_path / "runs.log"), extra=("--config", str(config)))
    watch(run, out, ("write", 0.05))  # SIGKILL once its first shard file is there: mid-processing
    wait_for_dead_runs_tasks()
    # --config again: a run killed before its first commit left no dataset (so no config) to rerun from
    assert run_cli(pattern, "--output", out, extra=("--config", str(config))).exit_code == 0
    assert_same_dataset(out, reference)
    assert read_root(out)["classes"] == read_root(reference)["classes"] == ["bird", "cat", "dog"]
    assert labels(out) == labels(reference)
    assert {cls for cls, _ in labels(out).values()} == {0, 1, 2}


@pytest.mark.ray
def test_a_dataset_written_before_its_class_table_keeps_its_folders_ids_when_a_new_drop_comes(
        ray_cluster, tmp_path) -> None:
    """Its one folder's samples carry their folder's own sorted order: the table starts with those names."""
    d1 = class_drop(tmp_path / "d1", {"cat": [0], "dog": [1]})
    out = str(tmp_path / "out")
    assert run_job(RunOptions(inputs=[d1], output=out, config=CFG)).exit_code == 0
    path = os.path.join(out, "manifest.json")
    with open(path) as f:
        root = json.load(f)
    del root["classes"]  # as a dataset written before the table: ids by the folder's own order
    with open(path, "w") as f:
        json.dump(root, f)
    d2 = class_drop(tmp_path / "d2", {"ant": [2], "cat": [3]})
    report = run_job(RunOptions(inputs=[d1, d2], output=out, config=CFG))
    assert report.exit_code == 0 and report.inputs_processed == [d2]
    assert ShardDataset(out, 2).classes == ["cat", "dog", "ant"]
    assert labels(out) == {0: (0, "cat"), 1: (1, "dog"), 2: (2, "ant"), 3: (0, "cat")}
