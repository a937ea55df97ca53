"""Failure codes: every failure the job can produce carries its code, counted under the code's category,
the same in the run summary, ``preprocess diagnose`` and ``shardio info``; reports round-trip the code and
older reports without one still display; an input failure names its path once.

The failures are produced by the real code (a tar holding one sample of each kind of failure, through
``process_input`` and ``diagnose``), not copied into the test; the codes of single images (decoding, the
per-image limits) are in tests/preprocess/image/test_failure_codes.py.
"""

from __future__ import annotations

import ast
import inspect
import io
import json
import os
import pickle
import struct
import zlib

import numpy as np
import pytest
from PIL import Image
from rich.console import Console

from preprocess import run_display
from preprocess.inputs import tar_samples
from preprocess.config import JobConfig
from preprocess.diagnose import diagnose, render_text
from preprocess.job import RunReport
from preprocess.worker import process_input
from shardio import failure_reasons
from shardio.errors import InputError, SampleError
from shardio.failure_reasons import CATEGORIES, FailureCode, count_by_category, failure_category
from shardio.format.run_report import report_json
from shardio.store.backends import for_path
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


# key -> (members of that sample, the code its failure must carry)
CASES: dict[str, tuple[list[Member], str]] = {
    "000001": ([Member("000001.jpg", GOOD_JPEG[: len(GOOD_JPEG) // 2])], "truncated"),  # Pillow's words
    "000002": ([Member("000002.png", _corrupt_png())], "decode_error"),
    "000003": ([Member("000003.jpg", b"")], "empty_member"),
    "000004": ([Member("000004.jpg", b"<html>404 Not Found</html>")], "not_an_image"),
    "000005": ([Member("000005.jpg", b"\xff\xd8\xff" + bytes(40))], "bad_jpeg_header"),
    "000006": ([Member("000006.jpg", bytes(range(256)) * 4)], "unknown_format"),
    "000007": ([Member("000007.png", _png_header(30000, 30000))], "too_many_pixels"),
    "000008": ([Member("000008.txt", b"caption only"), Member("000008.json", b"{}")], "missing_image"),
    "000009": ([Member("000009.jpg", GOOD_JPEG), Member("000009.cls", b"nine")], "bad_cls"),
    "000010": ([Member("000010.jpg", GOOD_JPEG), Member("000010.json", b"{nope")], "bad_json"),
    "000011": ([Member("000011.jpg", GOOD_JPEG), Member("000011.json", b"[1, 2]")], "json_not_object"),
    "000012": ([Member("000012.jpg", GOOD_JPEG), Member("000012.jpg", GOOD_JPEG)], "duplicate_member"),
    "000013": ([Member("000013.jpg", bytes(BIG))], "member_too_large"),
    "000014": ([Member("000014.jpg", kind="symlink", target="/etc/passwd")], "not_a_file"),
    "000015": ([Member("000015.jpg", kind="hardlink", target="000099.jpg")], "not_a_file"),
    "../evil": ([Member("../evil.jpg", GOOD_JPEG)], "unsafe_name"),
    "000099": ([Member("000099.jpg", GOOD_JPEG)], ""),  # good; then again, later in the tar:
}
LATE_DUPLICATE = ("000099", "duplicate_key")
# The samples whose image member reached the decoder: their reasons start with the member's name.
DECODED = {"000001", "000002", "000003", "000004", "000005", "000006", "000007", "000009", "000010", "000011"}


@pytest.fixture
def every_failure_tar(tars, monkeypatch) -> str:
    monkeypatch.setattr(tar_samples, "MAX_MEMBER_BYTES", BIG - 1)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # process_image sets it
    # another good sample between, or the two 000099 members would be one sample's member twice
    members = [m for ms, _ in CASES.values() for m in ms] + [Member("000100.jpg", GOOD_JPEG),
                                                             Member("000099.jpg", GOOD_JPEG)]
    return tars.write("every-failure.tar", members)


def _expected_codes() -> list[str]:
    return [code for _, code in CASES.values() if code] + [LATE_DUPLICATE[1]]


def test_every_failure_the_job_produces_carries_its_code(every_failure_tar, tmp_path):
    result = process_input(every_failure_tar, str(tmp_path / "out"), CFG,
                           for_path(every_failure_tar).stat_fingerprint(every_failure_tar))
    assert result.error is None and result.samples == 2
    wanted = {key: code for key, (_, code) in CASES.items() if code}
    got = {(f["key"], f["code"]) for f in result.failures}
    assert len(result.failures) == len(wanted) + 1, result.failures
    assert got == set(wanted.items()) | {LATE_DUPLICATE}
    for failure in result.failures:
        assert set(failure) == {"input", "key", "code", "reason"} and failure["reason"]
        assert type(failure["code"]) is str  # plain data: JSON and Ray carry it as it is
        assert failure["reason"].startswith(f"{failure['key']}.") == (failure["key"] in DECODED), failure


def test_diagnose_and_the_run_summary_count_the_same_categories(every_failure_tar, tmp_path):
    result = process_input(every_failure_tar, str(tmp_path / "out"), CFG,
                           for_path(every_failure_tar).stat_fingerprint(every_failure_tar))
    report = RunReport(run_id="r", output=str(tmp_path / "out"), started="now", config={},
                       failures=result.failures)
    diagnosed = diagnose([every_failure_tar], CFG, write_dir=str(tmp_path))
    codes = _expected_codes()
    expected = {CATEGORIES[FailureCode(c)]: codes.count(c) for c in codes}
    assert report.failures_by_reason() == expected
    assert diagnosed["failures_by_reason"] == expected
    assert sum(expected.values()) == len(CASES)  # 16 bad + the late duplicate


def test_every_code_has_its_own_category():
    assert set(CATEGORIES) == set(FailureCode)
    assert len(set(CATEGORIES.values())) == len(CATEGORIES), "two codes would be counted as one"
    assert all(code.value == code.value.lower() and " " not in code.value for code in FailureCode)


def test_counts_are_most_frequent_first():
    failures = [{"code": "too_many_pixels", "reason": "a.jpg: pixel bomb: 1"},
                {"code": "missing_image", "reason": "no image member (has: txt)"},
                {"code": "too_many_pixels", "reason": "b.jpg: pixel bomb: 2"}]
    assert list(count_by_category(failures).items()) == [
        ("pixel bomb (over max_image_pixels)", 2), ("no image member (metadata only)", 1)]


def test_a_failure_without_a_code_or_with_a_newer_one_still_counts():
    unknown = CATEGORIES[FailureCode.UNKNOWN]
    old = {"input": "a.tar", "key": "1", "reason": "1.jpg: pixel bomb: 9 > max_image_pixels 8"}  # no code
    assert failure_category(old) == unknown
    assert failure_category({**old, "code": None}) == unknown
    assert failure_category({**old, "code": "from_a_newer_writer"}) == "from_a_newer_writer"
    assert count_by_category([old, old, {**old, "code": "too_small"}]) == {unknown: 2, "image too small": 1}


def test_categories_are_never_read_out_of_reason_text():
    # The successor of 17 regexes that turned reasons back into categories: codes only, no text parsing.
    source = inspect.getsource(failure_reasons)
    tree = ast.parse(source)
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"re", "regex", "fnmatch", "glob"}, imported
    reads_reason = [node.lineno for node in ast.walk(tree)
                    if isinstance(node, ast.Constant) and node.value == "reason"]
    assert not reads_reason, f"shardio/failure_reasons.py reads a failure's reason at lines {reads_reason}"
    # The same reason under another code is counted under that code: the words play no part.
    assert failure_category({"code": "too_small", "reason": "pixel bomb: 1"}) == "image too small"


def test_a_report_round_trips_the_codes_and_info_counts_them(every_failure_tar, tmp_path):
    out = str(tmp_path / "out")
    result = process_input(every_failure_tar, out, CFG, for_path(every_failure_tar).stat_fingerprint(every_failure_tar))
    report = RunReport(run_id="r", output=out, started="now", config={}, failures=result.failures)
    doc = json.loads(report_json(report))
    assert doc["failures"] == result.failures
    assert doc["failures_by_reason"] == report.failures_by_reason()
    assert {f["code"] for f in doc["failures"]} == set(_expected_codes())


def test_the_summary_shows_an_old_report_s_failures_under_unknown(tmp_path, monkeypatch):
    old = [{"input": "a.tar", "key": f"{i}", "reason": f"{i}.jpg: cannot decode: OSError: x"}
           for i in range(3)]
    report = RunReport(run_id="r", output=str(tmp_path), started="now", config={}, samples_failed=4,
                       failures=old + [{"input": "a.tar", "key": "9", "code": "empty_member",
                                        "reason": "9.jpg: empty image member (0 bytes)"}])
    console = Console(file=io.StringIO(), width=400)
    monkeypatch.setattr(run_display, "console", console)
    run_display.summary(report, "report.json")
    printed = console.file.getvalue()
    assert f"     3 x {CATEGORIES[FailureCode.UNKNOWN]}" in printed
    assert "     1 x empty image member (0 bytes)" in printed


def test_an_input_failure_names_its_path_once(tars, tmp_path, monkeypatch):
    path = tars.write("no-samples.tar", [Member("README", b"hi")])
    result = process_input(path, str(tmp_path / "out"), CFG, for_path(path).stat_fingerprint(path))
    assert result.error == "tar holds no sample members"
    diagnosed = diagnose([path], CFG, write_dir=str(tmp_path))
    assert diagnosed["inputs_failed"] == [{"input": path, "reason": "tar holds no sample members"}]

    report = RunReport(run_id="r", output=str(tmp_path / "out"), started="now", config={},
                       inputs_failed=[{"input": path, "reason": result.error}])
    console = Console(file=io.StringIO(), width=400)
    monkeypatch.setattr(run_display, "console", console)
    run_display.summary(report, "report.json")
    printed = console.file.getvalue()
    assert f"input failed: {path}: tar holds no sample members" in printed
    assert printed.count(os.path.basename(path)) == 1, printed
    assert any(f"input failed: {path}: tar holds" in str(line) for line in render_text(diagnosed))


def test_an_input_error_keeps_input_and_reason_through_pickling():
    error = pickle.loads(pickle.dumps(InputError("/data/a.tar", "no such file")))  # as Ray would carry it
    assert (error.input, error.reason, str(error)) == ("/data/a.tar", "no such file", "/data/a.tar: no such file")


def test_a_sample_error_keeps_code_and_detail_through_pickling():
    error = pickle.loads(pickle.dumps(SampleError(FailureCode.TOO_SMALL, "image too small (4x4: ...)")))
    assert (error.code, error.detail, str(error)) == (FailureCode.TOO_SMALL, "image too small (4x4: ...)",
                                                      "image too small (4x4: ...)")
