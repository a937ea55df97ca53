"""The peers' own venv, ``bench/out/peer-venv``: LitData and Mosaic Streaming, never in the project's venv; and
the client comparison's, ``bench/out/clients-venv``: s3fs (``ensure_clients_venv``).

Both pull stock Pillow (and torchvision), which would replace the project venv's Pillow-SIMD, so they live
in a venv of their own, made here on first use and reused after. Install order and why:

1. ``torch==<this venv's version>`` from the local CPU wheel (no 3 GB of CUDA libraries to fetch);
2. ``litdata`` and ``mosaicml-streaming``, each on its own (one failing does not drop the other), with
   ``torch`` constrained to that version, or pip upgrades it to the newest torch;
3. an import check of each. The torchvision that PyPI has for this torch is built against PyPI's (CUDA)
   torch and cannot register its operators on the CPU build ("operator torchvision::nms does not exist");
   Mosaic imports torchvision at ``import streaming``. If that is what fails, torch is reinstalled from
   PyPI itself (the same version, CUDA build, ~3 GB; it runs on the CPU here) and the check repeated.

A peer that still cannot be imported gets its reason, which the results print instead of its rows.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import torch

__all__ = ["PEERS", "ensure_clients_venv", "ensure_peer_venv"]

# peer name -> (pip package, module the check imports)
PEERS = {"LitData": ("litdata", "litdata"), "Mosaic Streaming": ("mosaicml-streaming", "streaming")}
TORCH = torch.__version__.split("+")[0]


def _pip(python: str, args: list[str], pypi_only: bool = False) -> tuple[bool, str]:
    env = dict(os.environ)
    if pypi_only:  # neither the local wheel folder nor the local indexes: the registry's own build
        env.pop("PIP_FIND_LINKS", None)
        env["PIP_CONFIG_FILE"] = os.devnull
    process = subprocess.run([python, "-m", "pip", "install", "-q", *args], env=env, capture_output=True,
                             text=True, timeout=1800, check=False)
    return process.returncode == 0, (process.stderr or process.stdout)[-1500:]


def _make_venv(directory: str, python: str) -> str:
    """"" once ``directory`` is a venv (made here if ``python`` is not there yet), else why it could not be made."""
    if os.path.exists(python):
        return ""
    made = subprocess.run([sys.executable, "-m", "venv", directory], capture_output=True, text=True, check=False)
    return "" if made.returncode == 0 else f"python -m venv failed: {made.stderr.strip()[-300:]}"


def _import_error(python: str, module: str) -> str:
    """"" if ``module`` imports in the venv, else the last line of its error."""
    process = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True, timeout=300,
                             check=False)
    if process.returncode == 0:
        return ""
    lines = [line for line in process.stderr.splitlines() if line.strip()]
    return lines[-1] if lines else f"exit {process.returncode}"


def ensure_peer_venv(directory: str, log: Callable[[str], None] = print) -> tuple[str, dict[str, str]]:
    """(the venv's python, {peer: "" if usable, else why not}); creates and fills the venv on first use."""
    python = os.path.join(directory, "bin", "python")
    problems = {peer: _import_error(python, module) if os.path.exists(python) else "no venv"
                for peer, (_, module) in PEERS.items()}
    if not any(problems.values()):
        return python, problems
    log(f"peer venv {directory}: installing torch=={TORCH} (CPU), litdata, mosaicml-streaming (first use)")
    why = _make_venv(directory, python)
    if why:
        return python, dict.fromkeys(PEERS, why)
    ok, output = _pip(python, [f"torch=={TORCH}"])
    if not ok:
        return python, dict.fromkeys(PEERS, f"pip install torch=={TORCH} failed: {output.strip()[-300:]}")
    constraints = os.path.join(directory, "constraints.txt")
    with open(constraints, "w") as f:
        f.write(f"torch=={TORCH}\n")
    for peer, (package, module) in PEERS.items():
        ok, output = _pip(python, ["-c", constraints, package])
        problems[peer] = "" if ok else f"pip install {package} failed: {output.strip()[-300:]}"
        if ok:
            problems[peer] = _import_error(python, module)
    if any("torchvision" in why for why in problems.values()):
        log(f"torchvision cannot load on the CPU torch build; reinstalling torch=={TORCH} from PyPI (CUDA build)")
        ok, output = _pip(python, ["--force-reinstall", f"torch=={TORCH}"], pypi_only=True)
        if not ok:
            log(f"torch from PyPI failed: {output.strip()[-300:]}")
        problems = {peer: _import_error(python, module) for peer, (_, module) in PEERS.items()}
    for peer, why in problems.items():
        log(f"peer {peer}: {'ready' if not why else 'NOT AVAILABLE: ' + why}")
    return python, problems


def ensure_clients_venv(directory: str, log: Callable[[str], None] = print) -> tuple[str, str]:
    """(the venv's python, "" if s3fs and obstore import there, else why not): what ``bench.s3_clients``'s
    ``compare_clients`` runs in. Not the project's venv: s3fs's aiobotocore pins a botocore older than the boto3
    there needs, and pip would install it over boto3's. Made on first use (s3fs and this venv's obstore version)."""
    from importlib.metadata import version

    python = os.path.join(directory, "bin", "python")
    why = _import_error(python, "s3fs, obstore") if os.path.exists(python) else "no venv"
    if not why:
        return python, ""
    log(f"clients venv {directory}: installing s3fs and obstore (first use)")
    why = _make_venv(directory, python)
    if why:
        return python, why
    ok, output = _pip(python, ["s3fs", f"obstore=={version('obstore')}"])
    if not ok:
        return python, f"pip install s3fs obstore failed: {output.strip()[-300:]}"
    return python, _import_error(python, "s3fs, obstore")
