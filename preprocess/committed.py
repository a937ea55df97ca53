"""What a run finds committed, read once under the lock: every later step asks this one reading.

The config check, the plan, the answer to a rerun with nothing to do and the commit all start from
``Committed``: the index as it was read, its committed inputs by name (what the plan compares the listing
with), and the warning if ``manifest.json`` had to be restored. A version 3 index is read as columns
(``load_index``: O(inputs), never an object per shard; LAION-2B-en's 230k inputs and 2.3M shards, where
``load_manifest`` alone took ~25 s and ~3 GB), which is all a rerun with nothing to do needs
(``Committed.columns``); anything else (no dataset yet, a version 1/2 manifest, a ``manifest.json``
missing or corrupt) is what ``shardio.write.directory.load_committed`` makes of it: read, restored or
upgraded at the first commit.
"""

from __future__ import annotations

from dataclasses import dataclass

from preprocess.config import JobConfig
from preprocess.rewrite import config_to_compare
from shardio.errors import DatasetIncompatibleError, ShardError
from shardio.format import InputEntry, Manifest
from shardio.format.manifests import DatasetIndex, load_index
from shardio.format.model_outputs import OutputSpec
from shardio.write import directory as dataset_dir
from shardio.store.root import Place, open_root

__all__ = ["Committed", "read_committed", "check_compatible"]


@dataclass
class Committed:
    """The dataset as the run found it: ``index`` (None: a new dataset; a ``DatasetIndex``; a version 1/2
    ``Manifest``), its committed ``inputs`` by name, and ``restored``: the warning when ``manifest.json`` was
    restored from a kept generation ("" if not)."""

    index: DatasetIndex | Manifest | None
    inputs: dict[str, InputEntry]
    restored: str = ""

    @property
    def outputs(self) -> tuple[OutputSpec, ...]:
        """The model outputs the dataset has (none for a new dataset)."""
        return () if self.index is None else self.index.outputs

    @property
    def columns(self) -> DatasetIndex | None:
        """The index as columns, as found (not restored): what a rerun with nothing to do is answered from;
        None where the run must go through the commit (a new dataset, a version 1/2 one, a restored one)."""
        return self.index if isinstance(self.index, DatasetIndex) and not self.restored else None


def read_committed(place: Place) -> Committed:
    """What is committed at ``place`` (the caller holds the lock): the index as columns when it is a
    readable version 3 one (one read, the usual case), else ``load_committed``'s reading, which may restore
    a kept generation. Nothing here checks the config: the caller says a restoration first."""
    root = open_root(place)
    try:
        index = load_index(root)
    except (ShardError, OSError):
        index = None
    if index is not None and index.segments is not None:
        return Committed(index, index.committed_inputs())
    existing, restored = dataset_dir.load_committed(root)
    return Committed(existing, _committed_inputs(existing), restored)


def _committed_inputs(existing: DatasetIndex | Manifest | None) -> dict[str, InputEntry]:
    """The committed inputs by name, what the plan compares the listing with: one entry per input from
    the index's columns (``shards`` left empty), none per shard; a version 1/2 manifest's own."""
    if existing is None:
        return {}
    return existing.committed_inputs() if isinstance(existing, DatasetIndex) else dict(existing.inputs)


def check_compatible(manifest: Manifest | DatasetIndex, cfg: JobConfig, place: Place,
                     rewriting: str | None = None) -> None:
    """``DatasetIncompatibleError`` naming every key in which ``cfg`` differs from the dataset's config; a rewrite
    of output ``rewriting`` may change that output's ``models:`` entry (``preprocess.rewrite``)."""
    wanted = cfg.output_dict()
    stored = {**JobConfig().output_dict(), **manifest.config}  # keys newer than the dataset: their defaults
    if rewriting is not None:
        stored = config_to_compare(stored, wanted, rewriting)
    if stored == wanted:
        return
    # Said over the full form: a raw dataset stores no encoding keys (JobConfig.to_dict), which a JPEG run
    # would otherwise read back as "encoding: dataset has None".
    full = JobConfig().full_output_dict()
    said_stored, said_wanted = {**full, **stored}, {**full, **wanted}
    keys = sorted(set(said_stored) | set(said_wanted))
    diffs = [f"{k}: dataset has {said_stored.get(k)!r}, this run {said_wanted.get(k)!r}"
             for k in keys if said_stored.get(k) != said_wanted.get(k)]
    raise DatasetIncompatibleError(
        f"{dataset_dir.manifest_path(place)}: written with a different config ({'; '.join(diffs)}); "
        "shards of different shapes or pixels never mix: leave these keys out of the flags and --config file "
        "(a rerun uses the dataset's own config), or use a new --output"
    )
