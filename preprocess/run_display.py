"""What ``preprocess run`` shows a person on stderr: the live bar on a terminal, plain progress lines off one,
and the summary at the end (or, with ``-q``, only why the run failed). Off a terminal a line is never
wrapped, so a log or cron's mail can be grepped (``failed 0``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from preprocess.job import RunReport
from preprocess.run_progress import PROGRESS_INTERVAL_S, RunProgress, describe, duration_text
from preprocess.sample_data import on_purpose_notes

__all__ = ["RunDisplay", "console", "summary", "quiet_failure", "failure_text"]

console = Console(stderr=True)  # every command of the CLI writes here (preprocess.cli imports it)


class RunDisplay:
    """Progress on stderr: a live bar over inputs with images/s and an ETA on a terminal; off one (a pipe,
    a log file, cron), a line per input and a ``progress:`` line at most once per ``progress_interval_s``
    (``preprocess.run_progress``: samples, images/s, the share done and ETA, the running inputs')."""

    def __init__(self, quiet: bool, progress_interval_s: float = PROGRESS_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.quiet = quiet
        self.live = console.is_terminal and not quiet
        self.run = RunProgress(progress_interval_s, clock)
        self.progress: Progress | None = None
        self.task: Any = None

    def __call__(self, kind: str, payload: Any) -> None:
        if kind in ("plan", "progress", "input"):
            self.run.see(kind, payload)
        if kind == "plan":
            if not self.quiet:
                where = payload.get("cluster")
                on = f" on {where['nodes']} node(s), {where['cpus']} CPUs" if where else ""
                remembered = payload.get("remembered", 0)
                again = (f", {remembered} failed before and unchanged (not read again; --retry-failed reads them)"
                         if remembered else "")
                console.print(f"{payload['todo']} input(s) to process{on}, {payload['skipped']} already committed"
                              f"{again}", highlight=False, soft_wrap=not console.is_terminal)
            if payload["todo"] and self.live:
                self.progress = Progress(
                    TextColumn("[bold]preprocess"), BarColumn(), MofNCompleteColumn(), TextColumn("inputs"),
                    TextColumn("{task.fields[images]} images, {task.fields[rate]} img/s"),
                    TimeElapsedColumn(), TextColumn("ETA {task.fields[eta]}"), console=console,
                )
                self.progress.start()
                self.task = self.progress.add_task("run", total=payload["todo"], images=0, rate="-", eta="-")
            return
        if kind == "ray":  # a line Ray printed: quiet means quiet
            if not self.quiet:
                console.print(payload, markup=False, highlight=False)
            return
        if kind == "warning":
            if not self.quiet:
                console.print(f"[yellow]warning:[/yellow] {escape(str(payload))}", highlight=False,
                              soft_wrap=not console.is_terminal)
            return
        if kind == "input" and not self.live and not self.quiet:
            status = f"FAILED: {payload.error}" if payload.error else f"{payload.samples} samples"
            console.print(f"{payload.input}: {status} ({payload.elapsed_s:.1f} s)", highlight=False,
                          markup=False, soft_wrap=True)
        if kind == "progress" and not self.live and not self.quiet and self.run.due():
            console.print(f"progress: {describe(self.run.snapshot())}", highlight=False, markup=False,
                          soft_wrap=True)
        if self.progress is not None and kind in ("progress", "input"):
            eta = self.run.eta_s()
            self.progress.update(self.task, advance=1 if kind == "input" else 0, images=self.run.samples,
                                 rate=f"{self.run.images_per_s():.0f}",
                                 eta=duration_text(eta) if eta is not None else "-")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def summary(report: RunReport, report_path: str) -> None:
    # Off a terminal (a log file, cron's mail) a line is never wrapped: `grep "failed 0"` finds it whole.
    unwrapped = not console.is_terminal

    def say(text: str, markup: bool = False) -> None:
        console.print(text, highlight=False, markup=markup, soft_wrap=unwrapped)

    console.rule("[bold]preprocess summary")
    say(f"samples written {report.samples_written} ({report.samples_upscaled} upscaled), "
        f"failed {report.samples_failed}; "
        f"inputs processed {len(report.inputs_processed)}, skipped {report.inputs_skipped_count}, "
        f"failed {len(report.inputs_failed)}"
        + (f", pruned {len(report.inputs_pruned)}" if report.inputs_pruned else "")
        + (f", ignored {len(report.inputs_ignored)} non-tar file(s)" if report.inputs_ignored else "")
        + (f"; {sum(entry['files'] for entry in report.files_ignored)} file(s) of folders ignored (files_ignored "
           "in the report)" if report.files_ignored else ""))
    steady = (f" ({report.processing_images_per_s:.1f}/s after {report.startup_s:.1f} s start-up)"
              if report.startup_s else "")
    say(f"{report.elapsed_s:.1f} s, {report.images_per_s:.1f} images/s{steady}; dataset now holds "
        f"{report.dataset_samples} samples in {report.output}")
    if report.samples_per_bucket:  # the order of the dataset's bucket list, as `shardio info` shows it
        say("samples written per bucket (h x w, as `shardio info`): " + ", ".join(
            f"{shape} {n}" for shape, n in report.samples_per_bucket.items()))
    if not report.inputs_processed and not report.inputs_failed:
        say("nothing new to process")
    for reason, count in list(report.failures_by_reason().items())[:8]:
        say(f"  {count:6d} x {reason}")
    for note in on_purpose_notes(report.failures[:1000]):  # the generated sample's deliberate failures
        console.print(f"note: {note}", highlight=False, markup=False, soft_wrap=True)
    for failed in report.inputs_failed[:10]:
        say(f"[red]input failed:[/red] {escape(failed['input'])}: {escape(failure_text(failed, report))}",
            markup=True)
    say(f"report: {report_path}")


def failure_text(failed: dict[str, Any], report: RunReport) -> str:
    """A failed input's reason, and, for one remembered from an earlier run, that it was not read again."""
    earlier = failed.get("failed_in")
    if not earlier or earlier == report.run_id:
        return failed["reason"]
    return (f"{failed['reason']} (found by run {earlier}; unchanged since, so not read again: "
            "--retry-failed reads it)")


def quiet_failure(report: RunReport, report_path: str) -> None:
    """Why a ``-q`` run exits 1, in a few lines: its failed inputs, or its share of failed samples."""
    for failed in report.inputs_failed[:10]:
        console.print(f"error: input failed: {failed['input']}: {failure_text(failed, report)}", highlight=False,
                      markup=False, soft_wrap=True)
    if len(report.inputs_failed) > 10:
        console.print(f"error: ... and {len(report.inputs_failed) - 10} more failed input(s)", highlight=False)
    if not report.inputs_failed:
        console.print(f"error: {report.samples_failed} sample(s) failed, {report.failed_fraction:.1%} of the run: over "
                      f"max_failed_fraction {report.config.get('max_failed_fraction', 1.0):g}", highlight=False,
                      markup=False)
    console.print(f"report: {report_path}", highlight=False, markup=False, soft_wrap=True)
