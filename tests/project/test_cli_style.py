"""``preprocess`` and ``shardio`` are one CLI stack (typer, made by ``shardio.tools.cli_style``) with one help
style: the same help layout, ``-h``/``--help``, ``--version``, usage errors and ``error:`` lines."""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from preprocess.cli import app as preprocess_app
from shardio.tools.cli import app as shardio_app

COMMAND_LINES = [pytest.param(preprocess_app, "preprocess", "verify", id="preprocess"),
                 pytest.param(shardio_app, "shardio", "info", id="shardio")]


def invoke(app: typer.Typer, prog: str, *args: str):
    return CliRunner().invoke(app, list(args), prog_name=prog, terminal_width=100)


def panels(text: str) -> list[str]:
    """The titles of the help's boxes, in order (``╭─ Options ───╮`` -> ``Options``)."""
    return re.findall(r"╭─ (.+?) ─", text)


@pytest.mark.parametrize("app, prog, command", COMMAND_LINES)
def test_the_top_level_help_has_the_same_layout(app, prog, command):
    result = invoke(app, prog, "--help")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().startswith(f"Usage: {prog} [OPTIONS] COMMAND [ARGS]...")
    assert panels(result.stdout) == ["Options", "Commands"]
    options = result.stdout.split("╭─ Options")[1].split("╰")[0]
    assert "--version" in options and "--help" in options and "-h" in options
    assert invoke(app, prog, "-h").stdout == result.stdout
    assert invoke(app, prog).output.strip() == result.stdout.strip()  # the bare command shows the help


@pytest.mark.parametrize("app, prog, command", COMMAND_LINES)
def test_a_command_help_has_the_same_layout(app, prog, command):
    result = invoke(app, prog, command, "-h")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().startswith(f"Usage: {prog} {command} [OPTIONS]")
    assert panels(result.stdout) == ["Arguments", "Options"]
    assert result.stdout == invoke(app, prog, command, "--help").stdout


@pytest.mark.parametrize("app, prog, command", COMMAND_LINES)
def test_version_names_the_program(app, prog, command):
    result = invoke(app, prog, "--version")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"{prog} ") and "shardio " in result.stdout


@pytest.mark.parametrize("app, prog, command", COMMAND_LINES)
def test_a_usage_error_exits_2_the_same_way(app, prog, command):
    result = invoke(app, prog, command, "somewhere", "--no-such-option")
    assert result.exit_code == 2
    assert f"Usage: {prog} {command}" in result.stderr and panels(result.stderr) == ["Error"]
    assert "No such option: --no-such-option" in result.stderr


@pytest.mark.parametrize("app, prog, command", COMMAND_LINES)
def test_a_dataset_error_is_one_error_line_with_exit_1(app, prog, command, tmp_path):
    missing = str(tmp_path / "no-dataset-here")
    result = invoke(app, prog, command, missing)
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("error: ") and f"{missing}: no such dataset directory" in result.stderr


ARGUMENT = {"preprocess": "DIRECTORY", "shardio": "DIR"}


def usage_line(text: str) -> str:
    return next(line.strip() for line in text.splitlines() if line.strip().startswith("Usage:"))


@pytest.mark.parametrize("app, prog, command", COMMAND_LINES)
def test_flags_show_no_value_and_arguments_read_as_in_the_docs(app, prog, command):
    """A flag takes no value, so its help shows none (a ``<bool>`` invites ``--quiet true``); an argument
    reads as the reference page names it (``DIRECTORY``), not typer's ``{directory}``."""
    for args in ([], [command]):
        help_text = invoke(app, prog, *args, "--help").stdout
        assert "<bool>" not in help_text, help_text
    assert usage_line(invoke(app, prog, command, "--help").stdout) == \
        f"Usage: {prog} {command} [OPTIONS] {ARGUMENT[prog]}"


def test_the_run_usage_names_its_inputs_as_the_docs_do():
    result = invoke(preprocess_app, "preprocess", "run", "--help")
    assert usage_line(result.stdout) == "Usage: preprocess run [OPTIONS] INPUTS..."
    described = " ".join(result.stdout.split("╭─")[0].split())
    assert "<bool>" not in result.stdout
    assert "INPUT tars" not in described and "Parquet files, folders" in described


def test_a_summary_off_a_terminal_is_never_wrapped(monkeypatch, tmp_path):
    """A log file or a cron mail is read with grep: each summary line stays whole, whatever its length."""
    import io

    from rich.console import Console

    from preprocess import run_display
    from shardio.format.run_report import RunReport

    stream = io.StringIO()
    monkeypatch.setattr(run_display, "console", Console(file=stream, width=80))  # a file: not a terminal
    output = str(tmp_path / ("a-dataset-directory-with-a-long-name" * 2))
    report = RunReport(run_id="r1", output=output, started="", config={}, samples_written=123456,
                       samples_failed=0, inputs_processed=["a"] * 12, inputs_skipped_count=3456,
                       dataset_samples=7654321, elapsed_s=12.5, images_per_s=9876.5)
    run_display.summary(report, f"{output}/reports/r1.json")
    lines = stream.getvalue().splitlines()
    assert any("samples written 123456 (0 upscaled), failed 0; inputs processed 12, skipped 3456, failed 0"
               in line for line in lines), lines
    assert any(f"dataset now holds 7654321 samples in {output}" in line for line in lines), lines
    assert f"report: {output}/reports/r1.json" in lines
