"""What a dataset holds and how it was made: the manifest, the bytes on disk and the run history.

The run history is ``DIR/reports/*.json`` (one per ``preprocess run``; its format: ``shardio.format.run_report``).
Failures by reason are counted for the inputs the manifest lists now, each from the last run that
processed it, so an input reprocessed after a fix is not counted twice.
"""

from __future__ import annotations

import os
from typing import Any

from shardio.format import INDEX_DIR, MANIFESTS_DIR, REPORTS_DIR, SHARDS_DIR
from shardio.format.manifests import DatasetIndex
from shardio.store.backends import for_path
from shardio.failure_reasons import count_by_category
from shardio.read.snapshot import open_dataset
from shardio.format.run_report import run_history, skipped_count

__all__ = ["dataset_info", "run_history", "format_info"]  # run_history: shardio.format.run_report


def _directory_bytes(directory: str, index: DatasetIndex) -> int:
    """The dataset's bytes on disk without a pass over ``shards/`` (2.3M shards are 4.6M files): the listed
    shards' bytes from the root's totals, the retired files kept for older generations (one stat each),
    and every file outside ``shards/`` (the index, the kept roots, reports). A file in ``shards/`` that
    nothing lists (a killed run's leftover, which the next run or ``preprocess gc`` removes) is not counted."""
    store = for_path(directory)
    total = index.totals.get("bytes", 0) + index.totals.get("meta_bytes", 0)
    for retired in index.retired:
        try:
            total += store.file_size(store.join(directory, retired.path))
        except (FileNotFoundError, OSError):
            pass  # collected already
    if not store.is_local:
        found = store.list_files(directory)  # the top level: manifest.json, the lock
        for folder in (INDEX_DIR, MANIFESTS_DIR, REPORTS_DIR):
            found += store.list_files(store.join(directory, folder), recursive=True)
        return total + sum(info.size for info in found)
    for root, dirs, files in os.walk(directory):
        if root == directory:
            dirs[:] = [d for d in dirs if d != SHARDS_DIR]
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass  # removed while we walked (a job cleaning up)
    return total


def dataset_info(directory: str) -> dict[str, Any]:
    """Count, shape, bytes, shards, config, versions, failures by reason and run history, as JSON data."""
    snapshot = open_dataset(directory)
    manifest = snapshot.manifest
    runs, problems = run_history(snapshot.directory)
    failures_of_input: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        processed = set(run.get("inputs_processed", []))
        for path in processed:
            failures_of_input[path] = []
        for failure in run.get("failures", []):
            if failure.get("input") in processed:
                failures_of_input[failure["input"]].append(failure)
    names = manifest.shards.input_names() if failures_of_input else []
    reasons = count_by_category(f for path in names for f in failures_of_input.get(path, []))
    pixel_bytes, meta_bytes = manifest.totals["bytes"], manifest.totals["meta_bytes"]
    return {
        "directory": snapshot.directory,
        "samples": manifest.samples,
        "shape": list(manifest.shape),
        "layout": "NHWC uint8",
        "shards": len(manifest.shards),
        "inputs": manifest.totals["input_count"],
        "failed_samples": manifest.totals["failed"],
        "encoding": manifest.encoding,
        # Per image, the pixel file bytes (header and offsets included) over the samples: what a JPEG
        # dataset costs against raw's H×W×3, and what the whole dataset grows by per million images.
        "bytes_per_image": pixel_bytes / manifest.samples if manifest.samples else 0.0,
        "raw_bytes_per_image": manifest.shape[0] * manifest.shape[1] * 3,
        "pixel_bytes": pixel_bytes,
        "meta_bytes": meta_bytes,
        "directory_bytes": _directory_bytes(snapshot.directory, manifest),
        "updated": manifest.updated,
        "config": manifest.config,
        "config_hash": manifest.config_hash,
        "versions": manifest.versions,
        "failures_by_reason": reasons,
        "runs": [
            {
                "run_id": r.get("run_id"), "started": r.get("started"),
                "samples_written": r.get("samples_written", 0), "samples_failed": r.get("samples_failed", 0),
                "inputs_processed": len(r.get("inputs_processed", [])),
                "inputs_skipped": skipped_count(r),
                "inputs_failed": len(r.get("inputs_failed", [])),
                "elapsed_s": r.get("elapsed_s"), "images_per_s": r.get("images_per_s"),
                "exit_code": r.get("exit_code"), "versions": r.get("versions", {}),
            }
            for r in runs
        ],
        "report_problems": problems,
    }


def _size(nbytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if nbytes < 1000 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000  # type: ignore[assignment]
    return ""


def _encoding_line(info: dict[str, Any]) -> str:
    per_image, raw = info["bytes_per_image"], info["raw_bytes_per_image"]
    ratio = f", {raw / per_image:.1f}x smaller than raw" if info["encoding"] != "raw" and per_image else ""
    projected = f"this dataset raw: {_size(int(raw * info['samples']))}" if info["encoding"] != "raw" else ""
    return (f"encoding     {info['encoding']}: {_size(int(per_image))} per image{ratio}; 1 M images "
            f"{_size(int(per_image * 1e6))}" + (f" (raw {_size(raw * 10**6)}); {projected}" if projected else ""))


def format_info(info: dict[str, Any]) -> str:
    """``dataset_info`` as the lines ``shardio info`` prints."""
    h, w, c = info["shape"]
    versions = info["versions"]
    lines = [
        f"dataset      {info['directory']}",
        f"samples      {info['samples']}  ({h}x{w}x{c} {info['layout']}, {info['shards']} shards from "
        f"{info['inputs']} inputs; {info['failed_samples']} samples failed)",
        f"on disk      {_size(info['pixel_bytes'])} pixels + {_size(info['meta_bytes'])} metadata; "
        f"directory {_size(info['directory_bytes'])}",
        _encoding_line(info),
        f"updated      {info['updated']}",
        "config       " + ", ".join(f"{k}={v}" for k, v in info["config"].items()),
        f"config hash  {info['config_hash'][:16]}",
        "versions     " + ", ".join(f"{k} {v}" for k, v in versions.items()),
    ]
    if info["failures_by_reason"]:
        lines.append("failures by reason (inputs in the dataset, from their last run):")
        lines += [f"  {count:6d} x {reason}" for reason, count in info["failures_by_reason"].items()]
    lines.append(f"run history ({len(info['runs'])} runs):")
    for run in info["runs"]:
        drift = "" if run["versions"] == versions or not run["versions"] else "  [different library versions]"
        lines.append(
            f"  {run['run_id']}  +{run['samples_written']} samples, {run['samples_failed']} failed; inputs "
            f"{run['inputs_processed']} processed, {run['inputs_skipped']} skipped, {run['inputs_failed']} "
            f"failed; {run['elapsed_s']} s, {run['images_per_s']} img/s; exit {run['exit_code']}{drift}"
        )
    lines += [f"WARNING: {p}" for p in info["report_problems"]]
    return "\n".join(lines)
