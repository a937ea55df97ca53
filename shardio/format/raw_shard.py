"""A raw shard (``encoding: raw``): its ``.npy`` header written, sized and parsed (spec, "Pixels": always 128
bytes, so a shard's exact size follows from its sample count and one ``stat`` catches a truncated shard)."""

from __future__ import annotations

import re
from typing import Any

from shardio.errors import ShardFormatError
from shardio.format.spec import HEADER_BYTES, NPY_MAGIC

__all__ = ["fixed_npy_header", "npy_header_fields", "npy_header", "shard_nbytes", "parse_npy_header",
           "npy_header_dict"]

# A .npy header's dictionary, read without ``ast``: CPython 3.11 keeps the AST builder's recursion depth in state
# all threads share, and a header parsed in one thread while another compiles (a module imported for the first
# time, from source: a fresh checkout has no .pyc) fails with "SystemError: AST constructor recursion depth
# mismatch". The grammar is the one numpy writes: {'descr': STR, 'fortran_order': BOOL, 'shape': (INT, ...), }.
_VALUE = r"""'[^'\\]*'|True|False|\(\s*(?:\d+\s*,\s*)*(?:\d+\s*)?\)"""  # a str, a bool, a tuple of ints
_ENTRY = re.compile(r"\s*'(descr|fortran_order|shape)'\s*:\s*(" + _VALUE + r")\s*(,|\})")


def fixed_npy_header(descr: str, shape: tuple[int, ...]) -> bytes:
    """The fixed 128-byte .npy v1.0 header of a C-order array of ``descr`` and ``shape``: every shard's pixel
    file starts with one (raw, JPEG offsets, yuv420 planes), so its data starts at ``HEADER_BYTES``."""
    dims = tuple(int(n) for n in shape)
    body = "{'descr': %r, 'fortran_order': False, 'shape': %s, }" % (descr, dims)
    body_len = HEADER_BYTES - len(NPY_MAGIC) - 2
    if len(body) + 1 > body_len:
        raise ValueError(f"shape {dims} does not fit a {HEADER_BYTES}-byte header")
    padded = body.ljust(body_len - 1) + "\n"
    return NPY_MAGIC + body_len.to_bytes(2, "little") + padded.encode("latin1")


def npy_header_fields(header: bytes, path: str, what: str, hint: str, header_name: str) -> dict[str, Any]:
    """The fields of a fixed 128-byte .npy v1.0 header (``descr``, ``fortran_order``, ``shape`` as a tuple): what
    every shard file's parser reads before it checks what its kind needs. ShardFormatError naming ``path`` when
    the magic is missing (``what``: the kind of file expected; ``hint``: the fix) or ``header_name`` is unreadable."""
    if len(header) < HEADER_BYTES or not header.startswith(NPY_MAGIC):
        raise ShardFormatError(f"{path}: not {what} (no .npy v1.0 magic in the first {HEADER_BYTES} bytes); "
                               f"HINT: {hint}")
    try:
        return npy_header_dict(header[10:HEADER_BYTES].decode("latin1"))
    except ValueError as e:
        raise ShardFormatError(f"{path}: unreadable {header_name}: {e}") from e


def npy_header_dict(text: str) -> dict[str, Any]:
    """A .npy header's dictionary (``descr`` str, ``fortran_order`` bool, ``shape`` tuple of ints), each key
    once and all three present; ValueError for anything else (a structured dtype's list ``descr`` included:
    no shardio file has one)."""
    body = text.strip()
    if not body.startswith("{"):
        raise ValueError(f"the header {body[:40]!r} is not a dictionary")
    found: dict[str, Any] = {}
    at, end = 1, len(body)
    while at < end:
        match = _ENTRY.match(body, at)
        if match is None:
            if body[at:].strip() == "}":  # the closing brace after a trailing comma
                at = end
                break
            raise ValueError(f"the header {body[:80]!r} is not descr, fortran_order and shape")
        key, value, after = match.groups()
        if key in found:
            raise ValueError(f"the header names {key} twice")
        if value.startswith("'"):
            found[key] = value[1:-1]
        elif value.startswith("("):
            found[key] = tuple(int(d) for d in value[1:-1].replace(",", " ").split())
        else:
            found[key] = value == "True"
        at = match.end()
        if after == "}":
            break
    kinds = {"descr": str, "fortran_order": bool, "shape": tuple}
    if body[at:].strip() or set(found) != set(kinds) or any(not isinstance(found[k], t) for k, t in kinds.items()):
        raise ValueError(f"the header {body[:80]!r} is not descr, fortran_order and shape")
    return found


def npy_header(count: int, height: int, width: int) -> bytes:
    """The fixed 128-byte .npy v1.0 header of a shard of ``count`` H×W×3 uint8 images."""
    return fixed_npy_header("|u1", (count, height, width, 3))


def shard_nbytes(count: int, height: int, width: int) -> int:
    """The exact size of a raw shard of ``count`` H×W×3 images: the header and the pixels."""
    return HEADER_BYTES + count * height * width * 3


def parse_npy_header(header: bytes, path: str) -> tuple[int, int, int]:
    """Return (N, H, W) from a shard's first 128 bytes, or say exactly what is wrong with them."""
    meta = npy_header_fields(header, path, "a shardio shard", "the file is corrupt or was not written by preprocess "
                             "- re-run `preprocess verify --repair`", ".npy header")
    shape = meta["shape"]
    ok = meta["descr"] == "|u1" and not meta["fortran_order"] and len(shape) == 4 and shape[3] == 3
    if not ok:
        raise ShardFormatError(f"{path}: header describes {meta!r}, expected uint8 N×H×W×3 in C order")
    return int(shape[0]), int(shape[1]), int(shape[2])
