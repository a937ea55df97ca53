"""The README documents what the code does: every config key with its default, so the table cannot drift
from ``preprocess.config.JobConfig`` again (it once missed five keys)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from preprocess.config import JobConfig

README = Path(__file__).resolve().parent.parent / "README.md"


def _config_table() -> dict[str, str]:
    """``{key: default cell}`` from the table under "## Config reference" (a row may name several keys)."""
    text = README.read_text(encoding="utf-8")
    section = text.split("## Config reference", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    table: dict[str, str] = {}
    for row in rows:
        keys_cell, default_cell = (cell.strip() for cell in row.strip("|").split("|")[:2])
        keys = re.findall(r"`([a-z_]+)`", keys_cell)
        defaults = [d.strip() for d in default_cell.split(", ")] if len(keys) > 1 else [default_cell]
        table.update(zip(keys, defaults if len(defaults) == len(keys) else [default_cell] * len(keys)))
    return table


def _as_written(value: Any) -> set[str]:
    """The ways the README may write ``value`` (YAML spelling, thousands separators, in backticks)."""
    if value is None:
        forms = {"null"}
    elif isinstance(value, bool):
        forms = {str(value).lower()}
    elif isinstance(value, int):
        forms = {str(value), f"{value:,}"}
    elif isinstance(value, float):
        forms = {repr(value), f"{value:g}"}
    elif isinstance(value, (tuple, list)):
        forms = {"[" + ", ".join(str(v) for v in value) + "]"}
    else:
        forms = {str(value)}
    return forms | {f"`{form}`" for form in forms}


def test_every_config_key_is_in_the_readme_table_and_nothing_else():
    fields = {f.name for f in dataclasses.fields(JobConfig)}
    documented = set(_config_table())
    assert not fields - documented, f"config keys missing from the README's table: {sorted(fields - documented)}"
    assert not documented - fields, f"README documents keys JobConfig lacks: {sorted(documented - fields)}"


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(JobConfig)])
def test_the_readme_gives_each_keys_default(field):
    value = getattr(JobConfig(), field)
    written = _config_table().get(field)
    assert written in _as_written(value), f"README says {field} defaults to {written!r}, the code {value!r}"
