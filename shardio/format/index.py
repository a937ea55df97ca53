"""Format 3's index: segments (``index/SHA256.npz``) and the root that names them (the layout, the
meaning and the commit order are in ``shardio.format.spec``, "Index"). Encoding, decoding, folding
segments into a ``Manifest``, an input's signature (what a commit compares), and the tiered merge:
storage-free, numpy and the standard library only (the reader's install has no xxhash or pyarrow).
"""

from __future__ import annotations

import hashlib
import io
import struct
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardio.errors import ShardFormatError, ShardIntegrityError
from shardio.store.checksum import ALGORITHM_CODES, ALGORITHM_NAMES, DIGEST_BYTES, XXH3_128
from shardio.format.buckets import root_buckets
from shardio.format.dataset_manifest import Manifest
from shardio.format.entries import InputEntry, RetiredFile, ShardEntry
from shardio.format.model_outputs import OUTPUT_DIGEST_COLUMN, check_output_digests, outputs_json, root_outputs
from shardio.format.names import check_dataset_path
from shardio.format.root_fields import root_classes, root_dataset_id, root_generation, root_name_fence, root_shape
from shardio.format.segment_columns import npz_arrays
from shardio.format.spec import FORMAT_NAME, INDEX_DIR

FENCE_MEMBER = "fence"

__all__ = ["FENCE_MEMBER", "with_fence", "SegmentRef", "Delta", "COMPACT_FANOUT", "encode_segment", "decode_segment",
           "segment_path", "check_segment_path", "root_json", "manifest_from_root", "current_inputs", "plan_compaction",
           "merge_segments", "input_signature", "totals_of", "segment_bytes", "check_shard_buckets",
           "BUCKET_COLUMN", "check_segment_outputs"]

# Merge the newest 8 segments when they share a tier (a factor of 8 in rows): a root then names at most
# 7 per tier, ~42 at 2.3M shards, and each entry is rewritten ~log8(N / rows per commit) times (4 at 30k
# shards committed 10 at a time).
COMPACT_FANOUT = 8
# Fixed so that the same content gives the same bytes, hence the same name (zip's earliest date).
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)
# The member a bucketed dataset's segments have (spec, "Buckets"): each shard's bucket id, uint16.
BUCKET_COLUMN = "shard_bucket"


@dataclass(frozen=True)
class SegmentRef:
    """One segment as a root names it: ``path`` ``index/SHA256.npz``, its size and its row counts."""

    path: str
    bytes: int
    shards: int
    inputs: int
    removed: int
    samples: int

    @property
    def rows(self) -> int:
        return self.shards + self.inputs + self.removed

    @property
    def tier(self) -> int:
        rows, tier = max(1, self.rows), 0
        while rows >= COMPACT_FANOUT:
            rows //= COMPACT_FANOUT
            tier += 1
        return tier


@dataclass
class Delta:
    """What one segment says: inputs (name -> entry, with their shards; ``listed`` False for a name that
    only groups shards) that replace earlier ones, and names removed from the segments before it."""

    inputs: dict[str, tuple[InputEntry, list[ShardEntry], bool]]
    removed: set[str]
    # Whether the segment has the ``shard_bucket`` member (a bucketed dataset's: spec, "Buckets").
    bucketed: bool = False
    # How many output digests each shard row has (the ``output_digest`` member's K; 0: no such member).
    outputs: int = 0

    @property
    def empty(self) -> bool:
        return not self.inputs and not self.removed


def segment_path(data: bytes) -> str:
    return f"{INDEX_DIR}/{hashlib.sha256(data).hexdigest()}.npz"


def check_segment_path(rel: Any, where: str) -> str:
    """``rel`` if it is ``index/HEX64.npz``; ShardFormatError naming ``where`` otherwise (a root is data:
    a forged path must never make a reader read, or gc delete, a file outside ``index/``)."""
    ok = (isinstance(rel, str) and rel.startswith(f"{INDEX_DIR}/") and rel.endswith(".npz")
          and len(rel) == len(INDEX_DIR) + 1 + 64 + 4
          and all(c in "0123456789abcdef" for c in rel[len(INDEX_DIR) + 1:-4]))
    if not ok:
        raise ShardFormatError(f"{where}: unsafe segment path {rel!r} (must be {INDEX_DIR}/SHA256.npz); the root "
                               "was edited or forged: nothing was read or deleted")
    return rel


