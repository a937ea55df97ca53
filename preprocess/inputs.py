"""Turning the CLI's INPUT arguments (paths, globs, brace ranges) into a sorted list of tar paths.

The glob rule. A glob (or brace range) is how a nightly cron names its inputs, so it must neither
shrink silently nor grow with junk:

- an argument with a glob or a brace range that matches no tar at all is a usage error
  (``NoInputsMatched``, exit 2) raised before anything is touched: a source mount that is down must
  not look like an empty drop (with ``--prune`` it would empty the dataset);
- a glob takes only tar files (``TAR_SUFFIXES``); anything else it matches (img2dataset's
  ``_stats.json`` and ``.parquet`` beside its tars) is counted as ignored, not a failed input;
- a path named explicitly is taken as it is: a missing one, or one that is not a tar, is a failed
  input named in the report (exit 1), as is a missing member of a brace range that matched others.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field

from braceexpand import braceexpand

from shardio import storage
from shardio.errors import NoInputsMatched

__all__ = ["resolve_inputs", "ResolvedInputs", "NoInputsMatched", "TAR_SUFFIXES"]

_GLOB_CHARS = set("*?[")
# What the tar reader opens (``tarfile`` mode ``r|*``: plain, gzip, bzip2, xz).
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")


@dataclass
class ResolvedInputs:
    paths: list[str] = field(default_factory=list)  # absolute, deduplicated, sorted
    failed: list[dict[str, str]] = field(default_factory=list)  # {input, reason}
    ignored: list[str] = field(default_factory=list)  # non-tar files a glob matched


def _is_tar(path: str) -> bool:
    return path.lower().endswith(TAR_SUFFIXES)


def resolve_inputs(patterns: list[str]) -> ResolvedInputs:
    """Expand ``data/{00000..00099}.tar``, ``data/*.tar`` and plain paths into absolute paths, by the glob
    rule of the module docstring. Paths are deduplicated and sorted, so the order of arguments never
    changes the dataset. Raises ``NoInputsMatched`` for a glob or brace range that matches no tar."""
    found: set[str] = set()
    ignored: set[str] = set()
    failed: list[dict[str, str]] = []
    for pattern in patterns:
        expansions = list(braceexpand(pattern))
        is_pattern = len(expansions) > 1 or any(_GLOB_CHARS & set(e) for e in expansions)
        matched: set[str] = set()
        pattern_failed: list[dict[str, str]] = []
        pattern_ignored: set[str] = set()
        for expanded in expansions:
            local = storage.check_local(expanded)
            if _GLOB_CHARS & set(local):
                files = [os.path.abspath(m) for m in glob.glob(local, recursive=True) if os.path.isfile(m)]
                matched.update(f for f in files if _is_tar(f))
                pattern_ignored.update(f for f in files if not _is_tar(f))
                if not files:
                    pattern_failed.append({"input": expanded, "reason": "glob matched no files"})
            elif os.path.isfile(local):
                matched.add(os.path.abspath(local))
            elif os.path.isdir(local):
                pattern_failed.append({"input": expanded, "reason": "is a directory; pass DIR/*.tar"})
            else:
                pattern_failed.append({"input": expanded, "reason": "no such file"})
        if is_pattern and not matched:
            others = f" (only {len(pattern_ignored)} non-tar file(s))" if pattern_ignored else ""
            raise NoInputsMatched(
                f"{pattern}: matched no tar file{others}; nothing was read, written or pruned. Is the source "
                "mounted? A glob or brace range that matches nothing is refused so that an unmounted drop "
                "never looks like an empty one"
            )
        found |= matched
        ignored |= pattern_ignored
        failed += pattern_failed
    return ResolvedInputs(sorted(found), failed, sorted(ignored - found))
