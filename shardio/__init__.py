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
from shardio.dataset import ShardDataset
from shardio.format import FORMAT_VERSION
from shardio.loader import DeviceLoader, ShardLoader, to_device
from shardio.reader import DatasetSnapshot, open_dataset

__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION",
    "DatasetSnapshot",
    "open_dataset",
    "ShardDataset",
    "ShardLoader",
    "DeviceLoader",
    "to_device",
    "ShardioError",
    "ShardError",
    "ShardFormatError",
    "ShardIntegrityError",
    "DatasetIncompatibleError",
    "SampleError",
]