def _strings(values: list[str]) -> tuple[np.ndarray, np.ndarray]:
    encoded = [v.encode("utf-8") for v in values]
    offsets = np.zeros(len(encoded) + 1, dtype="<i8")
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    return offsets, np.frombuffer(b"".join(encoded), dtype=np.uint8)


def _read_strings(z: Any, name: str) -> list[str]:
    offsets, blob = z[f"{name}_offsets"], z[f"{name}_blob"].tobytes()
    return [blob[offsets[i]:offsets[i + 1]].decode("utf-8") for i in range(len(offsets) - 1)]


def encode_segment(delta: Delta, fence: str = "") -> bytes:
    """The segment's bytes: inputs sorted by name, each one's shards by path (so the same delta always
    gives the same bytes). ``fence``: the dataset's (spec, "Fencing names"), written as the member
    ``fence`` where it has one."""
    names = sorted(delta.inputs, key=lambda n: n.encode("utf-8"))
    shards: list[ShardEntry] = []
    first = [0]
    for name in names:
        shards.extend(sorted(delta.inputs[name][1], key=lambda e: e.path))
        first.append(len(shards))
    width = 16 if all(e.checksum_algorithm == XXH3_128 for e in shards) else 32
    digest = np.zeros((len(shards), width), dtype=np.uint8)
    meta_digest = np.zeros((len(shards), width), dtype=np.uint8)
    for row, entry in enumerate(shards):
        size = DIGEST_BYTES[entry.checksum_algorithm]
        digest[row, :size] = np.frombuffer(bytes.fromhex(entry.checksum), dtype=np.uint8)
        meta_digest[row, :size] = np.frombuffer(bytes.fromhex(entry.meta_checksum), dtype=np.uint8)
    entries = [delta.inputs[n][0] for n in names]
    arrays: dict[str, np.ndarray] = {}
    for table, values in (("input_name", names), ("input_etag", [e.etag for e in entries]),
                          ("shard_path", [e.path for e in shards]),
                          ("shard_meta_path", [e.meta_path for e in shards]),
                          ("removed", sorted(delta.removed, key=lambda n: n.encode("utf-8")))):
        arrays[f"{table}_offsets"], arrays[f"{table}_blob"] = _strings(values)
    for field_name in ("size", "mtime_ns", "samples", "failed"):
        arrays[f"input_{field_name}"] = np.array([getattr(e, field_name) for e in entries], dtype="<i8")
    arrays["input_listed"] = np.array([delta.inputs[n][2] for n in names], dtype=np.uint8)
    arrays["input_first_shard"] = np.array(first, dtype="<i8")
    arrays["shard_samples"] = np.array([e.samples for e in shards], dtype="<i8")
    arrays["shard_bytes"] = np.array([e.bytes for e in shards], dtype="<i8")
    arrays["shard_meta_bytes"] = np.array([e.meta_bytes for e in shards], dtype="<i8")
    arrays["shard_algorithm"] = np.array([ALGORITHM_CODES[e.checksum_algorithm] for e in shards], dtype=np.uint8)
    arrays["shard_digest"], arrays["shard_meta_digest"] = digest, meta_digest
    if delta.bucketed:
        arrays[BUCKET_COLUMN] = np.array([e.bucket for e in shards], dtype="<u2")
    elif any(e.bucket for e in shards):
        raise ValueError("a shard of a bucket other than 0 in a segment of a single-shape dataset")
    if delta.outputs:
        arrays[OUTPUT_DIGEST_COLUMN] = _output_digests(shards, delta.outputs)
    elif any(e.outputs for e in shards):
        raise ValueError("a shard with output digests in a segment of a dataset without outputs")
    return segment_bytes(with_fence(arrays, fence))


def _output_digests(shards: list[ShardEntry], outputs: int) -> np.ndarray:
    column = np.zeros((len(shards), outputs, DIGEST_BYTES[XXH3_128]), dtype=np.uint8)
    for row, entry in enumerate(shards):
        if len(entry.outputs) != outputs:
            raise ValueError(f"shard {entry.path}: {len(entry.outputs)} output digests, the dataset has {outputs} "
                             "outputs")
        column[row] = np.frombuffer(bytes.fromhex("".join(entry.outputs)), dtype=np.uint8).reshape(outputs, -1)
    return column


