"""What a dataset's stored ``config`` implies beyond its keys: its hash, its pixel encoding, a ``.jsonl``
line's crop where it has none, and ``ConfigDerived``, the properties every view of a dataset shares
(identity, encoding, buckets, format version)."""

from __future__ import annotations

import hashlib
import json
from functools import cached_property
from typing import Any

from shardio.errors import ShardFormatError
from shardio.format.buckets import config_buckets
from shardio.format.root_fields import derived_identity
from shardio.format.spec import ENCODINGS, RAW, UNCROPPED_MODES
from shardio.format.version_rule import dataset_format_version, is_bucketed_config

__all__ = ["config_hash", "pixel_encoding", "line_crop_default", "ConfigDerived"]


def pixel_encoding(config: Any, path: str = "manifest") -> str:
    """The dataset's pixel encoding from its stored config (``raw`` where the key is absent: every
    dataset written before version 3); ShardFormatError naming ``path`` for one this shardio cannot read."""
    encoding = config.get("encoding", RAW) if isinstance(config, dict) else RAW
    if encoding not in ENCODINGS:
        raise ShardFormatError(f"{path}: config says encoding {encoding!r}; this shardio reads "
                               f"{', '.join(ENCODINGS)}; HINT: upgrade shardio")
    return encoding


def line_crop_default(config: Any) -> tuple[int, int]:
    """The (top, left) crop of a ``.jsonl`` line without ``crop`` in a dataset of this stored ``config``:
    (0, 0) where the mode cuts nothing (``pad``, ``stretch``), else (-1, -1), unknown (a line written
    before the field existed; a config without ``mode`` is the job's default, ``center_crop``)."""
    mode = config.get("mode", "center_crop") if isinstance(config, dict) else None
    return (0, 0) if mode in UNCROPPED_MODES else (-1, -1)


def config_hash(config: dict[str, Any]) -> str:
    """The sha256 of the config's canonical JSON (sorted keys, no spaces): the root's ``config_hash``."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


class ConfigDerived:
    """What a dataset's ``config`` says beyond its keys, for every view of a dataset (``Manifest``, the
    reader's ``DatasetIndex``, the writer's ``EditableIndex``)."""

    config: dict[str, Any]
    dataset_id: str  # the root's ``dataset``; "" where it has none (spec, "Identity")

    @property
    def config_hash(self) -> str:
        return config_hash(self.config)

    @property
    def identity(self) -> str:
        """The dataset's identity as a resume state names it (spec, "Identity"): the root's ``dataset``,
        else ``config:`` and the first 32 hex digits of the config hash."""
        return self.dataset_id or derived_identity(self.config_hash)

    @property
    def encoding(self) -> str:
        """``raw``, ``jpeg`` or ``yuv420``: how the shards hold the pixels (the config's ``encoding``)."""
        return pixel_encoding(self.config)

    @property
    def is_bucketed(self) -> bool:
        """Whether the config says ``mode: bucket`` (format version 4: spec, "Buckets")."""
        return is_bucketed_config(self.config)

    @cached_property
    def buckets(self) -> tuple[tuple[int, int], ...]:
        """(h, w) of each bucket, by id: a bucketed dataset's resolved list, else its one shape ``((H, W),)``
        (computed once: a size check asks it per shard)."""
        found = config_buckets(self.config)
        return found if found is not None else ((self.shape[0], self.shape[1]),)  # type: ignore[attr-defined]

    def bucket_shape(self, bucket: int) -> tuple[int, int, int]:
        """``(h, w, 3)`` of bucket ``bucket``: what a shard of that bucket holds per sample; ShardFormatError
        for an id outside the list."""
        buckets = self.buckets
        if not 0 <= bucket < len(buckets):
            raise ShardFormatError(f"bucket {bucket} is not one of the dataset's {len(buckets)} buckets "
                                   "(edited or forged)")
        height, width = buckets[bucket]
        return height, width, 3

    @property
    def format_version(self) -> int:
        """The ``format_version`` this dataset's root is written with (spec, "The version rule")."""
        return dataset_format_version(self.config)
