"""Every exception shardio and preprocess raise on purpose, as one tree::

    ShardioError                          (exit: see EXIT_CODES)
    ├── ShardError                        a dataset or shard cannot be used: exit 1
    │   ├── ShardFormatError              not a shardio dataset, or another format version / layout
    │   ├── ShardIntegrityError           size or checksum differs from the manifest (truncated, corrupt)
    │   └── DatasetIncompatibleError      the dataset was made with another config: exit 2
    │       └── VersionDrift              ... or another Pillow / libjpeg-turbo (``--strict-versions``)
    ├── OutputFull                        the output disk filled up; the dataset is as of its last commit
    ├── StorageUnavailable                the object store failed after retries (5xx, unreachable)
    ├── UsageError                        refused before any work, fix the command and rerun: exit 2
    │   ├── ConfigError                   a bad config key or value (also a ValueError)
    │   ├── NoInputsMatched               a glob / brace range matched no tar, or no INPUT is a usable tar
    │   ├── UnsupportedInput              an INPUT named explicitly that no input source reads (text, Parquet)
    │   ├── OutputUnusable                --output is a file, or not writable by this user
    │   ├── OutputLocked                  another live run holds the dataset directory
    │   │   └── CommitConflict            another writer committed since this run read the manifest
    │   ├── PruneRefused                  --prune would drop most of the dataset, unconfirmed
    │   ├── RayUnavailable                the Ray address cannot be reached
    │   ├── NodeBuildMismatch             a cluster node has other pixel libraries than the driver
    │   ├── NodeAccessError               a cluster node cannot read the inputs or write the output
    │   ├── UnsupportedPath               a URL scheme no storage backend serves (a NotImplementedError)
    │   ├── StorageAccessError            the object store refused the credentials, or the bucket is missing
    │   ├── UnsupportedStore              the object store ignores conditional writes
    │   └── MissingExtra                  an optional extra is needed (``pip install 'shardio[s3]'``)
    ├── SampleError                       one sample could not be turned into pixels (counted, not fatal):
    │                                     a ``FailureCode`` and its detail (``shardio.failure_reasons``)
    └── InputError                        one input (tar) could not be read (named in the report)

Every message names the file (and the tar member, input or shard) and says what to do. A command's exit
status for an exception is ``exit_code(error)``, from the one table ``EXIT_CODES`` below; a run that
ends without one exits by its report (``shardio.format.run_report.RunReport.exit_code``: ``EXIT_OK``,
``EXIT_FAILED`` or ``signal_exit_code``).
"""

from __future__ import annotations

from shardio.failure_reasons import FailureCode

__all__ = [
    "ShardioError",
    "ShardError",
    "ShardFormatError",
    "ShardIntegrityError",
    "DatasetIncompatibleError",
    "VersionDrift",
    "OutputFull",
    "UsageError",
    "ConfigError",
    "NoInputsMatched",
    "UnsupportedInput",
    "OutputUnusable",
    "OutputLocked",
    "PruneRefused",
    "RayUnavailable",
    "NodeBuildMismatch",
    "NodeAccessError",
    "UnsupportedPath",
    "StorageAccessError",
    "StorageUnavailable",
    "UnsupportedStore",
    "MissingExtra",
    "CommitConflict",
    "SampleError",
    "InputError",
    "EXIT_OK",
    "EXIT_FAILED",
    "EXIT_USAGE",
    "EXIT_CODES",
    "exit_code",
    "signal_exit_code",
]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


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


class VersionDrift(DatasetIncompatibleError):
    """Appending with a different Pillow(-SIMD) / libjpeg-turbo than the dataset was written with, under
    ``--strict-versions`` (otherwise only a warning)."""


class OutputFull(ShardioError):
    """The output filesystem is full (or over quota): the run stopped; the dataset is as of its last
    commit."""


class UsageError(ShardioError):
    """The command was refused before it changed anything: what was asked cannot be done as given."""


class ConfigError(UsageError, ValueError):
    """A config file or flag has an unknown key or a value out of range (a ValueError for callers that
    validate values generically)."""


class NoInputsMatched(UsageError):
    """A glob or brace range matched no tar, or no INPUT at all names a usable tar (a folder, only missing
    paths): a source mount that is down must not look like "no new data", nor a mistyped command create a
    dataset."""