def with_fence(arrays: dict[str, np.ndarray], fence: str) -> dict[str, np.ndarray]:
    """``arrays`` with the member ``fence`` (its ASCII bytes, uint8) where ``fence`` is set: the segment's
    bytes, hence its name, are then its fence's own (spec, "Fencing names"); readers ignore the member."""
    if fence:
        arrays[FENCE_MEMBER] = np.frombuffer(fence.encode("ascii"), dtype=np.uint8)
    return arrays


def segment_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """A segment's members (name -> array, the spec's "Index" table) as its bytes: a stored zip, members
    in name order with fixed timestamps, so the same arrays give the same bytes, hence the same name."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for name in sorted(arrays):
            member = io.BytesIO()
            np.lib.format.write_array(member, np.ascontiguousarray(arrays[name]), allow_pickle=False)
            archive.writestr(zipfile.ZipInfo(f"{name}.npy", _ZIP_TIME), member.getvalue())
    return out.getvalue()


def decode_segment(data: bytes, path: str) -> Delta:
    """The delta a segment's bytes say; ShardFormatError naming ``path`` for anything malformed."""
    try:
        z = npz_arrays(data)
        names = _read_strings(z, "input_name")
        etags = _read_strings(z, "input_etag")
        paths, meta_paths = _read_strings(z, "shard_path"), _read_strings(z, "shard_meta_path")
        removed = set(_read_strings(z, "removed"))
        columns = {k: z[k] for k in ("input_size", "input_mtime_ns", "input_samples", "input_failed",
                                     "input_listed", "input_first_shard", "shard_samples", "shard_bytes",
                                     "shard_meta_bytes", "shard_algorithm", "shard_digest", "shard_meta_digest")}
        bucketed = BUCKET_COLUMN in z
        buckets = z[BUCKET_COLUMN] if bucketed else np.zeros(len(paths), np.uint16)
        output_column = z.get(OUTPUT_DIGEST_COLUMN)
    except (ValueError, KeyError, OSError, zipfile.BadZipFile, UnicodeDecodeError, struct.error) as e:
        raise ShardFormatError(f"{path}: not a readable index segment ({type(e).__name__}: {e})") from e
    first = columns["input_first_shard"]
    if len(first) != len(names) + 1 or first[0] != 0 or first[-1] != len(paths) or np.any(np.diff(first) < 0):
        raise ShardFormatError(f"{path}: input_first_shard does not partition its {len(paths)} shards")
    codes = columns["shard_algorithm"]
    unknown = np.flatnonzero(~np.isin(codes, list(ALGORITHM_NAMES)))
    if len(unknown):
        row = int(unknown[0])
        raise ShardFormatError(f"{path}: shard {paths[row]!r} has checksum algorithm code {int(codes[row])}, "
                               "this shardio knows 0 and 1")
    # Whole columns to Python at once (hex of every digest in one call, then slices): a row costs its
    # ShardEntry, not a dozen numpy scalar reads (load_manifest of 300k shards: 5.1 s before).
    for key in ("shard_digest", "shard_meta_digest"):
        if columns[key].ndim != 2 or len(columns[key]) != len(paths) or columns[key].shape[1] not in (16, 32):
            raise ShardFormatError(f"{path}: {key} is {columns[key].shape}, not ({len(paths)}, 16 or 32)")
    if buckets.shape != (len(paths),) or buckets.dtype.kind not in "iu":
        raise ShardFormatError(f"{path}: {BUCKET_COLUMN} is {buckets.dtype} {buckets.shape}, "
                               f"not ({len(paths)},) integers")
    bucket_ids = buckets.tolist()
    outputs = check_output_digests(output_column, len(paths), path)
    output_hex = output_column.tobytes().hex() if output_column is not None else ""
    per_output = 2 * DIGEST_BYTES[XXH3_128]
    width = columns["shard_digest"].shape[1]
    digests, meta_digests = columns["shard_digest"].tobytes().hex(), columns["shard_meta_digest"].tobytes().hex()
    samples, sizes = columns["shard_samples"].tolist(), columns["shard_bytes"].tolist()
    meta_sizes, algorithms = columns["shard_meta_bytes"].tolist(), [ALGORITHM_NAMES[c] for c in codes.tolist()]
    owners = np.repeat(np.arange(len(names)), np.diff(first)).tolist()
    shards: list[ShardEntry] = []
    for row, (rel, meta) in enumerate(zip(paths, meta_paths)):
        algorithm = algorithms[row]
        start = 2 * width * row
        stop = start + 2 * DIGEST_BYTES[algorithm]
        shards.append(ShardEntry(
            check_dataset_path(rel, path), check_dataset_path(meta, path), samples[row], sizes[row],
            digests[start:stop], meta_sizes[row], meta_digests[start:stop], names[owners[row]], algorithm,
            bucket_ids[row], tuple(output_hex[(row * outputs + k) * per_output:(row * outputs + k + 1) * per_output]
                                   for k in range(outputs))))
    inputs: dict[str, tuple[InputEntry, list[ShardEntry], bool]] = {}
    for i, name in enumerate(names):
        own = shards[first[i]:first[i + 1]]
        entry = InputEntry(size=int(columns["input_size"][i]), mtime_ns=int(columns["input_mtime_ns"][i]),
                           samples=int(columns["input_samples"][i]), failed=int(columns["input_failed"][i]),
                           shards=[e.path for e in own], etag=etags[i])
        inputs[name] = (entry, own, bool(columns["input_listed"][i]))
    return Delta(inputs, removed, bucketed, outputs)


