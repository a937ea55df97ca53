"""Model outputs (format version 6: spec, "Model outputs"): what a root says of each output (``OutputSpec``,
``root_outputs``), an output file's name beside its shard (``output_path``), its fixed 128-byte ``.npy``
header and exact size (``output_header``, ``output_nbytes``, ``parse_output_header``).

An output is a fixed-shape tensor per sample (per bucket), stored in the dtype its model returned, so a batch of
it is a slice of a memory map as a raw shard's pixels are. Storage-free, numpy only: torch's dtypes are named,
never imported (bfloat16, which numpy lacks, is stored as its raw 16 bits, ``<u2``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardio.errors import ShardFormatError
from shardio.format.raw_shard import fixed_npy_header, npy_header_fields
from shardio.format.spec import HEADER_BYTES
from shardio.store.checksum import DIGEST_BYTES, XXH3_128

__all__ = ["OutputSpec", "root_outputs", "outputs_json", "output_path", "output_header", "output_nbytes",
           "parse_output_header", "shard_files", "OUTPUT_DIGEST_COLUMN", "check_output_digests", "TORCH_DTYPES",
           "OUTPUT_INPUTS", "MAX_OUTPUT_DIMS", "OUTPUT_SUFFIX"]

# The torch dtype an output is returned in -> the ``.npy`` descr its file stores (little-endian; one byte has
# no order). bfloat16 has no numpy dtype: its raw bits, ``<u2``, viewed as torch.bfloat16 by the reader.
TORCH_DTYPES: dict[str, str] = {
    "float16": "<f2", "bfloat16": "<u2", "float32": "<f4", "float64": "<f8", "uint8": "|u1", "int8": "|i1",
    "int16": "<i2", "int32": "<i4", "int64": "<i8", "bool": "|b1",
}
_ITEMSIZE = {descr: int(descr[2:]) for descr in TORCH_DTYPES.values()}

OUTPUT_INPUTS = ("image", "text")  # what a model is given: a batch's pixels, or its captions
MAX_OUTPUT_DIMS = 8  # dimensions of one sample's output (a latent: 3; a text embedding: 2)
OUTPUT_SUFFIX = ".npy"  # shards/STEM-NNNNN.NAME.npy
# The index member of a version 6 dataset's segments: uint8 (n, K, 16), the xxh3_128 digest of each shard's K
# output files, in the root's ``outputs`` order (``shardio.format.index`` writes it).
OUTPUT_DIGEST_COLUMN = "output_digest"
_DIGEST_BYTES = DIGEST_BYTES[XXH3_128]


@dataclass(frozen=True)
class OutputSpec:
    """One output as a root records it: its ``name`` (a batch key and its files' name), what its model takes
    (``input``), its ``dtype`` (a torch dtype's name) and the ``descr`` its files store, its per-sample shape for
    each bucket (``shapes``; None for a bucket no committed sample has reached yet; one entry in a single-shape
    dataset) and the ``identity`` of the model that made it (``function``, ``weights``, ``version``)."""

    name: str
    input: str
    dtype: str
    shapes: tuple[tuple[int, ...] | None, ...]
    identity: dict[str, Any]

    @property
    def descr(self) -> str:
        return TORCH_DTYPES[self.dtype]

    def sample_shape(self, bucket: int = 0) -> tuple[int, ...]:
        """Bucket ``bucket``'s per-sample shape; ValueError when no committed sample has reached it."""
        shape = self.shapes[bucket]
        if shape is None:
            raise ValueError(f"output {self.name!r}: bucket {bucket} has no shape yet (no sample of it committed)")
        return shape

    def sample_bytes(self, bucket: int = 0) -> int:
        return math.prod(self.sample_shape(bucket)) * _ITEMSIZE[self.descr]

    def with_shape(self, bucket: int, shape: Sequence[int]) -> OutputSpec:
        """This spec with bucket ``bucket``'s shape set (a first sample of it); ValueError for another shape
        than the one recorded (a model returns one shape per bucket)."""
        shape = tuple(int(d) for d in shape)
        recorded = self.shapes[bucket]
        if recorded is not None and recorded != shape:
            raise ValueError(f"output {self.name!r}: bucket {bucket} holds samples of {list(recorded)}, the model "
                             f"now returned {list(shape)}")
        if recorded == shape:
            return self
        shapes = list(self.shapes)
        shapes[bucket] = shape
        return OutputSpec(self.name, self.input, self.dtype, tuple(shapes), self.identity)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "input": self.input, "dtype": self.dtype, "descr": self.descr,
                "shapes": [None if s is None else list(s) for s in self.shapes], "identity": dict(self.identity)}

    @classmethod
    def from_json(cls, doc: Any, buckets: int, where: str) -> OutputSpec:
        """An output of a root at ``where`` with ``buckets`` buckets; ShardFormatError naming it for anything
        the spec does not allow."""
        if not isinstance(doc, dict):
            raise ShardFormatError(f"{where}: an output is {str(doc)[:60]!r}, not a JSON object")
        name = doc.get("name")
        if not isinstance(name, str) or not name.isidentifier() or not name.isascii():
            raise ShardFormatError(f"{where}: output name {str(name)[:40]!r} is not an ASCII identifier")
        where = f"{where}: output {name!r}"
        if doc.get("input") not in OUTPUT_INPUTS:
            raise ShardFormatError(f"{where}: input {str(doc.get('input'))[:20]!r} is not one of {OUTPUT_INPUTS}")
        dtype = doc.get("dtype")
        if dtype not in TORCH_DTYPES or doc.get("descr") != TORCH_DTYPES[dtype]:
            raise ShardFormatError(f"{where}: dtype {str(dtype)[:20]!r} with descr {str(doc.get('descr'))[:20]!r} "
                                   f"(the dtypes: {', '.join(TORCH_DTYPES)}, each with its own descr)")
        shapes = doc.get("shapes")
        if not isinstance(shapes, list) or len(shapes) != buckets:
            raise ShardFormatError(f"{where}: shapes is {str(shapes)[:60]!r}, not a list of {buckets} (one a bucket)")
        identity = doc.get("identity")
        if not isinstance(identity, dict) or not isinstance(identity.get("function"), str) or any(
                value is not None and not isinstance(value, str) for value in identity.values()):
            raise ShardFormatError(f"{where}: identity is {str(identity)[:80]!r}, not an object of strings with "
                                   "a function")
        return cls(name, doc["input"], dtype, tuple(_shape(s, f"{where}: shapes[{b}]") for b, s in enumerate(shapes)),
                   dict(identity))


def _shape(value: Any, where: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > MAX_OUTPUT_DIMS or any(
            isinstance(d, bool) or not isinstance(d, int) or not 0 < d <= 1 << 31 for d in value):
        raise ShardFormatError(f"{where} is {str(value)[:60]!r}, not a list of at most {MAX_OUTPUT_DIMS} "
                               "dimensions, each an int >= 1")
    return tuple(value)


def root_outputs(doc: dict[str, Any], buckets: int, path: str) -> tuple[OutputSpec, ...]:
    """A root's ``outputs`` (spec, "Model outputs"): () where absent; ShardFormatError naming ``path`` for a
    malformed one or a name given twice. ``buckets``: how many the root has (1 for a single-shape dataset)."""
    value = doc.get("outputs", [])
    if not isinstance(value, list):
        raise ShardFormatError(f"{path}: \"outputs\" is {str(value)[:40]!r}, not a list")
    outputs = tuple(OutputSpec.from_json(item, buckets, path) for item in value)
    names = [o.name for o in outputs]
    if len(set(names)) != len(names):
        raise ShardFormatError(f"{path}: an output is named twice in {names}")
    return outputs


def outputs_json(outputs: Sequence[OutputSpec]) -> list[dict[str, Any]]:
    return [o.to_json() for o in outputs]


def check_output_digests(column: np.ndarray | None, shards: int, path: str) -> int:
    """The K of a segment's ``output_digest`` member (0 where it has none); ShardFormatError naming
    ``path`` unless it is uint8 (shards, K, 16)."""
    if column is None:
        return 0
    if column.ndim != 3 or column.shape[0] != shards or column.shape[2] != _DIGEST_BYTES or column.dtype != np.uint8:
        raise ShardFormatError(f"{path}: {OUTPUT_DIGEST_COLUMN} is {column.dtype} {column.shape}, not uint8 "
                               f"({shards}, K, {_DIGEST_BYTES})")
    return int(column.shape[1])


def output_path(shard_path: str, name: str) -> str:
    """The file of output ``name`` of the shard whose pixel file is ``shard_path`` (``shards/X.npy``,
    ``shards/X.jpg.npy`` or ``shards/X.yuv.npy``): ``shards/X.NAME.npy``."""
    stem = shard_path.removesuffix(".npy")
    for encoded in (".jpg", ".yuv"):
        stem = stem.removesuffix(encoded)
    return f"{stem}.{name}{OUTPUT_SUFFIX}"


def shard_files(shard_path: str, meta_path: str, output_names: Sequence[str]) -> tuple[str, ...]:
    """Every file of one shard: its pixels, its metadata and its outputs' (the files a commit lists, retires and
    a cleaning keeps together)."""
    return (shard_path, meta_path, *(output_path(shard_path, name) for name in output_names))


def output_header(descr: str, samples: int, sample_shape: Sequence[int]) -> bytes:
    """The exact 128-byte header of an output file of ``samples`` samples of ``sample_shape``."""
    return fixed_npy_header(descr, (int(samples), *(int(d) for d in sample_shape)))


def output_nbytes(samples: int, sample_shape: Sequence[int], descr: str) -> int:
    """An output file's exact size: the header and the samples' bytes."""
    return HEADER_BYTES + int(samples) * math.prod(sample_shape) * _ITEMSIZE[descr]


def parse_output_header(header: bytes, where: str) -> tuple[str, tuple[int, ...]]:
    """The (descr, shape) of an output file's 128-byte header; ShardFormatError naming ``where`` otherwise."""
    meta = npy_header_fields(header, where, "a model output file", "the file is corrupt - run `preprocess verify "
                             "DIR --repair`", "output file header")
    descr, fortran = meta["descr"], meta["fortran_order"]
    try:
        shape = tuple(int(d) for d in meta["shape"])
    except (ValueError, TypeError) as e:
        raise ShardFormatError(f"{where}: unreadable output file header: {e}") from e
    if fortran or descr not in _ITEMSIZE or not shape:
        raise ShardFormatError(f"{where}: header says {descr!r} {list(shape)} fortran_order={fortran}: not an "
                               "output file's (C order, one of the output dtypes)")
    return descr, shape
