"""Shard checksums (shardio/store/checksum.py, the manifest's entries in shardio/format.py): new shards carry
xxh3_128 digests that a stranger's ``xxh128sum`` reproduces; datasets written before (sha256 entries,
format_version 1), alone or mixed with new entries, still open, read, verify and round-trip unchanged; an
entry naming no known algorithm is refused naming the manifest; and without the ``xxhash`` package the
reader still imports and reads, while checking an xxh3_128 digest says what to install."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import xxhash
from typer.testing import CliRunner

import shardio
from preprocess.cli import app
from shardio.read.cache.cache_dir import CachedShard
from shardio.store.checksum import file_checksum, new_hasher
from shardio.errors import MissingExtra, ShardFormatError, ShardIntegrityError
from shardio.format import ShardEntry
from shardio.format.manifests import generation_path, load_manifest
from shardio.read.cache.shard_cache import ShardCache
from shardio.write.shard_writer import write_manifest
from tests.dataset_fixtures import flip_bits, make_dataset
from tests.legacy_format import legacy_doc
from tests.paths import REPO_ROOT

REPO = REPO_ROOT
INPUTS = (12, 9)  # two inputs, shards of 8: four shards, two of them partial


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def manifest_doc(directory: str) -> dict:
    """The current generation as one format 1/2 document (its entries as that format wrote them)."""
    return legacy_doc(directory)


def root_version(directory: str) -> int:
    with open(os.path.join(directory, "manifest.json"), encoding="utf-8") as f:
        return json.load(f)["format_version"]


def rewrite_manifest(directory: str, doc: dict) -> None:
    """Replace the current generation's bytes (``manifest.json``, its ``manifests/GEN.json``) with ``doc``,
    a format 1/2 document (as an older shardio left the dataset)."""
    data = json.dumps(doc, indent=1).encode()
    for path in (os.path.join(directory, "manifest.json"), generation_path(directory, doc["generation"])):
        with open(path, "wb") as f:
            f.write(data)


def as_sha256_entries(directory: str, which: list[int] | None = None, format_version: int = 1) -> dict:
    """Turn shard entries ``which`` (default all) of a fresh dataset into the entries shardio wrote before
    xxh3_128 (``sha256`` / ``meta_sha256``, computed with hashlib, key order as then); returns the doc."""
    doc = manifest_doc(directory)
    def sha256(rel: str) -> str:
        return hashlib.sha256(read(os.path.join(directory, rel))).hexdigest()

    for index, entry in enumerate(doc["shards"]):
        if which is not None and index not in which:
            continue
        doc["shards"][index] = {
            "path": entry["path"], "meta_path": entry["meta_path"], "samples": entry["samples"],
            "bytes": entry["bytes"], "sha256": sha256(entry["path"]), "meta_bytes": entry["meta_bytes"],
            "meta_sha256": sha256(entry["meta_path"]), "input": entry["input"],
        }
    doc["format_version"] = format_version
    rewrite_manifest(directory, doc)
    return doc


def verify(directory: str):
    return CliRunner().invoke(app, ["verify", directory])


@pytest.fixture
def dataset(tmp_path) -> str:
    directory = str(tmp_path / "ds")
    make_dataset(directory, INPUTS)
    return directory


def test_new_shards_list_xxh3_128_that_xxh128sum_reproduces(dataset):
    doc = manifest_doc(dataset)
    assert doc["format_version"] == 2 and root_version(dataset) == 3
    cli = shutil.which("xxh128sum") or next((p for p in ["/usr/bin/xxh128sum"] if os.path.exists(p)), None)
    for entry in doc["shards"]:
        assert list(entry) == ["path", "meta_path", "samples", "bytes", "xxh3_128", "meta_bytes",
                               "meta_xxh3_128", "input"]
        for rel, key in ((entry["path"], "xxh3_128"), (entry["meta_path"], "meta_xxh3_128")):
            path = os.path.join(dataset, rel)
            assert entry[key] == xxhash.xxh3_128(read(path)).hexdigest(), rel
            if cli is not None:  # the stranger's check: the standard tool prints the manifest's digest
                printed = subprocess.run([cli, path], capture_output=True, text=True, check=True).stdout
                assert printed.split()[0] == entry[key], rel
    assert verify(dataset).exit_code == 0


def test_entries_travel_from_worker_to_driver_as_dicts(dataset):
    # The worker sends dataclasses.asdict(entry) through Ray; the driver rebuilds ShardEntry(**d).
    for entry in load_manifest(dataset).shards:
        assert ShardEntry(**dataclasses.asdict(entry)) == entry
        assert entry.checksum_algorithm == "xxh3_128"


def test_a_dataset_written_with_sha256_opens_reads_and_verifies(dataset):
    as_sha256_entries(dataset)
    manifest = load_manifest(dataset)
    assert {e.checksum_algorithm for e in manifest.shards} == {"sha256"}
    snapshot = shardio.open_dataset(dataset, verify=True)
    first = snapshot.pixels(0)
    assert first.shape == (8, 8, 8, 3) and [int(p[0, 0, 0]) for p in first] == list(range(8))
    result = verify(dataset)
    assert result.exit_code == 0 and "all match the manifest" in result.output, result.output
    # Rewritten by this shardio (as an incremental commit would), it becomes a format 3 index whose
    # entries keep their sha256 digests (its one-document form is still version 1: sha256 only).
    write_manifest(dataset, manifest)
    assert root_version(dataset) == 3 and manifest_doc(dataset)["format_version"] == 1
    assert [e.checksum for e in load_manifest(dataset).shards] == [e.checksum for e in manifest.shards]

    bad = manifest.shards[1]
    flip_bits(os.path.join(dataset, bad.path), 200)
    result = verify(dataset)
    assert result.exit_code == 1, result.output
    [line] = [line for line in result.output.splitlines() if line.startswith("BAD")]
    assert f"{bad.path}: sha256 differs from the manifest" in line, line
    with pytest.raises(ShardIntegrityError, match=r"00001\.npy: sha256 differs from the manifest"):
        shardio.open_dataset(dataset, verify=True)


def test_a_mixed_manifest_round_trips_its_entries_unchanged(dataset):
    doc = as_sha256_entries(dataset, which=[0], format_version=2)  # one old entry among new ones
    before = [json.dumps(entry) for entry in doc["shards"]]
    manifest = load_manifest(dataset)
    assert [e.checksum_algorithm for e in manifest.shards] == ["sha256", "xxh3_128", "xxh3_128", "xxh3_128"]
    assert [json.dumps(entry.to_json()) for entry in manifest.shards] == before
    write_manifest(dataset, manifest)  # saved as the next generation
    after = manifest_doc(dataset)
    assert after["generation"] == doc["generation"] + 1
    assert after["format_version"] == 2  # an xxh3_128 entry: a version-1 reader could not check it
    assert root_version(dataset) == 3
    assert [json.dumps(entry) for entry in after["shards"]] == before
    shardio.open_dataset(dataset, verify=True)  # each entry checked by its own algorithm
    flip_bits(os.path.join(dataset, manifest.shards[2].meta_path), 3)
    with pytest.raises(ShardIntegrityError,
                       match=r"input-1-00000\.jsonl: xxh3_128 differs from the manifest"):
        shardio.open_dataset(dataset, verify=True)


@pytest.mark.parametrize(("change", "says"), [
    ({"drop": ["xxh3_128", "meta_xxh3_128"], "add": {"blake3": "00", "meta_blake3": "00"}},
     r"no checksum this shardio knows .*blake3.*it checks xxh3_128, sha256"),
    ({"drop": ["xxh3_128", "meta_xxh3_128"], "add": {}}, r"no checksum this shardio knows"),
    ({"drop": [], "add": {"sha256": "00", "meta_sha256": "00"}}, r"checksums of xxh3_128 and sha256"),
    ({"drop": [], "add": {"colour": "red"}}, r"fields the format does not have: \['colour'\]"),
])
def test_an_entry_without_one_known_checksum_is_refused_naming_the_manifest(dataset, change, says):
    doc = manifest_doc(dataset)
    entry = doc["shards"][1]
    for key in change["drop"]:
        del entry[key]
    entry.update(change["add"])
    rewrite_manifest(dataset, doc)
    manifest_path = re.escape(os.path.join(dataset, "manifest.json"))
    where = rf"{manifest_path}: shard 'shards/input-0-00001\.npy' .*"
    with pytest.raises(ShardFormatError, match=where + says):
        load_manifest(dataset)
    with pytest.raises(ShardFormatError, match=r"unknown checksum algorithm 'blake3'"):
        new_hasher("blake3")


def test_without_xxhash_the_reader_imports_and_reads_and_checking_says_what_to_install(dataset, monkeypatch):
    # A training image with numpy and torch only: import, open, read, iterate, all without xxhash.
    code = (
        "import sys\n"
        "sys.modules['xxhash'] = None  # unimportable\n"
        "import shardio\n"
        "from shardio import ShardDataset, open_dataset\n"
        f"snapshot = open_dataset({dataset!r})\n"
        "assert [int(p[0, 0, 0]) for p in snapshot.pixels(2)] == list(range(12, 20))\n"
        f"batches = list(ShardDataset({dataset!r}, 7, shuffle=False))\n"
        "assert sum(len(b['image']) for b in batches) == 21\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=False)
    assert result.returncode == 0, result.stderr

    monkeypatch.setitem(sys.modules, "xxhash", None)
    shardio.open_dataset(dataset)  # sizes only: no checksum taken
    with pytest.raises(MissingExtra, match=r"xxh3_128 .*pip install xxhash .*shardio\[s3\]"):
        shardio.open_dataset(dataset, verify=True)
    entry = load_manifest(dataset).shards[0]
    with pytest.raises(MissingExtra, match="pip install xxhash"):
        file_checksum(os.path.join(dataset, entry.path), entry.checksum_algorithm)
    # A remote dataset's cache checks every download: without xxhash it fails when made, not in a thread.
    join = "/".join
    units = [CachedShard.of("s3://bucket/ds", e, lambda *parts: join(parts)) for e in load_manifest(dataset).shards]
    with pytest.raises(MissingExtra, match="pip install xxhash"):
        ShardCache(units, None, os.path.join(dataset, "..", "cache"), 10**9, shape=(8, 8, 3))
    # sha256 entries need no xxhash
    assert file_checksum(os.path.join(dataset, entry.path), "sha256") == \
        hashlib.sha256(read(os.path.join(dataset, entry.path))).hexdigest()
