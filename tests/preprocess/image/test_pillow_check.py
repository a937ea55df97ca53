"""Stock Pillow over Pillow-SIMD: detected from the files on disk (not only pip's list), repaired by
``make install`` every time it is run, and warned about by ``preprocess run``.

Nothing here touches the real venv: the check runs on fake states, on a fake site-packages in a child
interpreter started with ``-S``, and the Makefile runs against a fake ``python`` that logs its commands.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import stat
import subprocess
import sys

import pytest

from preprocess.image.pillow_check import PillowState, pillow_problems
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
HEALTHY = PillowState(stock_pillow=None, pillow_simd="12.1.1.post0", pil_imports=True, imaging_matches_simd=True,
                      cpu_has_avx2=True, avx2_marker=True)


@pytest.mark.parametrize("changes, expected", [
    ({}, []),
    ({"stock_pillow": "12.1.1", "imaging_matches_simd": False}, ["stock Pillow 12.1.1 is installed",
                                                                 "PIL/_imaging is not the module Pillow-SIMD"]),
    # `pip uninstall pillow` after the above: pip lists only Pillow-SIMD, but PIL is gone
    ({"pil_imports": False, "imaging_matches_simd": False}, ["PIL does not import"]),
    ({"pillow_simd": None, "stock_pillow": "12.1.1", "imaging_matches_simd": False},
     ["stock Pillow 12.1.1", "Pillow-SIMD is not installed"]),
    ({"avx2_marker": False}, ["not built with AVX2"]),
    ({"avx2_marker": False, "cpu_has_avx2": False}, []),  # nothing to build with
])
def test_problems_of_each_state(changes, expected):
    problems = pillow_problems(PillowState(**{**HEALTHY.__dict__, **changes}))
    assert len(problems) == len(expected), problems
    for problem, words in zip(problems, expected):
        assert words in problem


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _fake_site(site, *, simd_imaging: bytes, installed_imaging: bytes | None, stock: bool) -> None:
    """A site-packages with Pillow-SIMD's dist-info recording ``simd_imaging`` as PIL/_imaging.py, the file
    actually there holding ``installed_imaging`` (None: PIL removed), and stock Pillow's dist-info."""
    simd = site / "pillow_simd-12.1.1.post0.dist-info"
    simd.mkdir(parents=True)
    (simd / "METADATA").write_text("Metadata-Version: 2.1\nName: pillow-simd\nVersion: 12.1.1.post0\n")
    (simd / "RECORD").write_text(f"PIL/__init__.py,,\nPIL/_imaging.py,{_record_hash(simd_imaging)},"
                                 f"{len(simd_imaging)}\n")
    if installed_imaging is not None:
        (site / "PIL").mkdir()
        (site / "PIL" / "__init__.py").write_text("")
        (site / "PIL" / "_imaging.py").write_bytes(installed_imaging)
    if stock:
        dist = site / "pillow-12.1.1.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: pillow\nVersion: 12.1.1\n")
        (dist / "RECORD").write_text("PIL/__init__.py,,\n")


