"""The ``models:`` mapping of a job's config, parsed and checked: one ``ModelSpec`` per output.

Each output is named by its key and made by a model, given as a ``"MODULE:FUNCTION"`` string or as a
mapping with ``fn`` and options::

    models:
      latent:                      # the batch key it is read under, and its files' name
        fn: my_models:make_vae     # FUNCTION() returns the callable (preprocess.models.loading)
        input: image               # image (default): uint8 [B, h, w, 3] of one bucket; text: the captions
        batch_size: 16             # samples per call (default 16)
        dtype: float16             # the dtype stored: a floating output is cast to it, any other must be it
        device: auto               # auto (a GPU when there is one), cpu, cuda or cuda:N
        replicas: auto             # Ray actors running it: auto (one per GPU of the cluster, else none), or N
      text_embedding: my_models:make_text_encoder

An output name is an ASCII identifier (it becomes a file name and a batch key) and names no key a batch or a
sample already carries (``RESERVED_NAMES``, nor any ``__dunder__``), nor an encoding's file suffix
(``RESERVED_FILE_NAMES``). Torch is not imported here: the config of a
run is read by the command line before anything heavy is.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shardio.errors import ConfigError
from shardio.format.jpeg_shard import JPEG_SUFFIX
from shardio.format.yuv_shard import YUV_SUFFIX

__all__ = ["ModelSpec", "parse_models", "INPUTS", "IMAGE", "TEXT", "DTYPES", "DEVICES", "RESERVED_NAMES",
           "DEFAULT_BATCH_SIZE", "OPTION_KEYS", "RESERVED_FILE_NAMES", "AUTO"]

IMAGE, TEXT = "image", "text"
INPUTS = (IMAGE, TEXT)

# The torch dtypes an output may be stored in: each has a fixed little-endian width (bfloat16 has no numpy
# dtype; the runner hands it back as its raw 16 bits, preprocess.models.runner).
DTYPES = ("float16", "bfloat16", "float32", "float64", "uint8", "int8", "int16", "int32", "int64", "bool")

DEVICES = ("auto", "cpu", "cuda", "cuda:N")
_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")

# Samples per model call when the config does not say. Unmeasured on a GPU so far: small enough that a VAE
# encoder's activations at 1024² fit a 24 GB card in float16, large enough to keep a GPU busy at 256².
DEFAULT_BATCH_SIZE = 16

# Every key a batch (shardio.read.batches.BatchAssembler, shardio.read.bucket_order.Buckets.batch_defaults,
# shardio.read.mixing) or a sample (shardio.read.sample_access.sample_at) carries, whatever the dataset:
# an output under one of these names would hide it. tests/preprocess/models/test_model_config.py reads real
# batches and samples of both layouts and checks that this list covers their keys.
RESERVED_NAMES = ("image", "__key__", "cls", "txt", "json", "original_size", "crop_top_left", "content_box",
                  "bucket", "shard", "row", "index", "__source__", "__epoch__", "__position__")

# An output's file is named after it beside the shard's own (``STEM-NNNNN.NAME.npy``): a name that would make
# the file of an encoding's pixels (``STEM-NNNNN.jpg.npy``, ``.yuv.npy``) is refused.
RESERVED_FILE_NAMES = tuple(suffix.split(".")[1] for suffix in (JPEG_SUFFIX, YUV_SUFFIX))

OPTION_KEYS = ("fn", "input", "batch_size", "dtype", "device", "replicas")

AUTO = "auto"


@dataclass(frozen=True)
class ModelSpec:
    """One output of ``models:``: its ``name``, the ``fn`` (``"MODULE:FUNCTION"``) whose call returns the model,
    what it reads (``input``), ``batch_size``, the ``dtype`` stored (None: the model's own), ``device`` and
    ``replicas``: how many Ray actors run it (``preprocess.models.replicas``; ``"auto"``: one per GPU of the
    cluster where ``device`` is ``auto`` or ``cuda`` and the cluster has GPUs, else 0; 0: in each input's task)."""

    name: str
    fn: str
    input: str = IMAGE
    batch_size: int = DEFAULT_BATCH_SIZE
    dtype: str | None = None
    device: str = "auto"
    replicas: int | str = AUTO

    def __post_init__(self) -> None:
        _check_name(self.name)
        where = f"models: {self.name}"
        _check_fn(self.fn, where)
        if self.input not in INPUTS:
            raise ConfigError(f"{where}: input must be one of {', '.join(INPUTS)}, got {self.input!r}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(f"{where}: batch_size must be an integer >= 1, got {self.batch_size!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"{where}: dtype must be one of {', '.join(DTYPES)} (torch's names), "
                              f"got {self.dtype!r}")
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise ConfigError(f"{where}: device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.replicas != AUTO and (isinstance(self.replicas, bool) or not isinstance(self.replicas, int)
                                      or self.replicas < 0):
            raise ConfigError(f"{where}: replicas must be auto or an integer >= 0 (0: the model runs in each "
                              f"input's task), got {_shown(self.replicas)}")
        if self.replicas not in (AUTO, 0) and self.device.startswith("cuda:"):
            raise ConfigError(f"{where}: device {self.device} names one GPU, but replicas run on the GPUs Ray "
                              f"gives them: use device: cuda with replicas: {self.replicas}, or replicas: 0")

    @property
    def module(self) -> str:
        """The module ``fn`` names (imported by ``preprocess.models.loading``)."""
        return self.fn.partition(":")[0]

    @property
    def function(self) -> str:
        """The function ``fn`` names in its module (dotted for an attribute of an attribute)."""
        return self.fn.partition(":")[2]

    def runs_on_gpu(self, cluster_gpus: int) -> bool:
        """Whether a replica of this model takes a GPU on a cluster with ``cluster_gpus`` GPUs: ``device`` is auto
        or cuda and the cluster has one."""
        return cluster_gpus > 0 and self.device in (AUTO, "cuda")

    def replica_count(self, cluster_gpus: int) -> int:
        """How many replicas run this model on a cluster with ``cluster_gpus`` GPUs: ``replicas``, where ``auto`` is
        one per GPU when the model runs on one (``runs_on_gpu``), else 0 (in each input's task; so is a model
        pinned to one GPU, ``cuda:N``)."""
        if self.replicas == AUTO:
            return cluster_gpus if self.runs_on_gpu(cluster_gpus) else 0
        return int(self.replicas)

    def to_dict(self) -> dict[str, Any]:
        """The canonical form, every option spelled out (JSON types)."""
        return {"fn": self.fn, "input": self.input, "batch_size": self.batch_size, "dtype": self.dtype,
                "device": self.device, "replicas": self.replicas}

    def output_dict(self) -> dict[str, Any]:
        """What decides the stored values (the weights aside: ``preprocess.models.identity``): the function,
        what it reads and the dtype stored. ``batch_size``, ``device`` and ``replicas`` are how it runs: a run may
        change them (their float results may differ in the last bits; the CPU alone is bitwise repeatable)."""
        return {"fn": self.fn, "input": self.input, "dtype": self.dtype}


def parse_models(value: Any) -> tuple[ModelSpec, ...]:
    """The ``models:`` mapping (as YAML gives it; None: no models) as specs, in the order given; ConfigError
    naming the output and the key for anything else."""
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise ConfigError(f"models must be a mapping of output names to 'MODULE:FUNCTION' (or to a mapping with "
                          f"fn and options), got {_shown(value)}")
    return tuple(_spec(name, entry) for name, entry in value.items())


def _spec(name: Any, entry: Any) -> ModelSpec:
    _check_name(name)
    if isinstance(entry, str):
        return ModelSpec(name=name, fn=entry)
    if not isinstance(entry, Mapping):
        raise ConfigError(f"models: {name}: must be 'MODULE:FUNCTION' or a mapping with fn and options "
                          f"({', '.join(OPTION_KEYS[1:])}), got {_shown(entry)}")
    unknown = [key for key in entry if key not in OPTION_KEYS]
    if unknown:
        raise ConfigError(f"models: {name}: unknown key {unknown[0]!r} (known: {', '.join(OPTION_KEYS)})")
    if "fn" not in entry:
        raise ConfigError(f"models: {name}: fn is missing (the 'MODULE:FUNCTION' whose call returns the model)")
    return ModelSpec(name=name, **dict(entry))


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not (name.isascii() and name.isidentifier()):
        raise ConfigError(f"models: output name {name!r} must be an identifier (ASCII letters, digits and _, "
                          "not starting with a digit): it is a batch key and part of a file name")
    if name in RESERVED_NAMES or (name.startswith("__") and name.endswith("__")):
        raise ConfigError(f"models: output name {name!r} is a key every batch or sample already carries "
                          f"(reserved: {', '.join(RESERVED_NAMES)} and any __name__); choose another")
    if name.lower() in RESERVED_FILE_NAMES:
        raise ConfigError(f"models: output name {name!r} would name its files as a shard's pixels are named "
                          f"(reserved: {', '.join(RESERVED_FILE_NAMES)}); choose another")


def _check_fn(fn: Any, where: str) -> None:
    module, colon, function = fn.partition(":") if isinstance(fn, str) else ("", "", "")
    if not colon or not _dotted(module) or not _dotted(function):
        raise ConfigError(f"{where}: fn must be 'MODULE:FUNCTION' (e.g. my_models:make_vae), got {_shown(fn)}")


def _dotted(path: str) -> bool:
    return bool(path) and all(part.isidentifier() for part in path.split("."))


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
