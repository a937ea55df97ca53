"""Which ``format_version`` a dataset has: the one decision (spec, "The version rule"), asked by the root
writer (``ConfigDerived.format_version``), the job that records the version it writes, and the reader's
checks (``shardio.format.buckets.root_buckets``)."""

from __future__ import annotations

from typing import Any

from shardio.format.spec import (BUCKET_FORMAT_VERSION, BUCKET_MODE, FORMAT_VERSION, OUTPUTS_FORMAT_VERSION, YUV420,
                                 YUV420_FORMAT_VERSION)

__all__ = ["is_bucketed_config", "is_yuv420_config", "has_models_config", "dataset_format_version",
           "root_format_version"]


def is_bucketed_config(config: Any) -> bool:
    """Whether a stored config says ``mode: bucket`` (spec, "Buckets")."""
    return isinstance(config, dict) and config.get("mode") == BUCKET_MODE


def is_yuv420_config(config: Any) -> bool:
    """Whether a stored config says ``encoding: yuv420`` (spec, "Pixel encodings")."""
    return isinstance(config, dict) and config.get("encoding") == YUV420


def has_models_config(config: Any) -> bool:
    """Whether a stored config has a non-empty ``models`` (spec, "Model outputs")."""
    return isinstance(config, dict) and bool(config.get("models"))


def dataset_format_version(config: Any) -> int:
    """The ``format_version`` of a dataset whose stored config is ``config``: 6 for one with ``models`` (its
    outputs are what a trainer reads; a reader of versions 3 to 5 would miss them), else 5 for ``encoding: yuv420``
    (bucketed or not: a reader of versions 3 and 4 would map its planes as raw pixels), else 4 for ``mode:
    bucket`` (its shards have several shapes, which a version 3 reader would map at the root's one shape),
    else 3 (the same bytes as before buckets, so older readers keep reading it)."""
    if has_models_config(config):
        return OUTPUTS_FORMAT_VERSION
    if is_yuv420_config(config):
        return YUV420_FORMAT_VERSION
    return BUCKET_FORMAT_VERSION if is_bucketed_config(config) else FORMAT_VERSION


def root_format_version(bucketed: bool) -> int:
    """The ``format_version`` a commit of a raw or JPEG dataset writes (spec, "Buckets"): 4 for a bucketed
    dataset, else 3 (``dataset_format_version`` for a caller that knows only whether its dataset is bucketed)."""
    return dataset_format_version({"mode": BUCKET_MODE} if bucketed else {})