def fold(deltas: Iterable[Delta]) -> dict[str, tuple[InputEntry, list[ShardEntry], bool]]:
    """The live inputs after applying ``deltas`` in order (the meaning of a root)."""
    live: dict[str, tuple[InputEntry, list[ShardEntry], bool]] = {}
    for delta in deltas:
        for name in delta.removed:
            live.pop(name, None)
        live.update(delta.inputs)
    return live


def merge_segments(deltas: list[Delta], from_start: bool) -> Delta:
    """Consecutive segments as one: later inputs win, removals applied; a removal survives only when
    segments before the merged run may still hold the name (``from_start`` False) and no merged input
    replaces it anyway."""
    live = fold(deltas)
    removed: set[str] = set()
    if not from_start:
        removed = set().union(*(d.removed for d in deltas)) - set(live)
    return Delta(live, removed, any(d.bucketed for d in deltas), max((d.outputs for d in deltas), default=0))


def plan_compaction(segments: list[SegmentRef]) -> int:
    """How many of the newest segments to merge now: ``COMPACT_FANOUT`` when they share a tier, else 0."""
    if len(segments) < COMPACT_FANOUT:
        return 0
    newest = segments[-COMPACT_FANOUT:]
    return COMPACT_FANOUT if len({s.tier for s in newest}) == 1 else 0


def input_signature(entry: InputEntry, shards: list[ShardEntry], listed: bool) -> tuple[Any, ...]:
    """What makes an input's index entry: equal signatures, equal segment rows (a commit skips it)."""
    return (entry.size, entry.mtime_ns, entry.samples, entry.failed, entry.etag, listed,
            tuple(sorted((e.path, e.meta_path, e.samples, e.bytes, e.checksum, e.meta_bytes, e.meta_checksum,
                          e.checksum_algorithm, e.bucket, e.outputs) for e in shards)))


def current_inputs(manifest: Manifest, only: set[str] | None = None,
                   shards_of: Callable[[str], list[ShardEntry]] | None = None,
                   ) -> dict[str, tuple[InputEntry, list[ShardEntry], bool]]:
    """The manifest's content as segment inputs (of the names in ``only``, when given): each listed input
    with its shards, and a shard whose ``input`` is not listed grouped under that name (``listed`` False).
    ``shards_of(name)``: an input's shards found without a pass over all of them (a ``Committer``'s)."""
    by_input: dict[str, list[ShardEntry]] = {}
    if only is not None and shards_of is not None:
        by_input = {name: found for name in only if (found := shards_of(name))}
    else:
        for entry in manifest.shards:
            if only is None or entry.input in only:
                by_input.setdefault(entry.input, []).append(entry)
    out: dict[str, tuple[InputEntry, list[ShardEntry], bool]] = {}
    names = manifest.inputs if only is None else [n for n in only if n in manifest.inputs]
    for name in names:
        out[name] = (manifest.inputs[name], by_input.pop(name, []), True)
    for name, shards in by_input.items():
        out[name] = (InputEntry(0, 0, sum(e.samples for e in shards), 0, [e.path for e in shards]), shards, False)
    return out


