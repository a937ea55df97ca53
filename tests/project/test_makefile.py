"""`make shards` hands INPUT to `preprocess run` unexpanded (issue 22 item 5), so preprocess's own glob rule
applies: `INPUT='data/*'` over an img2dataset folder must not become an explicit `00000_stats.json`.

``PY`` is replaced by ``printf '%s\\n'``, so the recipe prints the arguments the shell would pass, one a line,
and nothing runs; ``-o .venv/.installed`` keeps make from building the environment first.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def shards_arguments(shell: str, **variables: str) -> list[str]:
    assignments = [f"{name}={value}" for name, value in variables.items()]
    done = subprocess.run(["make", "-s", "-C", ROOT, "-o", ".venv/.installed", "shards", "PY=printf '%s\\n'",
                           f"SHELL={shell}", *assignments], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.fixture
def img2dataset_folder(tmp_path) -> str:
    folder = tmp_path / "data"
    folder.mkdir()
    for name in ("00000.tar", "00001.tar", "00000_stats.json", "00000.parquet"):
        (folder / name).write_bytes(b"")
    return str(folder)


@pytest.mark.parametrize("shell", ["/bin/sh", "bash"])
def test_shards_passes_globs_and_brace_ranges_through_unexpanded(img2dataset_folder, tmp_path, shell):
    if shutil.which(shell) is None:
        pytest.skip(f"no {shell}")
    glob, braces = f"{img2dataset_folder}/*", f"{img2dataset_folder}/{{00000..00001}}.tar"
    out = str(tmp_path / "out")
    args = shards_arguments(shutil.which(shell), INPUT=f"{glob} {braces}", OUTPUT=out, CONFIG="configs/224.yaml")
    assert args == ["-m", "preprocess.cli", "run", glob, braces, "--output", out, "--config", "configs/224.yaml"]
