"""Why a sample failed, as a code: the table of failure codes and the summary category of each.

A failed sample is a record ``{input, key, code, reason}`` in a run report's ``failures``: ``code`` (a
``FailureCode`` value) says what went wrong, for programs and for counting; ``reason`` says it to a person,
with what differs from sample to sample (the member, sizes, the limit, the decoder's words). ``preprocess
run``'s summary, ``preprocess diagnose`` and ``shardio info`` count failures by code, each printed as its
category below, so the same failure is counted under the same words everywhere. Nothing reads a category
back out of a reason: 17 regexes once did, and a reworded message fell out of its category unnoticed.

Codes are set where the failure is found: ``preprocess.image.transform`` (decoding, the per-image limits),
``preprocess.worker`` (``.cls`` / ``.json``, a decode stopped by ``preprocess.image.decode_watch``),
``preprocess.inputs.tar_samples`` (problems found while reading a tar), ``preprocess.inputs.folder_samples`` (an
image in no class folder, a folder's file that cannot be read) and ``preprocess.inputs.sources`` (an item a
Python source's function yields that is no sample). A code is never renamed or reused: old
reports keep it. A report written before codes existed has failures without one; they count as
``unknown``, their reasons still in the report. A code this version does not know (a newer writer's) is
its own category.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import Enum
from typing import Any

__all__ = ["FailureCode", "CATEGORIES", "code_of", "failure_category", "count_by_category"]


class FailureCode(str, Enum):
    """What went wrong with one sample; the value is what a report stores. (A ``str`` mixin, not 3.11's
    ``StrEnum``: the reader supports Python 3.10.)"""

    # the image bytes (preprocess.image.transform)
    EMPTY_MEMBER = "empty_member"  # the image member holds 0 bytes
    NOT_AN_IMAGE = "not_an_image"  # no image signature, and the start looks like text (an HTML error page)
    BAD_JPEG_HEADER = "bad_jpeg_header"  # a JPEG signature, but a header no decoder can read
    UNKNOWN_FORMAT = "unknown_format"  # binary data of no allowed format
    UNSUPPORTED_FORMAT = "unsupported_format"  # a TIFF compression this Pillow build cannot decode
    UNREADABLE_TIFF = "unreadable_tiff"  # a TIFF whose layout the decoder cannot read (e.g. its extra samples)
    UNSUPPORTED_COLOUR = "unsupported_colour"  # a colour space this Pillow build cannot convert (Lab: no littleCMS)
    TOO_MANY_PIXELS = "too_many_pixels"  # the header's size is over max_image_pixels (a pixel bomb)
    EMPTY_SIZE = "empty_size"  # the header's size is 0 on a side
    TOO_SMALL = "too_small"  # the short side is under min_image_size
    ASPECT_RATIO = "aspect_ratio"  # long / short side is over max_aspect_ratio
    TOO_MANY_SCANS = "too_many_scans"  # a JPEG with more scans than max_jpeg_scans
    DECODED_BYTES = "decoded_bytes"  # decoding would take more than max_decoded_bytes
    TRUNCATED = "truncated"  # the data ends before the image does (a cut download)
    INCOMPLETE_JPEG = "incomplete_jpeg"  # a JPEG's scans stop before every component is complete
    SCAN_ENDS_EARLY = "scan_ends_early"  # a JPEG's scan data ends early (a stray marker, a header too large)
    DECODE_ERROR = "decode_error"  # the decoder refused the data (its words are in the reason)
    DECODE_TIMEOUT = "decode_timeout"  # the decode took longer than max_decode_seconds
    INTERNAL = "internal"  # the output had the wrong shape: a bug
    # a decode that never returned (preprocess.image.decode_watch, recorded by preprocess.worker)
    DECODE_STUCK = "decode_stuck"
    # the metadata members (preprocess.worker.parse_fields)
    BAD_CLS = "bad_cls"  # .cls is not a decimal integer in 0..2**63-1
    BAD_JSON = "bad_json"  # .json does not parse as strict JSON
    JSON_NOT_OBJECT = "json_not_object"  # .json parses, but not to an object
    # the tar's members (preprocess.inputs.tar_samples)
    MISSING_IMAGE = "missing_image"  # a sample with metadata but no image member
    DUPLICATE_KEY = "duplicate_key"  # a key seen again later in the tar: the first is kept
    DUPLICATE_MEMBER = "duplicate_member"  # two members of one sample with the same extension
    UNSAFE_NAME = "unsafe_name"  # an absolute member name, or one with '..'
    NOT_A_FILE = "not_a_file"  # a symlink, hard link or special file where a member should be
    MEMBER_TOO_LARGE = "member_too_large"  # over tar_samples.MAX_MEMBER_BYTES: skipped unread
    # a folder's files (preprocess.inputs.folder_samples)
    NO_CLASS = "no_class"  # folder_classes: an image directly in the folder, in no class sub-folder
    UNREADABLE_FILE = "unreadable_file"  # a file of a folder input that cannot be read (permissions, I/O)
    # a source written in Python (preprocess.inputs.sources)
    NOT_A_SAMPLE = "not_a_sample"  # its function yielded something that is no Sample (a dict, None)
    # never written: a failure of a report from before codes
    UNKNOWN = "unknown"


# The words a summary prints for each code: one category per code, stable (users grep for them).
CATEGORIES: dict[FailureCode, str] = {
    FailureCode.EMPTY_MEMBER: "empty image member (0 bytes)",
    FailureCode.NOT_AN_IMAGE: "not a supported image (looks like text)",
    FailureCode.BAD_JPEG_HEADER: "not a supported image (JPEG signature but unreadable header)",
    FailureCode.UNKNOWN_FORMAT: "not a supported image (unknown signature)",
    FailureCode.UNSUPPORTED_FORMAT: "TIFF compression not supported",
    FailureCode.UNREADABLE_TIFF: "TIFF the decoder cannot read (its layout: samples, extra samples, bits)",
    FailureCode.UNSUPPORTED_COLOUR: "colour space this Pillow build cannot convert to RGB (Lab needs littleCMS)",
    FailureCode.TOO_MANY_PIXELS: "pixel bomb (over max_image_pixels)",
    FailureCode.EMPTY_SIZE: "image with an empty size (0 pixels)",
    FailureCode.TOO_SMALL: "image too small",
    FailureCode.ASPECT_RATIO: "aspect ratio too large",
    FailureCode.TOO_MANY_SCANS: "too many JPEG scans",
    FailureCode.DECODED_BYTES: "decoded size too large",
    FailureCode.TRUNCATED: "truncated image (the data ends early)",
    FailureCode.INCOMPLETE_JPEG: "incomplete JPEG",
    FailureCode.SCAN_ENDS_EARLY: "JPEG scan data ends early",
    FailureCode.DECODE_ERROR: "cannot decode (the decoder's error is in each reason)",
    FailureCode.DECODE_TIMEOUT: "decode too slow",
    FailureCode.INTERNAL: "internal: wrong output shape (a bug: please report it)",
    FailureCode.DECODE_STUCK: "decode did not finish (worker stopped, sample skipped)",
    FailureCode.BAD_CLS: ".cls is not an integer in 0..2**63-1",
    FailureCode.BAD_JSON: ".json is not valid JSON",
    FailureCode.JSON_NOT_OBJECT: ".json is not a JSON object",
    FailureCode.MISSING_IMAGE: "no image member (metadata only)",
    FailureCode.DUPLICATE_KEY: "key seen twice in a tar (first kept)",
    FailureCode.DUPLICATE_MEMBER: "member appears twice in a sample",
    FailureCode.UNSAFE_NAME: "unsafe member name (absolute or '..')",
    FailureCode.NOT_A_FILE: "member is a link or special file",
    FailureCode.MEMBER_TOO_LARGE: "member too large (skipped unread)",
    FailureCode.NO_CLASS: "image not in a class folder (folder_classes)",
    FailureCode.UNREADABLE_FILE: "file cannot be read (permissions, I/O: its error is in each reason)",
    FailureCode.NOT_A_SAMPLE: "not a Sample (a Python source yielded something else)",
    FailureCode.UNKNOWN: "unknown (a report from before failure codes: see its reasons)",
}
_CATEGORY_OF_VALUE: dict[str, str] = {code.value: category for code, category in CATEGORIES.items()}


def code_of(failure: Mapping[str, Any]) -> str:
    """The code of one failure record; ``unknown`` for a record without one (an older report)."""
    code = failure.get("code")
    return code if isinstance(code, str) and code else FailureCode.UNKNOWN.value


def failure_category(failure: Mapping[str, Any]) -> str:
    """The summary category of one failure record (as a run report stores it), read from its code."""
    code = code_of(failure)
    return _CATEGORY_OF_VALUE.get(code, code)


def count_by_category(failures: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """How many failure records fall in each category, most frequent first."""
    counts: dict[str, int] = {}
    for failure in failures:
        category = failure_category(failure)
        counts[category] = counts.get(category, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))