def totals_of(manifest: Manifest) -> dict[str, int]:
    """The root's totals, counted (O(shards): a ``Committer`` keeps them as it goes instead)."""
    return {"samples": manifest.samples, "shard_count": len(manifest.shards), "input_count": len(manifest.inputs),
            "bytes": sum(s.bytes for s in manifest.shards), "meta_bytes": sum(s.meta_bytes for s in manifest.shards),
            "failed": sum(i.failed for i in manifest.inputs.values())}


def root_json(manifest: Manifest, totals: dict[str, int] | None = None, run: str = "") -> dict[str, Any]:
    """The root document (``manifest.json`` / ``manifests/GEN.json``) of a manifest whose ``segments``
    are set; ``totals`` (``totals_of``'s keys) when the caller kept them; ``run``: the id of the run that
    commits it ("" for a commit outside a run), so retention can tell a run's passing generations."""
    assert manifest.segments is not None  # set by the commit before it writes a root
    totals = totals or totals_of(manifest)
    return {
        "format": FORMAT_NAME,
        "format_version": manifest.format_version,
        "layout": "NHWC",
        "dtype": "uint8",
        "shape": list(manifest.shape),
        **({"buckets": [list(b) for b in manifest.buckets]} if manifest.is_bucketed else {}),
        "samples": totals["samples"],
        "shard_count": totals["shard_count"],
        "input_count": totals["input_count"],
        "bytes": totals["bytes"],
        "meta_bytes": totals["meta_bytes"],
        "failed": totals["failed"],
        "config": manifest.config,
        "config_hash": manifest.config_hash,
        "versions": manifest.versions,
        "updated": manifest.updated,
        "generation": manifest.generation,
        **({"dataset": manifest.dataset_id} if manifest.dataset_id else {}),
        **({"fence": manifest.name_fence} if manifest.name_fence else {}),
        **({"classes": list(manifest.classes)} if manifest.classes else {}),
        **({"outputs": outputs_json(manifest.outputs)} if manifest.outputs else {}),
        "segments": [vars(s).copy() for s in manifest.segments],
        "retired": [vars(r).copy() for r in manifest.retired],
        **({"run": run} if run else {}),
    }


def parse_segment_refs(doc: dict[str, Any], path: str) -> list[SegmentRef]:
    try:
        refs = [SegmentRef(**s) for s in doc["segments"]]
    except (KeyError, TypeError) as e:
        raise ShardFormatError(f"{path}: malformed root (segments: {type(e).__name__}: {e})") from e
    for ref in refs:
        check_segment_path(ref.path, path)
    return refs


def _check_listed_once(live: dict[str, tuple[InputEntry, list[ShardEntry], bool]], path: str) -> None:
    """ShardFormatError naming the root when a live shard file is listed twice (the same words as the
    reader's columns: ``shardio.format.shard_table.check_listed_once``)."""
    owner: dict[str, str] = {}
    for name in sorted(live, key=lambda n: n.encode("utf-8")):
        for entry in live[name][1]:
            for rel in (entry.path, entry.meta_path):
                if rel in owner:
                    owners = (f"twice by input {name!r}" if owner[rel] == name
                              else f"by inputs {owner[rel]!r} and {name!r}")
                    raise ShardFormatError(f"{path}: shard file {rel!r} is listed {owners} (an index lists each shard "
                                           "file once: edited or forged?): nothing was read")
                owner[rel] = name


def check_segment_outputs(digests: int, has_inputs: bool, outputs: int, path: str) -> None:
    """ShardFormatError naming segment ``path`` unless its output digests a shard (``digests``: the K of its
    ``output_digest`` member, 0 without one) are the root's ``outputs`` count (spec, "Model outputs"); a
    segment of removals alone has no shard rows to carry any."""
    if digests != outputs and (digests or has_inputs):
        raise ShardFormatError(f"{path}: its shards have {digests} output digests, the root lists {outputs} "
                               "outputs: edited or forged, nothing was read")


