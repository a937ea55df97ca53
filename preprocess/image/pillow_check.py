"""Is the ``PIL`` this interpreter imports a working Pillow-SIMD build? (``make install`` and ``preprocess``)

Stock Pillow and Pillow-SIMD install the same ``PIL`` package, so anything that requires ``pillow``
(``pip install torchvision``, matplotlib) writes stock Pillow's files over Pillow-SIMD's without a word;
uninstalling ``pillow`` afterwards deletes the shared files and leaves no working ``PIL`` at all, while
pip still lists ``pillow-simd``. So the check looks at the files, not only at pip's list: the compiled
``PIL/_imaging`` module on disk must be the one Pillow-SIMD's install record hashed.

Run as a script (stdlib only: it must work when ``PIL`` is broken), before the package is installed::

    python preprocess/image/pillow_check.py            # exit 0: Pillow-SIMD is active; 1: the problems, one a line
    python preprocess/image/pillow_check.py --pil-dir  # where the PIL package lives (for a clean rebuild)

``make install`` runs it every time and rebuilds Pillow-SIMD from source when it exits 1.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import sys
import sysconfig
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

__all__ = ["PillowState", "pillow_problems", "current_state", "SLOWDOWN", "main"]

# Written by `make install` next to the venv's bin/ after building with CC="cc -mavx2".
AVX2_MARKER = ".pillow-simd-avx2"

# What `make bench` measures (bench/paths.py): the naive full decode + resize takes 1.7-2.0x as long per
# image on stock Pillow as on Pillow-SIMD (docs/reference/figures.md: "stock / SIMD naive time" in the
# detail of "job / naive path (Pillow-SIMD)"), mostly the resize. The job's own path (draft decode, then a
# small resize) is not measured on stock Pillow.
SLOWDOWN = ("`make bench` measured a full decode + resize 1.7-2.0x slower per image on stock Pillow than on "
            "Pillow-SIMD (docs/reference/figures.md), and pixels differ from a Pillow-SIMD dataset's; "
            "run `make install` to rebuild Pillow-SIMD")


@dataclass(frozen=True)
class PillowState:
    """What pip and the file system say about PIL (gathered by ``current_state``, or faked by tests)."""

    stock_pillow: str | None  # version of the ``pillow`` distribution, if pip lists one
    pillow_simd: str | None  # version of the ``pillow-simd`` distribution, if pip lists one
    pil_imports: bool  # ``import PIL._imaging`` works
    imaging_matches_simd: bool  # the PIL/_imaging module on disk is the one Pillow-SIMD installed
    cpu_has_avx2: bool
    avx2_marker: bool


def pillow_problems(state: PillowState) -> list[str]:
    """Why PIL is not a working AVX2 Pillow-SIMD build; empty when it is."""
    problems = []
    if state.stock_pillow is not None:
        problems.append(f"stock Pillow {state.stock_pillow} is installed (something required `pillow`); it "
                        "shares the PIL package with Pillow-SIMD")
    if state.pillow_simd is None:
        problems.append("Pillow-SIMD is not installed")
    elif not state.pil_imports:
        problems.append("PIL does not import (its files were removed: `pip uninstall pillow` deletes the files "
                        "it shares with Pillow-SIMD)")
    elif not state.imaging_matches_simd:
        problems.append("PIL/_imaging is not the module Pillow-SIMD installed (stock Pillow's files are active)")
    if state.pillow_simd is not None and state.cpu_has_avx2 and not state.avx2_marker:
        problems.append("Pillow-SIMD was not built with AVX2 by `make install` (no marker file)")
    return problems


def _file_matches_record(dist: metadata.Distribution, prefix: str) -> bool:
    """The installed module whose path starts with ``prefix`` (``PIL/_imaging.``) has the sha256 the
    distribution's RECORD lists."""
    for entry in dist.files or []:
        # the compiled module (.so, .pyd), not its type stub (.pyi)
        if str(entry).startswith(prefix) and not str(entry).endswith(".pyi") and entry.hash:
            digest = hashlib.sha256(Path(str(dist.locate_file(entry))).read_bytes()).digest()
            return base64.urlsafe_b64encode(digest).rstrip(b"=").decode() == entry.hash.value
    return False


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def current_state() -> PillowState:
    pil_imports = False
    try:
        pil_imports = importlib.util.find_spec("PIL._imaging") is not None
        if pil_imports:
            import PIL._imaging  # noqa: F401
    except Exception:  # noqa: BLE001 - a half-removed PIL fails in any way: it is broken all the same
        pil_imports = False
    matches = False
    try:
        matches = _file_matches_record(metadata.distribution("pillow-simd"), "PIL/_imaging.")
    except (metadata.PackageNotFoundError, OSError):
        pass
    try:
        cpu_avx2 = "avx2" in Path("/proc/cpuinfo").read_text()
    except OSError:
        cpu_avx2 = False
    return PillowState(
        stock_pillow=_version("pillow"), pillow_simd=_version("pillow-simd"), pil_imports=pil_imports,
        imaging_matches_simd=matches, cpu_has_avx2=cpu_avx2,
        avx2_marker=(Path(sysconfig.get_paths()["data"]) / AVX2_MARKER).exists(),
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--pil-dir"]:
        print(Path(sysconfig.get_paths()["platlib"]) / "PIL")
        return 0
    problems = pillow_problems(current_state())
    for problem in problems:
        print(f"pillow check: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
