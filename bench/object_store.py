"""``make bench``'s object-storage figures, each a ratio of two rates taken in this one run.

``python -m bench.object_store [--quick] [--results DIR] [--no-peers] [--no-job]`` starts one SeaweedFS
S3 server on loopback (``tests.s3_server.S3Server``, the test suite's), writes a dataset of random
256x256 uint8 images with shardio's writer (16 shards of 160: 2,560 samples, 503 MB; ``--quick``: 4 of
64) and uploads it, then measures on the same server and the same shard objects:

a) the server's raw parallel GET throughput (obstore, 8 threads; ``bench.s3_clients.raw_get``), before
   and after the reader rows, their mean the denominator of the cold-epoch ratio;
b) s3fs against obstore: GET of a large object, of many 200 KB objects, PUT (``compare_clients``);
c) ``ShardDataset("s3://...", cache_dir=..., cache_limit=...)`` cold, warm and with a bounded cache,
   against the local reader on the same shards, the cache's size sampled from outside
   (``bench.s3_reader``);
d) the job (``run_job``) with input and output on the server against the same job on local disk, on the
   bench corpus of LAION-like JPEG tars (``bench.s3_job``);
e) LitData and Mosaic Streaming at their fastest settings for these images, on the same server, each a
   subprocess of ``bench/out/peer-venv`` (``bench.peer_venv``, ``bench/peers/``).

Rows whose code is not on this branch yet (the reader cache, the S3 job) read "not available" with the
reason, as does a peer that cannot be installed. Results go into ``results.json`` under
``"object_store"`` and a section of ``results.md`` in ``bench/`` (or ``--results DIR``), next to what
``bench.run`` wrote there. 4-6 minutes on 2 cores once the peer venv exists (~3 minutes more to make
it, once). The server is loopback on a shared VM: absolute MB/s say little; the ratios are the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import time
from typing import Any

from bench.corpus import CorpusSpec, build_corpus
from bench.job_bench import ForeignLoad
from bench.peer_venv import ensure_clients_venv, ensure_peer_venv
from bench.copy_baseline import build
from bench.s3_clients import SAMPLE_BYTES, obstore_store, raw_get
from bench.s3_job import job_rows, upload_files
from bench.s3_reader import reader_rows
from bench.results_file import write_section
from shardio.format.manifests import load_manifest
from tests.object_stores import point_environment_at, restore_environment
from tests.s3_server import BENCH_VOLUME_MB, S3Server

HERE = os.path.dirname(os.path.abspath(__file__))
SCRATCH = os.path.join(HERE, "out")
WORK = os.path.join(SCRATCH, "object-store")
BUCKET = "bench"
SECTION = "<!-- object-store: written by python -m bench.object_store -->"


def _log(message: str) -> None:
    print(f"[object-store {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _dataset(quick: bool) -> tuple[str, dict[str, int], dict[str, int]]:
    """(local dataset dir, {shard key in the bucket: bytes}, {"samples", "bytes"}); written once, reused."""
    shards, per_shard = (4, 64) if quick else (16, 160)
    directory = build(os.path.join(WORK, f"dataset-{shards}x{per_shard}"), shards, per_shard)
    manifest = load_manifest(directory)  # any format version (a version 3 root lists no shards itself)
    objects = {f"ds/{entry.path}": entry.bytes for entry in manifest.shards}
    return directory, objects, {"samples": manifest.samples, "bytes": sum(objects.values())}


def _upload_dataset(store: Any, directory: str) -> dict[str, Any]:
    files = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            files["ds/" + os.path.relpath(path, directory).replace(os.sep, "/")] = path
    # manifest.json last, as a writer publishes it: a reader never sees one naming a missing shard
    manifest = files.pop("ds/manifest.json")
    start = time.perf_counter()
    nbytes = upload_files(store, files)
    nbytes += upload_files(store, {"ds/manifest.json": manifest})
    seconds = time.perf_counter() - start
    return {"files": len(files) + 1, "bytes": nbytes, "seconds": round(seconds, 2),
            "MB/s": round(nbytes / seconds / 1e6, 1)}


PEER_WORKERS = (2, 4)  # DataLoader workers tried for each peer (2 cores): the best warm epoch is its row


def _run_child(command: list[str], marker: str, timeout: int = 900,
               env: dict[str, str] | None = None) -> tuple[dict[str, Any] | None, str]:
    """(the JSON the child printed after ``marker``, "") or (None, why it gave none): a peer's script, the clients'
    comparison."""
    try:
        process = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False, env=env)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout} s"
    line = next((ln for ln in reversed(process.stdout.splitlines()) if ln.startswith(marker + " ")), None)
    if process.returncode != 0 or line is None:
        tail = (process.stderr or process.stdout).strip().splitlines()[-3:]
        return None, f"exit {process.returncode}: {' | '.join(tail)}"[-600:]
    return json.loads(line[len(marker) + 1:]), ""


def _clients(env: dict[str, str], rounds: int, large_mb: int) -> dict[str, Any]:
    """``bench.s3_clients.compare_clients`` in the clients' venv (s3fs is no dependency of shardio, and its
    botocore pin would break the project venv's boto3): its result, or why there is none."""
    python, why = ensure_clients_venv(os.path.join(SCRATCH, "clients-venv"), log=_log)
    if why:
        return {"not available": why}
    code = ("import json, os\nfrom bench.s3_clients import compare_clients\n"
            f"print('CLIENTS ' + json.dumps(compare_clients({BUCKET!r}, dict(os.environ), rounds={rounds}, "
            f"large_mb={large_mb})))")
    result, why = _run_child([python, "-c", code], "CLIENTS", timeout=1800,
                             env={**os.environ, **env, "PYTHONPATH": os.path.dirname(HERE)})
    return result if result is not None else {"not available": why}


