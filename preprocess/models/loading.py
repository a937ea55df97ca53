"""A model from its ``MODULE:FUNCTION``: the module imported, ``FUNCTION()`` called once per process, the callable
it returns kept for the rest of the process (a Ray actor or a worker loads its model once, whatever it runs).

Each failure is a ConfigError naming the output and what failed (the module not found, an import inside it
failing, no such function, ``FUNCTION()`` raising, or returning no callable), chained to the cause.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any

from shardio.errors import ConfigError
from preprocess.models.model_config import ModelSpec

__all__ = ["load_model", "loaded_models"]

# fn -> the callable its call returned, per process. Keyed by fn alone: two outputs naming the same function
# share one model (one copy of its weights on the device).
_LOADED: dict[str, Callable[..., Any]] = {}
_LOCK = threading.Lock()  # a second thread asking for the same model waits for the first call, never repeats it


def load_model(spec: ModelSpec) -> Callable[..., Any]:
    """The callable ``spec.fn``'s call returns, made on this process's first call for it."""
    with _LOCK:
        model = _LOADED.get(spec.fn)
        if model is None:
            model = _LOADED[spec.fn] = _make(spec)
        return model


def loaded_models() -> tuple[str, ...]:
    """The ``fn`` of every model this process has made, in the order made."""
    return tuple(_LOADED)


def _make(spec: ModelSpec) -> Callable[..., Any]:
    where = f"models: {spec.name}"
    factory = _find(spec, where)
    try:
        model = factory()
    except Exception as e:
        raise ConfigError(f"{where}: {spec.fn}() raised {type(e).__name__}: {e}") from e
    if not callable(model):
        raise ConfigError(f"{where}: {spec.fn}() returned {type(model).__name__}, not a callable: it must return "
                          "the model (a function or torch module taking a batch)")
    return model  # type: ignore[no-any-return]


def _find(spec: ModelSpec, where: str) -> Callable[..., Any]:
    try:
        found: Any = importlib.import_module(spec.module)
    except ModuleNotFoundError as e:
        if e.name is not None and (spec.module == e.name or spec.module.startswith(e.name + ".")):
            raise ConfigError(f"{where}: module {spec.module!r} not found (is it installed, or on PYTHONPATH on "
                              "every node?)") from e
        raise ConfigError(f"{where}: importing {spec.module!r} failed: {e}") from e
    except Exception as e:
        raise ConfigError(f"{where}: importing {spec.module!r} failed: {type(e).__name__}: {e}") from e
    for part in spec.function.split("."):
        if not hasattr(found, part):
            raise ConfigError(f"{where}: {spec.module!r} has no function {spec.function!r}")
        found = getattr(found, part)
    if not callable(found):
        raise ConfigError(f"{where}: {spec.fn} is a {type(found).__name__}, not a function")
    return found  # type: ignore[no-any-return]
