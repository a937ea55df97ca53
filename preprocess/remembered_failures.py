"""The inputs that failed for their bytes in the last run, remembered from its report and set aside unread
while they are unchanged (``preprocess.job``'s docstring, "A permanently broken input", says why): the
newest report read once (``latest_report``: one listing of ``reports/`` and one read, under the lock), an
entry kept only where it recorded the input's fingerprint.
"""

from __future__ import annotations

from typing import Any

from preprocess.inputs.resolve import InputFingerprint
from preprocess.plan import Plan
from shardio.format.run_report import RunReport, latest_report
from shardio.store.root import Place

__all__ = ["remembered_failures", "set_aside_remembered"]


def remembered_failures(output: Place) -> dict[str, dict[str, Any]]:
    """The inputs the newest run report of ``output`` (the dataset's root, or its path) says failed for their
    bytes (``fingerprint`` recorded), by path: what this run reports again without reading, if unchanged.
    None remembered without a readable report."""
    latest = latest_report(output)
    failed = latest.get("inputs_failed") if latest is not None else None
    if not isinstance(failed, list):
        return {}
    return {entry["input"]: entry for entry in failed
            if isinstance(entry, dict) and isinstance(entry.get("input"), str)
            and isinstance(entry.get("fingerprint"), dict)}


def set_aside_remembered(planned: Plan, remembered: dict[str, dict[str, Any]], report: RunReport) -> int:
    """Take out of ``planned.todo`` every input that failed for its bytes before and is unchanged since (the
    same size and mtime, or size and ETag: ``plan._same_input``'s rule), and report it failed again, as it
    was, without reading it; a changed one stays to do. Returns how many were set aside."""
    if not remembered:
        return 0
    todo = []
    for path, fingerprint in planned.todo:
        entry = remembered.get(path)
        if entry is None or not _unchanged_since(entry["fingerprint"], fingerprint):
            todo.append((path, fingerprint))
            continue
        report.inputs_failed.append({key: entry[key] for key in
                                     ("input", "reason", "fingerprint", "failed_in", "samples_lost") if key in entry})
    set_aside = len(planned.todo) - len(todo)
    planned.todo = todo
    return set_aside


def _unchanged_since(recorded: dict[str, Any], fingerprint: InputFingerprint) -> bool:
    if fingerprint.etag:
        return recorded.get("size") == fingerprint.size and recorded.get("etag") == fingerprint.etag
    return recorded.get("size") == fingerprint.size and recorded.get("mtime_ns") == fingerprint.mtime_ns
