"""``preprocess``: the command line of the job (typer).

Exit codes: 0 every input processed (bad samples are counted in the report, not fatal); 1 an input could
not be processed (the others are still committed) or a check failed; 2 usage or config error; 130 / 143
``run`` stopped by SIGINT / SIGTERM (see ``preprocess.cluster.stop_signals``). A command ended by an exception
exits with ``shardio.errors.exit_code`` (the one table, derived from the exception tree); a finished run
with its report's ``exit_code``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape

import shardio
from preprocess.image import jpeg_region
from preprocess.config import load_config
from preprocess.diagnose import diagnose as time_stages, render_text
from preprocess.inputs.resolve import resolve_inputs
from preprocess.job import RunOptions, RunReport, dataset_config, report_json, run_job
from preprocess.logging_events import LOG_FORMATS, EventLogger
from preprocess.run_display import RunDisplay, console, quiet_failure, summary
from preprocess.run_progress import PROGRESS_INTERVAL_S
from preprocess.image import pillow_check
from preprocess.cluster.stop_signals import StopOnSignal
from preprocess.verify import repair_dataset, restore_manifest, verify_dataset
from preprocess.image.versions import library_versions, pillow_build
from shardio.tools.cli_style import fail, new_app, version_option
from shardio.write.directory import foreign_files_warning, report_path
from shardio.write.retention import (
    DEFAULT_RETAIN_GENERATIONS,
    DEFAULT_RETAIN_HOURS,
    DEFAULT_RETAIN_PASSING_MINUTES,
    Retention,
)
from shardio.write.retention import gc as collect_garbage
from shardio.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, ShardioError, exit_code

# The same look as `shardio` (shardio.tools.cli_style): help layout, -h/--help, --version, error lines.
app = new_app("Images (WebDataset tars, Parquet files, folders) -> fixed-shape uint8 shards.")


def _fail_usage(message: str) -> None:
    fail(message, EXIT_USAGE)


def _fail(error: ShardioError, quiet: bool = False) -> None:
    """End the command for ``error``: its message (unless ``quiet``: already said, e.g. as JSON) and its
    exit status from the exception tree (``shardio.errors.exit_code``)."""
    if not quiet:
        fail(error, exit_code(error))  # the one error line of both command lines (shardio.tools.cli_style)
    raise typer.Exit(exit_code(error)) from None


def _describe_versions() -> str:

    build = pillow_build()
    kind = "Pillow-SIMD" if build["pillow_simd"] else "stock Pillow"
    avx = "AVX2" if build["built_with_avx2"] else "no AVX2 marker"
    return (f"preprocess (shardio {shardio.__version__}); PIL {build['pil_version']} ({kind}, {avx}); "
            f"libjpeg-turbo {build['libjpeg_turbo']}")


@app.callback()
def _main(version: Annotated[bool, version_option(_describe_versions)] = False) -> None:
    """Preprocess images (tars, Parquet files, folders) once, offline, into shards read with no CPU work."""


# What click reads as a boolean value: words a flag's value would be spelled with (``--quiet true``).
_FLAG_VALUE_WORDS = frozenset({"1", "0", "true", "false", "t", "f", "yes", "no", "y", "n", "on", "off"})


def _refuse_flag_values(inputs: list[str], flags_given: list[str]) -> None:
    """A flag takes no value: in ``--quiet true`` the ``true`` is an INPUT. Such an INPUT that names no
    existing path is refused as a usage error (exit 2) before anything is read or written, rather than
    counted as a missing input, which would record a failed run in the dataset's history. Any other
    missing path stays a counted failed input (docs/guides/your-data.md); a file really named ``true``
    is an input like any other."""
    for name in inputs:
        if name.lower() in _FLAG_VALUE_WORDS and not os.path.lexists(name):
            flag = flags_given[0] if flags_given else "--quiet"
            _fail_usage(f"INPUT {name!r} is no file: a flag takes no value (write `{flag}`, not "
                        f"`{flag} {name}`); nothing was read or written")


def _warn_about_pillow() -> None:
    """Stock Pillow (put back by anything that requires `pillow`) decodes and resizes slower, and its
    pixels differ from Pillow-SIMD's: say so before a run (on stderr, even with -q) rather than never."""
    problems = pillow_check.pillow_problems(pillow_check.current_state())
    if problems:
        console.print(f"[yellow]warning:[/yellow] {'; '.join(problems)}: {pillow_check.SLOWDOWN}", highlight=False)