def check_shard_buckets(column: np.ndarray | None, shards: int, buckets: tuple[tuple[int, int], ...] | None,
                        path: str) -> None:
    """ShardFormatError naming segment ``path`` unless its ``shard_bucket`` member (``column``; None: the
    segment has none) is what the root's version says (spec, "Buckets"): present with one id per shard,
    each below ``len(buckets)``, in a bucketed dataset (``buckets`` its list); absent in any other."""
    if buckets is None:
        if column is not None:
            raise ShardFormatError(f"{path}: has a {BUCKET_COLUMN} member but its root is not a bucketed dataset's "
                                   "(mode: bucket): edited or forged, nothing was read")
        return
    if column is None:
        raise ShardFormatError(f"{path}: no {BUCKET_COLUMN} member in a bucketed dataset's segment (spec, "
                               '"Buckets"): edited or forged, nothing was read')
    if column.shape != (shards,) or column.dtype.kind not in "iu":
        raise ShardFormatError(f"{path}: {BUCKET_COLUMN} is {column.dtype} {column.shape}, not ({shards},) integers")
    if shards and int(column.max()) >= len(buckets):
        row = int(np.argmax(column >= len(buckets)))
        raise ShardFormatError(f"{path}: shard row {row} is in bucket {int(column[row])}, the root lists "
                               f"{len(buckets)} buckets: edited or forged, nothing was read")


def manifest_from_root(doc: dict[str, Any], path: str, read_segment: Any) -> Manifest:
    """The dataset a version 3 or 4 root at ``path`` describes; ``read_segment(rel)`` gives a segment's
    bytes. Every segment's size and sha256 are checked (a corrupt segment is named, never half-read)."""
    refs = parse_segment_refs(doc, path)
    buckets = root_buckets(doc, path)
    outputs = root_outputs(doc, len(buckets) if buckets else 1, path)
    deltas = []
    for ref in refs:
        data = read_segment(ref.path)
        if len(data) != ref.bytes or segment_path(data) != ref.path:
            raise ShardIntegrityError(f"{path}: segment {ref.path} is {len(data)} bytes and hashes to "
                                      f"{segment_path(data)}; the root says {ref.bytes} bytes (corrupt or "
                                      "truncated): HINT: `preprocess verify DIR --repair` restores a kept generation")
        delta = decode_segment(data, ref.path)
        shards = [e for value in delta.inputs.values() for e in value[1]]
        check_shard_buckets(np.array([e.bucket for e in shards], np.int64) if delta.bucketed else None, len(shards),
                            buckets, ref.path)
        check_segment_outputs(delta.outputs, bool(delta.inputs), len(outputs), ref.path)
        deltas.append(delta)
    live = fold(deltas)
    try:
        h, w, c = root_shape(doc, path)
        manifest = Manifest(shape=(h, w, c), config=doc["config"], versions=doc.get("versions", {}),
                            updated=doc.get("updated", ""), generation=root_generation(doc, path),
                            retired=[RetiredFile(**r) for r in doc.get("retired", [])],
                            dataset_id=root_dataset_id(doc, path), name_fence=root_name_fence(doc, path),
                            classes=root_classes(doc, path), outputs=outputs)
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise ShardFormatError(f"{path}: malformed root ({type(e).__name__}: {e})") from e
    for name in sorted(live, key=lambda n: n.encode("utf-8")):
        entry, shards, listed = live[name]
        manifest.shards.extend(shards)
        if listed:
            manifest.inputs[name] = entry
    _check_listed_once(live, path)
    manifest.segments = refs
    manifest.indexed = {name: input_signature(*value) for name, value in live.items()}
    for retired in manifest.retired:
        check_dataset_path(retired.path, path)
    if doc.get("samples") != manifest.samples or doc.get("shard_count") != len(manifest.shards):
        raise ShardIntegrityError(f"{path}: says {doc.get('samples')} samples in {doc.get('shard_count')} shards, "
                                  f"its segments hold {manifest.samples} in {len(manifest.shards)}")
    return manifest
