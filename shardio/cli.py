"""``shardio``: look at a dataset from the training side (argparse: shardio needs only numpy and torch).

    shardio info DIR [--json]                      count, shape, bytes, config, versions, failures, runs
    shardio preview DIR --out grid.png [--n 64]    a contact sheet of random samples (+ grid.png.json)
    shardio bench DIR [--target-rate R]            ShardDataset samples/s (median, range); loader advice

Exit codes: 0 done; 1 the dataset cannot be read (the message says why and what to do); 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from shardio.errors import ShardioError

__all__ = ["main", "build_parser"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _workers(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 0,2,4, got {text!r}") from None
    if not counts or any(c < 0 for c in counts):
        raise argparse.ArgumentTypeError(f"worker counts must be >= 0, got {text!r}")
    return counts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardio", description="Inspect and benchmark a shardio dataset.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    info = commands.add_parser("info", help="Count, shape, bytes on disk, config, versions, failures, runs.")
    info.add_argument("directory", metavar="DIR")
    info.add_argument("--json", action="store_true", help="Print JSON instead of text.")

    preview = commands.add_parser("preview", help="A contact sheet (PNG) of random samples.")
    preview.add_argument("directory", metavar="DIR")
    preview.add_argument("--out", required=True, help="PNG to write; the tile table goes to OUT.json.")
    preview.add_argument("--n", type=_positive_int, default=64, help="Samples to show (default 64).")
    preview.add_argument("--seed", type=int, default=0, help="Which random samples (default 0).")
    preview.add_argument("--tile", type=_positive_int, default=None,
                         help="Tile height in pixels (nearest-neighbour; default: the stored size).")

    bench = commands.add_parser("bench", help="ShardDataset throughput, and whether a consumer would wait.")
    bench.add_argument("directory", metavar="DIR")
    bench.add_argument("--target-rate", type=_positive_float, default=None, metavar="R",
                       help="The consumer's samples/s (e.g. the GPU step rate × batch size).")
    bench.add_argument("--batch-size", type=_positive_int, default=256)
    bench.add_argument("--workers", type=_workers, default=None, metavar="LIST",
                       help="Worker counts to measure besides 0, e.g. 2,4 (default: the suggested one).")
    bench.add_argument("--seconds", type=_positive_float, default=1.0,
                       help="Per round and setting (default 1).")
    bench.add_argument("--repeats", type=_positive_int, default=5,
                       help="Interleaved rounds per setting; the report gives median and range (default 5).")
    bench.add_argument("--no-shuffle", action="store_true", help="Read in stored order.")
    bench.add_argument("--torch-threads", type=_positive_int, default=None, metavar="N",
                       help="torch.set_num_threads(N) first (default: torch's, one per core).")
    bench.add_argument("--json", action="store_true", help="Print JSON instead of text.")
    return parser


def _run(args: argparse.Namespace) -> int:
    if args.command == "info":
        from shardio.info import dataset_info, format_info

        info = dataset_info(args.directory)
        print(json.dumps(info, indent=1, ensure_ascii=False) if args.json else format_info(info))
        return EXIT_OK
    if args.command == "preview":
        from shardio.preview import write_preview

        result = write_preview(args.directory, args.out, n=args.n, seed=args.seed, tile_height=args.tile)
        h, w, _ = result.shape
        print(f"wrote {result.out} ({w}x{h}, {len(result.table)} samples) and {result.table_path}")
        for row in result.table:
            caption = f"  {row['caption']}" if row["caption"] else ""
            print(f"{row['number']:4d}  {row['key']}{caption}")
        return EXIT_OK
    from shardio.loader_bench import format_bench, run_bench
    if args.torch_threads is not None:
        import torch

        torch.set_num_threads(args.torch_threads)

    workers = [c for c in args.workers if c > 0] if args.workers is not None else None
    report = run_bench(args.directory, batch_size=args.batch_size, workers=workers,
                       shuffle=not args.no_shuffle, seconds=args.seconds, repeats=args.repeats,
                       target_rate=args.target_rate)
    print(json.dumps(report, indent=1) if args.json else format_bench(report))
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardio`` console script; returns (and, as a script, exits with) the code."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on a usage error (0 for --help): return it like the rest
        return int(e.code or 0)
    try:
        return _run(args)
    except ShardioError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except ValueError as e:  # bad arguments the parser cannot see (e.g. a batch larger than the dataset)
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