def _peers(quick: bool, local_dir: str) -> dict[str, Any]:
    python, problems = ensure_peer_venv(os.path.join(SCRATCH, "peer-venv"), log=_log)
    scripts = {"LitData": "litdata_peer.py", "Mosaic Streaming": "mosaic_peer.py"}
    out: dict[str, Any] = {}
    for peer, script in scripts.items():
        if problems[peer]:
            out[peer] = {"not available": problems[peer]}
            continue
        slug = script.split("_")[0]
        scratch = os.path.join(WORK, f"peer-{slug}")
        shutil.rmtree(scratch, ignore_errors=True)
        runs: dict[int, dict[str, Any]] = {}
        for workers in PEER_WORKERS:
            _log(f"peer {peer}, {workers} workers" + ("" if runs else ": write to the server, then epochs"))
            command = [python, os.path.join(HERE, "peers", script), "--shards", local_dir,
                       "--remote", f"s3://{BUCKET}/peer-{slug}", "--scratch", scratch,
                       "--epochs", "2" if quick else "3", "--workers", str(workers)]
            result, why = _run_child(command + (["--skip-write"] if runs else []), "PEER_RESULT")
            runs[workers] = result if result is not None else {"not available": why}
        shutil.rmtree(scratch, ignore_errors=True)
        out[peer] = peer_row(runs)
    return out


