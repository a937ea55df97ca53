"""What a dataset holds and how it was made: the manifest, the bytes on disk and the run history.

The run history is ``DIR/reports/*.json`` (one per ``preprocess run``; its format: ``shardio.format.run_report``).
Failures by reason are counted for the inputs the manifest lists now, each from the last run that
processed it, so an input reprocessed after a fix is not counted twice.

A bucketed dataset (``shardio.format``, "Buckets") also gets its bucket histogram: per bucket its shape,
samples, shards and pixel bytes, from the index's columns (one ``bincount`` each, no object per shard).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from shardio.format import INDEX_DIR, MANIFESTS_DIR, NONE, REPORTS_DIR, SHARDS_DIR
from shardio.format.manifests import DatasetIndex
from shardio.store.root import DatasetRoot
from shardio.failure_reasons import count_by_category
from shardio.read.snapshot import open_dataset
from shardio.format.run_report import run_history, skipped_count

__all__ = ["dataset_info", "run_history", "format_info", "bucket_histogram"]  # run_history: shardio.format.run_report

_BAR = 30  # characters of the largest bucket's bar in ``shardio info``


def bucket_histogram(index: DatasetIndex) -> list[dict[str, Any]]:
    """Per bucket, by id: ``bucket``, ``shape`` [h, w], ``samples``, ``shards``, ``bytes`` (the pixel files'),
    counted over the index's columns."""
    table = index.shards
    ids = table.bucket_ids()
    count = len(index.buckets)
    samples = np.bincount(ids, weights=table.samples, minlength=count)
    shards = np.bincount(ids, minlength=count)
    nbytes = np.bincount(ids, weights=table.column("bytes"), minlength=count)
    return [{"bucket": b, "shape": [h, w], "samples": int(samples[b]), "shards": int(shards[b]),
             "bytes": int(nbytes[b])} for b, (h, w) in enumerate(index.buckets)]


def _directory_bytes(dataset: DatasetRoot, index: DatasetIndex) -> int:
    """The dataset's bytes on disk without a pass over ``shards/`` (2.3M shards are 4.6M files): the listed
    shards' bytes from the root's totals, the retired files kept for older generations (one stat each),
    and every file outside ``shards/`` (the index, the kept roots, reports). A file in ``shards/`` that
    nothing lists (a killed run's leftover, which the next run or ``preprocess gc`` removes) is not counted."""
    store, directory = dataset.storage, dataset.path
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
    runs, problems = run_history(snapshot.root)
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
    raw_per_image = manifest.shape[0] * manifest.shape[1] * 3
    bucketed: dict[str, Any] = {}
    if manifest.is_bucketed:
        histogram = bucket_histogram(manifest)
        bucketed = {"buckets": histogram}
        if manifest.samples:  # what the samples' own shapes take raw (the budget is an upper bound)
            raw_per_image = sum(b["samples"] * b["shape"][0] * b["shape"][1] * 3 for b in histogram) / manifest.samples
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
        "raw_bytes_per_image": raw_per_image,
        "pixel_bytes": pixel_bytes,
        "meta_bytes": meta_bytes,
        "directory_bytes": _directory_bytes(snapshot.root, manifest),
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
        **bucketed,
        **({"classes": list(snapshot.classes)} if snapshot.classes else {}),
        **({"outputs": [o.to_json() for o in snapshot.outputs]} if snapshot.outputs else {}),
    }


