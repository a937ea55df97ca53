"""A folder on object storage (a prefix named as an INPUT) gives the samples of the local folder of the same
files, is one input recognised by its listing, and fails when an object changes under the reader."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from preprocess.config import JobConfig
from preprocess.inputs.resolve import resolve_inputs
from preprocess.plan import check_output_apart, plan_inputs
from preprocess.worker import process_input
from shardio.errors import NoInputsMatched, OutputUnusable
from shardio.format import InputEntry
from shardio.format.manifests import read_root
from shardio.store.s3 import S3Storage
from tests.folder_factory import write_file
from tests.tar_factory import decode_index, index_image, jpeg_bytes, png_bytes, read_shards

CFG = JobConfig(height=16, width=16, samples_per_shard=4, folder_classes=True)
FLAT = JobConfig(height=16, width=16, samples_per_shard=4)  # a folder of images with no class folders
NO_IMAGE = ("is a folder with no image file named .jpg, .jpeg, .png or .webp (image_extensions); for the tar "
            "files in it, pass FOLDER/*.tar")
LAYOUT = {"dog/a/000003.jpg": 3, "cat/000001.png": 1, "cat/000002.jpg": 2, "zebra/deep/er/000004.jpg": 4,
          "000000.jpg": 0, "cat/000005.jpg": 5}


@pytest.fixture
def photos(tmp_path, s3_server, s3_bucket) -> tuple[str, str]:
    """(local folder, its prefix's URL without "/"): the same files, nested classes, sidecars (one orphan),
    a hidden folder."""
    root = tmp_path / "photos"
    for relative, index in LAYOUT.items():
        image = index_image(index)
        write_file(root / relative, png_bytes(image) if relative.endswith(".png") else jpeg_bytes(image))
    write_file(root / "cat/000001.txt", b"a cat")
    write_file(root / "cat/000002.json", json.dumps({"source": "web"}).encode())
    write_file(root / "dog/orphan.txt", b"a caption with no image")
    write_file(root / ".hidden/000009.jpg", jpeg_bytes(index_image(9)))
    client = s3_server.client()
    for base, _, files in os.walk(root):
        for name in files:
            path = os.path.join(base, name)
            client.upload_file(path, s3_bucket, "photos/" + os.path.relpath(path, root))
    return str(root), f"s3://{s3_bucket}/photos"


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """The objects the code under test GETs (whole or by range)."""
    got: list[str] = []
    for name in ("read_tagged", "read_range", "read_bytes", "read_versioned", "open_read", "download"):
        real = getattr(S3Storage, name)

        def counted(self, path, *args, _real=real, **kwargs):
            got.append(path)
            return _real(self, path, *args, **kwargs)

        monkeypatch.setattr(S3Storage, name, counted)
    return got


def test_a_prefix_gives_the_pixels_keys_classes_and_metadata_of_the_local_folder(photos, tmp_path, reads):
    local, url = photos
    with_slash = resolve_inputs([url + "/"])
    resolved = resolve_inputs([url])
    assert resolved.paths == with_slash.paths == [url + "/"] and resolved.folders == {url + "/"}
    assert resolved.failed == [] and resolved.listed == with_slash.listed
    assert reads == [], "resolving a prefix lists it, and reads no object"
    remote = process_input(url + "/", str(tmp_path / "r"), CFG, resolved.listed[url + "/"])
    assert remote.error is None, remote.error
    assert len(reads) == 7, "one GET per image and sidecar; none for the image in no class folder"
    here = process_input(local, str(tmp_path / "l"), CFG, resolve_inputs([local]).listed[local])
    pixels, rows = read_shards(str(tmp_path / "r"), remote.shards)
    local_pixels, local_rows = read_shards(str(tmp_path / "l"), here.shards)
    assert [decode_index(p) for p in pixels] == [1, 2, 5, 3, 4]
    np.testing.assert_array_equal(pixels, local_pixels)
    for field in ("key", "txt", "cls", "json", "member", "width", "height"):
        assert [r[field] for r in rows] == [r[field] for r in local_rows], field
    assert [r["cls"] for r in rows] == [0, 0, 0, 1, 2]  # cat 0, dog 1, zebra 2; a root image has none: failed
    assert {r["tar"] for r in rows} == {url + "/"}
    said = [(f["key"], f["code"], f["reason"]) for f in remote.failures]
    assert said == [(f["key"], f["code"], f["reason"]) for f in here.failures]
    assert [(key, code) for key, code, _ in said] == [("000000", "no_class"), ("dog/orphan", "missing_image")]
    assert os.path.basename(remote.shards[0]["path"]).startswith("photos-")


def test_a_rerun_with_nothing_changed_skips_it_unread_and_an_added_object_makes_it_changed(
        photos, tmp_path, reads, s3_server, s3_bucket):
    _, url = photos
    name = url + "/"
    first = resolve_inputs([url])
    fingerprint = first.listed[name]
    assert fingerprint.etag and fingerprint.size > 0
    committed = {name: InputEntry(fingerprint.size, fingerprint.mtime_ns, 6, 1, etag=fingerprint.etag)}
    again = resolve_inputs([url])
    plan = plan_inputs(again, committed)
    assert plan.todo == [] and plan.skipped == 1 and reads == []
    s3_server.client().put_object(Bucket=s3_bucket, Key="photos/cat/000006.jpg", Body=jpeg_bytes(index_image(6)))
    grown = resolve_inputs([url])
    assert [path for path, _ in plan_inputs(grown, committed).todo] == [name]
    assert grown.listed[name].size > fingerprint.size and grown.listed[name].etag != fingerprint.etag
    # A task given the plan's older listing refuses to commit what it no longer names.
    stale = process_input(name, str(tmp_path / "stale"), CFG, fingerprint)
    assert "added, removed or replaced" in stale.error and stale.shards == [] and not stale.lasting
    result = process_input(name, str(tmp_path / "new"), CFG, grown.listed[name])
    assert result.error is None and result.samples == 6  # 7 images, one in no class folder


def test_a_prefix_without_images_is_refused_as_a_local_folder_is_and_a_missing_one_is_no_such_object(
        s3_server, s3_bucket):
    client = s3_server.client()
    client.put_object(Bucket=s3_bucket, Key="tars/a.tar", Body=b"x" * 1000)
    client.put_object(Bucket=s3_bucket, Key="named.tar/000001.jpg", Body=jpeg_bytes(index_image(1)))
    url = f"s3://{s3_bucket}"
    resolved = resolve_inputs([f"{url}/tars", f"{url}/tars/", f"{url}/nothing", f"{url}/named.tar"])
    assert resolved.paths == []
    assert sorted((f["input"], f["reason"]) for f in resolved.failed) == [
        (f"{url}/named.tar", "is a folder; pass FOLDER/*.tar"),  # a name claiming a tar is no folder
        (f"{url}/nothing", "no such object"),
        (f"{url}/tars", NO_IMAGE),
        (f"{url}/tars/", NO_IMAGE)]


def test_an_output_inside_the_input_prefix_is_refused(photos, s3_bucket):
    _, url = photos
    resolved = resolve_inputs([url])
    with pytest.raises(OutputUnusable, match="lies inside the input folder"):
        check_output_apart(f"{url}/shards", resolved)
    check_output_apart(f"s3://{s3_bucket}/elsewhere", resolved)


def test_an_object_replaced_while_the_folder_is_read_fails_the_input_naming_it(photos, tmp_path, monkeypatch,
                                                                                s3_server, s3_bucket):
    _, url = photos
    name = url + "/"
    fingerprint = resolve_inputs([url]).listed[name]
    real = S3Storage.read_tagged

    def replacing(self, path):
        if path.endswith("/000001.png"):  # the first read: another object is replaced meanwhile
            s3_server.client().put_object(Bucket=s3_bucket, Key="photos/zebra/deep/er/000004.jpg",
                                          Body=jpeg_bytes(index_image(8)))
        return real(self, path)

    monkeypatch.setattr(S3Storage, "read_tagged", replacing)
    result = process_input(name, str(tmp_path / "out"), CFG, fingerprint)
    assert "'zebra/deep/er/000004.jpg' was replaced while the folder was read" in result.error
    assert result.input == name and result.shards == [] and not result.lasting


def test_every_cloud_reads_a_prefix_as_the_local_folder(cloud_bucket, tmp_path):
    """Each object is read at the ETag its listing gave, on every cloud (GCS's conditional-write version is
    a generation, not the ETag: the reader compares ETags, ``Storage.read_tagged``)."""
    root = tmp_path / "flat"
    for index in range(3):
        write_file(root / f"{index:06d}.jpg", jpeg_bytes(index_image(index)))
        write_file(root / f"{index:06d}.txt", f"caption {index}".encode())
    url = cloud_bucket.upload_dir(str(root), "flat")
    resolved = resolve_inputs([url])
    assert resolved.paths == [url + "/"], resolved.failed
    remote = process_input(url + "/", str(tmp_path / "r"), FLAT, resolved.listed[url + "/"])
    here = process_input(str(root), str(tmp_path / "l"), FLAT, resolve_inputs([str(root)]).listed[str(root)])
    assert remote.error is None and remote.samples == 3, remote.error
    np.testing.assert_array_equal(read_shards(str(tmp_path / "r"), remote.shards)[0],
                                  read_shards(str(tmp_path / "l"), here.shards)[0])


@pytest.mark.ray
def test_the_job_commits_a_prefix_skips_it_unchanged_and_replaces_it_when_an_object_is_added(
        ray_cluster, photos, tmp_path, s3_server, s3_bucket):
    from preprocess.job import RunOptions, run_job

    _, url = photos
    out = str(tmp_path / "out")
    first = run_job(RunOptions(inputs=[url], output=out, config=CFG))
    # 6 images, one in no class folder; the class table from the prefix's one listing
    assert first.exit_code == 0 and first.inputs_processed == [url + "/"] and first.samples_written == 5
    assert read_root(out)["classes"] == ["cat", "dog", "zebra"]
    again = run_job(RunOptions(inputs=[url + "/"], output=out, config=CFG))
    assert again.exit_code == 0 and again.inputs_skipped == [url + "/"] and again.inputs_processed == []
    s3_server.client().put_object(Bucket=s3_bucket, Key="photos/ant/000006.jpg",
                                  Body=jpeg_bytes(index_image(6)))
    third = run_job(RunOptions(inputs=[url], output=out, config=CFG))
    assert third.exit_code == 0 and third.inputs_processed == [url + "/"] and third.samples_written == 6
    assert read_root(out)["samples"] == 6, "the folder is replaced whole, as a tar is"
    assert read_root(out)["classes"] == ["cat", "dog", "zebra", "ant"], "a new name appended, none renumbered"


def test_an_object_over_the_member_limit_is_a_counted_failure_and_is_never_fetched(
        photos, tmp_path, reads, monkeypatch, s3_server, s3_bucket):
    from preprocess.inputs import folder_samples

    _, url = photos
    name = url + "/"
    s3_server.client().put_object(Bucket=s3_bucket, Key="photos/big/000007.jpg", Body=b"\xff" * 30_000)
    fingerprint = resolve_inputs([url]).listed[name]
    monkeypatch.setattr(folder_samples, "MAX_MEMBER_BYTES", 20_000)  # every other file is a few KB
    result = process_input(name, str(tmp_path / "out"), CFG, fingerprint)
    assert result.error is None and result.samples == 5
    assert [(f["key"], f["code"]) for f in result.failures] == [("000000", "no_class"),
                                                               ("big/000007", "member_too_large"),
                                                               ("dog/orphan", "missing_image")]
    assert not any(path.endswith("big/000007.jpg") for path in reads)


def test_a_glob_takes_the_prefixes_of_images_it_matches_and_names_the_kinds_when_it_matches_none(
        photos, s3_server, s3_bucket):
    _, url = photos
    client = s3_server.client()
    client.put_object(Bucket=s3_bucket, Key="in/a.tar", Body=b"x" * 1000)
    client.put_object(Bucket=s3_bucket, Key="in/notes.json", Body=b"{}")
    client.put_object(Bucket=s3_bucket, Key="in/tars/b.tar", Body=b"x" * 1000)
    for prefix in ("in/p1", "in/p2", "in/p2/sub"):
        client.put_object(Bucket=s3_bucket, Key=f"{prefix}/000000.jpg", Body=jpeg_bytes(index_image(0)))
    client.put_object(Bucket=s3_bucket, Key="in/p1/scan.TIF", Body=b"II*\x00")  # a kind left out: counted
    base = f"s3://{s3_bucket}"
    star = resolve_inputs([f"{base}/in/*"])
    folders = [f"{base}/in/p1/", f"{base}/in/p2/"]
    assert star.paths == [f"{base}/in/a.tar", *folders] and star.folders == set(folders)
    assert star.ignored == [f"{base}/in/notes.json"] and star.failed == []
    assert star.files_ignored == [{"input": f"{base}/in/p1/", "files": 1, "first": "scan.TIF",
                                   "reason": "image files image_extensions leaves out (tif 1)"}]
    assert star.listed[f"{base}/in/p1/"] == resolve_inputs([f"{base}/in/p1"]).listed[f"{base}/in/p1/"]
    assert resolve_inputs([f"{base}/*"]).paths == [f"{base}/in/", url + "/"]  # in/ holds images below it
    deep = resolve_inputs([f"{base}/in/**"])  # a prefix inside a folder input is part of it
    assert set(folders) <= set(deep.paths) and f"{base}/in/p2/sub/" not in deep.paths
    for pattern in (f"{base}/in/*.parquet", f"{base}/in/tar*"):
        with pytest.raises(NoInputsMatched) as refused:
            resolve_inputs([pattern])
        said = str(refused.value)
        assert "matched no input" in said and "tar files" in said and "Parquet files" in said, said
        assert "folders of image files" in said and "tar file;" not in said
