"""Turning the CLI's INPUT arguments (paths, globs, brace ranges) into a sorted list of tar paths."""

from __future__ import annotations

import glob
import os

from braceexpand import braceexpand

from shardio import storage

__all__ = ["resolve_inputs"]

_GLOB_CHARS = set("*?[")


def resolve_inputs(patterns: list[str]) -> tuple[list[str], list[dict[str, str]]]:
    """Expand ``data/{00000..00099}.tar``, ``data/*.tar`` and plain paths into absolute paths.

    Returns (paths, failed): a plain path that does not exist, or a glob that matches nothing, is a
    failed input named in the report, never a silent no-op. Paths are deduplicated and sorted, so the
    order of arguments never changes the dataset.
    """
    found: set[str] = set()
    failed: list[dict[str, str]] = []
    for pattern in patterns:
        for expanded in braceexpand(pattern):
            local = storage.check_local(expanded)
            if _GLOB_CHARS & set(local):
                matches = [m for m in glob.glob(local, recursive=True) if os.path.isfile(m)]
                if not matches:
                    failed.append({"input": expanded, "reason": "glob matched no files"})
                found.update(os.path.abspath(m) for m in matches)
            elif os.path.isfile(local):
                found.add(os.path.abspath(local))
            elif os.path.isdir(local):
                failed.append({"input": expanded, "reason": "is a directory; pass DIR/*.tar"})
            else:
                failed.append({"input": expanded, "reason": "no such file"})
    return sorted(found), failed