def _size(nbytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if nbytes < 1000 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000  # type: ignore[assignment]
    return ""


def _encoding_line(info: dict[str, Any]) -> str:
    if info["encoding"] == NONE:
        return "encoding     none: no pixels kept (the model outputs below are the dataset)"
    per_image, raw = info["bytes_per_image"], info["raw_bytes_per_image"]
    ratio = f", {raw / per_image:.1f}x smaller than raw" if info["encoding"] != "raw" and per_image else ""
    projected = f"this dataset raw: {_size(int(raw * info['samples']))}" if info["encoding"] != "raw" else ""
    return (f"encoding     {info['encoding']}: {_size(int(per_image))} per image{ratio}; 1 M images "
            f"{_size(int(per_image * 1e6))}" + (f" (raw {_size(int(raw * 10**6))}); {projected}" if projected else ""))


def _aspect(height: int, width: int) -> str:
    """A bucket's aspect as w:h with its short side 1 (``3:1``, ``1:1.29``, ``1:8192``): never 0 for a valid
    bucket, as a w/h printed to two decimals is for 8192x1 (0.0001)."""
    ratio = f"{max(height, width) / min(height, width):.2f}".rstrip("0").rstrip(".")
    return f"{ratio}:1" if width >= height else f"1:{ratio}"


def _bucket_lines(info: dict[str, Any]) -> list[str]:
    """The bucket histogram: one line per bucket (shape, aspect w:h, samples and share, shards, bytes, a bar)."""
    buckets = info["buckets"]
    total = max(1, info["samples"])
    most = max([1] + [b["samples"] for b in buckets])
    lines = [f"buckets      {len(buckets)} shapes (h x w, aspect w:h), {info['shape'][0]}x{info['shape'][1]} "
             "pixel budget:"]
    for b in buckets:
        h, w = b["shape"]
        bar = "#" * round(_BAR * b["samples"] / most)
        lines.append(f"  {b['bucket']:3d}  {h:4d}x{w:<4d} {_aspect(h, w):>7}  {b['samples']:8d} samples "
                     f"{100 * b['samples'] / total:5.1f}%  {b['shards']:6d} shards  {_size(b['bytes']):>9}  {bar}")
    return lines


_CLASSES_SHOWN = 20  # names on the classes line; ImageNet's 1,000 would bury the rest of the summary


def _classes_line(classes: list[str]) -> str:
    """The class table (spec, "Classes"): ``classes      3: 0 cat, 1 dog, 2 bird``, the first names only."""
    shown = ", ".join(f"{number} {name}" for number, name in enumerate(classes[:_CLASSES_SHOWN]))
    hidden = len(classes) - _CLASSES_SHOWN
    more = f", ... ({hidden} more: `shardio info --json`)" if hidden > 0 else ""
    return f"classes      {len(classes)}: {shown}{more}"


def _output_lines(outputs: list[dict[str, Any]]) -> list[str]:
    """Each model output (spec, "Model outputs"): its name, input, dtype, shape per bucket and model identity."""
    lines = [f"outputs      {len(outputs)}: " + ", ".join(o["name"] for o in outputs)]
    for o in outputs:
        shapes = sorted({tuple(s) for s in o["shapes"] if s is not None})
        shown = " ".join("x".join(map(str, s)) for s in shapes[:6]) + (" ..." if len(shapes) > 6 else "")
        identity = o["identity"]
        made_by = " ".join([identity["function"], *(f"{k} {identity[k]}" for k in ("weights", "version")
                                                   if identity.get(k))])
        lines.append(f"  {o['name']}: {o['input']} -> {o['dtype']} [{shown or 'no sample yet'}]; made by {made_by}")
    return lines


def format_info(info: dict[str, Any]) -> str:
    """``dataset_info`` as the lines ``shardio info`` prints."""
    h, w, c = info["shape"]
    versions = info["versions"]
    lines = [
        f"dataset      {info['directory']}",
        f"samples      {info['samples']}  ("
        + (f"{len(info['buckets'])} bucket shapes, budget {h}x{w}" if "buckets" in info else f"{h}x{w}x{c}")
        + f" {info['layout']}, {info['shards']} shards from "
        f"{info['inputs']} inputs; {info['failed_samples']} samples failed)",
        f"on disk      {_size(info['pixel_bytes'])} pixels + {_size(info['meta_bytes'])} metadata; "
        f"directory {_size(info['directory_bytes'])}",
        _encoding_line(info),
        *(_bucket_lines(info) if "buckets" in info else []),
        *([_classes_line(info["classes"])] if "classes" in info else []),
        *(_output_lines(info["outputs"]) if "outputs" in info else []),
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
