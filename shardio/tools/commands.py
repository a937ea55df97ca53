"""The ``shardio`` commands (typer, as ``preprocess``; ``shardio.tools.cli_style``); the console script's entry
point is ``shardio.tools.cli.main``.

    shardio info DIR [--json]                      count, shape, bytes, config, versions, failures, runs
    shardio preview DIR --out grid.png [--n 64]    a contact sheet of random samples (+ grid.png.json)
    shardio bench DIR [--target-rate R]            ShardDataset samples/s (median, range); loader advice

Exit codes, from the one table (``shardio.errors.exit_code``) as for ``preprocess``: 0 done; 1 the dataset
cannot be read (the message says why and what to do); 2 usage error (a bad option, a URL scheme no backend
serves, a missing extra). ``import shardio`` never imports this module: the reader needs no typer, which
comes with the ``cli`` extra; without it this module raises ``MissingExtra`` naming the extra, and
``shardio.tools.cli.main`` prints that one line.
"""

from __future__ import annotations

import json
from typing import Annotated, Optional

from shardio.errors import EXIT_USAGE, MissingExtra, ShardioError, exit_code

try:  # optional heavy dependency: the `cli` extra (a training image installs numpy and torch only)
    import typer
except ImportError as e:
    raise MissingExtra(
        "the `shardio` command needs the cli extra (typer, rich): pip install 'shardio[cli]' "
        "(from the repository or a clone: docs/quickstart.md, \"The reader alone\"); `import shardio` "
        "and the reader need neither"
    ) from e

import shardio  # noqa: E402 (after the extra's check)
from shardio.tools.cli_style import fail, new_app, version_option  # noqa: E402
from shardio.tools.info import dataset_info, format_info  # noqa: E402
from shardio.tools.preview import write_preview  # noqa: E402

__all__ = ["app"]

app = new_app("Inspect and benchmark a shardio dataset (the training side; `preprocess` writes it).")

Directory = Annotated[str, typer.Argument(
    metavar="DIR",
    help="Dataset directory, or s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, az://CONTAINER/PREFIX.")]
JsonOutput = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]


def _describe_versions() -> str:
    import numpy
    import torch

    return f"shardio {shardio.__version__}; numpy {numpy.__version__}; torch {torch.__version__}"


def _positive(value: Optional[float]) -> Optional[float]:
    if value is not None and not value > 0:
        raise typer.BadParameter(f"must be > 0, got {value:g}")
    return value


def _worker_counts(text: Optional[str]) -> Optional[list[int]]:
    if text is None:
        return None
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected integers like 0,2,4, got {text!r}") from None
    if not counts or any(c < 0 for c in counts):
        raise typer.BadParameter(f"worker counts must be >= 0, got {text!r}")
    return counts


@app.callback()
def _main(version: Annotated[bool, version_option(_describe_versions)] = False) -> None:
    """Inspect and benchmark a shardio dataset: what it holds, how it looks, how fast it reads."""


@app.command()
def info(directory: Directory, json_output: JsonOutput = False) -> None:
    """Count, shape, bytes on disk, config, versions, failures, runs."""
    with _errors():
        described = dataset_info(directory)
    typer.echo(json.dumps(described, indent=1, ensure_ascii=False) if json_output else format_info(described))


@app.command()
def preview(
    directory: Directory,
    out: Annotated[str, typer.Option(
        "--out", help="PNG to write (a name ending in .png); the tile table goes to OUT.json.")],
    n: Annotated[int, typer.Option("--n", min=1, help="Samples to show.")] = 64,
    seed: Annotated[int, typer.Option(help="Which random samples.")] = 0,
    tile: Annotated[Optional[int], typer.Option(
        min=1, help="Tile height in pixels (nearest-neighbour; default: the stored size).")] = None,
) -> None:
    """A contact sheet (PNG) of random samples, numbered, and their keys and captions."""
    with _errors():
        result = write_preview(directory, out, n=n, seed=seed, tile_height=tile)
    h, w, _ = result.shape
    typer.echo(f"wrote {result.out} ({w}x{h}, {len(result.table)} samples) and {result.table_path}")
    for row in result.buckets:  # a bucketed dataset: a row of the sheet per bucket, top to bottom
        height, width = row["shape"]
        typer.echo(f"bucket {row['bucket']}: {height}x{width}, "
                   f"{row['tiles']} of {row['samples']} samples shown")
    for row in result.table:
        caption = f"  {row['caption']}" if row["caption"] else ""
        typer.echo(f"{row['number']:4d}  {row['key']}{caption}")


@app.command()
def bench(
    directory: Directory,
    target_rate: Annotated[Optional[float], typer.Option(
        metavar="R", callback=_positive,
        help="The consumer's samples/s (e.g. the GPU step rate × batch size).")] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="Samples per batch.")] = 256,
    workers: Annotated[Optional[str], typer.Option(
        metavar="LIST", callback=_worker_counts,
        help="Worker counts to measure besides 0, e.g. 2,4 (default: the suggested one).")] = None,
    seconds: Annotated[float, typer.Option(callback=_positive, help="Per round and setting.")] = 1.0,
    repeats: Annotated[int, typer.Option(
        min=1, help="Interleaved rounds per setting; the report gives median and range.")] = 5,
    no_shuffle: Annotated[bool, typer.Option("--no-shuffle", help="Read in stored order.")] = False,
    torch_threads: Annotated[Optional[int], typer.Option(
        metavar="N", min=1, help="torch.set_num_threads(N) first (default: torch's, one per core).")] = None,
    json_output: JsonOutput = False,
) -> None:
    """ShardDataset throughput, and whether a consumer would wait."""
    # Here, not at the top: it imports torch (~1 s, ~190 MB), which `shardio info` and `preview` never need.
    from shardio.tools.loader_bench import format_bench, run_bench  # layering: allowed (torch, heavy)

    if torch_threads is not None:
        import torch

        torch.set_num_threads(torch_threads)
    counts = [c for c in workers if c > 0] if workers is not None else None  # the callback parsed LIST
    with _errors():
        report = run_bench(directory, batch_size=batch_size, workers=counts, shuffle=not no_shuffle,
                           seconds=seconds, repeats=repeats, target_rate=target_rate)
    typer.echo(json.dumps(report, indent=1) if json_output else format_bench(report))


class _errors:
    """A ShardioError ends the command with its message and its code from the one table; a ValueError
    (bad arguments the options cannot see, e.g. a batch larger than the dataset) is a usage error."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        if isinstance(error, ShardioError):
            fail(error, exit_code(error))
        if isinstance(error, ValueError):
            fail(error, EXIT_USAGE)
        return False
