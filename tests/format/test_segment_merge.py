"""Compaction as columns (shardio.format.segment_merge): the same bytes as the object path (decode, merge,
encode) over random histories, a bucketed dataset's ``shard_bucket`` carried too, no entry object made by a
commit's compaction, and malformed segments named."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import random

import numpy as np
import pytest

from shardio.errors import ShardFormatError
from shardio.format import spec
from shardio.format.index import (FENCE_MEMBER, Delta, decode_segment, encode_segment, merge_segments, segment_bytes,
                                  segment_path)
from shardio.format.manifests import load_manifest
from shardio.format.segment_merge import merge_columns
from shardio.format.segment_columns import SegmentColumns
from shardio.format.entries import InputEntry, ShardEntry
from shardio.store.root import open_root
from shardio.write import commit as dataset_commit
from tests.index_steps import expected_inputs, run_steps
from tests.layout_fixtures import Layout

# ASCII, Latin, CJK, an emoji, a name with a NUL inside and one that is another plus a NUL: byte order
# differs from naive fixed-width order exactly there.
NAMES = ["a.tar", "b.tar", "é.tar", "z/ü.tar", "日本.tar", "s3://bucket/😀.tar", "x", "x\0", "x\0y", "",
         "A.tar", "aa.tar"]
ETAGS = ["", '"0f3a-1"', '"é-2"']


def _shards(rng: random.Random, name: str, version: int) -> list[ShardEntry]:
    out = []
    for k in rng.sample(range(12), rng.randint(0, 4)):
        stem = hashlib.sha256(f"{name}-{version}-{k}".encode()).hexdigest()[:10]
        stem = rng.choice([stem, f"é{stem}", f"{stem}-日"])
        algorithm = rng.choice(["xxh3_128", "xxh3_128", "sha256"])
        digest = hashlib.sha256(stem.encode() + b"npy").hexdigest()
        meta_digest = hashlib.sha256(stem.encode() + b"jsonl").hexdigest()
        size = 32 if algorithm == "xxh3_128" else 64
        out.append(ShardEntry(f"shards/{stem}.npy", f"shards/{stem}.jsonl", rng.randint(1, 9),
                              rng.randint(100, 10**6), digest[:size], rng.randint(10, 999), meta_digest[:size],
                              name, algorithm))
    return out


def random_history(seed: int, segments: int = 12) -> list[Delta]:
    """``segments`` deltas over a small name pool: adds, replacements, removals (of names present or not),
    re-adds, unlisted groups, empty segments."""
    rng = random.Random(seed)
    deltas = []
    for step in range(segments):
        inputs = {}
        removed = set()
        if rng.random() < 0.15:
            deltas.append(Delta({}, set()))
            continue
        for name in rng.sample(NAMES, rng.randint(0, 5)):
            shards = _shards(rng, name, step)
            entry = InputEntry(rng.randint(0, 10**9), rng.randint(0, 10**18), sum(e.samples for e in shards),
                               rng.randint(0, 3), [e.path for e in shards], rng.choice(ETAGS))
            inputs[name] = (entry, shards, rng.random() < 0.8)
        for name in rng.sample(NAMES, rng.randint(0, 3)):
            if name not in inputs or rng.random() < 0.2:  # a name both removed and added: the add stands
                removed.add(name)
        deltas.append(Delta(inputs, removed))
    return deltas


def object_merge(blobs: list[bytes], from_start: bool) -> bytes | None:
    """Compaction as it was: every row to an object and back."""
    merged = merge_segments([decode_segment(b, segment_path(b)) for b in blobs], from_start)
    return None if merged.empty else encode_segment(merged)


def columns_merge(blobs: list[bytes], from_start: bool) -> bytes | None:
    merged = merge_columns([SegmentColumns(b, segment_path(b)) for b in blobs], from_start)
    if merged is None:
        return None
    delta = decode_segment(merged.data, "merged")
    assert (merged.inputs, merged.removed) == (len(delta.inputs), len(delta.removed))
    assert merged.shards == sum(len(v[1]) for v in delta.inputs.values())
    assert merged.samples == sum(e.samples for v in delta.inputs.values() for e in v[1])
    return merged.data


def bucketed_history(seed: int, segments: int = 12) -> list[Delta]:
    """``random_history``'s deltas as a bucketed dataset's: each shard in a random one of 5 buckets."""
    rng = random.Random(seed)
    out = []
    for delta in random_history(seed, segments):
        inputs = {name: (entry, [dataclasses.replace(e, bucket=rng.randrange(5)) for e in shards], listed)
                  for name, (entry, shards, listed) in delta.inputs.items()}
        out.append(Delta(inputs, delta.removed, bucketed=True))
    return out


@pytest.mark.parametrize("layout, seed", [*(("single", seed) for seed in range(40)),
                                          *(("buckets", seed) for seed in range(20))], indirect=["layout"])
def test_columns_merge_to_the_same_bytes_as_objects_over_random_histories(layout: Layout, seed):
    """In a bucketed dataset the merge carries ``shard_bucket``: the newest segment naming an input decides its
    shards' buckets (a single-shape dataset's are all 0)."""
    history = bucketed_history(seed) if layout.bucketed else random_history(seed)
    blobs = [encode_segment(d) for d in history]
    decoded = [decode_segment(blob, "x") for blob in blobs]
    rng = random.Random(seed)
    for _ in range(8):
        start = rng.randrange(len(blobs))
        stop = start + rng.randint(1, 8)
        run = blobs[start:stop]
        for from_start in (start == 0, True, False):
            merged = columns_merge(run, from_start)
            assert merged == object_merge(run, from_start)
            if merged is not None:
                delta = decode_segment(merged, "merged")
                assert delta.bucketed == layout.bucketed
                live = {}
                for d in decoded[start:stop]:  # what the run's segments say, newest last
                    for name in d.removed:
                        live.pop(name, None)
                    live.update({n: [(e.path, e.bucket) for e in v[1]] for n, v in d.inputs.items()})
                assert {n: [(e.path, e.bucket) for e in v[1]] for n, v in delta.inputs.items()} == live


def test_a_single_shape_merge_has_no_bucket_column():
    blobs = [encode_segment(d) for d in random_history(3)]
    merged = columns_merge(blobs[:8], True)
    assert merged is not None and not decode_segment(merged, "m").bucketed
    assert b"shard_bucket" not in merged


@pytest.mark.parametrize("seed", range(6))
def test_byte_ranges_copied_a_few_bytes_at_a_time_give_the_same_bytes(seed, monkeypatch):
    """The string tables and keys gathered in chunks of 7 bytes (runs of 7 or more sliced): the chunking
    and the windowed path-order check, at a size a test can reach."""
    monkeypatch.setattr("shardio.format.segment_merge._CHUNK", 7)
    blobs = [encode_segment(d) for d in random_history(200 + seed)]
    for start in range(0, len(blobs), 3):
        for from_start in (True, False):
            run = blobs[start:start + 6]
            assert columns_merge(run, from_start) == object_merge(run, from_start)


@pytest.mark.parametrize("seed", range(10))
def test_merged_segments_merge_again_to_the_same_bytes(seed):
    """Tier over tier: a merged segment (32-byte digests whose live rows may now all be xxh3) merged with
    newer ones, as the object path would."""
    blobs = [encode_segment(d) for d in random_history(100 + seed, 24)]
    columns, objects = blobs[:], blobs[:]
    while len(columns) > 1:
        from_start = len(columns) <= 4
        a, b = columns_merge(columns[-4:], from_start), object_merge(objects[-4:], from_start)
        assert a == b
        columns = columns[:-4] + ([] if a is None else [a])
        objects = objects[:-4] + ([] if b is None else [b])


def test_a_merge_that_says_nothing_is_none_and_a_surviving_removal_is_kept():
    gone = Delta({}, {"old.tar"})
    empty = Delta({}, set())
    blobs = [encode_segment(gone), encode_segment(empty)]
    assert columns_merge(blobs, from_start=True) is None is object_merge(blobs, from_start=True)
    kept = merge_columns([SegmentColumns(b, segment_path(b)) for b in blobs], from_start=False)
    assert kept is not None and (kept.inputs, kept.removed, kept.shards) == (0, 1, 0)
    assert kept.data == object_merge(blobs, from_start=False)
    assert merge_columns([], from_start=True) is None


def _arrays(data: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        return {name: z[name] for name in z.files}


def _one_input_segment(paths: list[str], algorithm: str = "xxh3_128") -> bytes:
    size = 32 if algorithm == "xxh3_128" else 64
    shards = [ShardEntry(p, p.replace(".npy", ".jsonl"), 1, 10, "ab" * (size // 2), 5, "cd" * (size // 2), "in.tar",
                         algorithm) for p in paths]
    return encode_segment(Delta({"in.tar": (InputEntry(1, 2, len(paths), 0, list(paths)), shards, True)}, set()))


def _with(data: bytes, **changes: np.ndarray) -> bytes:
    arrays = _arrays(data)
    arrays.update(changes)
    return segment_bytes(arrays)


def _strings(values: list[bytes]) -> dict[str, np.ndarray]:
    offsets = np.zeros(len(values) + 1, dtype="<i8")
    np.cumsum([len(v) for v in values], out=offsets[1:])
    return {"offsets": offsets, "blob": np.frombuffer(b"".join(values), dtype=np.uint8)}


@pytest.mark.parametrize("chunk", [7, 1 << 18])
def test_shards_out_of_path_order_in_a_hand_written_segment_are_sorted_as_the_object_path_sorts_them(
        chunk, monkeypatch):
    monkeypatch.setattr("shardio.format.segment_merge._CHUNK", chunk)
    data = _one_input_segment(["shards/a.npy", "shards/b.npy", "shards/c.npy"])
    table = _strings([b"shards/c.npy", b"shards/a.npy", b"shards/b.npy"])
    shuffled = _with(data, shard_path_offsets=table["offsets"], shard_path_blob=table["blob"],
                     shard_samples=np.array([3, 1, 2], dtype="<i8"))
    newer = encode_segment(Delta({"zz.tar": (InputEntry(1, 1, 0, 0, []), [], True)}, set()))
    assert columns_merge([shuffled, newer], True) == object_merge([shuffled, newer], True)


@pytest.mark.parametrize("damage, message", [
    ("unsafe_path", "unsafe shard path '../x.npy'"),
    ("not_utf8", "shard_path row 0 is not UTF-8"),
    ("sha256_in_16", "sha256 in a 16-byte shard_digest column"),
    ("unknown_code", "checksum algorithm code 7"),
    ("twice", "input_name lists a name twice"),
    ("no_listed", "no member input_listed.npy"),
    ("short_etags", "string table input_etag has offsets that do not index its blob"),
])
def test_a_malformed_segment_is_named_by_the_columns_merge(damage, message):
    data = _one_input_segment(["shards/a.npy", "shards/b.npy"])
    arrays = _arrays(data)
    if damage == "unsafe_path":
        table = _strings([b"../x.npy", b"shards/b.npy"])
    elif damage == "not_utf8":
        table = _strings([b"shards/\xff.npy", b"shards/b.npy"])
    if damage in ("unsafe_path", "not_utf8"):
        arrays["shard_path_offsets"], arrays["shard_path_blob"] = table["offsets"], table["blob"]
    elif damage == "sha256_in_16":
        arrays["shard_algorithm"] = np.array([0, 1], dtype=np.uint8)
    elif damage == "unknown_code":
        arrays["shard_algorithm"] = np.array([0, 7], dtype=np.uint8)
    elif damage == "twice":
        names = _strings([b"in.tar", b"in.tar"])
        arrays["input_name_offsets"], arrays["input_name_blob"] = names["offsets"], names["blob"]
        etags = _strings([b"", b""])
        arrays["input_etag_offsets"], arrays["input_etag_blob"] = etags["offsets"], etags["blob"]
        arrays["input_first_shard"] = np.array([0, 1, 2], dtype="<i8")
        for name in ("input_size", "input_mtime_ns", "input_samples", "input_failed"):
            arrays[name] = np.array([1, 1], dtype="<i8")
        arrays["input_listed"] = np.array([1, 1], dtype=np.uint8)
    elif damage == "no_listed":
        del arrays["input_listed"]
    elif damage == "short_etags":
        arrays["input_etag_offsets"] = np.zeros(3, dtype="<i8")
    bad = segment_bytes(arrays)
    with pytest.raises(ShardFormatError, match=segment_path(bad)) as raised:
        merge_columns([SegmentColumns(bad, segment_path(bad))], from_start=True)
    assert message in str(raised.value)


def _old_compact(root, segments, opened=None, fence=""):
    """``_compact`` as it was (decode every row to objects, merge, encode; ``opened`` unused)."""
    store = root.storage
    while count := dataset_commit.plan_compaction(segments):
        run = segments[-count:]
        deltas = [decode_segment(store.read_bytes(root.join(ref.path)), ref.path) for ref in run]
        merged = merge_segments(deltas, from_start=count == len(segments))
        written = [] if merged.empty else [dataset_commit._write_segment(root, merged, None, fence)]
        segments = segments[:-count] + written
    return segments


def test_a_commit_sequence_compacts_without_an_entry_object_and_as_the_object_path_did(tmp_path, monkeypatch):
    steps = 130
    with monkeypatch.context() as patch:
        patch.setattr(dataset_commit, "_compact", _old_compact)
        run_steps(str(tmp_path / "objects"), steps)
    before = load_manifest(str(tmp_path / "objects"))

    merges = []
    real_merge = dataset_commit.merge_columns
    real_shard_init, real_input_init = ShardEntry.__init__, InputEntry.__init__

    def no_entries(real):
        def init(self, *args, **kwargs):
            if merges and merges[-1] == "running":
                raise AssertionError("the compaction made an entry object")
            real(self, *args, **kwargs)
        return init

    def merge(segments, from_start, fence=""):
        merges.append("running")
        try:
            return real_merge(segments, from_start, fence)
        finally:
            merges[-1] = "done"

    def refuse(*args, **kwargs):
        raise AssertionError("the compaction decoded a segment to objects")

    monkeypatch.setattr(dataset_commit, "merge_columns", merge)
    monkeypatch.setattr(ShardEntry, "__init__", no_entries(real_shard_init))
    monkeypatch.setattr(InputEntry, "__init__", no_entries(real_input_init))
    for module in (dataset_commit, spec):
        for name in ("decode_segment", "merge_segments"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, refuse)
    monkeypatch.setattr("shardio.format.index.decode_segment", refuse)
    monkeypatch.setattr("shardio.format.index.merge_segments", refuse)
    manifest = run_steps(str(tmp_path / "columns"), steps)
    assert len(merges) >= 10 and set(merges) == {"done"}
    assert manifest.segments == before.segments  # the same segment names, sizes and counts
    monkeypatch.undo()
    after = load_manifest(str(tmp_path / "columns"))
    assert after.segments == before.segments
    assert {n: int(after.inputs[n].size - 100) for n in after.inputs} == expected_inputs(steps)
    assert [vars(e) for e in after.shards] == [vars(e) for e in before.shards]


def test_a_corrupt_segment_stops_the_compaction_and_is_named(tmp_path):
    out = str(tmp_path / "ds")
    manifest = run_steps(out, 6)
    victim = manifest.segments[-1].path
    path = tmp_path / "ds" / victim
    data = bytearray(path.read_bytes())
    data[-30] ^= 0xFF
    path.write_bytes(bytes(data))
    segments = manifest.segments + [manifest.segments[-1]] * 7  # eight of one tier: a merge is due
    with pytest.raises(Exception, match=victim.split("/")[1].removesuffix(".npz")):
        dataset_commit._compact(open_root(out), segments)


@pytest.mark.parametrize("seed", range(4))
def test_a_fenced_datasets_merge_carries_its_fence_and_stays_the_objects_bytes(seed):
    """Spec, "Fencing names": every segment a fenced dataset writes, merged ones included, holds the member
    ``fence``, so its bytes and name are its fence's own; the columns and the objects still agree."""
    fence = f"{seed:016x}"
    blobs = [encode_segment(d, fence) for d in random_history(300 + seed)]
    merged = merge_columns([SegmentColumns(b, segment_path(b)) for b in blobs], True, fence)
    objects = merge_segments([decode_segment(b, segment_path(b)) for b in blobs], True)
    assert merged is not None and merged.data == encode_segment(objects, fence)
    assert merged.data != encode_segment(objects)
    with np.load(io.BytesIO(merged.data), allow_pickle=False) as z:
        assert z[FENCE_MEMBER].tobytes() == fence.encode()