class UnsupportedInput(UsageError):
    """An INPUT named explicitly is no kind of input a source reads (its name claims none and its first
    bytes are none: a text file, a Parquet file): refused before Ray starts or the output is touched
    (``preprocess.inputs.kinds``)."""


class OutputUnusable(UsageError):
    """``--output`` is a file, or a directory this user cannot create or write."""


class OutputLocked(UsageError):
    """Another live run holds the output directory."""


class PruneRefused(UsageError):
    """``--prune`` would drop most of the dataset and was not confirmed: nothing touched."""


class RayUnavailable(UsageError):
    """The Ray cluster named by ``--ray-address`` cannot be reached (refused before any work)."""


class NodeBuildMismatch(UsageError):
    """A node of the Ray cluster has another Pillow(-SIMD) / AVX2 / libjpeg-turbo than the driver: it would
    write other pixels for the same input, so the run is refused before any task (the message names it)."""


class NodeAccessError(UsageError):
    """A node of the Ray cluster cannot read the run's inputs or write its output (no endpoint, no
    credentials, no network, a folder not on its disk): refused before any task (the message names it)."""


class UnsupportedPath(UsageError, NotImplementedError):
    """A path with a URL scheme (``s3://``) that no storage backend serves yet."""


class StorageAccessError(UsageError):
    """The object store refused the request for good: wrong credentials, no permission, no such bucket
    (never retried: a retry cannot fix it)."""


class UnsupportedStore(UsageError):
    """The object store ignores conditional writes (or does not take the upload they ride on), so two writers
    could overwrite each other's commit: refused before anything is written."""


class MissingExtra(UsageError, ImportError):
    """A feature needs an optional extra that is not installed; the message says what to install."""


class CommitConflict(OutputLocked):
    """Another writer committed since this run read the manifest: nothing was overwritten."""


class StorageUnavailable(ShardioError):
    """The object store kept failing after retries (unreachable, 5xx, SlowDown): the run stops with what
    it committed; rerunning resumes."""


class SampleError(ShardioError):
    """One sample could not be decoded; the job records its code and reason and goes on.

    ``code`` is what the summaries count by; ``str(e)`` is the detail a person reads (the reason, without
    the member name the job adds), so no one has to read the category back out of the words.
    """

    def __init__(self, code: FailureCode, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail

    def __reduce__(self) -> tuple[type, tuple[FailureCode, str]]:  # pickling rebuilds from both fields
        return (type(self), (self.code, self.detail))


class InputError(ShardioError):
    """One input could not be read as a tar; the job names it and goes on with the rest.

    ``str(e)`` is ``"{input}: {reason}"``; a run report stores ``{input, reason}`` apart, so the reason
    alone (``e.reason``) goes there: the summary once printed the path twice (``PATH: PATH: reason``).
    ``lasting``: the bytes themselves are at fault (not a tar, truncated, a corrupt header), so the same
    bytes fail the same way every time and a rerun remembers it (``preprocess.job``); False for what a
    retry may cure (a read or stat error, a download cut, an object replaced while read).
    """

    def __init__(self, input: str, reason: str, lasting: bool = True) -> None:
        super().__init__(f"{input}: {reason}")
        self.input = input
        self.reason = reason
        self.lasting = lasting

    def __reduce__(self) -> tuple[type, tuple[str, str, bool]]:  # pickling (Ray) rebuilds from the fields
        return (type(self), (self.input, self.reason, self.lasting))


# The exit status of a command that ends with one of these: the most specific class listed wins (a
# DatasetIncompatibleError is a ShardError, but asks the user to change the command, so it exits 2).
EXIT_CODES: dict[type[ShardioError], int] = {
    DatasetIncompatibleError: EXIT_USAGE,
    UsageError: EXIT_USAGE,
    ShardioError: EXIT_FAILED,
}


def signal_exit_code(signum: int) -> int:
    """A command stopped by signal ``signum`` exits as a shell reports a process it killed: 128 + the
    number (130 SIGINT, 143 SIGTERM)."""
    return 128 + signum


def exit_code(error: ShardioError) -> int:
    """The exit status for ``error``: its nearest class in ``EXIT_CODES``."""
    for cls in type(error).__mro__:
        if cls in EXIT_CODES:
            return EXIT_CODES[cls]
    return EXIT_FAILED
