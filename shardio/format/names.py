"""Names in a dataset: sample and member names as valid UTF-8, reversibly (spec, "Names"), the file names a
writer gives a shard, and the one safe form of a path a manifest lists (``shards/NAME``: never outside
the dataset)."""

from __future__ import annotations

import posixpath
import re
from typing import Any

from shardio.errors import ShardFormatError
from shardio.format.spec import SHARDS_DIR

__all__ = ["escape_name", "unescape_name", "is_shard_file_name", "check_dataset_path"]


_ESCAPED = re.compile(r"\\(x[0-9a-f]{2}|\\)")


def escape_name(name: str) -> str:
    """A tar member name (``str`` as ``tarfile`` decodes it: UTF-8, undecodable bytes as lone surrogates
    ``U+DC80..U+DCFF``) as valid UTF-8 text, reversibly: see "Names" in ``shardio.format.spec``."""
    if name.isascii() and "\\" not in name:
        return name  # nearly every name: nothing to escape
    text = name.encode("utf-8", "surrogateescape").decode("utf-8", "surrogateescape")
    out = []
    for char in text:
        if char == "\\":
            out.append("\\\\")
        elif "\udc80" <= char <= "\udcff":
            out.append(f"\\x{ord(char) - 0xDC00:02x}")
        else:
            out.append(char)
    return "".join(out)


def unescape_name(text: str) -> bytes:
    """The member name's original bytes from its stored form (the inverse of ``escape_name``)."""
    out = bytearray()
    position = 0
    for match in _ESCAPED.finditer(text):
        out += text[position:match.start()].encode("utf-8")
        token = match.group(1)
        out += b"\\" if token == "\\" else bytes([int(token[1:], 16)])
        position = match.end()
    out += text[position:].encode("utf-8")
    return bytes(out)


_SHARDS_PREFIX = f"{SHARDS_DIR}/"


# A shard's file name as writers give it (spec, "What a run of a dataset writes"): the cleaning of a
# killed run's leftovers removes only these (and staged ``.tmp-`` files), never a user's file.
_SHARD_FILE_NAME = re.compile(r"[^./][^/]*-[0-9]{5,}(\.npy|\.jpg\.npy|\.yuv\.npy|\.jsonl"
                              r"|\.[A-Za-z_][A-Za-z0-9_]*\.npy)")  # the last: a model output's file


def is_shard_file_name(name: str) -> bool:
    """Whether ``name`` (a file name in ``shards/``, no folder) is one a writer gives a shard's file:
    ``STEM-NNNNN.npy``, ``.jpg.npy``, ``.yuv.npy``, ``.jsonl``, or an output's ``.NAME.npy``."""
    return _SHARD_FILE_NAME.fullmatch(name) is not None and "\\" not in name and "\0" not in name


def check_dataset_path(rel: Any, where: str) -> str:
    """``rel`` if it is a safe shard path (``shards/NAME``, see the spec), else ShardFormatError naming it."""
    # The common case in a few string operations (a load checks two paths a shard): ``shards/`` then a
    # name with no separator, NUL or leading dot is already normal.
    if (isinstance(rel, str) and rel.startswith(_SHARDS_PREFIX) and len(rel) > len(_SHARDS_PREFIX)
            and rel[len(_SHARDS_PREFIX)] != "." and rel.count("/") == 1 and "\\" not in rel and "\0" not in rel):
        return rel
    ok = (
        isinstance(rel, str)
        and "\\" not in rel
        and "\0" not in rel
        and posixpath.normpath(rel) == rel
        and rel.count("/") == 1
        and rel.split("/")[0] == SHARDS_DIR
        and not rel.split("/")[1].startswith(".")
    )
    if not ok:
        raise ShardFormatError(
            f"{where}: unsafe shard path {rel!r} (must be {SHARDS_DIR}/NAME inside the dataset); the manifest was "
            "edited or forged: nothing was read or deleted. HINT: restore the manifest from a kept generation "
            "(`preprocess verify DIR --repair`) or from a backup"
        )
    return rel
