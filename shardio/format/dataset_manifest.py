"""A dataset as objects (``Manifest``: what a commit edits, whatever version it was read from) and its
one-document JSON, the ``manifest.json`` of format versions 1 and 2 (spec, "Manifest"): written for
tests and older readers, read with every check a root gets (safe paths, each file listed once)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from shardio.errors import ShardFormatError, ShardIntegrityError
from shardio.format.buckets import root_buckets
from shardio.store.checksum import SHA256
from shardio.format.dataset_config import ConfigDerived, pixel_encoding
from shardio.format.entries import InputEntry, RetiredFile, ShardEntry
from shardio.format.model_outputs import OutputSpec
from shardio.format.names import check_dataset_path
from shardio.format.root_fields import root_generation, root_shape
from shardio.format.spec import FORMAT_NAME, JPEG, JPEG_FORMAT_VERSION, LEGACY_VERSIONS, READ_VERSIONS

__all__ = ["Manifest"]


@dataclass
class Manifest(ConfigDerived):
    """A dataset: its shape, config, shards, inputs and retired files, as one commit sees it."""

    shape: tuple[int, int, int]
    config: dict[str, Any]
    versions: dict[str, Any]
    shards: list[ShardEntry] = field(default_factory=list)
    inputs: dict[str, InputEntry] = field(default_factory=dict)
    updated: str = ""
    generation: int = 0
    retired: list[RetiredFile] = field(default_factory=list)
    # Not stored: the version (ETag on object storage) of the file this manifest was read from, so the
    # next commit replaces exactly that one (``If-Match``) and never a newer writer's.
    source_version: str = field(default="", compare=False, repr=False)
    # Format 3 only (``shardio.format.index``): the root's segments, oldest first (``SegmentRef``), and
    # each committed input's signature as those segments hold it, so a commit writes only the inputs
    # that changed since. None: not described by segments (read from a version 1/2 manifest, or built
    # in memory): the next commit writes everything in one segment (the upgrade).
    segments: list[Any] | None = field(default=None, compare=False, repr=False)
    indexed: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # Format 3 only: the root's ``dataset`` (spec, "Identity"); "" for a version 1/2 manifest (whose
    # one-document form, ``to_json``, has no such field) or one built in memory.
    dataset_id: str = field(default="", compare=False, repr=False)
    # Format 3 only: the root's ``fence`` (spec, "Fencing names"), "" where it has none.
    name_fence: str = field(default="", compare=False, repr=False)
    # Format 3 only: the root's class table (spec, "Classes"), () where it has none.
    classes: tuple[str, ...] = field(default=(), compare=False, repr=False)
    # Format 6 only: the root's model outputs (spec, "Model outputs": ``OutputSpec``s), () where it has none.
    outputs: tuple[OutputSpec, ...] = field(default=(), compare=False, repr=False)

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def legacy_version(self) -> int:
        """The version of the one-document form (``to_json``): 1 while every entry is sha256, else 2."""
        if self.shards and all(entry.checksum_algorithm == SHA256 for entry in self.shards):
            return 1
        return 2

    def to_json(self) -> dict[str, Any]:
        """The whole dataset as one version 1/2 document: what older shardio wrote (and what tests
        compare); a commit writes format 3 (``shardio.format.index``)."""
        return {
            "format": FORMAT_NAME,
            "format_version": self.legacy_version,
            "layout": "NHWC",
            "dtype": "uint8",
            "shape": list(self.shape),
            "samples": self.samples,
            "config": self.config,
            "config_hash": self.config_hash,
            "versions": self.versions,
            "shards": [s.to_json() for s in self.shards],
            "inputs": {k: v.to_json() for k, v in sorted(self.inputs.items())},
            "updated": self.updated,
            "generation": self.generation,
            "retired": [asdict(r) for r in self.retired],
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any], path: str) -> Manifest:
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise ShardFormatError(f"{path}: not a shardio manifest (no \"format\": \"{FORMAT_NAME}\")")
        version = doc.get("format_version")
        if version not in LEGACY_VERSIONS:
            if version in READ_VERSIONS:
                raise ShardFormatError(f"{path}: a format {version} root: read it with "
                                       "shardio.format.manifests.load_manifest")
            raise ShardFormatError(
                f"{path}: format_version {version!r}, this shardio reads versions "
                f"{', '.join(str(v) for v in READ_VERSIONS)}; "
                "HINT: install the shardio version that wrote it, or re-run preprocess into a new directory"
            )
        try:
            if doc["layout"] != "NHWC" or doc["dtype"] != "uint8" or len(doc["shape"]) != 3:
                raise ShardFormatError(f"{path}: unsupported layout {doc['layout']}/{doc['dtype']}")
            h, w, c = root_shape(doc, path)
            manifest = cls(
                shape=(h, w, c),
                config=doc["config"],
                versions=doc.get("versions", {}),
                shards=[ShardEntry.from_json(s, path) for s in doc["shards"]],
                inputs={k: InputEntry(**v) for k, v in doc.get("inputs", {}).items()},
                updated=doc.get("updated", ""),
                generation=root_generation(doc, path),
                retired=[RetiredFile(**r) for r in doc.get("retired", [])],
            )
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise ShardFormatError(f"{path}: malformed manifest ({type(e).__name__}: {e})") from e
        root_buckets(doc, path)  # a version 1/2 manifest is never bucketed: refused if it says so
        if version != JPEG_FORMAT_VERSION and pixel_encoding(manifest.config, path) == JPEG:
            raise ShardFormatError(f"{path}: format_version {version} with encoding jpeg (a JPEG dataset is "
                                   f"version {JPEG_FORMAT_VERSION}): the manifest was edited or forged")
        for entry in manifest.shards:
            check_dataset_path(entry.path, path)
            check_dataset_path(entry.meta_path, path)
        for entry in manifest.inputs.values():
            for rel in entry.shards:
                check_dataset_path(rel, path)
        for retired in manifest.retired:
            check_dataset_path(retired.path, path)
        _check_listed_once(manifest, path)
        if doc.get("samples") != manifest.samples:
            raise ShardIntegrityError(
                f"{path}: says {doc.get('samples')} samples but its shards hold {manifest.samples}"
            )
        return manifest


def _check_listed_once(manifest: Manifest, path: str) -> None:
    """ShardFormatError naming the file when a shard file is listed twice in ``shards`` or claimed by two
    inputs (or twice by one): the reader would yield its samples twice and a repair or prune would act on
    it twice. Only a hand edit or a bad merge makes such a manifest; the job never writes one."""
    seen: set[str] = set()
    for entry in manifest.shards:
        for rel in (entry.path, entry.meta_path):
            if rel in seen:
                raise ShardFormatError(
                    f"{path}: shard file {rel!r} is listed twice in \"shards\" (a manifest lists each shard "
                    "once; edited by hand?): nothing was read")
            seen.add(rel)
    owner: dict[str, str] = {}
    for name, entry in manifest.inputs.items():
        for rel in entry.shards:
            if rel in owner:
                claimed = f"twice by input {name!r}" if owner[rel] == name else \
                    f"by inputs {owner[rel]!r} and {name!r}"
                raise ShardFormatError(f"{path}: shard file {rel!r} is claimed {claimed} (a shard belongs "
                                       "to one input, once; edited by hand?): nothing was read")
            owner[rel] = name
