"""A worker's images/s over the same images as a tar, a Parquet file and a folder (the shared pipeline).

    python -m bench.sources [--images 120] [--rounds 3]

One LAION-like corpus tar (``bench.corpus``: 1-2.5 MP photo-like JPEGs with ``.txt`` / ``.json``, cached
under ``bench/out``) is rewritten as an img2dataset-layout Parquet file (``key``, ``jpg``, ``caption``, the
json's keys as columns; row groups of 32 rows) and as a folder of ``KEY.jpg`` / ``KEY.txt`` / ``KEY.json``.
Each round runs ``preprocess.worker.process_input`` (read, decode, resize, shard write: no Ray, so the
sources' own cost is what differs) over each, in an order rotated per round; the figure is each source's
median images/s over the tar's in the same rounds, and the pixels of all three are checked equal.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tarfile
import tempfile
import time

import numpy as np

from bench.corpus import CorpusSpec, build_corpus
from preprocess.config import JobConfig
from preprocess.worker import process_input
from shardio.store.backends import for_path

HERE = os.path.dirname(os.path.abspath(__file__))


def _members(tar_path: str) -> dict[str, dict[str, bytes]]:
    samples: dict[str, dict[str, bytes]] = {}
    with tarfile.open(tar_path) as tar:
        for info in tar:
            key, _, ext = info.name.rpartition(".")
            samples.setdefault(key, {})[ext] = tar.extractfile(info).read()
    return samples


def _write_parquet(path: str, samples: dict[str, dict[str, bytes]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    keys = list(samples)
    metas = [json.loads(samples[k]["json"]) if "json" in samples[k] else {} for k in keys]
    columns = {"key": keys, "jpg": pa.array([samples[k]["jpg"] for k in keys], pa.binary()),
               "caption": [samples[k].get("txt", b"").decode() for k in keys]}
    for name in sorted({n for m in metas for n in m if isinstance(m[n], (int, float, str))}):
        columns[name] = [m.get(name) for m in metas]
    pq.write_table(pa.table(columns), path, row_group_size=32)


def _write_folder(folder: str, samples: dict[str, dict[str, bytes]]) -> None:
    for key, members in samples.items():
        for ext, data in members.items():
            path = os.path.join(folder, f"{key}.{ext}")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)


def _fingerprint(path: str):
    if os.path.isdir(path):
        from preprocess.inputs.resolve import resolve_inputs

        return resolve_inputs([path]).listed[path]
    return for_path(path).stat_fingerprint(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    corpus = build_corpus(os.path.join(HERE, "out", "corpus"), CorpusSpec(tars=1, samples_per_tar=args.images))
    work = tempfile.mkdtemp(prefix="bench-sources-")
    try:
        tar = corpus.tars[0]
        samples = _members(tar)
        parquet, folder = os.path.join(work, "images.parquet"), os.path.join(work, "images")
        _write_parquet(parquet, samples)
        _write_folder(folder, samples)
        cfg = JobConfig(height=256, width=256, samples_per_shard=1000)
        sources = {"tar": tar, "parquet": parquet, "folder": folder}
        rates: dict[str, list[float]] = {name: [] for name in sources}
        pixels: dict[str, np.ndarray] = {}
        names = list(sources)
        for number in range(args.rounds):
            for name in names[number % 3:] + names[: number % 3]:
                out = os.path.join(work, f"out-{name}-{number}")
                started = time.perf_counter()
                result = process_input(sources[name], out, cfg, _fingerprint(sources[name]))
                seconds = time.perf_counter() - started
                assert result.error is None and not result.failures, (name, result.error, result.failures[:2])
                rates[name].append(result.samples / seconds)
                pixels[name] = np.concatenate([np.load(os.path.join(out, s["path"])) for s in result.shards])
                shutil.rmtree(out)
        assert all((pixels[name] == pixels["tar"]).all() for name in sources), "pixels differ between sources"
        print(f"{len(samples)} images ({corpus.megapixels_mean} MP mean), {args.rounds} rounds, one worker, no Ray; "
              "pixels identical across sources")
        for name in sources:
            ratios = [r / t for r, t in zip(rates[name], rates["tar"])]
            print(f"  {name:8s} {statistics.median(rates[name]):7.1f} images/s   "
                  f"/ tar: {statistics.median(ratios):.3f} "
                  f"(rounds {min(ratios):.3f}-{max(ratios):.3f})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
