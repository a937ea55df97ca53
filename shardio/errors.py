"""The exceptions shardio and preprocess raise, as one small tree::

    ShardioError
    ├── ShardError              a dataset or shard cannot be used
    │   ├── ShardFormatError    not a shardio dataset, or another format version / layout
    │   ├── ShardIntegrityError size or checksum differs from the manifest (truncated, corrupt)
    │   └── DatasetIncompatibleError  an existing dataset was made with another config
    ├── SampleError             one image could not be turned into pixels (counted, never fatal)
    └── InputError              one input (tar) could not be read (named in the report, others go on)

Every message names the file (and the tar member or shard index) and says what to do.
"""

from __future__ import annotations

__all__ = [
    "ShardioError",
    "ShardError",
    "ShardFormatError",
    "ShardIntegrityError",
    "DatasetIncompatibleError",
    "SampleError",
    "InputError",
]


class ShardioError(Exception):
    """Base of every error raised on purpose by shardio or preprocess."""


class ShardError(ShardioError):
    """A dataset directory or one of its shards cannot be used."""


class ShardFormatError(ShardError):
    """The file is not what the format spec says (magic, version, layout)."""


class ShardIntegrityError(ShardError):
    """A shard's size or checksum differs from what the manifest recorded."""


class DatasetIncompatibleError(ShardError):
    """An existing dataset was written with a different config; shapes must never mix."""


class SampleError(ShardioError):
    """One sample could not be decoded; the job records the reason and goes on."""


class InputError(ShardioError):
    """One input could not be read as a tar; the job names it and goes on with the rest.

    ``str(e)`` is ``"{input}: {reason}"``; a run report stores ``{input, reason}`` apart, so the reason
    alone (``e.reason``) goes there: the summary once printed the path twice (``PATH: PATH: reason``).
    """

    def __init__(self, input: str, reason: str) -> None:
        super().__init__(f"{input}: {reason}")
        self.input = input
        self.reason = reason

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # pickling (Ray) rebuilds from both fields
        return (type(self), (self.input, self.reason))
