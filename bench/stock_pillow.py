"""The naive baseline with stock Pillow, which is what a training DataLoader decodes with.

torchvision (and most training stacks) pull stock ``pillow``; this venv has Pillow-SIMD instead, on which
the naive path takes 1.7-2.0x less time (mostly its resize), so measured in-process it understates what the
job saves. Stock Pillow
goes into its own ``--target`` directory (``bench/out/stock-pillow``, installed on first use, never into the
venv), and a child interpreter with that directory first on ``PYTHONPATH`` runs the same ``bench.paths``
pool (one process per core, same images, same 256x256 centre crop) and answers one rate per request, so
the parent interleaves it with its own paths round by round.

``python -m bench.stock_pillow`` is that child: the first stdin line names the tars, config and process
count; it replies on stdout with the PIL it loaded (refusing to run unless it is the stock ``pillow``
distribution from the target directory), then answers ``{"warm": path}`` and ``{"rate": path}`` requests
for the ``*_stock`` paths of ``bench.paths`` (``naive_stock``, ``floor_stock``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from importlib import metadata
from typing import Any, Self

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STOCK_DIR = os.path.join(HERE, "out", "stock-pillow")
INSTALL_TIMEOUT_S = 300

__all__ = ["STOCK_DIR", "StockPillowPath", "ensure_stock_pillow", "wanted_version"]


def wanted_version() -> str | None:
    """The stock release Pillow-SIMD is built from (12.1.1.post0 -> 12.1.1): only the SIMD code differs.
    None (latest) when the venv has no Pillow-SIMD."""
    try:
        simd = metadata.version("pillow-simd")
    except metadata.PackageNotFoundError:
        return None
    return re.sub(r"\.post\d+$", "", simd)


def _installed(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "PIL", "__init__.py")) and any(
        name.lower().startswith("pillow-") and name.endswith(".dist-info") for name in os.listdir(directory)
    )


def ensure_stock_pillow(log: Callable[[str], None], directory: str = STOCK_DIR) -> tuple[str | None, str]:
    """``(directory, "")`` with stock Pillow installed there (pip ``--target``, first use only), or
    ``(None, why)`` when the install fails (offline machine, no wheel for this Python)."""
    if _installed(directory):
        return directory, ""
    version = wanted_version()
    requirement = f"pillow=={version}" if version else "pillow"
    staging = f"{directory}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    log(f"installing stock {requirement} into {os.path.relpath(directory, ROOT)} for the naive baseline")
    command = [
        *(sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps"),
        *("--only-binary=:all:", "--target", staging, requirement),
    ]
    try:
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        shutil.rmtree(staging, ignore_errors=True)
        return None, f"pip install {requirement} failed: {exc}"
    if done.returncode != 0 or not _installed(staging):
        shutil.rmtree(staging, ignore_errors=True)
        lines = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR")] or lines[-1:] or ["no output"]
        return None, f"pip install {requirement} failed (exit {done.returncode}): {errors[-1]}"
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(staging, directory)  # a half-finished install never looks installed
    return directory, ""


class StockPillowPath:
    """The naive path in a child interpreter on stock Pillow: ``warm()``, then ``rate()`` in images/s."""

    def __init__(self, tars: list[str], cfg: dict[str, Any], processes: int, directory: str = STOCK_DIR):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([directory, ROOT, *filter(None, [env.get("PYTHONPATH")])])
        env["SHARDIO_STOCK_PILLOW_DIR"] = directory
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.stock_pillow"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
            env=env,
            text=True,
        )
        try:
            self.info: dict[str, Any] = self._ask({"tars": tars, "cfg": cfg, "processes": processes})
        except RuntimeError:
            self.close()
            raise

    def _ask(self, request: Any) -> Any:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"stock-Pillow child exited with {self.process.wait()} (its stderr is above)")
        reply = json.loads(line)
        if isinstance(reply, dict) and "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def warm(self, path: str = "naive_stock") -> None:
        self._ask({"warm": path})

    def rate(self, path: str = "naive_stock") -> float:
        return float(self._ask({"rate": path}))

    def path(self, name: str) -> _ChildPath:
        """Another ``bench.paths`` path (e.g. ``floor_stock``) run by the same child, as a RemotePath."""
        return _ChildPath(self, name)

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _ChildPath:
    def __init__(self, child: StockPillowPath, name: str) -> None:
        self.child, self.name = child, name

    def warm(self) -> None:
        self.child.warm(self.name)

    def rate(self) -> float:
        return self.child.rate(self.name)


def _loaded_pil(directory: str) -> dict[str, Any]:
    """What this interpreter imported as ``PIL``; raises unless it is stock ``pillow`` from ``directory``."""
    import PIL
    from PIL import features

    directory = os.path.realpath(directory)
    where = os.path.realpath(PIL.__file__)
    problems = []
    if ".post" in PIL.__version__:
        problems.append(f"PIL {PIL.__version__} is a Pillow-SIMD version")
    if not where.startswith(directory + os.sep):
        problems.append(f"PIL was imported from {where}, not {directory}")
    try:
        dist = metadata.distribution("pillow")
    except metadata.PackageNotFoundError:
        raise RuntimeError(
            "not stock Pillow: " + "; ".join([*problems, "no `pillow` distribution"])
        ) from None
    dist_dir = os.path.realpath(str(dist.locate_file("")))
    if dist_dir != directory or dist.version != PIL.__version__:
        problems.append(f"the pillow distribution found is {dist.version} in {dist_dir}")
    if problems:
        raise RuntimeError("not stock Pillow: " + "; ".join(problems))
    return {
        "pil_version": PIL.__version__,
        "distribution": f"pillow {dist.version}",
        "pil_file": os.path.relpath(where, ROOT),
        "libjpeg_turbo": features.version("libjpeg_turbo"),
    }


def _serve() -> None:
    # Replies go to the original stdout; anything else printing in this process lands on stderr.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def reply(value: Any) -> None:
        replies.write(json.dumps(value) + "\n")
        replies.flush()

    request = json.loads(sys.stdin.readline())
    try:
        info = _loaded_pil(os.environ.get("SHARDIO_STOCK_PILLOW_DIR", STOCK_DIR))
    except (ImportError, RuntimeError) as exc:  # the parent prints it as the reason the row is skipped
        reply({"error": str(exc)})
        return
    from bench.corpus import read_images
    from bench.paths import PathPool
    from preprocess.config import JobConfig

    images = read_images(request["tars"])
    with PathPool(images, JobConfig(**request["cfg"]), request["processes"]) as pool:
        del images
        reply(info)
        for line in sys.stdin:
            command = json.loads(line)
            if isinstance(command, dict) and command.get("warm", "").endswith("_stock"):
                pool.rounds([command["warm"]], 0)
                reply("ok")
            elif isinstance(command, dict) and command.get("rate", "").endswith("_stock"):
                reply(pool.rate(command["rate"]))
            else:
                reply({"error": f"unknown request {command!r}"})


if __name__ == "__main__":
    _serve()
