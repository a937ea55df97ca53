"""Hashing names for membership, with numpy and no object per name: a 64-bit FNV-1a of each string's UTF-8
bytes, computed a byte column at a time over many strings (``string_hashes``), straight from a segment's
string table (``SegmentColumns.hashes``), and looked up in a sorted array (``hashes_in``). The index's
duplicate check, the leftover cleaning and retention all ask "is this path listed?" this way."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["string_hashes", "hashes_in", "fnv1a"]

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)  # 64-bit FNV-1a
_FNV_PRIME = np.uint64(0x100000001B3)
_HASH_ROWS = 1 << 16  # strings hashed at a time: bounds the temporaries, keeps them in cache


def string_hashes(values: Sequence[str] | np.ndarray) -> np.ndarray:
    """The 64-bit FNV-1a hash of each value's UTF-8 bytes (uint64, in order): a ``str`` sequence (a name
    that is not UTF-8, as ``os.listdir`` gives it, hashes as its bytes: ``surrogateescape``), or a
    fixed-width ``S`` array, whose values hash without their NUL padding (the same at any width).
    Computed a byte column at a time over all the strings, with numpy's uint64 wrap-around: no Python
    object per string for an array. For membership: equal strings hash equal; unequal ones may too (about
    n*m/2**64 expected collisions of m names against n), so a match means "maybe listed"."""
    if isinstance(values, np.ndarray) and values.dtype.kind == "S":
        flat = np.ascontiguousarray(values).reshape(-1)
        width = flat.dtype.itemsize
        if not len(flat) or not width:
            return np.full(len(flat), _FNV_OFFSET, dtype=np.uint64)
        matrix = flat.view(np.uint8).reshape(len(flat), width)
        lengths = np.empty(len(flat), dtype=np.int64)
        for start in range(0, len(flat), _HASH_ROWS):  # a value ends at its last non-NUL byte
            nonzero = matrix[start:start + _HASH_ROWS] != 0
            last = width - np.argmax(nonzero[:, ::-1], axis=1)
            lengths[start:start + _HASH_ROWS] = np.where(nonzero.any(axis=1), last, 0)
        return fnv1a(matrix.reshape(-1), np.arange(len(flat), dtype=np.int64) * width, lengths)
    encoded = [value.encode("utf-8", "surrogateescape") for value in values]
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    starts = np.zeros(len(encoded), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return fnv1a(np.frombuffer(b"".join(encoded), dtype=np.uint8), starts, lengths)


def hashes_in(listed: np.ndarray, hashes: np.ndarray) -> np.ndarray:
    """A bool per hash: is it in ``listed`` (sorted uint64, as ``ShardTable.path_hashes`` gives)? A binary
    search per hash, so a chunk of names costs O(chunk log listed), not a sort of both."""
    if not len(listed) or not len(hashes):
        return np.zeros(len(hashes), dtype=bool)
    at = np.searchsorted(listed, hashes)
    at[at == len(listed)] = 0
    return listed[at] == hashes


def fnv1a(blob: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """FNV-1a of the byte strings ``blob[starts[i]:starts[i] + lengths[i]]``. Rows in blocks, each block
    ordered longest first, so byte column ``j`` is a prefix of the block (the rows longer than ``j``)."""
    out = np.empty(len(starts), dtype=np.uint64)
    for start in range(0, len(starts), _HASH_ROWS):
        block_lengths = lengths[start:start + _HASH_ROWS]
        order = np.argsort(-block_lengths, kind="stable")
        ordered_starts = starts[start:start + _HASH_ROWS][order]
        longer = np.sort(block_lengths)  # longer[j]: how many rows are longer than j, from the top
        state = np.full(len(order), _FNV_OFFSET, dtype=np.uint64)
        width = int(longer[-1]) if len(longer) else 0
        for j in range(width):
            active = len(longer) - int(np.searchsorted(longer, j, side="right"))
            part = state[:active]
            part ^= blob[ordered_starts[:active] + j]
            part *= _FNV_PRIME
        out[start:start + len(order)][order] = state
    return out
