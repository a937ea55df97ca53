"""Failure reasons: every reason the job can produce is counted under a readable category, the same one
in the run summary, ``preprocess diagnose`` and ``shardio info``; an input failure names its path once.

The reasons are produced by the real code (a tar holding one sample of each kind of failure, through
``process_input`` and ``diagnose``), not copied into the test, so a reworded message that no rule knows
shows up here as an unreadable category.
"""

from __future__ import annotations

import io
import os
import struct
import zlib

import numpy as np
import pytest
from PIL import Image
from rich.console import Console

from preprocess import cli, tar_samples
from preprocess.config import JobConfig
from preprocess.diagnose import diagnose, render_text
from preprocess.job import RunReport
from preprocess.worker import process_input
from shardio.store.backends import for_path
from shardio.errors import InputError
from shardio.failure_reasons import count_by_category, failure_category
from tests.tar_factory import Member, index_image, jpeg_bytes

CFG = JobConfig(height=32, width=32)
GOOD_JPEG = jpeg_bytes(index_image(9, 160, 120))
BIG = 300_000  # a member over the (patched) MAX_MEMBER_BYTES; every other member is < 10 KB


def _png_header(width: int, height: int) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


def _corrupt_png() -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(4).integers(0, 256, (60, 80, 3), dtype=np.uint8)).save(out, "PNG")
    data = bytearray(out.getvalue())
    idat = data.index(b"IDAT")
    data[idat + 200: idat + 260] = bytes(b ^ 0x55 for b in data[idat + 200: idat + 260])
    return bytes(data)


