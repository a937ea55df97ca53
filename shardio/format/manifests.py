"""Finding and loading a dataset's manifests on its storage: ``DIR/manifest.json`` (the current generation),
the kept generations in ``DIR/manifests/``, and what to say when a directory holds none (the format they
follow is ``shardio.format.spec``'s). The reader and the write side both load through here."""

from __future__ import annotations

import json
import os
import sys

from shardio.errors import ShardFormatError, ShardIntegrityError
from shardio.format.checksum import SHA256, XXH3_128
from shardio.format.index import manifest_from_root
from shardio.format.spec import FORMAT_VERSION, MANIFEST_NAME, MANIFESTS_DIR, SHARDS_DIR, Manifest
from shardio.store.backends import for_path
from shardio.store.base import Storage
from shardio.store.holders import writer_holding

__all__ = ["generation_path", "list_generations", "load_manifest", "read_root"]


def generation_path(directory: str, generation: int) -> str:
    """``DIR/manifests/GEN.json``: the file generation ``generation`` is committed as, once."""
    return for_path(directory).join(directory, MANIFESTS_DIR, f"{generation:010d}.json")


def list_generations(directory: str) -> list[int]:
    """The generations with a file in ``DIR/manifests/``, oldest first (temp files and strays ignored)."""
    store = for_path(directory)
    found = []
    for name in store.list_dir(store.join(directory, MANIFESTS_DIR)):
        stem, dot, ext = name.partition(".")
        if dot and ext == "json" and stem.isdigit():
            found.append(int(stem))
    return sorted(found)


