"""A model's identity: what a dataset records beside each output, so that a rerun with another model is noticed.

``ModelIdentity`` holds:

- ``function``: the ``MODULE:FUNCTION`` that made the model, as the config names it;
- ``weights``: when the model is a ``torch.nn.Module``, holds one as its ``module`` attribute, or is a bound
  method of one (``vae.encode``), ``"xxh3_128:HEX"`` of its parameters and buffers. Each tensor, in the order
  of its name (sorted, so the order modules were built in does not count), adds a line
  ``NAME\\0DTYPE\\0SHAPE\\n`` (torch's dtype name, the shape as ``4,3,3,3``) and then its bytes, C order, as
  the tensor holds them (little-endian on every platform torch ships for). A parameter shared by two modules
  counts once, under its first name. xxh3_128 (``shardio.store.checksum``): a checksum against a changed
  model, not against an adversary, and ~30x faster than sha256, which matters for a 10 GB text encoder.
- ``version``: a ``version`` string attribute the callable carries, for models that are no torch module
  (an ONNX session, a remote encoder) or whose code changes what the weights compute.

A model with neither weights nor version is identified by its function alone and is ``unversioned``: the
same name may hide another model, so a job asked to be incremental with one refuses unless told otherwise.
The identity is the same in every process and run: nothing in it depends on addresses, devices or hash seeds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from shardio.errors import ConfigError
from shardio.store.checksum import WRITE_ALGORITHM, new_hasher
from preprocess.models.model_config import ModelSpec

__all__ = ["ModelIdentity", "model_identity", "torch_module_of", "weights_digest", "DIGEST_ALGORITHM"]

DIGEST_ALGORITHM = WRITE_ALGORITHM  # xxh3_128


@dataclass(frozen=True)
class ModelIdentity:
    """Which model made an output: its ``function``, its ``weights`` digest and its ``version`` (each None when
    the model has none)."""

    function: str
    weights: str | None = None
    version: str | None = None

    @property
    def unversioned(self) -> bool:
        """Whether only the function's name identifies the model (no weights digest, no version string)."""
        return self.weights is None and self.version is None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form a dataset records."""
        return {"function": self.function, "weights": self.weights, "version": self.version}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> ModelIdentity:
        return cls(function=doc["function"], weights=doc.get("weights"), version=doc.get("version"))

    def __str__(self) -> str:
        parts = [self.function]
        if self.weights is not None:
            parts.append(f"weights {self.weights}")
        if self.version is not None:
            parts.append(f"version {self.version!r}")
        if self.unversioned:
            parts.append("(unversioned)")
        return " ".join(parts)


def model_identity(spec: ModelSpec, model: Callable[..., Any]) -> ModelIdentity:
    """The identity of ``model``, made by ``spec.fn`` (ConfigError naming the output for a ``version`` that is
    not a non-empty string, or weights that cannot be read)."""
    where = f"models: {spec.name}"
    version = getattr(model, "version", None)
    if version is not None and (not isinstance(version, str) or not version):
        raise ConfigError(f"{where}: the model's version attribute must be a non-empty string, got {version!r}")
    module = torch_module_of(model)
    weights = None if module is None else weights_digest(module, where)
    return ModelIdentity(function=spec.fn, weights=weights, version=version)


def torch_module_of(model: Callable[..., Any]) -> torch.nn.Module | None:
    """The torch module ``model`` is, holds as ``module``, or is a bound method of; None if none."""
    for candidate in (model, getattr(model, "module", None), getattr(model, "__self__", None)):
        if isinstance(candidate, torch.nn.Module):
            return candidate
    return None


def weights_digest(module: torch.nn.Module, where: str = "model") -> str:
    """``"xxh3_128:HEX"`` of ``module``'s parameters and buffers (the module docstring's layout)."""
    digest = new_hasher(DIGEST_ALGORITHM)
    for name, tensor in _tensors(module):
        if tensor.is_meta:
            raise ConfigError(f"{where}: {name} has no values (a meta tensor): load the weights before "
                              "returning the model")
        shape = ",".join(str(side) for side in tensor.shape)
        digest.update(f"{name}\0{str(tensor.dtype).removeprefix('torch.')}\0{shape}\n".encode())
        try:
            data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        except (RuntimeError, TypeError) as e:  # a quantized or sparse tensor has no plain bytes
            raise ConfigError(f"{where}: cannot read the bytes of {name} ({tensor.dtype}, {tensor.layout}) "
                              f"for the model's identity: {e}") from e
        digest.update(data)
    return f"{DIGEST_ALGORITHM}:{digest.hexdigest()}"


def _tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    named = dict(module.named_parameters())
    for name, buffer in module.named_buffers():
        named.setdefault(name, buffer)
    for name in sorted(named):
        yield name, named[name]
