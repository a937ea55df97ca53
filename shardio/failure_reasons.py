"""A failed sample's reason, shortened to the category summaries count it under.

A run report keeps every failure's full reason (``{input, key, reason}``); ``preprocess run``'s summary,
``preprocess diagnose`` and ``shardio info`` count failures by category, and all three call
``failure_category`` so the same failure is counted under the same words everywhere.

The reasons come from ``preprocess`` (``tar_samples``: problems found while reading a tar;
``transform``: decoding; ``worker.parse_fields``: ``.cls`` / ``.json``), the worker prefixing decode and
metadata errors with the image member (``000001.jpg: cannot decode: ...``). A rule per reason, matched
anywhere in the text, drops what differs from sample to sample (member names, sizes, byte counts, the
JSON parser's position) and keeps what says what to fix. Cutting at the first ": " or " (" instead
turned ``no image member (has: json)`` into ``json)`` and ``unsafe member name '..' (...): ignored`` into
``ignored``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["failure_category", "count_by_category"]

# Longest category kept for a reason no rule knows (a future message): long enough to say what happened.
_MAX_UNKNOWN = 60

# (pattern, category): the first that matches wins; a category may use the pattern's groups.
_RULES: list[tuple[re.Pattern[str], str]] = [
    # Decoder failures keep the exception's type and its first words ("image file is truncated"), which
    # is what tells a truncated download from a corrupt one; the byte count in parentheses goes.
    (re.compile(r"cannot decode: (\w+): ([^(]{0,80}?)(?: \(|$)"), r"cannot decode: \1: \2"),
    (re.compile(r"cannot decode: (\w+)"), r"cannot decode: \1"),
    (re.compile(r"empty image member"), "empty image member (0 bytes)"),
    (re.compile(r"not a supported image \((JPEG signature but unreadable header|looks like text)"),
     r"not a supported image (\1)"),
    (re.compile(r"not a supported image"), "not a supported image (unknown signature)"),
    (re.compile(r"decode did not finish within"), "decode did not finish (worker stopped, sample skipped)"),
    (re.compile(r"pixel bomb"), "pixel bomb (over max_image_pixels)"),
    (re.compile(r"with an empty size"), "image with an empty size (0 pixels)"),
    (re.compile(r"internal: produced"), "internal: wrong output shape (a bug: please report it)"),
    (re.compile(r"\.cls is not an integer"), ".cls is not an integer in 0..2**63-1"),
    (re.compile(r"\.json is not valid JSON"), ".json is not valid JSON"),
    (re.compile(r"\.json is not a JSON object"), ".json is not a JSON object"),
    (re.compile(r"no image member"), "no image member (metadata only)"),
    (re.compile(r"key seen twice"), "key seen twice in a tar (first kept)"),
    (re.compile(r"unsafe member name"), "unsafe member name (absolute or '..')"),
    (re.compile(r"is a (symlink|hard link|special file), not a regular file"), r"member is a \1"),
    (re.compile(r"member .* appears twice"), "member appears twice in a sample"),
    (re.compile(r"member .* bytes \(> \d+\): skipped"), "member too large (skipped unread)"),
]


def failure_category(reason: str) -> str:
    """The short category of a failed sample's ``reason`` (as a run report stores it)."""
    for pattern, category in _RULES:
        match = pattern.search(reason)
        if match:
            return match.expand(category).strip()
    # A reason no rule knows: drop a leading member name ("x.jpg: ...", no spaces in it) and details.
    head, sep, rest = reason.partition(": ")
    text = rest if sep and " " not in head else reason
    return text.split(" (")[0].strip()[:_MAX_UNKNOWN] or "unknown"


def count_by_category(reasons: Iterable[str]) -> dict[str, int]:
    """How many reasons fall in each category, most frequent first."""
    counts: dict[str, int] = {}
    for reason in reasons:
        category = failure_category(reason)
        counts[category] = counts.get(category, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))
