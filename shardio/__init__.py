"""shardio: fixed-shape uint8 image shards, and a PyTorch dataset that streams them with no per-sample work.

Imports with numpy and torch alone. The format is specified in ``shardio.format``.
"""

from shardio.errors import (
    DatasetIncompatibleError,
    SampleError,
    ShardError,
    ShardFormatError,
    ShardIntegrityError,
    ShardioError,
)
from shardio.format import FORMAT_VERSION
from shardio.read.snapshot import DatasetSnapshot, open_dataset

__version__ = "0.1.0"

# The torch-based parts load on first use: the preprocessing workers import shardio's format and writer
# only, and importing torch would cost each of them ~190 MB of RSS and over a second of start-up.
_LAZY = {"ShardDataset": "shardio.read.dataset", "MixedDataset": "shardio.read.mixing",
         "SubsetDataset": "shardio.read.subset", "ShardLoader": "shardio.train.loader",
         "DeviceLoader": "shardio.train.loader", "to_device": "shardio.train.loader",
         "TrainAugment": "shardio.train.augment", "EvalTransform": "shardio.train.augment",
         "PositionedBatches": "shardio.train.augment"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shardio' has no attribute {name!r}")

__all__ = [
    "FORMAT_VERSION",
    "DatasetSnapshot",
    "open_dataset",
    "ShardDataset",
    "ShardLoader",
    "DeviceLoader",
    "to_device",
    "TrainAugment",
    "EvalTransform",
    "PositionedBatches",
    "MixedDataset",
    "SubsetDataset",
    "ShardioError",
    "ShardError",
    "ShardFormatError",
    "ShardIntegrityError",
    "DatasetIncompatibleError",
    "SampleError",
]
