"""A no-op rerun over committed Parquet files against one over as many committed tars (the job's driver:
listing, plan, the answer from the index; no Ray), each in a fresh process, median of ``--rounds``.

    python -m bench.sources_rerun [--inputs 1000] [--rounds 3]

The datasets are made as the job would have committed them (``bench.scale_job.make_committed_inputs``:
tiny inputs, one 1-sample shard each). The figure: Parquet's seconds over the tars'.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = """
import json, sys, time
from bench.scale_job import CONFIG
from preprocess.job import RunOptions, run_job
pattern, dataset = sys.argv[1], sys.argv[2]
start = time.perf_counter()
report = run_job(RunOptions([pattern], dataset, CONFIG))
print(json.dumps({"seconds": time.perf_counter() - start, "skipped": report.inputs_skipped_count,
                  "processed": len(report.inputs_processed), "exit": report.exit_code}))
"""


def _rerun(pattern: str, dataset: str) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", CHILD, pattern, dataset], cwd=root, capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    from bench.scale_job import make_committed_inputs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        made = {kind: make_committed_inputs(os.path.join(work, kind), args.inputs, kind=kind)
                for kind in ("tar", "parquet")}
        times: dict[str, list[float]] = {"tar": [], "parquet": []}
        for round_number in range(args.rounds):
            for kind in (("tar", "parquet") if round_number % 2 == 0 else ("parquet", "tar")):
                result = _rerun(*made[kind])
                if (result["skipped"], result["processed"], result["exit"]) != (args.inputs, 0, 0):
                    raise SystemExit(f"{kind}: the rerun was not a no-op: {result}")
                times[kind].append(result["seconds"])
    out = {"inputs": args.inputs, "rounds": args.rounds,
           **{f"{kind}_s": round(statistics.median(values), 3) for kind, values in times.items()}}
    out["parquet_over_tar"] = round(out["parquet_s"] / out["tar_s"], 3)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
