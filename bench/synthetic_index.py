"""A format 3 index of N shards written in seconds, without a Python object per shard: one segment (a
compacted index) whose arrays are made with numpy, laid out as the spec's "Index" says, and the root
naming it. No shard files: for what opening and planning cost, which never read them.

``python -m bench.synthetic_index DIR SHARDS [--per-input 10] [--samples 1000]``
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from shardio.format.index import segment_bytes, segment_path
from shardio.format.spec import FORMAT_NAME, FORMAT_VERSION, INDEX_DIR, MANIFEST_NAME, MANIFESTS_DIR, config_hash

__all__ = ["write_index"]

_ZIP_TIME = (1980, 1, 1, 0, 0, 0)


def _table(strings: list[str]) -> tuple[np.ndarray, np.ndarray]:
    encoded = [s.encode() for s in strings]
    offsets = np.zeros(len(encoded) + 1, dtype="<i8")
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    return offsets, np.frombuffer(b"".join(encoded), dtype=np.uint8)


def write_index(directory: str, shards: int, per_input: int = 10, samples: int = 1000,
                inputs_as: tuple[list[str], np.ndarray, np.ndarray] | None = None,
                config: dict | None = None, versions: dict | None = None) -> dict:
    """Write ``DIR/index/SHA.npz`` and ``DIR/manifest.json``: ``shards`` shards of ``samples`` samples,
    ``per_input`` per input; returns the root. ``inputs_as``: the inputs' (sorted names, sizes, mtime_ns)
    (real files a rerun will list), instead of made-up ones; ``config``/``versions``: the root's."""
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
    data = segment_bytes(arrays)
    rel = segment_path(data)
    os.makedirs(os.path.join(directory, INDEX_DIR), exist_ok=True)
    os.makedirs(os.path.join(directory, MANIFESTS_DIR), exist_ok=True)
    with open(os.path.join(directory, rel), "wb") as f:
        f.write(data)
    config = config or {"height": 2, "width": 2}
    shape = [int(config.get("height", 2)), int(config.get("width", 2)), 3]
    root = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "layout": "NHWC", "dtype": "uint8",
            "shape": shape, "samples": shards * samples, "shard_count": shards, "input_count": inputs,
            "bytes": int(arrays["shard_bytes"].sum()), "meta_bytes": int(arrays["shard_meta_bytes"].sum()),
            "failed": 0, "config": config, "config_hash": config_hash(config), "versions": versions or {}, "updated": "",
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
    args = parser.parse_args()
    write_index(args.directory, args.shards, args.per_input, args.samples)


if __name__ == "__main__":
    main()