def _fan_out(*hooks: Any) -> Any:
    def on_event(kind: str, payload: Any) -> None:
        for hook in hooks:
            hook(kind, payload)

    return on_event


def _close_log(event_log: EventLogger | None, report: RunReport | None = None, error: str | None = None) -> None:
    if event_log is None:
        return
    if report is not None:
        event_log.finish(report)
    if error is not None:
        event_log("error", error)
    if event_log.stream is not sys.stderr:
        event_log.stream.close()


@app.command()
def run(
    inputs: Annotated[list[str], typer.Argument(
        help="Tar or Parquet files, local or s3:// / gs:// / az:// URLs, globs ('data/*.tar', "
             "'s3://b/hf/*.parquet') or brace ranges ('data/{00000..00099}.tar'), or folders "
             "of images (local, or a bucket prefix: 's3://b/photos/').")],
    # str, not Path: pathlib turns s3://bucket/x into s3:/bucket/x, a local folder (a URL must stay a URL).
    output: Annotated[str, typer.Option(
        "--output", "-o",
        help="Dataset directory, or s3://BUCKET/PREFIX, gs://BUCKET/PREFIX "
             "or az://CONTAINER/PREFIX (created, or appended to).")],
    config: Annotated[Optional[Path], typer.Option("--config", "-c", help="YAML config (see configs/).")] = None,
    size: Annotated[Optional[int], typer.Option(help="Square output: height = width = SIZE.")] = None,
    height: Annotated[Optional[int], typer.Option(help="Output height.")] = None,
    width: Annotated[Optional[int], typer.Option(help="Output width.")] = None,
    mode: Annotated[Optional[str], typer.Option(
        help="center_crop | pad | stretch | bucket (aspect-ratio buckets near the height x width budget).")] = None,
    bucket_step: Annotated[Optional[int], typer.Option(
        help="mode bucket: sides of the derived buckets are multiples of this (default 16).")] = None,
    bucket_max_ratio: Annotated[Optional[float], typer.Option(
        help="mode bucket: largest long/short side of a derived bucket (default 3.0).")] = None,
    resample: Annotated[Optional[str], typer.Option(
        help="Resize filter: nearest|box|bilinear|hamming|bicubic|lanczos.")] = None,
    samples_per_shard: Annotated[Optional[int], typer.Option(
        help="Samples per shard file (the last one per input is partial).")] = None,
    encoding: Annotated[Optional[str], typer.Option(
        help="How shards hold pixels: raw (default; 196 KB an image at 256²) | jpeg (~24 KB, decoded by "
             "the reader) | yuv420 (98 KB, converted by the reader) | none (model outputs only: models in "
             "--config).")] = None,
    quality: Annotated[Optional[int], typer.Option(help="JPEG quality 1-100 (encoding jpeg; default 90).")] = None,
    subsampling: Annotated[Optional[str], typer.Option(
        help="JPEG chroma subsampling 4:4:4 | 4:2:0 (encoding jpeg; default 4:4:4).")] = None,
    workers: Annotated[Optional[int], typer.Option(
        help="Local Ray CPUs (default: all cores). Ignored with --ray-address.")] = None,
    ray_address: Annotated[Optional[str], typer.Option(
        envvar="RAY_ADDRESS",
        help="Join this Ray cluster (HOST:PORT, ray://HOST:PORT, auto).")] = None,
    report: Annotated[Optional[Path], typer.Option(
        help="Also write the JSON report here (always kept in OUTPUT/reports/).")] = None,
    wait: Annotated[bool, typer.Option(
        "--wait",
        help="If another run holds OUTPUT, wait for it instead of exiting.")] = False,
    prune: Annotated[bool, typer.Option("--prune", help="Drop committed inputs that are not among INPUTS.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
    log_format: Annotated[Optional[str], typer.Option(
        help="Structured log of the run: human | json (lines); to stderr unless --log-file.")] = None,
    log_file: Annotated[Optional[Path], typer.Option(
        help="Append the structured log to this file (format: --log-format, default human).")] = None,
    progress_interval: Annotated[float, typer.Option(
        min=0,
        help="Seconds between progress records in the log, and progress lines when "
             "stderr is not a terminal (samples, images/s, ETA, the running inputs).")] = PROGRESS_INTERVAL_S,
    strict_versions: Annotated[bool, typer.Option(
        "--strict-versions",
        help="Refuse (exit 2) to append with a Pillow / "
             "libjpeg-turbo other than the dataset's; default: warn.")] = False,
    confirm_large_prune: Annotated[bool, typer.Option(
        "--confirm-large-prune",
        help="Let --prune drop more than half of the committed "
             "inputs or samples (refused otherwise: exit 2).")] = False,
    retain_hours: Annotated[float, typer.Option(
        min=0,
        help="Keep superseded shards and manifests while "
             "their generation was current this recently.")] = DEFAULT_RETAIN_HOURS,
    retain_generations: Annotated[int, typer.Option(
        min=1,
        help="... and for this many newest generations (the current one included).")] = DEFAULT_RETAIN_GENERATIONS,
    retain_passing_minutes: Annotated[float, typer.Option(
        min=0,
        help="A run's passing generations (current under this long) are kept only "
             "as the newest of each bucket of this many minutes; 0 keeps every one.")] = DEFAULT_RETAIN_PASSING_MINUTES,
    retry_failed: Annotated[bool, typer.Option(
        "--retry-failed",
        help="Read again the inputs that failed for their bytes (not a tar, truncated) in the last run "
             "and are unchanged since; by default they are reported failed again without being read.")] = False,
    pass_credentials: Annotated[bool, typer.Option(
        "--pass-credentials",
        help="Give the Ray tasks this machine's object-store credentials (kept in their "
             "runtime_env: visible in the Ray dashboard); default: each node's own.")] = False,
    rewrite_output: Annotated[Optional[str], typer.Option(
        "--rewrite-output", metavar="NAME",
        help="Run the model that models: now gives for output NAME over every committed input (all must be "
             "listed) and commit the new outputs at once, as a new generation: the old one stays whole for its "
             "readers until retention collects it.")] = None,
) -> None:
    """Preprocess INPUTS (tars, Parquet files, folders) into OUTPUT; a rerun does only what changed."""
    flags = {"--wait": wait, "--prune": prune, "--quiet": quiet, "--strict-versions": strict_versions,
             "--confirm-large-prune": confirm_large_prune, "--retry-failed": retry_failed,
             "--pass-credentials": pass_credentials}
    _refuse_flag_values(inputs, [flag for flag, given in flags.items() if given])
    _warn_about_pillow()
    if size is not None and (height is not None or width is not None):
        _fail_usage("give --size or --height/--width, not both")
    if workers is not None and workers < 1:
        _fail_usage("--workers must be >= 1")
    overrides = {"height": size if size is not None else height, "width": size if size is not None else width,
                 "mode": mode, "resample": resample, "samples_per_shard": samples_per_shard,
                 "encoding": encoding, "quality": quality, "subsampling": subsampling,
                 "bucket_step": bucket_step, "bucket_max_ratio": bucket_max_ratio}
    try:
        # A rerun starts from the dataset's stored config; a flag or file that disagrees is refused (run_job).
        cfg = load_config(str(config) if config else None, overrides, base=dataset_config(output))
    except ShardioError as e:  # ConfigError
        _fail(e)
    if log_format is not None and log_format not in LOG_FORMATS:
        _fail_usage(f"--log-format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    event_log = None
    if log_format is not None or log_file is not None:
        log_stream = open(log_file, "a", encoding="utf-8") if log_file is not None else sys.stderr
        event_log = EventLogger(log_stream, log_format or "human", progress_interval_s=progress_interval)
    # Log lines on stderr and a live progress bar would garble each other: the log wins.
    display = RunDisplay(quiet or (event_log is not None and log_file is None),
                       progress_interval_s=progress_interval)
    options = RunOptions(inputs=inputs, output=str(output), config=cfg, workers=workers,
                         ray_address=ray_address, wait_for_lock=wait, prune=prune, strict_versions=strict_versions,
                         confirm_large_prune=confirm_large_prune, retry_failed=retry_failed,
                         retention=Retention(hours=retain_hours, generations=retain_generations,
                                             passing_minutes=retain_passing_minutes),
                         pass_credentials=pass_credentials, rewrite_output=rewrite_output)
    # The first Ctrl-C / SIGTERM stops the run cleanly (report, exit 130 / 143), a second exits at once.
    # JSON log on stderr: every line of stderr is JSON (no summary; the run_finished record carries it).
    json_stderr = event_log is not None and event_log.log_format == "json" and log_file is None
    stop = StopOnSignal(json_lines=json_stderr)
    try:
        with stop.installed():
            result = run_job(options, on_event=display if event_log is None else _fan_out(display, event_log),
                             stop_requested=stop.requested)
    except ShardioError as e:
        display.close()
        _close_log(event_log, error=str(e))
        _fail(e, quiet=json_stderr)  # a JSON log's "error" record above said it, as JSON
    finally:
        display.close()
    _close_log(event_log, report=result)
    saved_at = report_path(result.output, result.run_id)
    if report is not None:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_bytes(report_json(result))
        saved_at = str(report)
    if not quiet and not json_stderr:
        summary(result, saved_at)
    elif result.interrupted and not json_stderr:
        # Even under -q: the run did not do what was asked (the JSON log says so in its own records).
        console.print(f"{result.warnings[-1]}; report: {saved_at}", highlight=False, markup=False,
                      soft_wrap=True)
    elif result.exit_code != EXIT_OK and not json_stderr:
        quiet_failure(result, saved_at)  # -q silences progress, never why a run failed
    raise typer.Exit(result.exit_code)


@app.command()
def verify(
    directory: Annotated[str, typer.Argument(help="Dataset directory (the --output of `run`).")],
    repair: Annotated[bool, typer.Option(
        "--repair",
        help="Rebuild bad shards from the inputs they came from.")] = False,
    workers: Annotated[Optional[int], typer.Option(help="Local Ray CPUs for --repair (default: all cores).")] = None,
    ray_address: Annotated[Optional[str], typer.Option(
        envvar="RAY_ADDRESS",
        help="Join this Ray cluster for --repair.")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="With --repair: if a run holds DIR, wait for it.")] = False,
) -> None:
    """Check every shard's size and checksum against the manifest; --repair rebuilds bad ones.

    Exits 1 naming each bad shard. With --repair, drop the inputs behind
    bad shards and process just those again (same config)."""
    try:
        result = verify_dataset(str(directory))
    except ShardioError as e:
        restored = None
        if repair and exit_code(e) != EXIT_USAGE:
            try:
                restored = restore_manifest(str(directory), wait_for_lock=wait)
            except ShardioError as still:
                e = still
        if restored is None:
            _fail(e)
        typer.echo(f"RESTORED manifest.json from kept generation {restored.generation} ({restored.samples} samples, "
                   f"{len(restored.inputs)} inputs); it was unusable: {e}")
        try:
            result = verify_dataset(str(directory))
        except ShardioError as again:
            _fail(again)
    for bad in result.bad:
        typer.echo(f"BAD {bad.problem} (input {bad.input})")
    checked = f"{result.shards} shard(s), {result.bytes / 1e6:.1f} MB checked"
    if not result.bad:
        typer.echo(f"{checked}: all match the manifest")
        raise typer.Exit(EXIT_OK)
    typer.echo(f"{checked}: {len(result.bad)} bad, from {len(result.bad_inputs)} input(s)")
    if not repair:
        typer.echo(f"HINT: `preprocess verify {directory} --repair` rebuilds them from their inputs")
        raise typer.Exit(EXIT_FAILED)
    try:
        fixed = repair_dataset(str(directory), result, workers=workers, ray_address=ray_address, wait_for_lock=wait)
    except ShardioError as e:
        _fail(e)
    for path in fixed.missing:
        typer.echo(f"CANNOT REPAIR {path}: the input is gone; its shards stay listed and bad "
                   "(restore the input and rerun --repair, or `preprocess run ... --prune` without it)")
    if fixed.run is not None:
        for failed in fixed.run.inputs_failed:
            typer.echo(f"REBUILD FAILED {failed['input']}: {failed['reason']}")
        typer.echo(f"rebuilt {len(fixed.run.inputs_processed)} input(s), {fixed.run.samples_written} samples")
    after = fixed.after
    if after is not None and not after.bad:
        typer.echo("repaired: every shard now matches the manifest")
        raise typer.Exit(EXIT_OK)
    for bad in after.bad if after else []:
        typer.echo(f"STILL BAD {bad.problem} (input {bad.input})")
    raise typer.Exit(EXIT_FAILED)


@app.command()
def gc(
    directory: Annotated[str, typer.Argument(help="Dataset directory (the --output of `run`).")],
    retain_hours: Annotated[float, typer.Option(
        min=0,
        help="Keep superseded shards and manifests while "
             "their generation was current this recently.")] = DEFAULT_RETAIN_HOURS,
    retain_generations: Annotated[int, typer.Option(
        min=1,
        help="... and for this many newest generations (the current one included).")] = DEFAULT_RETAIN_GENERATIONS,
    retain_passing_minutes: Annotated[float, typer.Option(
        min=0,
        help="A run's passing generations (current under this long) are kept only "
             "as the newest of each bucket of this many minutes; 0 keeps every one.")] = DEFAULT_RETAIN_PASSING_MINUTES,
    wait: Annotated[bool, typer.Option("--wait", help="If a run holds DIR, wait for it.")] = False,
) -> None:
    """Delete superseded shards and manifest generations that no kept generation needs.

    A run does this at its end with its own --retain-* options."""
    try:
        retention = Retention(hours=retain_hours, generations=retain_generations,
                              passing_minutes=retain_passing_minutes)
        collected = collect_garbage(str(directory), retention, wait_for_lock=wait)
    except ShardioError as e:
        _fail(e)
    typer.echo(f"collected {len(collected.files)} retired file(s) ({collected.bytes / 1e6:.1f} MB) and "
               f"{len(collected.generations)} manifest generation(s); kept generations "
               f"{', '.join(map(str, collected.kept_generations))} and {collected.retained_files} retired file(s)")
    if collected.foreign:
        console.print(f"[yellow]warning:[/yellow] {escape(foreign_files_warning(str(directory), collected.foreign))}",
                      highlight=False)
    raise typer.Exit(EXIT_OK)


@app.command()
def doctor() -> None:
    """Which PIL build (Pillow-SIMD? AVX2?) and libjpeg-turbo are active, and whether that is right."""
    build = pillow_build()
    region_decoder = jpeg_region.available()
    for key, value in {**library_versions(), **build, "jpeg_region_decoder": region_decoder}.items():
        typer.echo(f"{key:24s} {value}")
    problems = pillow_check.pillow_problems(pillow_check.current_state())
    if problems:
        problems.append(pillow_check.SLOWDOWN)
    if not build["libjpeg_turbo"]:
        problems.append("PIL is not linked against libjpeg-turbo: decoding is slower")
    for problem in problems:
        typer.echo(f"WARNING: {problem}", err=True)
    if not region_decoder:  # optional by design: slower, never different pixels, so no failed exit
        typer.echo("WARNING: preprocess.image._jpeg_region is not built (no C compiler, or no libjpeg-turbo headers,"
                   " when the package was installed): JPEGs decode through Pillow, same pixels, ~5% slower;"
                   " reinstall with them (make install) to build it", err=True)
    raise typer.Exit(EXIT_FAILED if problems else EXIT_OK)


@app.command()
def diagnose(
    inputs: Annotated[list[str], typer.Argument(
        help="Inputs (tars, Parquet files, folders), globs or brace ranges, as for `run`.")],
    config: Annotated[Optional[Path], typer.Option("--config", "-c", help="YAML config (see configs/).")] = None,
    limit: Annotated[int, typer.Option(min=1, help="Samples to time (from the first inputs).")] = 500,
    project_images: Annotated[int, typer.Option(
        min=1,
        help="Project the job's time for this many images.")] = 1_000_000,
    cores: Annotated[Optional[int], typer.Option(
        min=1,
        help="... on this many cores (default: this machine's).")] = None,
    write_dir: Annotated[Optional[Path], typer.Option(
        help="Scratch directory for timing shard writes (default: a temp dir).")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Where the time goes, per stage, on a sample of your inputs; the bottleneck.

    Per stage (read, decode, convert, resize, write) mean/p50/p95 per image,
    the per-core rate, a projection, the slowest samples and the bottleneck.
    Exit 1 if an input is unreadable."""
    try:
        cfg = load_config(str(config) if config else None)
        resolved = resolve_inputs(inputs)
    except ShardioError as e:  # ConfigError, NoInputsMatched
        _fail(e)
    paths, failed = resolved.paths, resolved.failed
    result = time_stages(paths, cfg, limit=limit, project_images=project_images, cores=cores,
                         write_dir=str(write_dir) if write_dir else None)
    result["inputs_failed"] = failed + result["inputs_failed"]
    if json_output:
        typer.echo(json.dumps(result, indent=1, ensure_ascii=False))
    else:
        out = Console()
        if not out.is_terminal:
            out.width = 110  # a file or pipe: wide enough that the slowest-samples table is not cut
        for item in render_text(result):
            out.print(item, highlight=False)
    raise typer.Exit(EXIT_FAILED if result["inputs_failed"] or not result["samples"] else EXIT_OK)


def main() -> None:
    app(prog_name="preprocess")


if __name__ == "__main__":
    main()
