"""A folder of image files (nested, with classes and sidecars, some missing) gives the samples of the tar of
the same images, through the same worker."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from preprocess.config import JobConfig
from preprocess.folder_samples import iter_folder_samples
from preprocess.input_kinds import NumberedClasses
from preprocess.inputs import resolve_inputs
from preprocess.plan import check_output_apart
from preprocess.raw_sample import SampleProblem
from preprocess.worker import process_input
from shardio.errors import OutputUnusable
from tests.folder_factory import flat_folder, write_file
from tests.tar_factory import decode_index, index_image, jpeg_bytes, png_bytes, read_shards

CFG = JobConfig(height=16, width=16, samples_per_shard=4)


def fingerprint(path: str, extensions=CFG.image_extensions):
    resolved = resolve_inputs([path], extensions)
    return resolved.listed[resolved.paths[0]]


def test_a_flat_folder_gives_the_pixels_keys_and_metadata_of_the_tar_of_the_same_files(tars, tmp_path):
    tar = tars.make("same.tar", range(9))
    folder = flat_folder(tmp_path / "photos", range(9))
    tar_result = process_input(tar, str(tmp_path / "t"), CFG, (os.path.getsize(tar), 0))
    result = process_input(folder, str(tmp_path / "f"), CFG, fingerprint(folder))
    assert result.error is None and result.failures == [] and result.samples == 9
    pixels, rows = read_shards(str(tmp_path / "f"), result.shards)
    tar_pixels, tar_rows = read_shards(str(tmp_path / "t"), tar_result.shards)
    np.testing.assert_array_equal(pixels, tar_pixels)
    for field in ("key", "txt", "cls", "json", "member", "width", "height"):
        assert [r[field] for r in rows] == [r[field] for r in tar_rows], field
    assert {r["tar"] for r in rows} == {folder}


def test_nested_classes_missing_sidecars_and_orphans(tmp_path):
    root = tmp_path / "imagenet"
    layout = {"dog/a/000003.jpg": 3, "cat/000001.png": 1, "cat/000002.jpg": 2, "zebra/deep/er/000004.jpg": 4,
              "000000.jpg": 0}
    for relative, index in layout.items():
        image = index_image(index)
        write_file(root / relative, png_bytes(image) if relative.endswith(".png") else jpeg_bytes(image))
    write_file(root / "cat/000001.txt", b"a cat")
    write_file(root / "cat/000002.json", json.dumps({"source": "web"}).encode())
    write_file(root / "cat/000002.cls", b"99")  # ignored: the folder names the class
    write_file(root / "dog/orphan.txt", b"a caption with no image")
    write_file(root / ".hidden/000009.jpg", jpeg_bytes(index_image(9)))
    os.makedirs(root / "empty_class")
    cfg = JobConfig(height=16, width=16, samples_per_shard=4, folder_classes=True)
    result = process_input(str(root), str(tmp_path / "out"), cfg, fingerprint(str(root)))
    pixels, rows = read_shards(str(tmp_path / "out"), result.shards)
    # Sorted by relative path; classes are the sorted first-level folders (the empty one counts, as in
    # torchvision's ImageFolder): cat 0, dog 1, empty_class 2, zebra 3; a root image has none: a failure.
    assert [r["key"] for r in rows] == ["cat/000001", "cat/000002", "dog/a/000003", "zebra/deep/er/000004"]
    assert [decode_index(p) for p in pixels] == [1, 2, 3, 4]
    assert [r["cls"] for r in rows] == [0, 0, 1, 3]
    assert [r["json"] for r in rows] == [{"class": "cat"}, {"source": "web", "class": "cat"},
                                         {"class": "dog"}, {"class": "zebra"}]
    assert [r["txt"] for r in rows] == ["a cat", None, None, None]
    assert [(f["key"], f["code"]) for f in result.failures] == [("000000", "no_class"),
                                                               ("dog/orphan", "missing_image")]
    assert "not in a class folder" in result.failures[0]["reason"]
    # The job's class table (the dataset's ids, across inputs) numbers them instead of the folder's own order.
    table = NumberedClasses({"zebra": 0, "dog": 1, "cat": 2, "empty_class": 3})
    numbered = process_input(str(root), str(tmp_path / "numbered"), cfg, fingerprint(str(root)), reader=table)
    assert [r["cls"] for r in read_shards(str(tmp_path / "numbered"), numbered.shards)[1]] == [2, 2, 1, 0]
    without = process_input(str(root), str(tmp_path / "plain"), CFG, fingerprint(str(root)))
    assert [r["cls"] for r in read_shards(str(tmp_path / "plain"), without.shards)[1]] == [None, None, 99, None, None]


def test_a_folder_is_one_input_whose_fingerprint_changes_with_any_file(tmp_path):
    folder = flat_folder(tmp_path / "f", range(3), with_meta=False)
    first = fingerprint(folder)
    assert fingerprint(folder) == first
    write_file(os.path.join(folder, "sub", "000007.jpg"), jpeg_bytes(index_image(7)))
    added = fingerprint(folder)
    assert added != first
    os.rename(os.path.join(folder, "sub", "000007.jpg"), os.path.join(folder, "sub", "000008.jpg"))
    os.utime(os.path.join(folder, "sub"), ns=(added.mtime_ns + 10**9, added.mtime_ns + 10**9))
    assert fingerprint(folder) != added


def test_a_folder_without_images_is_refused_as_before_and_an_output_inside_a_folder_input_too(tars, tmp_path):
    tars.make("a.tar", range(1))
    resolved = resolve_inputs([tars.directory])
    assert resolved.paths == [] and resolved.failed[0]["reason"] == "is a directory; pass DIR/*.tar"
    folder = flat_folder(tmp_path / "f", range(2))
    resolved = resolve_inputs([folder])
    with pytest.raises(OutputUnusable, match="lies inside the input folder"):
        check_output_apart(os.path.join(folder, "shards"), resolved)
    check_output_apart(str(tmp_path / "elsewhere"), resolved)


def test_a_folder_holding_only_sidecars_fails_as_an_input(tmp_path):
    write_file(tmp_path / "f" / "x.txt", b"no image")
    found = list(iter_folder_samples(str(tmp_path / "f"), CFG))
    assert isinstance(found[0], SampleProblem) and found[0].reason == "no image file (has: txt)"


def test_an_empty_image_file_is_a_counted_failure_and_an_empty_sidecar_an_empty_caption(tmp_path):
    write_file(tmp_path / "f" / "a.jpg", b"")
    write_file(tmp_path / "f" / "b.jpg", jpeg_bytes(index_image(1)))
    write_file(tmp_path / "f" / "b.txt", b"")
    result = process_input(str(tmp_path / "f"), str(tmp_path / "out"), CFG, fingerprint(str(tmp_path / "f")))
    assert [(f["key"], f["code"]) for f in result.failures] == [("a", "empty_member")]
    assert read_shards(str(tmp_path / "out"), result.shards)[1][0]["txt"] == ""
