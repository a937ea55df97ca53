"""The format: what a dataset directory holds and how its files are laid out (``spec``, re-exported here so
``from shardio.format import Manifest`` reads as the spec) and the run report (``run_report``); the shard
checksums it names are storage's (``shardio.store.checksum``)."""

from shardio.format.spec import *  # noqa: F403 (the spec's __all__ is this package's)
from shardio.format.spec import __all__ as __all__

