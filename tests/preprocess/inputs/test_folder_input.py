"""A folder of image files (nested, with classes and sidecars, some missing) gives the samples of the tar of
the same images, through the same worker."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest

from preprocess.config import JobConfig
from preprocess.inputs.folder_samples import iter_folder_samples
from preprocess.inputs.kinds import KindReader
from preprocess.inputs.resolve import resolve_inputs
from preprocess.plan import check_output_apart
from preprocess.inputs.raw_sample import SampleProblem
from preprocess.worker import process_input
from shardio.errors import NoInputsMatched, OutputUnusable
from shardio.failure_reasons import FailureCode
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
    table = KindReader(class_ids={"zebra": 0, "dog": 1, "cat": 2, "empty_class": 3})
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


def test_a_folder_without_images_is_refused_naming_the_setting_and_an_output_inside_a_folder_input_too(
        tars, tmp_path):
    tars.make("a.tar", range(1))
    resolved = resolve_inputs([tars.directory])
    assert resolved.paths == [] and resolved.failed[0]["reason"] == (
        "is a folder with no image file named .jpg, .jpeg, .png or .webp (image_extensions); for the tar files "
        "in it, pass DIR/*.tar")
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


def _image_bytes(index: int, extension: str) -> bytes:
    """The self-identifying image ``index`` saved as ``extension`` (lossless except JPEG and GIF's palette)."""
    image = index_image(index)
    if extension in ("jpg", "jpeg"):
        return jpeg_bytes(image)
    out = io.BytesIO()
    image.save(out, format={"tif": "TIFF", "tiff": "TIFF", "bmp": "BMP", "gif": "GIF", "png": "PNG"}[extension])
    return out.getvalue()


def test_two_images_with_one_stem_are_two_samples_keyed_by_their_file_names_and_share_its_sidecars(tmp_path):
    root = tmp_path / "f"
    for relative, index in {"a.jpg": 0, "x.jpg": 1, "x.png": 2, "y.JPG": 3, "y.jpg": 4}.items():
        write_file(root / relative, _image_bytes(index, relative.rsplit(".", 1)[1].lower()))
    write_file(root / "a.txt", b"alone")  # no collision: the key stays the stem, as before
    write_file(root / "x.txt", b"shared")  # the stem's sidecar: both images of the stem carry it
    write_file(root / "x.png.txt", b"the png's own")  # a file name's sidecar: that image's only
    result = process_input(str(root), str(tmp_path / "out"), CFG, fingerprint(str(root)))
    pixels, rows = read_shards(str(tmp_path / "out"), result.shards)
    assert result.failures == [] and result.samples == 5
    assert [r["key"] for r in rows] == ["a", "x.jpg", "x.png", "y.JPG", "y.jpg"]
    assert [r["member"] for r in rows] == ["a.jpg", "x.jpg", "x.png", "y.JPG", "y.jpg"]
    assert [decode_index(p) for p in pixels] == [0, 1, 2, 3, 4]
    assert [r["txt"] for r in rows] == ["alone", "shared", "the png's own", None, None]


def test_a_file_named_like_another_images_key_is_a_counted_duplicate_naming_it(tmp_path):
    root = tmp_path / "f"
    for relative, index in {"x.jpg": 1, "x.png": 2, "x.jpg.png": 3}.items():
        write_file(root / relative, _image_bytes(index, relative.rsplit(".", 1)[1]))
    found = list(iter_folder_samples(str(root), CFG))
    assert [s.key for s in found if not isinstance(s, SampleProblem)] == ["x.jpg", "x.png"]
    problems = [s for s in found if isinstance(s, SampleProblem)]
    assert [(p.key, p.code) for p in problems] == [("x.jpg", FailureCode.DUPLICATE_KEY)]
    assert "'x.jpg.png'" in problems[0].reason


def test_tiff_bmp_and_gif_are_images_of_a_folder_or_counted_as_ignored_when_image_extensions_leaves_them_out(
        tmp_path):
    mixed = tmp_path / "mixed"
    for relative, index in {"a.jpg": 0, "b.tif": 1, "c.bmp": 2, "d.gif": 3, "e.TIFF": 4}.items():
        write_file(mixed / relative, _image_bytes(index, relative.rsplit(".", 1)[1].lower()))
    write_file(mixed / "c.txt", b"the bmp's caption")  # a left-out image's sidecar: left out with it
    write_file(mixed / "notes.md", b"not an image: neither a sample nor counted")
    resolved = resolve_inputs([str(mixed)])
    assert resolved.paths == [str(mixed)] and resolved.kinds == {str(mixed): "folder"}  # its task is told
    assert resolved.files_ignored == [
        {"input": str(mixed), "files": 4, "first": "b.tif",
         "reason": "image files image_extensions leaves out (bmp 1, gif 1, tif 1, tiff 1)"}]
    result = process_input(str(mixed), str(tmp_path / "out"), CFG, resolved.listed[str(mixed)])
    assert result.error is None and result.samples == 1 and result.failures == []
    wider = JobConfig(height=16, width=16, samples_per_shard=4,
                      image_extensions=("jpg", "jpeg", "png", "webp", "tif", "tiff", "bmp", "gif"))
    taken = resolve_inputs([str(mixed)], wider.image_extensions)
    assert taken.files_ignored == []
    result = process_input(str(mixed), str(tmp_path / "wide"), wider, taken.listed[str(mixed)])
    pixels, rows = read_shards(str(tmp_path / "wide"), result.shards)
    assert result.failures == [] and [r["key"] for r in rows] == ["a", "b", "c", "d", "e"]
    assert [decode_index(p) for p in pixels[[0, 1, 2, 4]]] == [0, 1, 2, 4]  # GIF's palette: its key alone
    assert rows[2]["txt"] == "the bmp's caption"


def test_a_folder_of_only_left_out_images_is_refused_naming_what_it_looked_for_and_the_setting(tmp_path):
    scans = tmp_path / "scans"
    for index in range(3):
        write_file(scans / f"{index:06d}.tif", _image_bytes(index, "tif"))
    resolved = resolve_inputs([str(scans)])
    assert resolved.paths == [] and resolved.failed == [{"input": str(scans), "reason": (
        "is a folder with no image file named .jpg, .jpeg, .png or .webp (image_extensions); it holds 3 image "
        "files image_extensions leaves out (tif 3): add their extension to image_extensions to read them")}]
    assert resolve_inputs([str(scans)], ("jpg", "tif")).paths == [str(scans)]


def test_links_that_lead_to_no_file_are_skipped_and_named_and_an_unreadable_file_is_a_counted_failure(
        tmp_path, monkeypatch):
    root = tmp_path / "f"
    for index in range(3):
        write_file(root / f"{index:06d}.jpg", _image_bytes(index, "jpg"))
    os.symlink("loop.jpg", root / "loop.jpg")  # a link to itself: "Too many levels of symbolic links"
    os.symlink("gone.jpg", root / "dangling.jpg")
    os.symlink(".", root / "again")  # a link to a folder (a directory loop here): not followed
    os.mkfifo(root / "pipe.jpg")  # never opened: a read would wait for a writer
    resolved = resolve_inputs([str(root)])
    assert resolved.paths == [str(root)] and resolved.failed == []
    assert resolved.files_ignored == [
        {"input": str(root), "files": 2, "first": "dangling.jpg", "reason": "links that lead to no file"},
        {"input": str(root), "files": 1, "first": "again", "reason": "links to folders (not followed)"},
        {"input": str(root), "files": 1, "first": "pipe.jpg", "reason": "special files (not regular files)"}]
    real_open = os.open

    def refusing(path, *args, **kwargs):
        if str(path).endswith("000001.jpg"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)
    result = process_input(str(root), str(tmp_path / "out"), CFG, resolved.listed[str(root)])
    assert result.error is None and result.samples == 2
    assert [(f["key"], f["code"]) for f in result.failures] == [("000001", "unreadable_file")]
    assert "'000001.jpg'" in result.failures[0]["reason"] and "Permission denied" in result.failures[0]["reason"]


def test_a_glob_takes_the_folders_of_images_it_matches_beside_tars(tars, tmp_path):
    data = tmp_path / "data"
    for folder in ("f1", "f2", "f2/sub"):
        write_file(data / folder / "000000.jpg", _image_bytes(0, "jpg"))
    write_file(data / "only_tars" / "x.tar", open(tars.make("x.tar", range(1)), "rb").read())
    write_file(data / "named.tar" / "000000.jpg", _image_bytes(0, "jpg"))  # a name claiming a tar: no folder
    write_file(data / "a.tar", open(tars.make("a.tar", range(1)), "rb").read())
    write_file(data / "notes.json", b"{}")
    star = resolve_inputs([f"{data}/*"])
    folders = [str(data / "f1"), str(data / "f2")]
    assert star.paths == [str(data / "a.tar"), *folders] and star.folders == set(folders)
    assert star.ignored == [str(data / "notes.json")] and star.failed == []
    assert star.listed[str(data / "f1")] == fingerprint(str(data / "f1"))
    assert resolve_inputs([f"{data}/*/"]).paths == folders  # "DIR/*/" names folders only
    deep = resolve_inputs([f"{data}/**"])  # a folder inside a folder input is part of it, not a second one
    assert set(folders) <= set(deep.paths) and str(data / "f2" / "sub") not in deep.paths
    with pytest.raises(NoInputsMatched) as refused:
        resolve_inputs([f"{data}/only_*"])
    said = str(refused.value)
    assert "matched no input" in said and "tar files" in said and "Parquet files" in said
    assert "folders of image files" in said and "1 folder(s) with no image file" in said


@pytest.mark.ray
def test_a_run_over_a_glob_of_folders_with_a_looping_link_and_a_tiff_commits_them_and_reports_what_it_left(
        ray_cluster, tmp_path):
    from typer.testing import CliRunner

    from preprocess.cli import app

    data = tmp_path / "data"
    for folder, indices in (("f1", range(3)), ("f2", range(3, 5))):
        flat_folder(data / folder, indices, with_meta=False)
    os.symlink("loop.jpg", data / "f1" / "loop.jpg")
    write_file(data / "f2" / "scan.tif", _image_bytes(9, "tif"))
    out, report = str(tmp_path / "out"), str(tmp_path / "r.json")
    result = CliRunner().invoke(app, ["run", f"{data}/*", "--output", out, "--report", report, "--size", "16"])
    assert result.exit_code == 0, result.output
    doc = json.load(open(report))
    assert sorted(doc["inputs_processed"]) == [str(data / "f1"), str(data / "f2")] and doc["samples_written"] == 5
    assert doc["inputs_failed"] == [] and doc["failures"] == []
    assert doc["files_ignored"] == [
        {"input": str(data / "f1"), "reason": "links that lead to no file", "files": 1, "first": "loop.jpg"},
        {"input": str(data / "f2"), "reason": "image files image_extensions leaves out (tif 1)", "files": 1,
         "first": "scan.tif"}]
    assert "2 file(s) of folders ignored" in " ".join(result.output.split())


def test_a_folder_named_beside_a_glob_that_takes_its_parent_is_read_once_as_part_of_it(tmp_path):
    data = tmp_path / "data"
    for folder in ("f1", "f1/sub"):
        write_file(data / folder / "000000.jpg", _image_bytes(0, "jpg"))
    for patterns in ([str(data / "f1" / "sub"), f"{data}/*"], [f"{data}/f1/*", str(data / "f1")]):
        resolved = resolve_inputs(patterns)
        assert resolved.paths == [str(data / "f1")] and resolved.folders == {str(data / "f1")}, patterns
        assert sorted(resolved.listed) == [str(data / "f1")]
