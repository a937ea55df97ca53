"""Bucket lists (format versions 4 and 5, spec "Buckets"): a stored config's list, and a root's ``buckets`` checked
against the version rule (``shardio.format.version_rule``)."""

from __future__ import annotations

from typing import Any

from shardio.errors import ShardFormatError
from shardio.format.spec import (BUCKET_FORMAT_VERSION, BUCKET_MODE, MAX_BUCKETS, MAX_SIDE, NONE,
                                 OUTPUTS_FORMAT_VERSION, YUV420, YUV420_FORMAT_VERSION)
from shardio.format.version_rule import dataset_format_version, is_bucketed_config

__all__ = ["config_buckets", "root_buckets"]


def _bucket_list(value: Any, path: str, where: str) -> tuple[tuple[int, int], ...]:
    """``value`` as a bucket list (spec, "Buckets"): ``[[h, w], ...]``, 1..``MAX_BUCKETS`` entries of whole
    numbers 1..``MAX_SIDE``; ShardFormatError naming ``path`` and ``where`` otherwise."""
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_BUCKETS:
        raise ShardFormatError(f"{path}: {where} is {str(value)[:80]}, not a list of 1..{MAX_BUCKETS} [h, w] "
                               "(edited or forged): nothing was read")
    out = []
    for number, bucket in enumerate(value):
        if (not isinstance(bucket, list) or len(bucket) != 2 or any(type(x) is not int for x in bucket)
                or not all(1 <= x <= MAX_SIDE for x in bucket)):
            raise ShardFormatError(f"{path}: {where}[{number}] is {str(bucket)[:40]}, not [h, w] with each side a "
                                   f"whole number 1..{MAX_SIDE} (edited or forged): nothing was read")
        out.append((bucket[0], bucket[1]))
    return tuple(out)


def config_buckets(config: Any, path: str = "manifest") -> tuple[tuple[int, int], ...] | None:
    """The bucket list a stored config resolves (``mode: bucket``: its ``buckets``), else None (one shape);
    ShardFormatError naming ``path`` for a bucketed config without a valid list."""
    if not is_bucketed_config(config):
        return None
    return _bucket_list(config.get("buckets"), path, "config \"buckets\"")


def root_buckets(doc: dict[str, Any], path: str) -> tuple[tuple[int, int], ...] | None:
    """A root's (or version 1/2 manifest's) ``buckets`` under the version rule (spec, "The version rule"):
    the list for a bucketed root (version 4, or 5 with ``mode: bucket``: present, valid, the config's own),
    None for any other; ShardFormatError naming ``path`` for a root that breaks the rule (its version against
    its config's encoding and mode, ``buckets`` present or absent)."""
    version = doc.get("format_version")
    in_config = config_buckets(doc.get("config"), path)
    config_version = dataset_format_version(doc.get("config"))  # what the root's config makes it
    if (version == OUTPUTS_FORMAT_VERSION) != (config_version == OUTPUTS_FORMAT_VERSION):
        raise ShardFormatError(f"{path}: format_version {version!r} with a config that "
                               f"{'has no' if version == OUTPUTS_FORMAT_VERSION else 'has'} models (a dataset with "
                               f"model outputs is version {OUTPUTS_FORMAT_VERSION}): edited or forged, nothing was "
                               "read")
    if isinstance(doc.get("config"), dict) and doc["config"].get("encoding") == NONE \
            and config_version != OUTPUTS_FORMAT_VERSION:
        raise ShardFormatError(f"{path}: config encoding {NONE!r} without models (a dataset without pixels holds "
                               "model outputs): edited or forged, nothing was read")
    if version == YUV420_FORMAT_VERSION and config_version != version:
        raise ShardFormatError(f"{path}: format_version {version} with a config whose encoding is not "
                               f"{YUV420!r}: edited or forged, nothing was read")
    if version != YUV420_FORMAT_VERSION and config_version == YUV420_FORMAT_VERSION:
        raise ShardFormatError(f"{path}: format_version {version!r} with config encoding {YUV420!r} (a yuv420 "
                               f"dataset is version {YUV420_FORMAT_VERSION}): edited or forged, nothing was read")
    if version == BUCKET_FORMAT_VERSION and config_version != version:
        raise ShardFormatError(f"{path}: format_version {version} with a config whose mode is not "
                               f"{BUCKET_MODE!r}: edited or forged, nothing was read")
    if version in (BUCKET_FORMAT_VERSION, YUV420_FORMAT_VERSION, OUTPUTS_FORMAT_VERSION) \
            and is_bucketed_config(doc.get("config")):
        if "buckets" not in doc:
            raise ShardFormatError(f"{path}: format_version {version} without \"buckets\" (a bucketed dataset's "
                                   "root lists them): edited or forged, nothing was read")
        buckets = _bucket_list(doc["buckets"], path, '"buckets"')
        if in_config != buckets:
            raise ShardFormatError(f"{path}: \"buckets\" {str(doc['buckets'])[:80]} differ from the config's "
                                   f"{str(doc['config'].get('buckets'))[:80]}: edited or forged, nothing was read")
        return buckets
    if "buckets" in doc:
        raise ShardFormatError(f"{path}: \"buckets\" in a format_version {version!r} root (only a bucketed "
                               f"dataset's root lists them, version {BUCKET_FORMAT_VERSION}, or "
                               f"{YUV420_FORMAT_VERSION} for yuv420): edited or forged, nothing was read")
    if in_config is not None:
        raise ShardFormatError(f"{path}: format_version {version!r} with config mode {BUCKET_MODE!r} (a bucketed "
                               f"dataset is version {BUCKET_FORMAT_VERSION}, or {YUV420_FORMAT_VERSION} for yuv420): "
                               "edited or forged, nothing was read")
    return None