def read_root(directory: str, generation: int | None = None) -> dict:
    """The JSON of ``manifest.json`` (or of generation ``generation``'s file) without its segments: a
    version 3 root holds the totals (``samples``, ``shard_count``, ``bytes``...), so ``shardio info``
    on a dataset of millions of shards reads a few KB."""
    store = for_path(directory)
    path = store.join(directory, MANIFEST_NAME) if generation is None else generation_path(directory, generation)
    try:
        doc = json.loads(store.read_bytes(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ShardFormatError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(doc, dict):
        raise ShardFormatError(f"{path}: not a shardio manifest (a JSON {type(doc).__name__})")
    return doc


def _read_manifest(store: Storage, path: str, directory: str) -> Manifest:
    data, version = store.read_versioned(path)
    try:
        doc = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ShardFormatError(f"{path}: not valid JSON ({e})") from e
    if isinstance(doc, dict) and doc.get("format_version") == FORMAT_VERSION and doc.get("format") == "shardio":
        manifest = manifest_from_root(doc, path, lambda rel: _read_segment(store, directory, rel))
    else:
        manifest = Manifest.from_json(doc, path)
    manifest.source_version = version
    return manifest


def _read_segment(store: Storage, directory: str, rel: str) -> bytes:
    path = store.join(directory, rel)
    try:
        return store.read_bytes(path)
    except FileNotFoundError as e:
        raise ShardIntegrityError(f"{path}: index segment missing (named by the root); HINT: `preprocess verify "
                                  "DIR --repair` restores a kept generation") from e


def load_manifest(directory: str, generation: int | None = None) -> Manifest:
    """Read and check ``DIR/manifest.json`` (the current generation), or the kept generation ``generation``
    from ``DIR/manifests/``; errors say whether the directory is empty, mid-write or foreign, and which
    kept generations can restore a corrupt ``manifest.json``."""
    store = for_path(directory)
    if not store.exists(directory):
        raise ShardFormatError(f"{directory}: no such dataset directory")
    if store.is_file(directory):
        kind = "a tar file (an input)" if directory.endswith(_TAR_SUFFIXES) else "a file"
        raise ShardFormatError(
            f"{directory}: is {kind}, not a dataset directory; a dataset is the directory that "
            "`preprocess run INPUT... --output DIR` writes (DIR holds manifest.json): pass DIR"
        )
    if generation is not None:
        path = generation_path(directory, generation)
        if not store.exists(path):
            kept = list_generations(directory)
            raise ShardFormatError(
                f"{path}: generation {generation} is not kept (kept: {_describe(kept)}); retention collected it, "
                "or it was never committed: open the current generation, or raise --retain-hours/--retain-generations"
            )
        manifest = _read_manifest(store, path, directory)
        if manifest.generation != generation:
            raise ShardFormatError(f"{path}: holds generation {manifest.generation}, not {generation}")
        return manifest
    path = store.join(directory, MANIFEST_NAME)
    kept = list_generations(directory)
    restore = (f"; kept generations: {_describe(kept)}: `preprocess verify {directory} --repair` restores the "
               "newest valid one (so does the next `preprocess run`)") if kept else ""
    if not store.exists(path):
        raise ShardFormatError(f"{path}: missing; {_why_no_manifest(store, directory)}{restore}")
    try:
        return _read_manifest(store, path, directory)
    except ShardFormatError as e:
        if not restore and "HINT" in str(e):
            raise
        if not restore:
            raise ShardFormatError(f"{e}; HINT: restore it from a backup, or re-run preprocess into a new "
                                   "directory") from e
        raise ShardFormatError(f"{e}{restore}") from e
    except ShardIntegrityError as e:
        raise ShardIntegrityError(f"{e}{restore}") from e


def _describe(generations: list[int]) -> str:
    if not generations:
        return "none"
    if len(generations) > 6:
        return f"{generations[0]}..{generations[-1]} ({len(generations)} files)"
    return ", ".join(str(g) for g in generations)


_TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")


def _why_no_manifest(store: Storage, directory: str) -> str:
    """What a directory without a manifest is, and what to pass instead (the common mistakes: the
    folder of input tars, the dataset's own ``shards/``)."""
    holder = writer_holding(store, directory)
    if holder:
        return (f"a run is writing it ({holder}) and has not committed yet: wait for it to finish, then open it "
                "again (`preprocess run --wait` queues behind it)")
    entries = [e for e in store.list_dir(directory) if not e.startswith(".")]
    if store.is_local:
        parent, base = os.path.dirname(os.path.abspath(directory)), os.path.basename(os.path.abspath(directory))
    else:
        parent, base = directory.rstrip("/").rsplit("/", 1)
    if not entries:
        return "the directory is empty; run `preprocess run INPUT... --output DIR` first"
    if SHARDS_DIR in entries:
        return "shards exist but no manifest: a first run is still writing or was killed; wait or re-run it"
    if base == SHARDS_DIR or any(e.endswith(".npy") for e in entries):
        if store.exists(store.join(parent, MANIFEST_NAME)):
            return f"this is the dataset's {SHARDS_DIR}/ folder: pass the dataset directory {parent}"
        return f"this looks like a {SHARDS_DIR}/ folder: pass the dataset directory (its parent, with manifest.json)"
    tars = [e for e in entries if e.endswith(_TAR_SUFFIXES)]
    if tars:
        return (f"this directory holds {len(tars)} input tar(s), not a dataset: preprocess them first "
                f"(`preprocess run '{store.join(directory, '*.tar')}' --output OUT`) and pass OUT")
    return ("this is not a shardio dataset directory: pass the directory that "
            "`preprocess run --output DIR` wrote (it holds manifest.json)")


def main(argv: list[str]) -> int:
    """``python -m shardio.format.manifests DIR [--sha256]``: ``DIGEST  shards/NAME`` lines of the current
    generation's xxh3_128 shards (or sha256 ones), for ``xxh128sum -c`` / ``sha256sum -c`` run in DIR."""
    paths = [a for a in argv if not a.startswith("--")]
    algorithm = SHA256 if "--sha256" in argv else XXH3_128
    for entry in load_manifest(paths[0] if paths else ".").shards:
        if entry.checksum_algorithm == algorithm:
            print(f"{entry.checksum}  {entry.path}\n{entry.meta_checksum}  {entry.meta_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