def peer_row(runs: dict[Any, dict[str, Any]]) -> dict[str, Any]:
    """A peer's row from its runs by worker count: the best cold epoch of any setting and the best warm
    one (medians of its warm epochs), each the peer's best case. Its cold epoch sometimes waited ~61 s
    for its first batch (Mosaic: its 60 s download timeout, then a retry; in 4 of 12 processes of six
    full runs, never alone, cause not established), so the cold figure is not one setting's bad luck."""
    done = {w: r for w, r in runs.items() if "epochs" in r}
    if not done:
        return {"not available": next(iter(runs.values()))["not available"], "by_workers": runs}
    for r in done.values():
        r["warm"] = {"samples/s": round(statistics.median(e["samples/s"] for e in r["epochs"][1:]), 1)}
    warm = max(done, key=lambda w: done[w]["warm"]["samples/s"])
    cold = max(done, key=lambda w: done[w]["epochs"][0]["samples/s"])
    row = {k: v for k, v in done[warm].items() if k not in ("epochs", "workers", "cache_bytes")}
    row["write_s"] = next((r.get("write_s") for r in runs.values() if r.get("write_s")), None)
    row["cold"] = {**done[cold]["epochs"][0], "workers": int(cold)}
    row["warm"] = {**done[warm]["warm"], "workers": int(warm)}
    tried = "; ".join(f"{w}: cold {r['epochs'][0]['samples/s']:.0f} "
                      f"(first batch {r['epochs'][0]['first_batch_s']:.1f} s)"
                      f", warm {r['warm']['samples/s']:.0f}" if "epochs" in r else f"{w}: failed"
                      for w, r in runs.items())
    row["setting"] += f"; best of DataLoader workers ({tried})"
    row["by_workers"] = runs
    return row


def measure(args: argparse.Namespace) -> dict[str, Any]:
    shutil.rmtree(os.path.join(WORK, "s3-server"), ignore_errors=True)
    server = S3Server(os.path.join(WORK, "s3-server"), volume_size_mb=BENCH_VOLUME_MB)
    _log("starting SeaweedFS (weed server -s3) on loopback")
    server.start()
    saved = point_environment_at(server)  # the product and the peers read the standard AWS variables
    try:
        return _measure(args, server)
    finally:
        server.stop()
        restore_environment(saved)
        log = os.path.join(WORK, "s3-server", "weed.log")
        if os.path.exists(log):  # the server's log outlives its data: stalls and errors show there
            shutil.copy(log, os.path.join(WORK, "weed.log"))
        shutil.rmtree(os.path.join(WORK, "s3-server"), ignore_errors=True)


def _measure(args: argparse.Namespace, server: S3Server) -> dict[str, Any]:
    env = server.env()
    server.client().create_bucket(Bucket=BUCKET)
    store = obstore_store(BUCKET, env)
    local_dir, shard_objects, size = _dataset(args.quick)
    dataset_bytes = size["bytes"]
    results: dict[str, Any] = {"quick": args.quick, "dataset": {**size, "shards": len(shard_objects),
                                                                  "image": [256, 256, 3]}}
    _log(f"uploading {len(shard_objects)} shards, {dataset_bytes / 1e6:.0f} MB, to s3://{BUCKET}/ds")
    results["upload"] = _upload_dataset(store, local_dir)
    rounds = 1 if args.quick else 3
    _log("raw parallel GET of the shard objects (obstore, 8 threads)")
    raw = [raw_get(store, shard_objects, rounds)]
    _log("reader: local, then s3:// cold / warm / bounded cache")
    results["reader"] = reader_rows(local_dir, f"s3://{BUCKET}/ds", WORK, dataset_bytes, len(shard_objects))
    _log("raw parallel GET again (the machine drifts: the ratio uses the mean)")
    raw.append(raw_get(store, shard_objects, rounds))
    results["raw_get"] = {"before": raw[0], "after": raw[1],
                          "MB/s": round(statistics.mean(r["best_MB/s"] for r in raw), 1)}
    results["raw_get"]["samples/s"] = round(results["raw_get"]["MB/s"] * 1e6 / SAMPLE_BYTES, 1)
    _log("s3fs vs obstore on the same server")
    results["clients"] = _clients(env, rounds=2 if args.quick else 3, large_mb=32 if args.quick else 128)
    if args.no_peers:
        results["peers"] = {"skipped": "--no-peers"}
    else:
        results["peers"] = _peers(args.quick, local_dir)
    if args.no_job:
        results["job"] = {"skipped": "--no-job"}
    else:
        spec = CorpusSpec(tars=4, samples_per_tar=24) if args.quick else CorpusSpec()
        corpus = build_corpus(os.path.join(SCRATCH, "corpus"), spec, log=_log)
        _log(f"job: {corpus.images} images in {len(corpus.tars)} tars, local disk vs s3:// in and out")
        results["job"] = job_rows(corpus.tars, store, BUCKET, WORK, reps=1 if args.quick else 2,
                                      server_pid=server.process.pid if server.process else None)
    results["figures"] = figures(results)
    return results