# key -> (members of that sample, the category its failure must be counted under)
CASES: dict[str, tuple[list[Member], str]] = {
    # + the decoder's words ("Truncated File Read", zlib's), which differ between Pillow versions
    "000001": ([Member("000001.jpg", GOOD_JPEG[: len(GOOD_JPEG) // 2])], "cannot decode: OSError"),
    "000002": ([Member("000002.png", _corrupt_png())], "cannot decode: OSError"),
    "000003": ([Member("000003.jpg", b"")], "empty image member (0 bytes)"),
    "000004": ([Member("000004.jpg", b"<html>404 Not Found</html>")], "not a supported image (looks like text)"),
    "000005": ([Member("000005.jpg", b"\xff\xd8\xff" + bytes(40))],
               "not a supported image (JPEG signature but unreadable header)"),
    "000006": ([Member("000006.jpg", bytes(range(256)) * 4)], "not a supported image (unknown signature)"),
    "000007": ([Member("000007.png", _png_header(30000, 30000))], "pixel bomb (over max_image_pixels)"),
    "000008": ([Member("000008.txt", b"caption only"), Member("000008.json", b"{}")],
               "no image member (metadata only)"),
    "000009": ([Member("000009.jpg", GOOD_JPEG), Member("000009.cls", b"nine")],
               ".cls is not an integer in 0..2**63-1"),
    "000010": ([Member("000010.jpg", GOOD_JPEG), Member("000010.json", b"{nope")], ".json is not valid JSON"),
    "000011": ([Member("000011.jpg", GOOD_JPEG), Member("000011.json", b"[1, 2]")],
               ".json is not a JSON object"),
    "000012": ([Member("000012.jpg", GOOD_JPEG), Member("000012.jpg", GOOD_JPEG)],
               "member appears twice in a sample"),
    "000013": ([Member("000013.jpg", bytes(BIG))], "member too large (skipped unread)"),
    "000014": ([Member("000014.jpg", kind="symlink", target="/etc/passwd")], "member is a symlink"),
    "000015": ([Member("000015.jpg", kind="hardlink", target="000099.jpg")], "member is a hard link"),
    "../evil": ([Member("../evil.jpg", GOOD_JPEG)], "unsafe member name (absolute or '..')"),
    "000099": ([Member("000099.jpg", GOOD_JPEG)], ""),  # good; then again, later in the tar:
}
LATE_DUPLICATE = ("000099", "key seen twice in a tar (first kept)")


@pytest.fixture
def every_failure_tar(tars, monkeypatch) -> str:
    monkeypatch.setattr(tar_samples, "MAX_MEMBER_BYTES", BIG - 1)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # process_image sets it
    # another good sample between, or the two 000099 members would be one sample's member twice
    members = [m for ms, _ in CASES.values() for m in ms] + [Member("000100.jpg", GOOD_JPEG),
                                                             Member("000099.jpg", GOOD_JPEG)]
    return tars.write("every-failure.tar", members)


def _expected() -> dict[str, int]:
    categories = [c for _, c in CASES.values() if c] + [LATE_DUPLICATE[1]]
    return {c: categories.count(c) for c in categories}


def test_every_reason_the_job_produces_has_its_category(every_failure_tar, tmp_path):
    result = process_input(every_failure_tar, str(tmp_path / "out"), CFG,
                           for_path(every_failure_tar).stat_fingerprint(every_failure_tar))
    assert result.error is None and result.samples == 2
    got = [(f["key"], f["reason"], failure_category(f["reason"])) for f in result.failures]
    wanted = {key: category for key, (_, category) in CASES.items() if category}
    assert len(got) == len(wanted) + 1, got
    for key, reason, category in got:
        expected = LATE_DUPLICATE[1] if key == LATE_DUPLICATE[0] else wanted[key]
        if expected == "cannot decode: OSError":  # the decoder's first words stay, its details go
            assert category.startswith(expected + ": ") and "(" not in category, (reason, category)
        else:
            assert category == expected, (key, reason)


def test_diagnose_and_the_run_summary_count_the_same_categories(every_failure_tar, tmp_path):
    result = process_input(every_failure_tar, str(tmp_path / "out"), CFG,
                           for_path(every_failure_tar).stat_fingerprint(every_failure_tar))
    report = RunReport(run_id="r", output=str(tmp_path / "out"), started="now", config={},
                       failures=result.failures)
    diagnosed = diagnose([every_failure_tar], CFG, write_dir=str(tmp_path))
    assert diagnosed["failures_by_reason"] == report.failures_by_reason()
    assert sum(diagnosed["failures_by_reason"].values()) == len(CASES)  # 16 bad + the late duplicate
    # Both OSError categories end in the decoder's words (the PNG's are zlib's): compare the rest exactly.
    decode = "cannot decode: OSError"
    counted = {k: v for k, v in report.failures_by_reason().items() if not k.startswith(decode)}
    assert counted == {k: v for k, v in _expected().items() if not k.startswith(decode)}
    assert sum(v for k, v in report.failures_by_reason().items() if k.startswith(decode)) == 2


@pytest.mark.parametrize("reason, category", [
    # The two shapes the old shortening broke: cut at ": " and " (".
    ("no image member (has: json)", "no image member (metadata only)"),
    ("unsafe member name '../x.jpg' (absolute or '..'): ignored", "unsafe member name (absolute or '..')"),
    ("x.jpg: cannot decode: OSError: image file is truncated (46 bytes not processed)",
     "cannot decode: OSError: image file is truncated"),
    ("x.jpg: PNG with an empty size 0x5", "image with an empty size (0 pixels)"),
    ("x.jpg: internal: produced (3, 3, 3), expected (4, 4, 3)",
     "internal: wrong output shape (a bug: please report it)"),
    ("member 'a.jpg' is a special file, not a regular file: ignored", "member is a special file"),
    # a message no rule knows: the member name and the details go, the words stay
    ("x.jpg: some future failure (detail 17)", "some future failure"),
])
def test_reason_shapes_no_tar_can_produce_here(reason, category):
    assert failure_category(reason) == category


def test_counts_are_most_frequent_first():
    assert list(count_by_category(["a.jpg: pixel bomb: 1", "no image member (has: txt)",
                                   "b.jpg: pixel bomb: 2"]).items()) == [
        ("pixel bomb (over max_image_pixels)", 2), ("no image member (metadata only)", 1)]


def test_an_input_failure_names_its_path_once(tars, tmp_path, monkeypatch):
    path = tars.write("no-samples.tar", [Member("README", b"hi")])
    result = process_input(path, str(tmp_path / "out"), CFG, for_path(path).stat_fingerprint(path))
    assert result.error == "tar holds no sample members"
    diagnosed = diagnose([path], CFG, write_dir=str(tmp_path))
    assert diagnosed["inputs_failed"] == [{"input": path, "reason": "tar holds no sample members"}]

    report = RunReport(run_id="r", output=str(tmp_path / "out"), started="now", config={},
                       inputs_failed=[{"input": path, "reason": result.error}])
    console = Console(file=io.StringIO(), width=400)
    monkeypatch.setattr(cli, "console", console)
    cli._summary(report, "report.json")
    printed = console.file.getvalue()
    assert f"input failed: {path}: tar holds no sample members" in printed
    assert printed.count(os.path.basename(path)) == 1, printed
    assert any(f"input failed: {path}: tar holds" in str(line) for line in render_text(diagnosed))


def test_an_input_error_keeps_input_and_reason_through_pickling():
    import pickle

    error = pickle.loads(pickle.dumps(InputError("/data/a.tar", "no such file")))  # as Ray would carry it
    assert (error.input, error.reason, str(error)) == ("/data/a.tar", "no such file", "/data/a.tar: no such file")
