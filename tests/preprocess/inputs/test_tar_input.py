"""iter_tar_samples and process_input on whole tars: grouping, .tar.gz, broken inputs, hostile member names.

A broken input is an ``InputError`` naming the file (process_input: ``error`` set, no shards left). A tar
cut exactly at a member boundary is the subtle one: tarfile ends its iteration there without complaint,
and the input would silently shrink.
"""

from __future__ import annotations

import gzip
import os
import tarfile

import pytest

from preprocess.inputs import tar_samples
from preprocess.config import JobConfig
from preprocess.inputs.tar_samples import RawSample, SampleProblem, iter_tar_samples
from preprocess.worker import process_input
from shardio.store.backends import for_path
from shardio.errors import InputError
from shardio.format import unescape_name
from tests.tar_factory import Member, decode_index, index_image, jpeg_bytes, png_bytes, read_shards

CFG = JobConfig(height=32, width=32)
IMAGE_EXTENSIONS = CFG.image_extensions


def items(path: str) -> list[RawSample | SampleProblem]:
    return list(iter_tar_samples(path, IMAGE_EXTENSIONS))


def member_offsets(path: str) -> list[tuple[str, int]]:
    """(name, offset of its header) of every member, then ("end", where the last member's data ends)."""
    with tarfile.open(path) as tar:
        members = list(tar)
    last = members[-1]
    end = last.offset_data + -(-last.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
    return [(m.name, m.offset) for m in members] + [("end", end)]


def input_error(path: str) -> str:
    with pytest.raises(InputError) as caught:
        items(path)
    message = str(caught.value)
    assert message.startswith(path), message
    return message


def run(path: str, out: str):
    return process_input(path, out, CFG, for_path(path).stat_fingerprint(path))


# --- good input ----------------------------------------------------------------------------------------


def test_samples_in_tar_order_with_their_fields(tars):
    found = items(tars.make("good.tar", range(13)))
    assert all(isinstance(s, RawSample) for s in found)
    assert [s.key for s in found] == [f"{i:06d}" for i in range(13)]
    assert [s.image_member for s in found][:2] == ["000000.jpg", "000001.jpg"]
    assert found[7].fields == {"txt": b"caption 7", "cls": b"7", "json": b'{"index": 7}'}


def test_tar_gz_works(tars, tmp_path):
    gz = tars.derive("good.tar.gz", tars.make("good.tar", range(5)), gzip.compress)
    assert [s.key for s in items(gz)] == [f"{i:06d}" for i in range(5)]
    result = run(gz, str(tmp_path / "out"))
    assert result.error is None and result.samples == 5
    pixels, _ = read_shards(str(tmp_path / "out"), result.shards)
    assert [decode_index(p) for p in pixels] == list(range(5))


def test_image_format_is_detected_not_taken_from_the_extension(tars, tmp_path):
    path = tars.write("mixed.tar", [
        Member("000000.jpg", png_bytes(index_image(0))),  # a PNG named .jpg
        Member("000001.png", jpeg_bytes(index_image(1))),  # a JPEG named .png
        Member("000002.jpeg", jpeg_bytes(index_image(2))),
        Member("000003.JPG", jpeg_bytes(index_image(3))),
    ])
    result = run(path, str(tmp_path / "out"))
    assert result.failures == [] and result.samples == 4
    pixels, rows = read_shards(str(tmp_path / "out"), result.shards)
    assert [decode_index(p) for p in pixels] == [0, 1, 2, 3]
    assert [r["member"] for r in rows] == ["000000.jpg", "000001.png", "000002.jpeg", "000003.JPG"]


def test_keys_with_directories_and_os_litter(tars):
    path = tars.write("dirs.tar", [
        Member("train/", kind="dir"),
        Member("train/000000.jpg", jpeg_bytes(index_image(0))),
        Member("train/._000000.jpg", b"\0\5\x16\7 AppleDouble"),  # macOS resource fork
        Member("__MACOSX/train/000000.jpg", b"junk"),
        Member("README", b"no extension: not a sample"),
        Member("val.v2/000001.jpg", jpeg_bytes(index_image(1))),
    ])
    assert [s.key for s in items(path)] == ["train/000000", "val.v2/000001"]


def test_duplicates_and_imageless_samples(tars):
    path = tars.write("dups.tar", [
        *tars.samples([0]),
        Member("000001.jpg", jpeg_bytes(index_image(1))),
        Member("000001.jpg", jpeg_bytes(index_image(2))),  # the same member twice in a row
        Member("000002.txt", b"caption without an image"),
        Member("000002.cls", b"2"),
        *tars.samples([3]),
        Member("000000.jpg", jpeg_bytes(index_image(9))),  # key 000000 again, later in the tar
    ])
    found = items(path)
    assert [type(s).__name__ for s in found] == ["RawSample", "SampleProblem", "SampleProblem", "RawSample",
                                               "SampleProblem"]
    assert "'000001.jpg' appears twice" in found[1].reason
    assert found[2].reason == "no image member (has: cls, txt)"
    assert found[4].key == "000000" and "key seen twice" in found[4].reason
    assert found[0].image == jpeg_bytes(index_image(0)), "the first occurrence is the one kept"


def test_oversized_member_is_skipped_not_read(tars, monkeypatch):
    monkeypatch.setattr(tar_samples, "MAX_MEMBER_BYTES", 4000)  # the good 320x240 JPEG is ~2.7 KB
    path = tars.write("big.tar", [Member("000000.jpg", bytes(5000)), *tars.samples([1], with_meta=False)])
    found = items(path)
    assert isinstance(found[0], SampleProblem) and "5000 bytes" in found[0].reason
    assert isinstance(found[1], RawSample)


# --- broken input --------------------------------------------------------------------------------------


@pytest.mark.parametrize("where, expected", [
    # tarfile alone stops quietly at the first two: 000002.cls and the rest would just be missing
    ("boundary", "truncated tar: ends at byte {at} after member '000002.txt', with no end-of-archive blocks"),
    ("in_header", "truncated tar: cut inside the header at byte {at}, after member '000002.txt'"),
    ("in_data", "not a readable tar (unexpected end of data; last good member: 000002.cls)"),
    ("after_last_member", "ends at byte {at} after member '000005.json', with no end-of-archive blocks"),
])
def test_truncated_tar(tars, where, expected):
    good = tars.make("good.tar", range(6))
    offsets = member_offsets(good)
    header = offsets[10][1]  # 000002.cls (1 byte of data)
    length = {"boundary": header, "in_header": header + 100, "in_data": header + 600,
              "after_last_member": offsets[-1][1]}
    at = offsets[-1][1] if where == "after_last_member" else header
    cut = tars.derive(f"cut-{where}.tar", good, lambda data: data[: length[where]])
    assert expected.format(at=at) in input_error(cut)


def test_truncated_tar_gz_at_a_member_boundary(tars):
    good = tars.make("good.tar", range(4))
    end = member_offsets(good)[8][1]  # up to 000002.jpg
    path = tars.derive("cut.tar.gz", good, lambda data: gzip.compress(data[:end]))
    assert "after member '000001.json', with no end-of-archive blocks" in input_error(path)


def test_truncated_gzip_stream(tars):
    compressed = tars.derive("whole.tar.gz", tars.make("good.tar", range(4)), gzip.compress)
    path = tars.derive("half.tar.gz", compressed, lambda data: data[: len(data) // 2])
    assert "not a readable tar" in input_error(path)


def test_corrupt_header_mid_tar(tars):
    good = tars.make("good.tar", range(4))
    with open(good, "rb") as f:
        data = bytearray(f.read())
    header = member_offsets(good)[6][1]
    data[header: header + 512] = b"garbage!" * 64
    path = tars.path("garbled.tar")
    with open(path, "wb") as f:
        f.write(bytes(data))
    assert "corrupt tar header" in input_error(path)


@pytest.mark.parametrize("content, expected", [
    (b"", "empty file (0 bytes)"),
    (b"just some text, not a tar\n", "not a readable tar: text, not a tar archive"),
    (jpeg_bytes(index_image(1)), "not a readable tar: a JPEG image, not a tar archive"),
    (bytes(10240), "holds no sample members"),  # an empty archive: only end-of-archive blocks
])
def test_not_a_tar(tars, content, expected):
    path = tars.path("input.tar")
    with open(path, "wb") as f:
        f.write(content)
    message = input_error(path)
    assert expected in message, message
    assert "method gz" not in message, "tarfile's internals instead of what the file is"


def test_missing_path_and_a_directory(tars, tmp_path):
    assert "no such file" in input_error(str(tmp_path / "nope.tar"))
    os.makedirs(tmp_path / "a_dir.tar")
    assert "not a readable tar" in input_error(str(tmp_path / "a_dir.tar"))


def test_only_readme_is_an_error(tars):
    assert "holds no sample members" in input_error(tars.write("readme.tar", [Member("README", b"hi")]))


def test_process_input_reports_a_broken_tar_and_leaves_no_shards(tars, tmp_path):
    good = tars.make("good.tar", range(20))
    # 19 of 20 samples, then nothing
    path = tars.derive("cut.tar", good, lambda data: data[: member_offsets(good)[-4][1]])
    out = tmp_path / "out"
    result = process_input(path, str(out), JobConfig(height=16, width=16, samples_per_shard=4),
                           for_path(path).stat_fingerprint(path))
    # The report stores {input, reason}: the reason must not repeat the path (`input failed: P: P: ...`).
    assert result.error is not None and path not in result.error and "truncated" in result.error
    assert result.samples == 0 and result.shards == [] and result.failures == []
    assert not any(files for _, _, files in os.walk(out)), "shards of a broken input were left behind"


# --- hostile members -----------------------------------------------------------------------------------


def _snapshot(root) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files}


def test_unsafe_members_are_counted_and_touch_nothing_outside_the_output(tars, tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # a relative write would land in tmp_path, which is checked below
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.jpg"
    secret.write_bytes(jpeg_bytes(index_image(66)))
    absolute = str(outside / "evil-absolute.jpg")
    path = tars.write("hostile.tar", [
        *tars.samples([0]),
        Member("../../evil.jpg", jpeg_bytes(index_image(1))),
        Member("a/../../../evil.jpg", jpeg_bytes(index_image(2))),
        Member(absolute, jpeg_bytes(index_image(3))),
        Member("000004.jpg", kind="symlink", target=str(secret)),
        Member("000005.jpg", kind="hardlink", target="000000.jpg"),
        Member("000006/", kind="dir"),
        Member("../evil-dir/", kind="dir"),
        Member("000007.jpg", kind="symlink", target="../../../outside/secret.jpg"),
        *tars.samples([8]),
    ])
    before = _snapshot(tmp_path)
    out = tmp_path / "a" / "b" / "out"
    result = run(path, str(out))

    assert result.error is None and result.samples == 2
    reasons = {f["key"]: f["reason"] for f in result.failures}
    assert set(reasons) == {"../../evil", "a/../../../evil", absolute[: -len(".jpg")], "000004", "000005",
                            "000007"}
    assert "unsafe member name" in reasons["../../evil"] and "unsafe member name" in reasons[absolute[:-4]]
    assert "is a symlink" in reasons["000004"] and "is a hard link" in reasons["000005"]
    pixels, rows = read_shards(str(out), result.shards)
    assert [decode_index(p) for p in pixels] == [0, 8], "a link was followed or a hostile member decoded"

    created = _snapshot(tmp_path) - before
    assert all(f.startswith(os.path.join("a", "b", "out") + os.sep) for f in created), created
    assert not os.path.exists(absolute) and not os.path.exists("/evil.jpg")
    assert secret.read_bytes() == jpeg_bytes(index_image(66))


# --- member names that are not UTF-8 ----------------------------------------------------------------------


def test_a_non_utf8_member_name_is_one_sample_stored_escaped_and_reversible(tars, tmp_path):
    latin1 = b"caf\xe9-000001".decode("utf-8", "surrogateescape")  # what tarfile makes of byte 0xE9
    backslash = "back\\x41slash-000003"  # a literal backslash: escaped too, so the stored form is unambiguous
    path = tars.write("names.tar", [
        *tars.samples([0]),
        Member(f"{latin1}.jpg", jpeg_bytes(index_image(1))),
        Member(f"{latin1}.txt", b"caption 1"),
        Member(b"bad\xff\xfe-000002.jpg".decode("utf-8", "surrogateescape"), b"not an image"),
        Member(f"{backslash}.jpg", jpeg_bytes(index_image(3))),
    ])
    out = tmp_path / "out"
    result = run(path, str(out))

    assert result.error is None, result.error
    assert result.samples == 3
    assert [f["key"] for f in result.failures] == ["bad\\xff\\xfe-000002"]
    pixels, rows = read_shards(str(out), result.shards)  # the .jsonl is valid UTF-8 JSON
    assert [decode_index(p) for p in pixels] == [0, 1, 3]
    assert [r["key"] for r in rows] == ["000000", "caf\\xe9-000001", "back\\\\x41slash-000003"]
    assert rows[1]["member"] == "caf\\xe9-000001.jpg" and rows[1]["txt"] == "caption 1"
    assert unescape_name(rows[1]["member"]) == b"caf\xe9-000001.jpg"
    assert unescape_name(rows[2]["member"]) == b"back\\x41slash-000003.jpg"
    assert unescape_name(result.failures[0]["key"]) == b"bad\xff\xfe-000002"
