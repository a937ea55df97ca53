"""The format: what a dataset directory holds and how its files are laid out (``spec``, re-exported here so
``from shardio.format import Manifest`` reads as the spec), the shard checksums (``checksum``), and the run
report (``run_report``)."""

from shardio.format.spec import *  # noqa: F403 (the spec's __all__ is this package's)
from shardio.format.spec import __all__ as __all__