def _figure(name: str, value: float | None, target: float | None = None, op: str = ">=",
            detail: str = "") -> dict[str, Any]:
    met = None
    if value is not None and target is not None:
        met = value >= target if op == ">=" else value <= target
    return {"name": name, "value": None if value is None else round(value, 3), "target": target, "op": op,
            "met": met, "detail": detail}


def figures(r: dict[str, Any]) -> list[dict[str, Any]]:
    reader, raw, job, peers = r["reader"], r["raw_get"], r["job"], r["peers"]
    local = reader["local"]["samples/s"]
    out = []
    why = reader.get("remote", "not measured")
    if "cold" in reader:
        cold, warm, full = reader["cold"]["samples/s"], reader["warm"]["samples/s"], reader["full_cache"]
        fetch = reader["download_path"]
        steady_warm, steady_local = reader["warm"]["steady_samples/s"], reader["local"]["steady_samples/s"]
        out += [
            _figure("reader cold epoch from S3 / raw parallel GET", cold / raw["samples/s"], 0.7,
                    detail=f"{cold:.0f} vs {raw['samples/s']:.0f} samples/s ({raw['MB/s']:.0f} MB/s)"),
            _figure("reader warm epoch / local-disk reader", warm / local, 0.9,
                    detail=f"{warm:.0f} vs {local:.0f} samples/s; first batch "
                    f"{reader['warm']['first_batch_s'] * 1e3:.0f} vs {reader['local']['first_batch_s'] * 1e3:.0f}"
                    f" ms of {r['dataset']['samples'] / warm * 1e3:.0f} ms epochs"),
            _figure("reader warm / local, each epoch less its first batch",
                    steady_warm / steady_local if steady_warm and steady_local else None,
                    detail=f"{steady_warm:.0f} vs {steady_local:.0f} samples/s" if steady_warm and steady_local
                    else "epochs of one batch"),
            _figure("cache fetch path alone / raw parallel GET", fetch["MB/s"] / raw["MB/s"],
                    detail=f"Storage.download, checksum included, {fetch['threads']} threads, no reader: "
                    f"{fetch['MB/s']:.0f} vs {raw['MB/s']:.0f} MB/s"),
            _figure("reader cold epoch / cache fetch path alone", cold / fetch["samples/s"],
                    detail=f"{cold:.0f} vs {fetch['samples/s']:.0f} samples/s"),
            _figure("peak cache / cache_limit (room for all)", full["peak_over_limit"], 1.0, "<=",
                    detail=f"{full['peak_cache_bytes'] / 1e6:.0f} of {full['cache_limit_bytes'] / 1e6:.0f} MB"),
        ]
    else:
        out += [_figure("reader cold epoch from S3 / raw parallel GET", None, 0.7, detail=why),
                _figure("reader warm epoch / local-disk reader", None, 0.9, detail=why),
                _figure("peak cache / cache_limit (room for all)", None, 1.0, "<=", detail=why)]
    bounded = reader.get("bounded")
    if isinstance(bounded, dict):
        shards = r["dataset"]["shards"]
        held = bounded["cache_limit_bytes"] / (r["dataset"]["bytes"] / shards)
        out.append(_figure(f"peak cache / cache_limit ({held:.1f} of {shards} shards)",
                           bounded["peak_over_limit"], 1.0, "<=",
                           detail=f"{bounded['peak_cache_bytes'] / 1e6:.0f} of "
                           f"{bounded['cache_limit_bytes'] / 1e6:.0f} MB; {bounded['samples/s']:.0f} samples/s "
                           f"an epoch (cold {bounded['epochs'][0]['samples/s']:.0f})"))
    else:
        out.append(_figure("peak cache / cache_limit (bounded)", None, 1.0, "<=", detail=bounded or why))
    if isinstance(job.get("s3"), dict):
        busy = job.get("machine_busy", {})
        out.append(_figure("job, S3 in and out / local disk (wall)", job["s3 / local"], None,
                           detail=f"{job['s3']['images/s']:.0f} vs {job['local']['images/s']:.0f} images/s, "
                           f"{job['images']} images, median of {job['reps']}, each after an untimed run of its kind"
                           + (f"; the S3 server itself took {job['server_cpu_share']:.0%} of the machine's CPU "
                              "during the S3 runs" if job.get("server_cpu_share") is not None else "")
                           + (f"; the machine busy {busy['s3']:.0%} (S3) and {busy['local']:.0%} (local)"
                              if busy else "")))
        if job.get("s3 / local, per job CPU second") is not None:
            own, machine = job["job_process_cpu_s"], job["job_cpu_s"]
            by_machine = job["s3 / local, per machine CPU second less the server's"]
            detail = (f"the job's own processes' CPU seconds (driver, Ray's daemons and workers) for the same images, "
                      f"local {statistics.median(own['local']):.2f} over S3 {statistics.median(own['s3']):.2f}; "
                      f"the machine's less the server process's (kernel threads, the server's disk writeback "
                      f"among them, counted as the job's): {statistics.median(machine['local']):.2f} over "
                      f"{statistics.median(machine['s3']):.2f}, "
                      f"{by_machine:.3f}; the wall ratio over "
                      f"(1 - server share): {job['s3 / local, server CPU excluded']:.3f}")
            out.append(_figure("job S3 / local on the cores the server leaves it",
                               job["s3 / local, per job CPU second"], 0.85, detail=detail))
    else:
        out.append(_figure("job S3 / local on the cores the server leaves it", None, 0.85,
                           detail=str(job.get("s3") or job.get("skipped", "not measured"))))
    for peer in ("LitData", "Mosaic Streaming"):
        row = peers.get(peer, {"not available": peers.get("skipped", "not measured")})
        for epoch in ("cold", "warm"):
            name = f"shardio / {peer}, {epoch} epoch from S3"
            if "not available" in row:
                out.append(_figure(name, None, 2.0, detail=f"{peer} not available: {row['not available']}"))
            elif epoch not in reader:
                out.append(_figure(name, None, 2.0, detail=f"shardio: {reader.get('remote')}; "
                                   f"{peer} {row[epoch]['samples/s']:.0f} samples/s"))
            else:
                ours = reader[epoch]["samples/s"]
                out.append(_figure(name, ours / row[epoch]["samples/s"], 2.0,
                                   detail=f"{ours:.0f} vs {row[epoch]['samples/s']:.0f} samples/s"))
        if "not available" not in row:  # both read local files: holds whatever the S3 reader's state
            out.append(_figure(f"shardio local-disk reader / {peer} warm epoch",
                               local / row["warm"]["samples/s"],
                               detail=f"{local:.0f} vs {row['warm']['samples/s']:.0f} samples/s"))
    for case, row in r["clients"].items():
        if isinstance(row, dict) and "obstore / s3fs" in row:
            out.append(_figure(f"obstore / s3fs: {case}", row["obstore / s3fs"],
                               detail=f"{row['obstore']['MB/s']:.0f} vs {row['s3fs']['MB/s']:.0f} MB/s"))
    return out


