"""Loading a model from ``MODULE:FUNCTION``: called once per process, and each failure named with its output."""

from __future__ import annotations

import itertools
import os
import sys
import textwrap

import pytest

from preprocess.models.loading import load_model, loaded_models
from preprocess.models.model_config import ModelSpec
from shardio.errors import ConfigError

_numbers = itertools.count()


@pytest.fixture
def module_file(tmp_path, monkeypatch):
    """Writes a module of the given source under a fresh name (the loader keeps every model it made for the
    process) and returns that name."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(source: str) -> str:
        name = f"model_module_{os.getpid()}_{next(_numbers)}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        return name
    return write


def test_the_function_is_called_once_per_process(module_file):
    name = module_file("""
        CALLS = []
        def make():
            CALLS.append(1)
            return lambda batch: batch
    """)
    spec = ModelSpec(name="latent", fn=f"{name}:make")
    first = load_model(spec)
    again = load_model(ModelSpec(name="other", fn=f"{name}:make", batch_size=3))
    assert first is again
    assert sys.modules[name].CALLS == [1]
    assert f"{name}:make" in loaded_models()


def test_a_dotted_function_is_an_attribute_of_an_attribute(module_file):
    name = module_file("""
        class Factory:
            @staticmethod
            def make():
                return len
    """)
    assert load_model(ModelSpec(name="latent", fn=f"{name}:Factory.make")) is len


def test_a_missing_module_is_named():
    with pytest.raises(ConfigError) as caught:
        load_model(ModelSpec(name="latent", fn="no_such_models_module.sub:make"))
    assert str(caught.value).startswith("models: latent: module 'no_such_models_module.sub' not found")
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)


def test_an_import_failing_inside_the_module_is_not_called_a_missing_module(module_file):
    name = module_file("""
        import no_such_dependency_of_the_model
    """)
    with pytest.raises(ConfigError) as caught:
        load_model(ModelSpec(name="latent", fn=f"{name}:make"))
    assert f"models: latent: importing {name!r} failed: No module named 'no_such_dependency_of_the_model'" \
        in str(caught.value)


def test_a_module_raising_on_import_is_named(module_file):
    name = module_file("""
        raise RuntimeError("no GPU driver")
    """)
    with pytest.raises(ConfigError, match=f"models: latent: importing '{name}' failed: RuntimeError: no GPU driver"):
        load_model(ModelSpec(name="latent", fn=f"{name}:make"))


def test_a_missing_function_is_named(module_file):
    name = module_file("""
        def make():
            return len
    """)
    with pytest.raises(ConfigError, match=f"models: latent: '{name}' has no function 'make_vae'"):
        load_model(ModelSpec(name="latent", fn=f"{name}:make_vae"))


def test_a_function_that_is_no_function_is_named(module_file):
    name = module_file("""
        make = 3
    """)
    with pytest.raises(ConfigError, match=f"models: latent: {name}:make is a int, not a function"):
        load_model(ModelSpec(name="latent", fn=f"{name}:make"))


def test_a_function_that_raises_is_named_and_chained_and_retried_next_time(module_file):
    name = module_file("""
        TRIES = []
        def make():
            TRIES.append(1)
            raise OSError("weights not found at /models/vae")
    """)
    spec = ModelSpec(name="latent", fn=f"{name}:make")
    with pytest.raises(ConfigError) as caught:
        load_model(spec)
    assert str(caught.value) == f"models: latent: {name}:make() raised OSError: weights not found at /models/vae"
    assert isinstance(caught.value.__cause__, OSError)
    with pytest.raises(ConfigError):
        load_model(spec)
    assert sys.modules[name].TRIES == [1, 1]  # a failure is not kept


def test_a_function_returning_no_callable_is_named(module_file):
    name = module_file("""
        def make():
            return {"weights": 1}
    """)
    with pytest.raises(ConfigError, match=f"models: latent: {name}:make\\(\\) returned dict, not a callable"):
        load_model(ModelSpec(name="latent", fn=f"{name}:make"))
