"""Every epoch cold: the reader streaming a dataset from S3, Google Cloud Storage and Azure Blob (the test
suite's emulators on loopback: SeaweedFS, fake-gcs-server, Azurite) against its two limits, in one run.

    python -m bench.cold_epoch [--clouds s3,gcs,azure] [--samples 3072] [--per-shard 64] [--ranks 4,8]
                               [--rounds 2] [--compare DIR] [--results DIR] [--quick]

The same photo-like 256x256 images as a raw and as a JPEG dataset (``bench.gpu_data``; shards of
``--per-shard``: 48 shards), for each cloud and each encoding, every epoch row in a fresh child process
(``--rounds`` of each, alternated, medians):

- ``local``: ``ShardDataset`` over the local copy, shuffled (the default window and block), batches of 256
  copied once into a reused buffer (a JPEG batch decoded on the CPU), after a warm-up epoch: the local-disk
  limit;
- ``raw_get``: every object of the dataset (shards and their metadata) fetched with parallel GETs into memory
  (obstore, 8 threads; whole objects and 8 MB ranges, the faster counts), before and after the epochs, the
  mean: the network's limit;
- ``cold``: ``ShardDataset(URL, cache_dir=..., cache_limit=a third of the dataset)``, shuffled, the same
  batches: the cache holds a third of the shards, so every epoch downloads every shard again (two epochs on one
  dataset object after an untimed one, as ``local``: the process's start and the cache's first fill are not an
  epoch's; the rate over both, and the downloads they made); the window is the default one as the reader clamps
  it to such a cache;
- ``cold / raw_get``, ``cold / local`` and ``cold / min(raw_get, local)`` (the goal: >= 0.9), and the
  client's CPU seconds per GB of shards (the reader's process: on 2 cores the server takes the rest);
- the whole machine's CPU seconds per GB (``/proc/stat``: the server's too) for the raw GETs and for the cold
  epochs, and their ratio: where the server shares the client's cores (2 cores on loopback), cold / raw GET cannot
  pass it, since both keep every core busy at best (``cpu_allows / raw_get``);
- ``--compare DIR``: the same cold epochs with the shardio of another checkout (``DIR`` on ``PYTHONPATH``,
  e.g. the main branch), alternated with this one's: the "before" column;
- ``--ranks 4,8`` (S3 only): that many rank processes of one node sharing one ``cache_dir``, in lockstep (a
  barrier after every batch, as DDP's all-reduce), on a dataset of ``--ranks-samples`` (the node's cache a third
  of it: each rank's ``cache_limit``, since the ranks sharing a directory hold the same files), two epochs after an
  untimed one: the combined rate against raw GET and the same ranks reading the local copy, the share of the
  shards downloaded an epoch, the directory's peak against the limit, and the whole machine's CPU per GB against
  the raw GETs'.

Writes ``cold_epoch`` into ``results.json`` and its section into ``results.md`` in ``bench/`` (or
``--results DIR``; ``--quick``: ``bench/out/quick``), and prints the table. On a shared 2-core VM the server and
the reader share the cores and the absolute rates drift: the ratios, taken in one run, are the figures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any


from bench.cold_child import cold_rate, dataset_objects, local_rate
from bench.cold_ranks import ranks_rows
from bench.gpu_data import build
from bench.machine_cpu import machine_cpu_s
from bench.results_file import write_section

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "out")
BATCH = 256
GET_THREADS = 8
RANGE_BYTES = 8 << 20
GOAL = 0.9


def _log(message: str) -> None:
    print(f"[cold-epoch {time.strftime('%H:%M:%S')}] {message}", flush=True)


def raw_get(url: str, objects: dict[str, int], rounds: int) -> float:
    """Best bytes/s of parallel GETs of every object (whole, or 8 MB ranges), into memory."""
    import obstore

    from shardio.store.backends import for_path

    storage = for_path(url)
    targets = {rel: storage._target(storage.join(url, rel)) for rel in objects}  # (obstore store, key)

    def whole(rel: str) -> int:
        store, key = targets[rel]
        return len(obstore.get(store, key).bytes())

    def ranged(piece: tuple[str, int, int]) -> int:
        store, key = targets[piece[0]]
        return len(obstore.get_range(store, key, start=piece[1], length=piece[2]))

    ranges = [(rel, start, min(RANGE_BYTES, size - start))
              for rel, size in objects.items() for start in range(0, size, RANGE_BYTES) if size]
    best = 0.0
    for _ in range(rounds):
        for fn, items in ((whole, list(objects)), (ranged, ranges)):
            started = time.perf_counter()
            with ThreadPoolExecutor(GET_THREADS) as pool:
                nbytes = sum(pool.map(fn, items))
            best = max(best, nbytes / (time.perf_counter() - started))
    return best


def _servers(clouds: list[str], root: str) -> dict[str, Any]:
    from tests.azure_server import AzureServer
    from tests.gcs_server import GCSServer
    from tests.s3_server import BENCH_VOLUME_MB, S3Server

    made = {"s3": lambda path: S3Server(path, volume_size_mb=BENCH_VOLUME_MB), "gcs": GCSServer, "azure": AzureServer}
    return {cloud: made[cloud](os.path.join(root, cloud)) for cloud in clouds}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from shardio.store import backends
    from tests.object_stores import CloudBucket, point_environment_at, restore_environment

    root = tempfile.mkdtemp(prefix="shardio-cold-")
    _log(f"datasets: {args.samples} images, shards of {args.per_shard}")
    data = build(os.path.join(OUT, f"cold-{args.samples}x{args.per_shard}"), args.samples, distinct=256,
                 samples_per_shard=args.per_shard, workers=os.cpu_count())
    local = {"raw": data.raw, "jpeg": data.jpeg}
    objects = {name: dataset_objects(directory) for name, directory in local.items()}
    result: dict[str, Any] = {"samples": args.samples, "per_shard": args.per_shard, "cores": os.cpu_count(),
                              "local": {}, "clouds": {}}
    worlds = [int(w) for w in args.ranks.split(",") if w]
    ranks_data = {}
    if worlds and "s3" in args.clouds.split(","):
        made = build(os.path.join(OUT, f"cold-ranks-{args.ranks_samples}x{args.per_shard}"), args.ranks_samples,
                     distinct=256, samples_per_shard=args.per_shard, workers=os.cpu_count())
        ranks_data = {"raw": made.raw, "jpeg": made.jpeg}
    servers = _servers(args.clouds.split(","), root)
    try:
        for cloud, server in servers.items():
            os.makedirs(server.root, exist_ok=True)
            server.start()
            saved = point_environment_at(server)
            backends._OPEN.clear()  # a backend made before this server's variables were set
            try:
                bucket = CloudBucket(server, server.new_bucket())
                rows: dict[str, Any] = {}
                for name, directory in local.items():
                    url = bucket.upload_dir(directory, prefix=name)
                    files, samples = objects[name]
                    nbytes = sum(files.values())
                    rounds = 1 if args.quick else args.rounds
                    epochs = 1 if args.quick else 2
                    get_rounds = 1 if args.quick else 2
                    machine = {"raw_get": 0.0, "cold": 0.0, "local": 0.0}  # CPU seconds, the server's too
                    began = machine_cpu_s()
                    gets, locals_, colds, befores = [raw_get(url, files, get_rounds)], [], [], []
                    machine["raw_get"] += machine_cpu_s() - began
                    for turn in range(rounds):  # alternated: a busy moment of a shared machine hits every row
                        local_run = local_rate(directory, epochs)
                        locals_.append(float(local_run["samples/s"]))
                        machine["local"] += local_run["machine_cpu_s"]
                        # this checkout and the other in turns, each first every other round (the second of a
                        # round runs against a server that has just served the same objects)
                        codes = [None, args.compare] if args.compare else [None]
                        for code in codes if turn % 2 == 0 else codes[::-1]:
                            if code is None:
                                colds.append(cold_rate(url, os.path.join(root, "cache"), nbytes // 3, epochs))
                                machine["cold"] += colds[-1]["machine_cpu_s"]
                            else:
                                befores.append(cold_rate(url, os.path.join(root, "cache"), nbytes // 3, epochs,
                                                         code))
                    began = machine_cpu_s()
                    gets.append(raw_get(url, files, get_rounds))
                    machine["raw_get"] += machine_cpu_s() - began
                    get_rate = statistics.mean(gets) * samples / nbytes
                    local_samples = statistics.median(locals_)
                    cold = min(colds, key=lambda c: abs(c["samples/s"] - statistics.median(
                        x["samples/s"] for x in colds)))  # the median run, with its counters
                    cold["runs_samples/s"] = [c["samples/s"] for c in colds]
                    cold["client_cpu_s_per_GB"] = round(statistics.median(
                        c["client_cpu_s"] / (len(c["epochs_samples/s"]) * nbytes / 1e9) for c in colds), 2)
                    row = {"raw_get_samples/s": round(get_rate, 1),
                           "raw_get_MB/s": round(statistics.mean(gets) / 1e6, 1),
                           "local_samples/s": round(local_samples, 1), "local_runs": [round(x, 1) for x in locals_],
                           "cold": cold}
                    limit = min(get_rate, local_samples)
                    row["cold / raw_get"] = round(cold["samples/s"] / get_rate, 3)
                    row["cold / local"] = round(cold["samples/s"] / local_samples, 3)
                    row["cold / limit"] = round(cold["samples/s"] / limit, 3)
                    # The machine's CPU per GB each way (whole and ranged GETs each round; a cold child's epochs
                    # only): where the server shares the client's cores, cold / raw GET cannot pass their ratio,
                    # what both reach when they keep every core busy.
                    per_gb = {"raw_get": machine["raw_get"] / (2 * 2 * get_rounds * nbytes / 1e9),
                              "cold": machine["cold"] / (rounds * epochs * nbytes / 1e9)}
                    row["machine_cpu_s_per_GB"] = {k: round(v, 2) for k, v in per_gb.items()}
                    if per_gb["cold"]:
                        row["cpu_allows / raw_get"] = round(per_gb["raw_get"] / per_gb["cold"], 3)
                        # The same for the local row (the decode's CPU, for JPEG): per GB of the same shards.
                        per_gb["local"] = machine["local"] / (rounds * epochs * nbytes / 1e9)
                        row["machine_cpu_s_per_GB"]["local"] = round(per_gb["local"], 2)
                        row["cpu_allows / local"] = round(per_gb["local"] / per_gb["cold"], 3)
                        allows = row["cpu_allows / raw_get"] if get_rate <= local_samples else row["cpu_allows / local"]
                        row["cold / what the CPU allows"] = round(row["cold / limit"] / allows, 3)
                    if befores:
                        before = statistics.median(b["samples/s"] for b in befores)
                        row["before"] = {"code": args.compare, "samples/s": round(before, 1),
                                         "runs_samples/s": [b["samples/s"] for b in befores],
                                         "client_cpu_s_per_GB": round(statistics.median(
                                             b["client_cpu_s"] / (len(b["epochs_samples/s"]) * nbytes / 1e9)
                                             for b in befores), 2),
                                         "cold / limit": round(before / limit, 3)}
                    rows[name] = row
                    _log(f"{cloud} {name}: cold {cold['samples/s']:.0f}, raw GET {get_rate:.0f}, local "
                         f"{row['local_samples/s']:.0f} samples/s: cold / limit {row['cold / limit']:.3f}"
                         + (f" (before: {row['before']['cold / limit']:.3f})" if "before" in row else ""))
                result["clouds"][cloud] = rows
                if worlds and cloud == "s3":
                    _log(f"ranks: {args.ranks_samples} images, {worlds} rank processes")
                    result["ranks"] = ranks_rows(bucket, ranks_data, worlds, rows, root, args.compare)
                    for label, row in result["ranks"].items():
                        _log(f"{label}: cold {row['cold']['samples/s']:.0f}, local {row['local_samples/s']:.0f}, "
                             f"raw GET {row['raw_get_samples/s']:.0f} samples/s: "
                             f"cold / limit {row['cold / limit']:.3f}")
            finally:
                server.stop(crash=True)
                restore_environment(saved)
                backends._OPEN.clear()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return result


def table(result: dict[str, Any]) -> str:
    lines = ["| cloud | shards | cold samples/s | raw GET | local | cold / raw GET | cold / local | "
             "cold / slower limit | before: cold / slower limit | client CPU s/GB (before) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for cloud, rows in result["clouds"].items():
        for name, row in rows.items():
            before = row.get("before", {})
            cpu = f"{row['cold']['client_cpu_s_per_GB']:.2f}" + (
                f" ({before['client_cpu_s_per_GB']:.2f})" if before else "")
            lines.append(f"| {cloud} | {name} | {row['cold']['samples/s']:.0f} | {row['raw_get_samples/s']:.0f} | "
                         f"{row['local_samples/s']:.0f} | {row['cold / raw_get']:.3f} | {row['cold / local']:.3f} | "
                         f"{row['cold / limit']:.3f} | {before.get('cold / limit', '')} | {cpu} |")
    for label, row in result.get("ranks", {}).items():
        name, cold = label.split(",")[0], row["cold"]
        lines.append(f"| s3, {row['ranks']} ranks, lockstep | {name} | {cold['samples/s']:.0f} | "
                     f"{row['raw_get_samples/s']:.0f} | {row['local_samples/s']:.0f} (the ranks) | | | "
                     f"{row['cold / limit']:.3f} | {row.get('before', {}).get('cold / limit', '')} | "
                     f"downloads {row['downloads / shards, an epoch']:.2f} of the shards an epoch, directory peak "
                     f"{row.get('directory peak / limit', 0):.2f} of the limit |")
    return "\n".join(lines)


SECTION = "<!-- cold-epoch: written by python -m bench.cold_epoch -->"


def _figure(name: str, value: float | None, target: float | None, detail: str) -> dict[str, Any]:
    met = None if value is None or target is None else value >= target
    return {"name": name, "value": None if value is None else round(value, 3), "target": target, "op": ">=",
            "met": met, "detail": detail}


def figures(result: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for cloud, rows in result["clouds"].items():
        for name, row in rows.items():
            cold, before = row["cold"], row.get("before")
            detail = (f"{cold['samples/s']:.0f} samples/s; / raw GET {row['cold / raw_get']:.3f} "
                      f"({row['raw_get_samples/s']:.0f}), / local {row['cold / local']:.3f} "
                      f"({row['local_samples/s']:.0f}); client {cold['client_cpu_s_per_GB']:.2f} CPU s/GB")
            if "cpu_allows / local" in row:
                used = row["machine_cpu_s_per_GB"]
                detail += (f"; the machine's CPU s/GB (server included) {used['cold']:.2f} cold, {used['raw_get']:.2f} "
                           f"raw GET, {used['local']:.2f} local: on cores they share, cold can reach "
                           f"{row['cpu_allows / raw_get']:.3f} of raw GET and {row['cpu_allows / local']:.3f} of "
                           f"local, and reaches {row['cold / what the CPU allows']:.3f} of the slower")
            if before:
                detail += (f"; before ({before['code']}): {before['cold / limit']:.3f}, "
                           f"{before['client_cpu_s_per_GB']:.2f} CPU s/GB")
            out.append(_figure(f"cold epoch from {cloud}, {name} shards / slower limit", row["cold / limit"], GOAL,
                               detail))
    for label, row in result.get("ranks", {}).items():
        name, cold = label.split(",")[0], row["cold"]
        detail = (f"{cold['samples/s']:.0f} samples/s together, in lockstep; raw GET {row['raw_get_samples/s']:.0f}, "
                  f"the same ranks from local disk {row['local_samples/s']:.0f}; the node's cache a third of the "
                  f"dataset: {row['downloads / shards, an epoch']:.2f} of the {row['shards']} shards downloaded an "
                  f"epoch ({cold['downloads']} downloads, {cold['adopted']} adopted), the directory's peak "
                  f"{row.get('directory peak / limit', 0):.2f} of the limit; shuffle window "
                  f"{cold.get('shuffle_window')} shards (the default, fitted to the cache)")
        if "cpu_allows / raw_get" in row:
            detail += (f"; the machine's CPU s/GB {row['machine_cpu_s_per_GB']:.2f}: on cores the server shares, "
                       f"the ranks can reach {row['cpu_allows / raw_get']:.3f} of raw GET and reach "
                       f"{row['cold / what the CPU allows']:.3f} of that")
        if "before" in row:
            detail += f"; before: {row['before']['cold / limit']:.3f}"
        out.append(_figure(f"{row['ranks']} ranks sharing a cache_dir, s3, {name} shards / slower limit",
                           row["cold / limit"], GOAL, detail))
    return out


def markdown(result: dict[str, Any]) -> str:
    lines = [SECTION, "## Every epoch cold", "",
             f"`python -m bench.cold_epoch`, {result['date']}: {result['samples']} photo-like 256x256 images in "
             f"shards of {result['per_shard']}, raw and JPEG, each cloud's emulator on loopback; a cache of a third "
             f"of the dataset; medians of {result['rounds']} alternated runs" + (" (quick run: too small to quote)"
                                                                               if result["quick"] else "") + ".",
             "", "| figure | measured | target | met | detail |", "|---|---|---|---|---|"]
    for f in result["figures"]:
        value = "n/a" if f["value"] is None else f"{f['value']:.3g}x"
        met = "" if f["met"] is None else ("yes" if f["met"] else "**no**")
        lines.append(f"| {f['name']} | {value} | >= {f['target']:g}x | {met} | {f['detail']} |")
    lines += ["", table(result), "", "Raw numbers in `bench/results.json` under `cold_epoch`.", ""]
    return "\n".join(lines)


def write_results(result: dict[str, Any], directory: str) -> None:
    """``result`` into DIR/results.json (``cold_epoch``) and its section into DIR/results.md, keeping the rest."""
    write_section(directory, "cold_epoch", result, SECTION, markdown(result))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clouds", default="s3,gcs,azure")
    parser.add_argument("--samples", type=int, default=3072)
    parser.add_argument("--per-shard", type=int, default=64)
    parser.add_argument("--ranks", default="4,8", help="rank processes of one node to run together (S3 only), "
                        "comma-separated; '' for none")
    parser.add_argument("--ranks-samples", type=int, default=24576, help="the ranks' dataset: a third of it "
                        "(the node's cache) must hold two shuffle windows, each well over a step of 8 ranks")
    parser.add_argument("--rounds", type=int, default=2, help="alternated runs of each row (medians)")
    parser.add_argument("--compare", help="a checkout of shardio to run the same cold epochs with, alternated "
                        "with this one's (e.g. the main branch): its rows are 'before'")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--results", help="directory of results.json/.md (default: bench/, or bench/out/quick "
                        "with --quick)")
    args = parser.parse_args(argv)
    # A third of a small dataset holds two windows of a few shards: the reader says so, and clamps the window.
    warnings.filterwarnings("ignore", message=".*holds two windows of")
    started = time.perf_counter()
    result = measure(args)
    result.update(quick=args.quick, rounds=1 if args.quick else args.rounds,
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  bench_seconds=round(time.perf_counter() - started, 1))
    result["figures"] = figures(result)
    directory = args.results or (os.path.join(OUT, "quick") if args.quick else HERE)
    write_results(result, directory)
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
