"""A model's identity: its function, a digest of its weights (a torch module) or its version; the same in every
process; changed by any weight or buffer; unversioned when it has neither."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from preprocess.models.identity import ModelIdentity, model_identity, torch_module_of, weights_digest
from preprocess.models.model_config import ModelSpec
from shardio.errors import ConfigError
from toy_models import LatentNet, caption_hash, make_plain

ROOT = pathlib.Path(__file__).resolve().parents[3]
LATENT = "tests.preprocess.models.toy_models:make_latent"
SPEC = ModelSpec(name="latent", fn=LATENT)


def identity_in_a_subprocess(hash_seed: str) -> str:
    code = f"from tests.preprocess.models.toy_models import identity_line; print(identity_line({LATENT!r}))"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": hash_seed}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    return done.stdout.strip()


def test_two_processes_give_the_same_identity_as_this_one():
    here = str(model_identity(SPEC, LatentNet()))
    assert here.startswith(f"{LATENT} weights xxh3_128:")
    assert identity_in_a_subprocess("1") == identity_in_a_subprocess("2") == here


def test_a_changed_weight_changes_the_identity():
    model = LatentNet()
    before = model_identity(SPEC, model)
    with torch.no_grad():
        model.conv.weight[3, 2, 1, 0] += 1
    after = model_identity(SPEC, model)
    assert after.weights != before.weights
    assert after.function == before.function


def test_a_changed_buffer_changes_the_identity():
    model = LatentNet()
    before = model_identity(SPEC, model).weights
    model.scale.fill_(1 / 32)
    assert model_identity(SPEC, model).weights != before


def test_a_changed_dtype_or_shape_changes_the_identity_even_with_the_same_bytes():
    def one(tensor: torch.Tensor) -> torch.nn.Module:
        module = torch.nn.Module()
        module.register_buffer("x", tensor)
        return module
    flat = torch.zeros(8, dtype=torch.float32)
    digests = {weights_digest(one(flat)), weights_digest(one(flat.reshape(2, 4))),
               weights_digest(one(flat.view(torch.int32))), weights_digest(one(torch.zeros(16, dtype=torch.float16)))}
    assert len(digests) == 4


def test_the_order_modules_were_built_in_does_not_count():
    class AB(torch.nn.Module):
        def __init__(self, first: str) -> None:
            super().__init__()
            layers = {"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 3)}
            for name in (first, "b" if first == "a" else "a"):
                setattr(self, name, layers[name])
            with torch.no_grad():
                for i, p in enumerate(sorted(self.state_dict())):
                    self.state_dict()[p].fill_(i)
    assert weights_digest(AB("a")) == weights_digest(AB("b"))


def test_a_bound_method_or_a_module_attribute_is_identified_by_the_modules_weights():
    model = LatentNet()
    digest = weights_digest(model)

    class Holder:
        def __init__(self) -> None:
            self.module = model

        def __call__(self, batch):
            return self.module(batch)

    assert torch_module_of(model.forward) is model
    assert model_identity(SPEC, model.forward).weights == digest
    assert model_identity(SPEC, Holder()).weights == digest


def test_a_version_string_identifies_a_model_without_weights():
    identity = model_identity(ModelSpec(name="text", fn="m:make_text", input="text"), caption_hash)
    assert identity == ModelIdentity(function="m:make_text", weights=None, version="caption-hash-1")
    assert not identity.unversioned
    assert str(identity) == "m:make_text version 'caption-hash-1'"


def test_a_module_with_a_version_records_both():
    model = LatentNet()
    model.version = "2"
    identity = model_identity(SPEC, model)
    assert identity.weights is not None and identity.version == "2"


def test_a_model_with_neither_is_its_name_alone_and_unversioned():
    identity = model_identity(ModelSpec(name="plain", fn="m:make_plain"), make_plain())
    assert identity == ModelIdentity(function="m:make_plain")
    assert identity.unversioned
    assert str(identity) == "m:make_plain (unversioned)"


def test_the_identity_round_trips_through_its_json_form():
    identity = model_identity(SPEC, LatentNet())
    assert ModelIdentity.from_dict(identity.to_dict()) == identity


@pytest.mark.parametrize("version", [3, "", None])
def test_a_version_that_is_no_string_is_refused_naming_the_output(version):
    def model(batch):
        return batch
    model.version = version
    if version is None:
        assert model_identity(SPEC, model).unversioned
        return
    with pytest.raises(ConfigError, match="models: latent: the model's version attribute must be a non-empty string"):
        model_identity(SPEC, model)


def test_a_module_without_loaded_weights_is_refused():
    with torch.device("meta"):
        model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="models: latent: bias has no values"):
        model_identity(SPEC, model)