def _check_in(site) -> subprocess.CompletedProcess[str]:
    # -S: no real site-packages, so only the fake distributions and PIL are visible
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), ROOT])
    return subprocess.run([sys.executable, "-S", "-m", "preprocess.image.pillow_check"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


SIMD = b"# Pillow-SIMD's compiled module\n"
STOCK = b"# stock Pillow's compiled module\n"


@pytest.mark.parametrize("installed, stock, expected", [
    (SIMD, False, None),
    (STOCK, True, "stock Pillow 12.1.1 is installed"),  # pip install torchvision
    (STOCK, False, "PIL/_imaging is not the module Pillow-SIMD installed"),  # pip list looks fine
    (None, False, "PIL does not import"),  # ... then `pip uninstall pillow`
])
def test_the_check_reads_the_files_on_disk(tmp_path, installed, stock, expected):
    site = tmp_path / "site"
    _fake_site(site, simd_imaging=SIMD, installed_imaging=installed, stock=stock)
    result = _check_in(site)
    if expected is None:
        # (a fake site has no AVX2 marker: only that may be reported)
        assert all("AVX2" in line for line in result.stderr.splitlines()), result.stderr
    else:
        assert result.returncode == 1 and expected in result.stderr, result.stderr


FAKE_PYTHON = """\
#!/bin/sh
echo "python $*" >> "$MAKE_LOG"
case "$*" in
  *"pillow_check --pil-dir"*) echo "$FAKE_PIL_DIR" ;;
  *pillow_check*) [ -f "$PILLOW_OK" ] && exit 0; echo "pillow check: stock Pillow" >&2; exit 1 ;;
  *"pip install"*pillow-simd*) touch "$PILLOW_OK" ;;
esac
exit 0
"""


@pytest.fixture
def fake_make(tmp_path):
    """Run the project's Makefile in a copy whose venv is a fake: returns (run, log, pillow_ok flag file)."""
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    work = tmp_path / "work"
    work.mkdir()
    (work / "preprocess" / "image").mkdir(parents=True)
    (work / "shardio" / "read").mkdir(parents=True)
    # The stamp's prerequisites (the Makefile's $(STAMP) rule): the C sources setup.py builds.
    for name in ("Makefile", "pyproject.toml", "setup.py", "preprocess/image/_jpeg_region.c",
                 "shardio/read/_jpeg_batch.c", "shardio/read/_gather.c"):
        shutil.copy(os.path.join(ROOT, name), work / name)
    python = work / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    (work / ".venv" / ".installed").write_text("")  # the stamp is newer than everything it depends on
    os.utime(work / ".venv" / ".installed", (2e9, 2e9))
    pil_dir = work / ".venv" / "lib" / "PIL"
    pil_dir.mkdir(parents=True)
    log, ok = tmp_path / "make.log", tmp_path / "pillow-ok"
    env = {**os.environ, "MAKE_LOG": str(log), "PILLOW_OK": str(ok), "FAKE_PIL_DIR": str(pil_dir)}
    env.pop("MAKEFLAGS", None)

    def run(*targets: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["make", "-C", str(work), *targets], env=env, capture_output=True, text=True,
                              timeout=60)

    return run, log, ok, pil_dir


def test_make_install_rebuilds_when_stock_pillow_came_back(fake_make):
    run, log, ok, pil_dir = fake_make
    result = run("install")
    assert result.returncode == 0, result.stdout + result.stderr
    commands = log.read_text().splitlines()
    assert "Nothing to be done" not in result.stdout
    uninstall = next(i for i, c in enumerate(commands) if "pip uninstall -q -y pillow pillow-simd" in c)
    install = next(i for i, c in enumerate(commands) if "--force-reinstall" in c and "pillow-simd==" in c)
    assert uninstall < install and commands[-1].endswith("-m preprocess.image.pillow_check"), commands
    assert not pil_dir.exists(), "what was left of PIL must go before the clean rebuild"


def test_make_install_leaves_a_healthy_pillow_simd_alone(fake_make):
    run, log, ok, _ = fake_make
    ok.write_text("")
    result = run("install")
    assert result.returncode == 0, result.stdout + result.stderr
    assert log.read_text().splitlines() == ["python -m preprocess.image.pillow_check"]


def test_make_install_fails_loudly_if_the_rebuild_does_not_help(fake_make, tmp_path):
    run, log, ok, _ = fake_make
    script = (tmp_path / "work" / ".venv" / "bin" / "python")
    script.write_text(FAKE_PYTHON.replace('touch "$PILLOW_OK"', "true"))
    result = run("install")
    assert result.returncode != 0 and "pillow check: stock Pillow" in result.stderr


def test_preprocess_run_warns_when_stock_pillow_is_active(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from preprocess import cli

    unhealthy = PillowState(**{**HEALTHY.__dict__, "stock_pillow": "12.1.1", "imaging_matches_simd": False})
    monkeypatch.setattr("preprocess.image.pillow_check.current_state", lambda: unhealthy)
    # a config error stops the run right after the warning: no Ray needed
    bad = tmp_path / "bad.yaml"
    bad.write_text("no_such_key: 1\n")
    result = CliRunner().invoke(cli.app, ["run", str(tmp_path / "x.tar"), "--output", str(tmp_path / "o"),
                                          "--config", str(bad)])
    assert result.exit_code == 2
    assert "stock Pillow 12.1.1 is installed" in result.output and "make install" in result.output


def test_doctor_quotes_what_make_bench_measures(monkeypatch):
    from typer.testing import CliRunner

    from preprocess import cli

    unhealthy = PillowState(**{**HEALTHY.__dict__, "stock_pillow": "12.1.1", "imaging_matches_simd": False})
    monkeypatch.setattr("preprocess.image.pillow_check.current_state", lambda: unhealthy)
    result = CliRunner().invoke(cli.app, ["doctor"])
    assert result.exit_code == 1
    # bench/README.md: stock Pillow's naive path takes 1.7-2.0x Pillow-SIMD's time (the old claim: 6-8x)
    assert "1.7-2.0x slower" in result.output and "6-8x" not in result.output
    assert "stock Pillow 12.1.1 is installed" in result.output


def test_doctor_warns_without_failing_when_the_region_decoder_is_not_built(monkeypatch):
    # Optional by design (a machine without libjpeg-turbo headers): slower, never other pixels, so make
    # install, which runs doctor, must not fail on it.
    from typer.testing import CliRunner

    from preprocess import cli
    from preprocess.image import jpeg_region

    monkeypatch.setattr("preprocess.image.pillow_check.current_state", lambda: HEALTHY)
    monkeypatch.setattr(jpeg_region, "_decode_region", None)
    result = CliRunner().invoke(cli.app, ["doctor"])
    assert result.exit_code == 0, result.output
    assert "jpeg_region_decoder      False" in result.output
    assert "preprocess.image._jpeg_region is not built" in result.output and "same pixels" in result.output
