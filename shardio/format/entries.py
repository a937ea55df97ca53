"""A manifest's entries: a shard (``ShardEntry``, its JSON form with one checksum algorithm), a committed
input (``InputEntry``), a retired file (``RetiredFile``), and the size a listed shard must have."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from shardio.errors import ShardFormatError
from shardio.store.checksum import ALGORITHMS
from shardio.format.jpeg_shard import jpeg_min_bytes
from shardio.format.raw_shard import shard_nbytes
from shardio.format.spec import JPEG, NONE, RAW, YUV420
from shardio.format.yuv_shard import yuv_shard_nbytes

__all__ = ["ShardEntry", "InputEntry", "RetiredFile", "expected_shard_size"]


# An entry's fields other than its two digests, which are stored under keys named by their algorithm.
_ENTRY_KEYS = ("path", "meta_path", "samples", "bytes", "meta_bytes", "input")


@dataclass(frozen=True)
class ShardEntry:
    """One shard as the manifest records it. ``checksum`` / ``meta_checksum``: hex digests of the whole
    ``.npy`` / ``.jsonl``, both by ``checksum_algorithm`` (``shardio.store.checksum``); in the manifest's JSON
    they sit under keys named by it (``to_json`` / ``from_json``)."""

    path: str
    meta_path: str
    samples: int
    bytes: int
    checksum: str
    meta_bytes: int
    meta_checksum: str
    input: str
    checksum_algorithm: str
    # The shard's bucket (spec, "Buckets"): an index into the dataset's bucket list; 0 in a single-shape
    # dataset (its one shape). Not part of a version 1/2 entry (``to_json``), which never has buckets.
    bucket: int = 0
    # The xxh3_128 hex digest of each of its output files (spec, "Model outputs"), in the root's ``outputs``
    # order; () in a dataset without outputs. Not part of a version 1/2 entry, which never has outputs.
    outputs: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The manifest's entry: an old ``sha256`` entry comes back with the same keys in the same order."""
        algorithm = self.checksum_algorithm
        return {"path": self.path, "meta_path": self.meta_path, "samples": self.samples, "bytes": self.bytes,
                algorithm: self.checksum, "meta_bytes": self.meta_bytes,
                f"meta_{algorithm}": self.meta_checksum, "input": self.input}

    @classmethod
    def from_json(cls, doc: dict[str, Any], path: str) -> ShardEntry:
        """An entry of the manifest at ``path``; ShardFormatError naming it for an entry with no checksum
        this shardio knows, with two, or with fields the format does not have."""
        if not isinstance(doc, dict):
            raise ShardFormatError(f"{path}: a shard entry is not a JSON object: {str(doc)[:80]!r}")
        where = f"{path}: shard {doc.get('path')!r}"
        named = [algorithm for algorithm in ALGORITHMS if algorithm in doc]
        others = sorted(set(doc) - set(_ENTRY_KEYS))
        if not named:
            raise ShardFormatError(
                f"{where} has no checksum this shardio knows (its other keys: {others}; it checks "
                f"{', '.join(ALGORITHMS)}); HINT: upgrade shardio, or restore the manifest from a kept "
                "generation or a backup")
        if len(named) > 1:
            raise ShardFormatError(f"{where} has checksums of {' and '.join(named)}: an entry has one "
                                   "algorithm")
        algorithm = named[0]
        unknown = sorted(set(others) - {algorithm, f"meta_{algorithm}"})
        if unknown:
            raise ShardFormatError(f"{where} has fields the format does not have: {unknown}")
        return cls(doc["path"], doc["meta_path"], doc["samples"], doc["bytes"], doc[algorithm],
                   doc["meta_bytes"], doc[f"meta_{algorithm}"], doc["input"], algorithm)


@dataclass
class InputEntry:
    """One committed input: how to recognise it next run, and which shards hold its samples."""

    size: int
    mtime_ns: int
    samples: int
    failed: int
    shards: list[str] = field(default_factory=list)
    etag: str = ""  # object-storage inputs only; "" (and not written) for a local file

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        if not self.etag:
            del doc["etag"]  # local inputs' entries stay as they were before object storage
        return doc


@dataclass
class RetiredFile:
    """A shard file that generation ``generation`` (committed at ``since``) stopped listing; kept for the
    readers of older generations until retention collects it. ``generation`` 0: retired by the commit
    being prepared (stamped when it is published)."""

    path: str
    generation: int = 0
    since: str = ""


def expected_shard_size(entry: ShardEntry, shape: tuple[int, int, int], encoding: str = RAW) -> int:
    """The size a listed shard must have, from the manifest alone (O(1)). A raw shard's is implied by its
    sample count (a yuv420 shard's too: its planes' fixed size); a JPEG shard's is the listed ``bytes`` when at
    least header + offsets (the file's own offsets are checked against it when it is mapped), else that
    minimum (so the check reports it)."""
    if encoding == JPEG:
        return max(entry.bytes, jpeg_min_bytes(entry.samples))
    if encoding == YUV420:
        return yuv_shard_nbytes(entry.samples, shape[0], shape[1])
    if encoding == NONE:  # the header alone: (N, 0, 0, 3) (spec, "Model outputs")
        return shard_nbytes(entry.samples, 0, 0)
    return shard_nbytes(entry.samples, shape[0], shape[1])