def markdown(r: dict[str, Any]) -> str:
    d, load = r["dataset"], r["foreign_load"]
    lines = [
        SECTION,
        "## Object storage",
        "",
        f"`python -m bench.object_store`, {r['date']}: one SeaweedFS server on loopback; {d['samples']} random "
        f"256x256 uint8 images in {d['shards']} shards ({d['bytes'] / 1e6:.0f} MB). Other processes used "
        f"{load['mean_cores']} cores on average (max {load['max_cores']}) of {os.cpu_count()}: "
        + ("near 0, ratios worth quoting." if load["mean_cores"] < 0.2 else "**a loaded machine: noisy.**")
        + (" **Quick run: too small to quote.**" if r["quick"] else ""),
        "",
        "| figure | measured | target | met | detail |",
        "|---|---|---|---|---|",
    ]
    for f in r["figures"]:
        value = "n/a" if f["value"] is None else f"{f['value']:.3g}x"
        target = "" if f["target"] is None else f"{f['op']} {f['target']:g}x"
        met = "" if f["met"] is None else ("yes" if f["met"] else "**no**")
        lines.append(f"| {f['name']} | {value} | {target} | {met} | {f['detail']} |")
    lines += ["", "Samples/s (batches of 256, shuffled; cold = empty cache, warm = the next epochs):", "",
              "| reader | cold | warm | setting |", "|---|---|---|---|"]
    reader = r["reader"]
    lines.append(f"| raw parallel GET (obstore, 8 threads) | {r['raw_get']['samples/s']:.0f} | | bytes only |")
    lines.append(f"| shardio, local disk | | {reader['local']['samples/s']:.0f} | page cache warm |")
    if "cold" in reader:
        lines.append(f"| shardio, s3:// | {reader['cold']['samples/s']:.0f} | {reader['warm']['samples/s']:.0f} "
                     f"| ShardDataset, cache_limit 1.25x the data |")
    else:
        lines.append(f"| shardio, s3:// | n/a | n/a | {reader.get('remote')} |")
    for peer, row in r["peers"].items():
        if not isinstance(row, dict):
            continue
        if "not available" in row:
            lines.append(f"| {peer} | n/a | n/a | not available: {row['not available']} |")
        else:
            lines.append(f"| {peer} {row['version']} | {row['cold']['samples/s']:.0f} | "
                         f"{row['warm']['samples/s']:.0f} | {row['setting']} |")
    versions = r["clients"].get("versions", {})
    if "not available" in r["clients"]:
        lines += ["", f"Clients: not available: {r['clients']['not available']}"]
    lines += ["", "Clients on the same server (" + ", ".join(f"{k} {v}" for k, v in versions.items())
              + "), MB/s, medians:", "", "| case | s3fs | obstore | obstore / s3fs |", "|---|---|---|---|"]
    for case, row in r["clients"].items():
        if isinstance(row, dict) and "obstore / s3fs" in row:
            lines.append(f"| {case} | {row['s3fs']['MB/s']:.0f} | {row['obstore']['MB/s']:.0f} "
                         f"| {row['obstore / s3fs']:.2f} |")
    lines += ["", "Raw numbers in `bench/results.json` under `object_store`.", ""]
    return "\n".join(lines)


def write_results(results: dict[str, Any], directory: str) -> None:
    """``results`` into DIR/results.json (``object_store``) and its section into DIR/results.md, keeping the rest."""
    write_section(directory, "object_store", results, SECTION, markdown(results))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny dataset, one round (checks the bench runs)")
    parser.add_argument("--results", help="directory of results.json/.md (default: bench/, or "
                        "bench/out/quick with --quick)")
    parser.add_argument("--no-peers", action="store_true", help="skip LitData and Mosaic Streaming")
    parser.add_argument("--no-job", action="store_true", help="skip the preprocessing job rows")
    args = parser.parse_args(argv)
    directory = args.results or (os.path.join(SCRATCH, "quick") if args.quick else HERE)
    started = time.perf_counter()
    with ForeignLoad() as foreign:
        results = measure(args)
    results["foreign_load"] = foreign.summary()
    results["bench_seconds"] = round(time.perf_counter() - started, 1)
    results["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    write_results(results, directory)
    print(markdown(results))
    _log(f"done in {results['bench_seconds']:.0f} s; wrote {directory}/results.json (object_store), results.md")
    return results


if __name__ == "__main__":
    main()
