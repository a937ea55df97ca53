"""Every block the docs mark ``<!-- runs -->`` runs, as written, on the sample dataset: a scratch directory
with ``.venv``, ``configs/`` and ``examples/`` beside it, where the quick start's own commands generate the
sample tars and preprocess them into ``out/sample-shards`` (one local Ray run, the rest reads it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from docsgen import snippets
from docsgen.reference import ROOT

pytestmark = pytest.mark.slow

# The quick start's first runnable block makes the dataset every other block reads.
SETUP_PAGE = ROOT / "docs" / "quickstart.md"


def _order(page: Path) -> tuple[int, str]:
    return (0 if page == SETUP_PAGE else 1, str(page))


RUNNABLE = [b for page in sorted(snippets.pages(), key=_order) for b in snippets.blocks(page)
            if b.marker == snippets.RUNS]
SETUP = RUNNABLE[0]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("RAY_ADDRESS", None)
    return env


def _run_shell(code: str, cwd: Path) -> None:
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}\n{code}\n--- stdout\n{done.stdout[-3000:]}\n" \
                                 f"--- stderr\n{done.stderr[-3000:]}"


def _run_python(code: str, cwd: Path) -> None:
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}\n{code}\n--- stderr\n{done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A directory laid out like the repository root, holding the sample dataset the quick start makes."""
    assert SETUP.page == SETUP_PAGE and "preprocess.sample_data" in SETUP.code, SETUP.where
    root = tmp_path_factory.mktemp("docs-workspace")
    (root / ".venv").symlink_to(Path(sys.prefix))
    for name in ("configs", "examples"):
        (root / name).symlink_to(ROOT / name)
    _run_shell(SETUP.code, root)
    return root


def test_the_quick_start_makes_the_sample_dataset_with_its_deliberate_failure(workspace):
    import json

    reports = sorted((workspace / "out" / "sample-shards" / "reports").glob("*.json"))
    report = json.loads(reports[0].read_text())
    assert report["samples_failed"] == 1, "the sample dataset's truncated JPEG, which the docs explain"
    assert [f["key"] for f in report["failures"]] == ["000000029"]


@pytest.mark.parametrize("block", RUNNABLE[1:], ids=lambda b: b.where)
def test_the_block_runs(block, workspace):
    if block.kind == "python":
        _run_python(block.code, workspace)
    else:
        _run_shell(block.code, workspace)
