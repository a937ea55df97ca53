"""A format 3 index of N shards written in seconds, without a Python object per shard: one segment (a
compacted index) whose arrays are made with numpy, laid out as the spec's "Index" says, and the root
naming it. No shard files: for what opening and planning cost, which never read them.

``buckets`` > 0 writes a bucketed dataset's index instead (format version 4, the spec's "Buckets"): a
config ``mode: bucket`` with that many shapes near a 256x256 budget, the root's ``buckets``, and the
``shard_bucket`` column, shard ``i`` in bucket ``(7 i) % buckets``.

``python -m bench.synthetic_index DIR SHARDS [--per-input 10] [--samples 1000] [--buckets 0]``
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from shardio.format.index import segment_bytes, segment_path
from shardio.format.dataset_config import config_hash
from shardio.format.spec import FORMAT_NAME, INDEX_DIR, MANIFEST_NAME, MANIFESTS_DIR
from shardio.format.version_rule import dataset_format_version

__all__ = ["write_index", "bucket_shapes"]


def bucket_shapes(count: int, side: int = 256, step: int = 32) -> list[list[int]]:
    """``count`` distinct [h, w] near a ``side``² budget: aspect ratios spread from tall to wide, sides
    multiples of ``step`` (a stand-in for the job's derived list: the index cost does not depend on it)."""
    shapes: list[list[int]] = []
    for k in range(count):
        ratio = 3.0 ** ((2 * k / max(1, count - 1)) - 1)  # w/h from 1/3 to 3
        w = max(step, int(side * ratio ** 0.5) // step * step)
        h = max(step, int(side * side / w) // step * step)
        while [h, w] in shapes:
            w += step
        shapes.append([h, w])
    return shapes

_ZIP_TIME = (1980, 1, 1, 0, 0, 0)


def _table(strings: list[str]) -> tuple[np.ndarray, np.ndarray]:
    encoded = [s.encode() for s in strings]
    offsets = np.zeros(len(encoded) + 1, dtype="<i8")
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    return offsets, np.frombuffer(b"".join(encoded), dtype=np.uint8)


def write_index(directory: str, shards: int, per_input: int = 10, samples: int = 1000,
                inputs_as: tuple[list[str], np.ndarray, np.ndarray] | None = None,
                config: dict | None = None, versions: dict | None = None, buckets: int = 0) -> dict:
    """Write ``DIR/index/SHA.npz`` and ``DIR/manifest.json``: ``shards`` shards of ``samples`` samples,
    ``per_input`` per input; returns the root. ``inputs_as``: the inputs' (sorted names, sizes, mtime_ns)
    (real files a rerun will list), instead of made-up ones; ``config``/``versions``: the root's;
    ``buckets``: that many buckets (a version 4 index), 0 for a single-shape one."""
    inputs = -(-shards // per_input)
    names = [f"in-{i:07d}.tar" for i in range(inputs)] if inputs_as is None else inputs_as[0]
    assert len(names) == inputs, (len(names), inputs)
    stems = [f"in-{i // per_input:07d}-{i % per_input:05d}" for i in range(shards)]
    first = np.minimum(np.arange(inputs + 1, dtype="<i8") * per_input, shards)
    arrays = {}
    for table, values in (("input_name", names), ("input_etag", [""] * inputs),
                          ("shard_path", [f"shards/{s}.npy" for s in stems]),
                          ("shard_meta_path", [f"shards/{s}.jsonl" for s in stems]), ("removed", [])):
        arrays[f"{table}_offsets"], arrays[f"{table}_blob"] = _table(values)
    counts = np.diff(first)
    sizes, mtimes = (counts, np.ones(inputs)) if inputs_as is None else inputs_as[1:]
    for name, values in (("size", sizes), ("mtime_ns", mtimes), ("samples", counts * samples),
                         ("failed", np.zeros(inputs))):
        arrays[f"input_{name}"] = np.asarray(values, dtype="<i8")
    arrays["input_listed"] = np.ones(inputs, dtype=np.uint8)
    arrays["input_first_shard"] = first
    arrays["shard_samples"] = np.full(shards, samples, dtype="<i8")
    arrays["shard_bytes"] = np.full(shards, 128 + samples * 12, dtype="<i8")
    arrays["shard_meta_bytes"] = np.full(shards, 40 * samples, dtype="<i8")
    arrays["shard_algorithm"] = np.zeros(shards, dtype=np.uint8)
    rng = np.random.default_rng(0)
    arrays["shard_digest"] = rng.integers(0, 256, (shards, 16), dtype=np.uint8)
    arrays["shard_meta_digest"] = rng.integers(0, 256, (shards, 16), dtype=np.uint8)
    shapes = bucket_shapes(buckets) if buckets else []
    if buckets:
        arrays["shard_bucket"] = ((np.arange(shards) * 7) % buckets).astype("<u2")
        config = {**(config or {"height": 256, "width": 256}), "mode": "bucket", "buckets": shapes}
    data = segment_bytes(arrays)
    rel = segment_path(data)
    os.makedirs(os.path.join(directory, INDEX_DIR), exist_ok=True)
    os.makedirs(os.path.join(directory, MANIFESTS_DIR), exist_ok=True)
    with open(os.path.join(directory, rel), "wb") as f:
        f.write(data)
    config = config or {"height": 2, "width": 2}
    shape = [int(config.get("height", 2)), int(config.get("width", 2)), 3]
    root = {"format": FORMAT_NAME, "format_version": dataset_format_version(config), "layout": "NHWC",
            "dtype": "uint8", "shape": shape, **({"buckets": shapes} if buckets else {}),
            "samples": shards * samples, "shard_count": shards, "input_count": inputs,
            "bytes": int(arrays["shard_bytes"].sum()), "meta_bytes": int(arrays["shard_meta_bytes"].sum()),
            "failed": 0, "config": config, "config_hash": config_hash(config), "versions": versions or {},
            "updated": "",
            "generation": 1, "segments": [{"path": rel, "bytes": len(data), "shards": shards, "inputs": inputs,
                                           "removed": 0, "samples": shards * samples}], "retired": []}
    with open(os.path.join(directory, MANIFEST_NAME), "w") as f:
        json.dump(root, f)
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    parser.add_argument("shards", type=int)
    parser.add_argument("--per-input", type=int, default=10)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--buckets", type=int, default=0)
    args = parser.parse_args()
    write_index(args.directory, args.shards, args.per_input, args.samples, buckets=args.buckets)


if __name__ == "__main__":
    main()
