"""The bytes the job writes are pinned: shard pixels, metadata lines and the manifest of a small sample
dataset (the awkward cases included: EXIF orientations, grayscale, CMYK, PNG with alpha, a truncated JPEG).

A refactor of the writer, the commit or the job must leave ``tests/preprocess/golden/sample_dataset.json`` unchanged.
What legitimately differs between machines and runs is normalised away first: the temp directory (input
paths, and the path fingerprint inside shard names), commit timestamps and library versions. Pixels depend
on the Pillow-SIMD build and libjpeg-turbo that ``make install`` pins; if those change on purpose, rewrite
the file with ``SHARDIO_UPDATE_GOLDEN=1 make test`` and say why in the commit.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any

import pytest
from typer.testing import CliRunner

from preprocess.cli import app
from preprocess.sample_data import make_sample_dataset
from tests.legacy_format import legacy_doc

pytestmark = pytest.mark.ray

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "sample_dataset.json")
FIXED_MTIME_NS = 1_700_000_000_000_000_000  # inputs are recognised by mtime, and shard names hash it
_FINGERPRINT = re.compile(r"-[0-9a-f]{10}-")


def _normalise_name(name: str) -> str:
    return _FINGERPRINT.sub("-FINGERPRINT-", name)


def normalised_dataset(directory: str, inputs_dir: str) -> dict[str, Any]:
    """Everything that decides what a reader gets, with run- and machine-specific parts taken out."""
    manifest = legacy_doc(directory)  # the content as format 2 wrote it (format 3 splits it into segments)
    prefix = inputs_dir.rstrip("/") + "/"

    def local(path: str) -> str:
        return path[len(prefix):] if path.startswith(prefix) else path

    shards = []
    for entry in manifest["shards"]:
        lines = []
        with open(os.path.join(directory, entry["meta_path"]), encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                row["tar"] = local(row["tar"])
                lines.append(row)
        pixels = open(os.path.join(directory, entry["path"]), "rb").read()
        shards.append({
            "path": _normalise_name(entry["path"]),
            "meta_path": _normalise_name(entry["meta_path"]),
            "samples": entry["samples"],
            "bytes": entry["bytes"],
            "xxh3_128": entry["xxh3_128"],
            "file_sha256": hashlib.sha256(pixels).hexdigest(),  # the pixels, pinned by the test's own hash
            "input": local(entry["input"]),
            "meta": lines,
        })
    inputs = {
        local(path): {**entry, "shards": [_normalise_name(s) for s in entry["shards"]]}
        for path, entry in manifest["inputs"].items()
    }
    # generation counts commits, which follow timing (one every COMMIT_INTERVAL_S at most), not content.
    dropped = {"updated", "versions", "shards", "inputs", "retired", "generation"}
    return {
        "manifest": {k: v for k, v in manifest.items() if k not in dropped},
        "inputs": inputs,
        "shards": shards,
    }


def test_the_sample_dataset_is_written_byte_for_byte_as_pinned(ray_cluster, tmp_path):
    inputs_dir = str(tmp_path / "sample")
    # Two tars of 30: tar 0 holds the EXIF-6, grayscale, CMYK, PNG-alpha and truncated samples, tar 1 EXIF 3/8.
    for path in make_sample_dataset(inputs_dir, tars=2, samples_per_tar=30):
        os.utime(path, ns=(FIXED_MTIME_NS, FIXED_MTIME_NS))
    out = str(tmp_path / "shards")
    result = CliRunner().invoke(app, ["run", f"{inputs_dir}/*.tar", "--output", out, "--samples-per-shard", "16",
                                      "-q"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    got = normalised_dataset(out, inputs_dir)
    if os.environ.get("SHARDIO_UPDATE_GOLDEN") == "1":
        os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
        with open(GOLDEN, "w", encoding="utf-8") as f:
            json.dump(got, f, indent=1, ensure_ascii=False, sort_keys=True)
            f.write("\n")
    expected = json.load(open(GOLDEN, encoding="utf-8"))
    assert got["manifest"] == expected["manifest"], "the manifest's header fields changed"
    assert got["inputs"] == expected["inputs"], "the manifest's inputs changed"
    assert [s["path"] for s in got["shards"]] == [s["path"] for s in expected["shards"]], "shard names changed"
    for mine, pinned in zip(got["shards"], expected["shards"]):
        assert mine["meta"] == pinned["meta"], f"{mine['meta_path']}: metadata lines changed"
        assert mine == pinned, f"{mine['path']}: pixels or manifest entry changed"
    assert got == expected
