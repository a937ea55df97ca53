"""A run's plan: which resolved inputs are committed unchanged (skipped), which to process, in what order.

It costs no I/O: every input arrives with its fingerprint from the listing that found it
(``preprocess.inputs.resolve``), and the committed ones are the dataset's ``Manifest.inputs``. Per input, one
lookup in each and a comparison (~0.4 us): a no-op rerun over LAION-2B-en's 230k tars plans in
about 0.1 s (``python -m bench.scale_job``). Skipped inputs are counted, and only the first
``NAMED_SKIPPED`` named (the run report must not grow by a line per committed input).

What stays O(inputs) in the driver, and must: the resolved listing (sorted and deduplicated before
anything is touched: a glob that matches nothing is refused first), ~250 bytes per input as Python
objects (path string, fingerprint tuple, dict slot), and the committed inputs the dataset index holds.
The work list is O(inputs to process), in the order they are submitted: largest first.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from preprocess.inputs.resolve import InputFingerprint, ResolvedInputs
from shardio.errors import OutputUnusable, PruneRefused
from shardio.format import InputEntry
from shardio.format.run_report import NAMED_SKIPPED
from shardio.store.root import Place, open_root

__all__ = ["Plan", "plan_inputs", "largest_first_key", "check_output_apart", "check_prune"]


@dataclass
class Plan:
    todo: list[tuple[str, InputFingerprint]] = field(default_factory=list)  # largest first, then path
    skipped: int = 0  # committed unchanged
    skipped_named: list[str] = field(default_factory=list)  # the first NAMED_SKIPPED of them, in path order


def largest_first_key(item: tuple[str, InputFingerprint]) -> tuple[int, str]:
    """Input size descending, then path: the longest tasks start first (LPT scheduling)."""
    return -item[1][0], item[0]


def plan_inputs(resolved: ResolvedInputs, committed: Mapping[str, InputEntry]) -> Plan:
    """Compare each resolved input's listed fingerprint with its committed entry (``committed``: the
    dataset's ``Manifest.inputs``); no file is opened or stat'ed here."""
    plan = Plan()
    listed = resolved.listed
    for path in resolved.paths:
        fingerprint = listed[path]
        entry = committed.get(path)
        if entry is not None and _same_input(entry, fingerprint):
            if plan.skipped < NAMED_SKIPPED:
                plan.skipped_named.append(path)
            plan.skipped += 1
        else:
            plan.todo.append((path, fingerprint))
    plan.todo.sort(key=largest_first_key)
    return plan


def _same_input(committed: InputEntry, fingerprint: InputFingerprint) -> bool:
    """An object: size + ETag; a local file: size + mtime_ns (``preprocess.job``'s docstring says why)."""
    if fingerprint.etag:
        return committed.size == fingerprint.size and committed.etag == fingerprint.etag
    return committed.size == fingerprint.size and committed.mtime_ns == fingerprint.mtime_ns


def check_output_apart(place: Place, resolved: ResolvedInputs) -> None:
    """``OutputUnusable`` if an input tar lies in the dataset directory or below it: the tars would sit
    among the manifest and ``shards/``, and the directory's cleaning must never be near a tar it does not
    own. A dataset *inside* an input folder (``data/shards-256`` beside ``data/*.tar``) is fine: its files
    are in their own directory, and a glob such as ``data/*`` takes files only, and tars only.

    Local paths are compared with their symlinks resolved (``out`` and a link to the input folder are one
    folder): one ``realpath`` per input folder, and one per input that is itself a symlink (the listing
    says which), not one per input (a realpath is an lstat per path component)."""
    root = open_root(place)
    directory = root.path
    inside = (os.path.realpath(directory) if root.is_local else directory) + "/"
    for folder in resolved.folders:
        # The other way round for a folder input: a dataset inside it would change its fingerprint (its
        # directories' mtimes, a prefix's listing) at every run, and its files would be read as the folder's.
        if inside.startswith(_comparable(folder, resolved.listed[folder]) + "/"):
            raise OutputUnusable(f"{directory}: --output lies inside the input folder {folder}; give an --output "
                                 "outside it; nothing was written")
    folder_inside: dict[str, bool] = {}  # input folder -> whether it lies in the output (a name has no "/")
    for path in resolved.paths:
        folder = path.rpartition("/")[0] or "/"
        held = folder_inside.get(folder)
        if held is None:
            held = folder_inside[folder] = (_comparable(folder, resolved.listed[path]) + "/").startswith(inside)
        if path in resolved.links:
            held = os.path.realpath(path).startswith(inside)
        if held:
            raise OutputUnusable(
                f"{directory}: --output holds input {path}; a dataset directory must not hold its input tars "
                "(they would be mixed with its manifest and shards): give an --output outside the input "
                f"folders, e.g. {path.rstrip('/').rsplit('/', 1)[0]}/shards; nothing was written"
            )


def _comparable(path: str, fingerprint: InputFingerprint) -> str:
    """``path`` as the output is compared with it: a local one with its links resolved, a URL as it is (an
    object's fingerprint carries its ETag, a local file's none: ``_same_input``'s rule)."""
    return path.rstrip("/") if fingerprint.etag else os.path.realpath(path)


def check_prune(committed: dict[str, InputEntry], totals: dict[str, int], to_prune: list[str],
                 directory: str) -> None:
    """``--prune`` dropping more than half of the committed inputs or samples is refused (``PruneRefused``,
    before anything is touched) unless confirmed: an input list that shrank by accident (a source mount half
    down) must not empty a dataset."""
    samples = sum(committed[p].samples for p in to_prune)
    if 2 * len(to_prune) > len(committed) or 2 * samples > totals["samples"]:
        raise PruneRefused(
            f"{directory}: --prune would drop {len(to_prune)} of {len(committed)} committed inputs "
            f"({samples} of {totals['samples']} samples), e.g. {to_prune[0]}; nothing was changed. If the inputs "
            "really are gone, rerun with --confirm-large-prune; if not, check that the source is mounted"
        )
