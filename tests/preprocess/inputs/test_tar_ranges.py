"""The tar reader's split: one index pass over the headers, then each member as a byte range.

The index must locate every member exactly (the object-storage reader will issue range requests from it),
read no member data, and a broken tar must fail in the index pass, before a single sample is decoded.
"""

from __future__ import annotations

import gzip
import io
import tarfile

import pytest

from preprocess.inputs.tar_samples import RawSample, index_tar, iter_tar_samples
from shardio.errors import InputError
from tests.tar_factory import Member, index_image, jpeg_bytes

IMAGE_EXTENSIONS = ("jpg", "png")


def test_index_locates_every_member_as_a_byte_range(tars):
    path = tars.write("ranges.tar", [
        Member("dir/", kind="dir"),
        *tars.samples(range(3)),
        Member("000003.jpg", kind="symlink", target="000000.jpg"),
        Member("a" * 150 + "/000004.jpg", jpeg_bytes(index_image(4))),  # a GNU long name: extra headers
    ])
    index = index_tar(path)
    assert index is not None and index.path == path
    with open(path, "rb") as f:
        archive = f.read()
    files = [m for m in index.members if m.kind == "file"]
    assert [m.kind for m in index.members if m.kind != "file"] == ["dir", "symlink"]
    assert len(files) == 3 * 4 + 1  # jpg, txt, cls, json per sample, then the long-named image
    samples = [s for s in iter_tar_samples(path, IMAGE_EXTENSIONS) if isinstance(s, RawSample)]
    by_name = {s.image_member: s.image for s in samples}
    for member in files:
        data = archive[member.offset: member.offset + member.size]
        if member.name in by_name:
            assert data == by_name[member.name]
    assert files[-1].name.endswith("/000004.jpg") and len(files[-1].name) == 161
    assert archive[files[-1].offset: files[-1].offset + files[-1].size] == jpeg_bytes(index_image(4))


def test_samples_are_read_from_the_ranges_of_the_index(tars):
    """With an index passed in, the data comes from its byte ranges: rewriting an image's bytes in place
    (same size) after indexing shows in the sample, so nothing was read during the index pass."""
    path = tars.write("reread.tar", tars.samples(range(2)))
    index = index_tar(path)
    image = next(m for m in index.members if m.name == "000001.jpg")
    with open(path, "r+b") as f:
        f.seek(image.offset)
        f.write(b"\xab" * image.size)
    found = list(iter_tar_samples(path, IMAGE_EXTENSIONS, index=index))
    assert found[1].image == b"\xab" * image.size
    assert isinstance(found[0], RawSample) and found[0].image == jpeg_bytes(index_image(0))


def test_a_truncated_tar_fails_before_the_first_sample(tars):
    path = tars.derive("cut.tar", tars.make("good.tar", range(6)), lambda data: data[: len(data) // 2])
    samples = iter_tar_samples(path, IMAGE_EXTENSIONS)
    with pytest.raises(InputError, match="not a readable tar|truncated"):
        next(samples)  # the tarfile-per-member reader yielded the first samples, then failed


def test_a_tar_shrunk_after_indexing_is_an_input_error(tars):
    path = tars.write("shrunk.tar", tars.samples(range(3)))
    index = index_tar(path)
    last_image = next(m for m in index.members if m.name == "000002.jpg")
    with open(path, "r+b") as f:
        f.truncate(last_image.offset + 10)
    with pytest.raises(InputError, match="changed while it was read"):
        list(iter_tar_samples(path, IMAGE_EXTENSIONS, index=index))


def test_compressed_tars_have_no_index_and_stream(tars):
    gz = tars.derive("good.tar.gz", tars.make("good.tar", range(3)), gzip.compress)
    assert index_tar(gz) is None
    assert [s.key for s in iter_tar_samples(gz, IMAGE_EXTENSIONS)] == ["000000", "000001", "000002"]



def _tarfile_index(path: str) -> list[tuple[str, int, int, str]]:
    """The index as tarfile alone reads it: the reference for the fast header parser."""
    kinds = {tarfile.DIRTYPE: "dir", tarfile.SYMTYPE: "symlink", tarfile.LNKTYPE: "hard link"}
    with tarfile.open(path, encoding="utf-8", errors="surrogateescape") as tar:
        return [(m.name, m.offset_data, m.size, "file" if m.isreg() else kinds.get(m.type, "special file"))
                for m in tar]


def _write_tar(path: str, names: list[str], tar_format: int) -> str:
    with tarfile.open(path, "w", format=tar_format, encoding="utf-8", errors="surrogateescape") as tar:
        for index, name in enumerate(names):
            info = tarfile.TarInfo(name)
            if name.endswith("/"):
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif name.endswith(".lnk"):
                info.type, info.linkname = tarfile.SYMTYPE, "000000.jpg"
                tar.addfile(info)
            else:
                data = bytes([index % 251]) * (index * 37 % 1500)  # 0 bytes, < 1 block, several blocks
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


NAMES = [
    "000000.jpg", "000000.txt", "000001.jpg", "a/b/000002.json",
    "d" * 120 + "/000003.jpg",  # > 100 bytes: GNU long-name header / ustar prefix / pax path
    "000004.jpg", "dir/", "000005.lnk", "000006.jpg",
    "caf\udce9/000007.jpg",  # a non-UTF-8 byte (0xe9), surrogate-escaped
    "000008.jpg",
]


@pytest.mark.parametrize("tar_format", [tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT])
def test_fast_index_equals_tarfiles(tmp_path, tar_format):
    names = NAMES if tar_format != tarfile.USTAR_FORMAT else [n for n in NAMES if "\udce9" not in n]
    path = _write_tar(str(tmp_path / "t.tar"), names, tar_format)
    index = index_tar(path)
    assert [(m.name, m.offset, m.size, m.kind) for m in index.members] == _tarfile_index(path)


def test_plain_headers_are_parsed_without_tarfile(tars, monkeypatch):
    """A webdataset tar of plain members: tarfile parses its first header (detection) and the end block,
    not one header per member (~30 us each, 3 a sample)."""
    path = tars.make("plain.tar", range(50))
    parsed = []
    original = tarfile.TarInfo.frombuf.__func__

    def counting_frombuf(cls, buf, encoding, errors):
        parsed.append(1)
        return original(cls, buf, encoding, errors)

    monkeypatch.setattr(tarfile.TarInfo, "frombuf", classmethod(counting_frombuf))
    index = index_tar(path)
    assert len(index.members) == 200 and len(parsed) <= 2
    assert [(m.name, m.offset, m.size, m.kind) for m in index.members] == _tarfile_index(path)
