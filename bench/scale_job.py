"""The job at LAION size: a no-op rerun over many committed inputs, and what one finished input costs the
driver, at 300 / 3k / 30k committed local inputs.

Synthetic and made in seconds: N tiny tars (2 KB: one member) and a dataset whose index lists each of
them as committed with its (size, mtime_ns) and one 1-sample 8x8 shard, written through the writer API
(``shardio.write.shard_writer.write_manifest``) instead of running the job N times. Each figure runs in
a fresh process (``python -m bench.scale_job --child ...``), so its RSS is its own.

- ``noop``: ``run_job`` over ``TARS/*.tar``: wall time (a no-op never starts Ray: there is no task, so the
  figure is the whole run after the imports) and the driver's peak RSS over its RSS before the run.
- ``fold``: the job's share of one finished input (``preprocess.job.fold_result``: report and commit
  bookkeeping, the commit itself left out) on a dataset of N committed inputs: us per input; and,
  apart, the run's first lookup of an input name (it reads each segment's name table once: O(inputs)).
- ``append``: a run with work, the driver's side: ``run_job`` over ``TARS/*.tar`` plus 10 new tars, with
  the Ray stage replaced by a stand-in that writes each new input's shard and folds its result as a
  worker's would (``preprocess.job.fold_result``): everything the driver does with the index (load,
  plan, commit, leftovers, retention), none of Ray's own start-up. Wall time, and the driver's peak RSS
  over its RSS before the run.
- ``plan``: the planning function alone (``preprocess.plan.plan_inputs``) at 230k inputs (LAION-2B-en's
  tars), in memory: seconds, and the listing's bytes per input (tracemalloc).

``--shard-curve 3000:1,10,100`` adds ``append`` on 3,000 committed inputs of 1, 10 and 100 shards each
(3k / 30k / 300k shards): what a run with work costs must not grow with the shards the dataset holds.

``--synthetic 230000:10`` adds ``append`` on LAION-2B-en's size: 230k committed tars of 10 shards each
(2.3M shards), the index made with numpy (``bench.synthetic_index``) and the committed shards' files not
written (a run with work never reads them).

``python -m bench.scale_job [--sizes 300,3000,30000] [--plan-inputs 230000] [--shard-curve 3000:1,10,100]
[--synthetic 230000:10]`` prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tarfile
import time
import tracemalloc
from typing import Any

from preprocess.config import JobConfig
from preprocess.image.versions import library_versions
from preprocess.worker import shard_stem
from shardio.format import InputEntry, Manifest, ShardEntry, npy_header
from shardio.store.checksum import WRITE_ALGORITHM, new_hasher
from shardio.write.shard_writer import write_manifest

__all__ = ["make_committed_inputs", "CONFIG", "main"]

CONFIG = JobConfig(height=8, width=8)
OUT = os.path.join(os.path.dirname(__file__), "out", "scale_job")


def _tiny_tar() -> bytes:
    """A valid 2 KB tar of one 1-byte member (tarfile itself pads every tar to 10 KB)."""
    info = tarfile.TarInfo("000000.txt")
    info.size = 1
    return info.tobuf(tarfile.USTAR_FORMAT) + b"x".ljust(512, b"\0") + bytes(1024)


def _digest(data: bytes) -> str:
    hasher = new_hasher(WRITE_ALGORITHM)
    hasher.update(data)
    return hasher.hexdigest()


def _tiny_parquet() -> bytes:
    """A valid Parquet file of one row (img2dataset's columns: key, jpg, caption)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    out = io.BytesIO()
    pq.write_table(pa.table({"key": ["000000"], "jpg": [b"x"], "caption": ["c"]}), out)
    return out.getvalue()


def make_committed_inputs(root: str, count: int, shards_per_input: int = 1, kind: str = "tar") -> tuple[str, str]:
    """``count`` tiny inputs (``kind``: tars, or Parquet files) in ``root/tars`` and a dataset
    ``root/dataset`` that lists every one of them as committed (as the job would have: same size and
    mtime_ns, ``shards_per_input`` 1-sample shards each). Returns (glob, dataset)."""
    tars, dataset = os.path.join(root, "tars"), os.path.join(root, "dataset")
    os.makedirs(tars, exist_ok=True)
    os.makedirs(os.path.join(dataset, "shards"), exist_ok=True)
    tar_bytes = _tiny_tar() if kind == "tar" else _tiny_parquet()
    pixels = npy_header(1, CONFIG.height, CONFIG.width) + bytes(CONFIG.height * CONFIG.width * 3)
    pixels_digest = _digest(pixels)
    manifest = Manifest(shape=(CONFIG.height, CONFIG.width, 3), config=CONFIG.output_dict(),
                        versions=library_versions())
    for number in range(count):
        path = os.path.join(tars, f"{number:06d}.{kind}")
        with open(path, "wb") as f:
            f.write(tar_bytes)
        info = os.stat(path)
        stem = shard_stem(path, info.st_size, info.st_mtime_ns)
        meta = (json.dumps({"key": f"{number:06d}", "tar": path, "member": "000000.jpg", "width": 8,
                            "height": 8, "txt": None, "cls": None, "json": None}) + "\n").encode()
        meta_digest = _digest(meta)
        names = []
        for shard in range(shards_per_input):
            rel, meta_rel = f"shards/{stem}-{shard:05d}.npy", f"shards/{stem}-{shard:05d}.jsonl"
            with open(os.path.join(dataset, rel), "wb") as f:
                f.write(pixels)
            with open(os.path.join(dataset, meta_rel), "wb") as f:
                f.write(meta)
            manifest.shards.append(ShardEntry(rel, meta_rel, 1, len(pixels), pixels_digest, len(meta), meta_digest,
                                              path, WRITE_ALGORITHM))
            names.append(rel)
        manifest.inputs[path] = InputEntry(info.st_size, info.st_mtime_ns, samples=shards_per_input, failed=0,
                                           shards=names)
    write_manifest(dataset, manifest)
    return os.path.join(tars, f"*.{kind}"), dataset


def make_synthetic_committed(root: str, count: int, shards_per_input: int) -> tuple[str, str]:
    """``make_committed_inputs`` at LAION size: ``count`` tiny tars, and an index (``bench.synthetic_index``:
    one segment made with numpy) that lists each as committed with ``shards_per_input`` shards whose files
    are not written. A run with work never reads a committed shard's file (nor its entry, but for the
    inputs it replaces), so the driver's figures are those of a real dataset of that size."""
    import numpy as np

    from bench.synthetic_index import write_index

    tars, dataset = os.path.join(root, "tars"), os.path.join(root, "dataset")
    os.makedirs(tars, exist_ok=True)
    os.makedirs(os.path.join(dataset, "shards"), exist_ok=True)
    tar_bytes = _tiny_tar()
    names, mtimes = [], []
    for number in range(count):
        path = os.path.join(tars, f"{number:06d}.tar")
        with open(path, "wb") as f:
            f.write(tar_bytes)
        names.append(path)
        mtimes.append(os.stat(path).st_mtime_ns)
    order = sorted(range(count), key=lambda i: names[i].encode())
    write_index(dataset, count * shards_per_input, shards_per_input, samples=1,
                inputs_as=([names[i] for i in order], np.full(count, len(tar_bytes)), np.array(mtimes)[order]),
                config=CONFIG.output_dict(), versions=library_versions())
    return os.path.join(tars, "*.tar"), dataset


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _child_noop(root: str) -> dict[str, Any]:
    from preprocess.job import RunOptions, run_job

    pattern, dataset = os.path.join(root, "tars", "*.tar"), os.path.join(root, "dataset")
    before = _rss_bytes()
    started = time.perf_counter()
    report = run_job(RunOptions([pattern], dataset, CONFIG))
    wall = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if report.inputs_processed or report.inputs_failed:
        raise RuntimeError(f"not a no-op: {len(report.inputs_processed)} processed, {report.inputs_failed[:3]}")
    return {"wall_s": round(wall, 3), "rss_over_start_mb": round(max(0, peak - before) / 1e6, 1),
            "skipped": report.inputs_skipped_count}


def _child_fold(root: str, inputs: int = 200) -> dict[str, Any]:
    from preprocess.job import fold_result
    from preprocess.worker import InputResult
    from shardio.format.run_report import RunReport
    from shardio.write.directory import Committer, load_committed

    dataset = os.path.join(root, "dataset")
    committer = Committer(dataset, load_committed(dataset)[0], interval_s=1e9)  # the commit left out
    committer.last_commit = time.monotonic()
    report = RunReport("bench", dataset, "", CONFIG.to_dict())
    results = [InputResult(f"/new/{n:06d}.tar", 2048, n, samples=1, shards=[{
        "path": f"shards/new{n}.npy", "meta_path": f"shards/new{n}.jsonl", "samples": 1, "bytes": 320,
        "checksum": "0" * 32, "meta_bytes": 10, "meta_checksum": "0" * 32, "input": f"/new/{n:06d}.tar",
        "checksum_algorithm": WRITE_ALGORITHM}]) for n in range(inputs)]
    started = time.perf_counter()
    committer.index.input("/not/committed.tar")  # the first lookup reads the segments' name tables, once
    first = time.perf_counter() - started
    started = time.perf_counter()
    for result in results:
        fold_result(report, committer, result)
    return {"fold_us_per_input": round((time.perf_counter() - started) / inputs * 1e6, 2),
            "first_lookup_s": round(first, 4)}


def _child_append(root: str, inputs: int = 10) -> dict[str, Any]:
    import uuid

    from preprocess import job
    from preprocess.job import RunOptions, fold_result, run_job
    from preprocess.worker import InputResult

    pattern, dataset = os.path.join(root, "tars", "*.tar"), os.path.join(root, "dataset")
    fresh = os.path.join(root, "new", uuid.uuid4().hex[:8])  # new names each time: always 10 to do
    os.makedirs(fresh)
    for n in range(inputs):
        with open(os.path.join(fresh, f"{n:03d}.tar"), "wb") as f:
            f.write(_tiny_tar())
    pixels = npy_header(1, CONFIG.height, CONFIG.width) + bytes(CONFIG.height * CONFIG.width * 3)
    versions = library_versions()

    def stand_in(run, work, committer, files, reader):  # job._process's signature: the tasks, run in-process
        run.emit("plan", work.event())
        for path, fingerprint in work.todo:
            stem = shard_stem(path, fingerprint.size, fingerprint.mtime_ns)
            meta = (json.dumps({"key": stem}) + "\n").encode()
            for rel, data in ((f"shards/{stem}-00000.npy", pixels), (f"shards/{stem}-00000.jsonl", meta)):
                with open(os.path.join(dataset, rel), "wb") as f:
                    f.write(data)
            fold_result(run.report, committer, InputResult(path, fingerprint.size, fingerprint.mtime_ns, samples=1,
                                                           shards=[{
                "path": f"shards/{stem}-00000.npy", "meta_path": f"shards/{stem}-00000.jsonl", "samples": 1,
                "bytes": len(pixels), "checksum": _digest(pixels), "meta_bytes": len(meta),
                "meta_checksum": _digest(meta), "input": path, "checksum_algorithm": WRITE_ALGORITHM}],
                versions=versions))
        return None

    job._process = stand_in
    before = _rss_bytes()
    started = time.perf_counter()
    report = run_job(RunOptions([pattern, os.path.join(fresh, "*.tar")], dataset, CONFIG))
    wall = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if len(report.inputs_processed) != inputs:
        raise RuntimeError(f"expected {inputs} processed, got {len(report.inputs_processed)}: "
                           f"{report.inputs_failed[:3]}")
    return {"wall_s": round(wall, 3), "rss_over_start_mb": round(max(0, peak - before) / 1e6, 1),
            "skipped": report.inputs_skipped_count}


def _child_plan(count: int) -> dict[str, Any]:
    from preprocess.inputs.resolve import InputFingerprint, ResolvedInputs
    from preprocess.plan import plan_inputs

    tracemalloc.start()
    paths = [f"/data/laion2B-en/{n:06d}.tar" for n in range(count)]  # img2dataset's names, 41-byte paths
    resolved = ResolvedInputs(paths, listed={p: InputFingerprint(400_000_000 + n, 1_700_000_000_000_000_000 + n)
                                             for n, p in enumerate(paths)})
    listing_bytes = tracemalloc.get_traced_memory()[0]
    committed = {p: InputEntry(f.size, f.mtime_ns, samples=10_000, failed=0) for p, f in resolved.listed.items()}
    tracemalloc.stop()
    started = time.perf_counter()
    plan = plan_inputs(resolved, committed)
    wall = time.perf_counter() - started
    assert plan.skipped == count and not plan.todo
    return {"inputs": count, "plan_s": round(wall, 3), "listing_bytes_per_input": round(listing_bytes / count)}


def _in_child(*args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "bench.scale_job", "--child", *args], check=True,
                         capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.scale_job", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="300,3000,30000")
    parser.add_argument("--plan-inputs", type=int, default=230_000)
    parser.add_argument("--synthetic", default="",
                        help="INPUTS:K: 'append' on a synthetic index of INPUTS x K shards (230000:10: LAION-2B-en)")
    parser.add_argument("--shard-curve", default="",
                        help="INPUTS:K1,K2,...: 'append' on INPUTS committed inputs of K shards each (e.g. "
                             "3000:1,10,100)")
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, value = args.child
        children = {"noop": _child_noop, "fold": _child_fold, "append": _child_append}
        result = children[kind](value) if kind != "plan" else _child_plan(int(value))
        print(json.dumps(result))
        return result
    figures: dict[str, Any] = {"noop": {}, "fold": {}, "append": {}}
    for size in (int(s) for s in args.sizes.split(",")):
        root = os.path.join(args.out, str(size))
        if not os.path.exists(os.path.join(root, "dataset", "manifest.json")):
            started = time.perf_counter()
            make_committed_inputs(root, size)
            figures.setdefault("built_s", {})[size] = round(time.perf_counter() - started, 1)
        figures["noop"][size] = _in_child("noop", root)
        figures["fold"][size] = _in_child("fold", root)
        figures["append"][size] = _in_child("append", root)
    if args.shard_curve:
        count, per_input = args.shard_curve.split(":")
        for k in (int(v) for v in per_input.split(",")):
            root = os.path.join(args.out, f"{count}x{k}")
            if not os.path.exists(os.path.join(root, "dataset", "manifest.json")):
                make_committed_inputs(root, int(count), k)
            figures.setdefault("append_by_shards", {})[f"{count} inputs x {k} shards"] = _in_child("append", root)
    if args.synthetic:
        count, k = (int(v) for v in args.synthetic.split(":"))
        root = os.path.join(args.out, f"synthetic-{count}x{k}")
        if not os.path.exists(os.path.join(root, "dataset", "manifest.json")):
            make_synthetic_committed(root, count, k)
        figures["append_synthetic"] = {f"{count} inputs x {k} shards": _in_child("append", root)}
    figures["plan"] = _in_child("plan", str(args.plan_inputs))
    print(json.dumps(figures, indent=1))
    return figures


if __name__ == "__main__":
    main()
