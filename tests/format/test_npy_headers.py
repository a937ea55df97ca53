"""A .npy header's dictionary is read without ``ast`` (``npy_header_dict``): CPython 3.11 shares the AST builder's
recursion depth between threads, so a header parsed while another thread compiled a module failed with
"SystemError: AST constructor recursion depth mismatch". It reads what numpy writes as numpy reads it, refuses
anything else, and a dataset opens and reads with ``ast`` unusable."""

from __future__ import annotations

import ast
import io

import numpy as np
import pytest
from dataset_fixtures import make_dataset

from shardio import ShardDataset
from shardio.errors import ShardFormatError
from shardio.format.raw_shard import fixed_npy_header, npy_header_dict, npy_header_fields
from shardio.format.segment_columns import npz_arrays

ARRAYS = [np.zeros(0, np.uint8), np.zeros((3, 4), "<f2"), np.zeros(2, "S7"), np.zeros((), np.int64),
          np.zeros((5, 1), np.uint16), np.zeros((2, 3), order="F"), np.zeros((7, 2, 16), ">i4"),
          np.zeros((1,) * 9, np.bool_)]


@pytest.mark.parametrize("array", ARRAYS, ids=lambda a: f"{a.dtype.str}{list(a.shape)}")
def test_every_header_numpy_writes_reads_as_numpy_reads_it(array: np.ndarray) -> None:
    buffer = io.BytesIO()
    np.save(buffer, array)
    raw = buffer.getvalue()
    text = raw[10:10 + int.from_bytes(raw[8:10], "little")].decode("latin1")
    assert npy_header_dict(text) == ast.literal_eval(text)
    if not array.flags.c_contiguous:
        with pytest.raises(ValueError, match="fortran order"):  # a segment's members are plain C-order arrays
            npz_arrays(_npz(array))
    else:
        assert (npz_arrays(_npz(array))["a"] == array).all()


def _npz(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, a=array)
    return buffer.getvalue()


@pytest.mark.parametrize("text", [
    "{'descr': '<u1', 'shape': (1,), }",  # a key missing
    "{'descr': [('a', '<u1')], 'fortran_order': False, 'shape': (1,), }",  # a structured dtype
    "{'descr': '<u1', 'fortran_order': False, 'shape': (1,), 'extra': 1, }",
    "{'descr': '<u1', 'descr': '<u1', 'fortran_order': False, 'shape': (1,), }",
    "{'descr': True, 'fortran_order': False, 'shape': (1,), }",
    "{'descr': '<u1', 'fortran_order': False, 'shape': (-1,), }",
    "{'descr': '<u1', 'fortran_order': False, 'shape': (1,), } and more",
    "['descr', '<u1']",
])
def test_anything_else_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        npy_header_dict(text)
    header = (b"\x93NUMPY\x01\x00" + (118).to_bytes(2, "little") + text.encode().ljust(117) + b"\n")[:128]
    with pytest.raises(ShardFormatError, match="shard.npy: unreadable pixel header"):
        npy_header_fields(header, "shard.npy", "a shard", "rebuild it", "pixel header")


def test_a_fixed_header_reads_back() -> None:
    assert npy_header_dict(fixed_npy_header("|u1", (4, 8, 8, 3))[10:].decode("latin1")) == {
        "descr": "|u1", "fortran_order": False, "shape": (4, 8, 8, 3)}


def test_a_dataset_opens_and_reads_with_ast_unusable(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = str(tmp_path / "ds")
    make_dataset(directory)

    def unusable(*args, **kwargs):
        raise AssertionError("ast used to read a header")

    monkeypatch.setattr(ast, "parse", unusable)
    monkeypatch.setattr(ast, "literal_eval", unusable)
    ds = ShardDataset(directory, 10, shuffle=True, seed=1)
    assert sum(len(batch["__key__"]) for batch in ds) == ds.num_samples > 0
