"""The index a run edits: the committed generation as columns, plus the run's own changes.

A run of the job adds, replaces and drops inputs, then commits a segment with what changed. It needs,
per input it touches, the committed entry and shards (to retire the old files and to tell a change
from a no-op), and the root's totals; never the whole dataset as objects. ``load_manifest`` builds an
object per shard and input (~1.4 KB and 12 µs a shard: ~3 GB at LAION-2B's 2.3M shards) before the
first commit; ``EditableIndex`` finds a touched input in the segments themselves (their columns,
``shardio.format.shard_table``: a bisection of each segment's sorted input names, newest first) and
makes the ``ShardEntry`` objects of that input only. What the run changes lives beside it
(``changed`` / ``gone``) until the next commit: the run's memory is what it does between two commits.

A ``Manifest`` (a version 1/2 one being upgraded, or one built in memory) is edited the same way, its
content held as the run's changes (``from_manifest``): the first commit writes what differs from the
segments it was read from, or everything (the upgrade).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shardio.format.index import Delta, SegmentRef, current_inputs, input_signature, totals_of
from shardio.format.manifests import DatasetIndex
from shardio.format.segment_columns import SegmentColumns
from shardio.format.shard_table import fold_segments, shard_entry
from shardio.format.dataset_config import ConfigDerived
from shardio.format.dataset_manifest import Manifest
from shardio.format.entries import InputEntry, RetiredFile, ShardEntry
from shardio.format.model_outputs import OutputSpec
from shardio.format.root_fields import new_dataset_id

__all__ = ["EditableIndex", "Group"]

# An input as a segment holds it: its entry, its shards, and whether it is listed (False: a name that
# only groups shards, from a version 1/2 manifest whose shards name no listed input).
Group = tuple[InputEntry, list[ShardEntry], bool]


class _SegmentStack:
    """The committed inputs, found by name in the segments themselves, newest first (the spec's
    "Meaning": the newest segment naming a name, as an input or a removal, decides). A segment's input
    names are sorted (UTF-8 bytes: numpy ``S`` order), so a lookup is a bisection per segment (~40 at
    2.3M shards), over name arrays made once per segment; no fold, no object per shard."""

    def __init__(self, segments: list[SegmentColumns], known: _SegmentStack | None = None) -> None:
        self.segments = segments
        previous = known._tables if known is not None else {}
        self._tables: dict[str, tuple[_SortedNames, _SortedNames]] = {
            s.path: previous[s.path] for s in segments if s.path in previous}

    def find(self, name: str) -> tuple[SegmentColumns, int] | None:
        key = name.encode("utf-8")
        for segment in reversed(self.segments):
            inputs, removed = self._names(segment)
            row = inputs.find(key)
            if row is not None:
                return segment, row
            if removed.find(key) is not None:
                return None
        return None

    def _names(self, segment: SegmentColumns) -> tuple[_SortedNames, _SortedNames]:
        tables = self._tables.get(segment.path)
        if tables is None:
            tables = self._tables[segment.path] = (_SortedNames(segment.names("input_name")),
                                                   _SortedNames(segment.names("removed")))
        return tables

    def group(self, name: str) -> Group | None:
        found = self.find(name)
        if found is None:
            return None
        segment, row = found
        arrays = segment.arrays
        first = arrays["input_first_shard"]
        shards = [shard_entry(segment, r) for r in range(int(first[row]), int(first[row + 1]))]
        entry = InputEntry(size=int(arrays["input_size"][row]), mtime_ns=int(arrays["input_mtime_ns"][row]),
                           samples=int(arrays["input_samples"][row]), failed=int(arrays["input_failed"][row]),
                           shards=[e.path for e in shards], etag=segment.string("input_etag", row))
        listed = bool(arrays["input_listed"][row]) if "input_listed" in arrays else True
        return entry, shards, listed


class _SortedNames:
    """One string table of a segment, searchable: sorted as written (checked), else with its order."""

    def __init__(self, names: np.ndarray) -> None:
        self.order = None if len(names) < 2 or bool(np.all(names[1:] >= names[:-1])) else np.argsort(names,
                                                                                                       kind="stable")
        self.names = names if self.order is None else names[self.order]

    def find(self, key: bytes) -> int | None:
        names = self.names
        if not len(names) or len(key) > names.dtype.itemsize or key.endswith(b"\0"):
            return None  # longer than every name here (a cast would truncate it): not here
        at = int(np.searchsorted(names, np.array(key, dtype=names.dtype)))
        if at == len(names) or names[at] != key:
            return None
        return at if self.order is None else int(self.order[at])


class EditableIndex(ConfigDerived):
    """One dataset's index as a run edits it; ``Committer`` (``shardio.write.commit``) is its one
    writer. The root's fields are attributes (``shape``, ``config``, ``versions``, ``generation``,
    ``retired``, ``segments``...), so the commit writes a root straight from it.

    What is committed is read from the segments (``_SegmentStack``); what changed since the last commit
    is held here (``changed``, ``gone``) and let go at each commit (``committed``): a run's memory is
    what it does between two commits, whatever the dataset holds and however long the run."""

    def __init__(self, shape: tuple[int, int, int], config: dict[str, Any], versions: dict[str, Any], *,
                 stack: _SegmentStack | None = None, updated: str = "", generation: int = 0,
                 retired: list[RetiredFile] | None = None, segments: list[SegmentRef] | None = None,
                 source_version: str = "", totals: dict[str, int] | None = None, dataset_id: str = "",
                 name_fence: str = "", classes: tuple[str, ...] = (), outputs: tuple[OutputSpec, ...] = ()) -> None:
        self.shape, self.config, self.versions = shape, config, versions
        # The dataset's identity (spec, "Identity"): the committed root's, or drawn now for a new dataset
        # (or one whose roots predate identities): its first commit writes it, every later one copies it.
        self.dataset_id = dataset_id or new_dataset_id()
        # The names' fence (spec, "Fencing names"): copied by every commit; set by a run that took the
        # lease over from a holder that may live (``shardio.write.lock``).
        self.name_fence = name_fence
        # The class table (spec, "Classes"): copied by every commit; a run appends its new names (never
        # reorders or removes one: ``add_classes``).
        self.classes: tuple[str, ...] = tuple(classes)
        # The model outputs (spec, "Model outputs"): copied by every commit; a run sets them (``set_outputs``:
        # a bucket's first shape, a new dataset's list) before the commit that first holds such samples.
        self.outputs: tuple[OutputSpec, ...] = tuple(outputs)
        self.updated, self.generation, self.source_version = updated, generation, source_version
        self.retired: list[RetiredFile] = list(retired or [])
        self._retired_paths = {r.path for r in self.retired}
        # None: not yet an index (a version 1/2 manifest, or a new dataset): the first commit writes all.
        self.segments = segments
        self._stack = stack
        self.changed: dict[str, Group] = {}  # inputs added or replaced since the last commit
        self.gone: set[str] = set()  # names removed since the last commit (and not added again)
        # A Manifest's segments, until its first commit: name -> signature of what they say.
        self._indexed: dict[str, tuple[Any, ...]] = {}
        self.totals = dict(totals or {k: 0 for k in ("samples", "shard_count", "input_count", "bytes",
                                                         "meta_bytes", "failed")})

    # --- construction ----------------------------------------------------------------------------------

    @classmethod
    def of(cls, committed: DatasetIndex | Manifest | None, shape: tuple[int, int, int] = (0, 0, 3),
           config: dict[str, Any] | None = None, versions: dict[str, Any] | None = None) -> EditableIndex:
        """The index to edit from what is committed (None: a new dataset of ``shape`` and ``config``)."""
        if isinstance(committed, Manifest):
            return cls.from_manifest(committed)
        if committed is None:
            return cls(shape, dict(config or {}), dict(versions or {}))
        if committed.segments is None:
            raise TypeError("a version 1/2 dataset is upgraded from its Manifest (load_manifest), not its columns")
        totals = {**committed.totals, "samples": committed.samples, "shard_count": len(committed.shards)}
        return cls(committed.shape, dict(committed.config), dict(committed.versions),
                   stack=_SegmentStack(list(committed.shards.segments)), updated=committed.updated,
                   generation=committed.generation, retired=committed.retired, segments=list(committed.segments),
                   source_version=committed.source_version, totals=totals, dataset_id=committed.dataset_id,
                   name_fence=committed.name_fence, classes=committed.classes, outputs=committed.outputs)

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> EditableIndex:
        """A manifest's content as changes: its first commit compares every name with the segments it was
        read from (``manifest.indexed``), or writes everything (no segments: the upgrade)."""
        index = cls(manifest.shape, manifest.config, manifest.versions, updated=manifest.updated,
                    generation=manifest.generation, retired=manifest.retired,
                    segments=None if manifest.segments is None else list(manifest.segments),
                    source_version=manifest.source_version, totals=totals_of(manifest), dataset_id=manifest.dataset_id,
                    name_fence=manifest.name_fence, classes=manifest.classes, outputs=manifest.outputs)
        index.changed = current_inputs(manifest)
        index._indexed = dict(manifest.indexed) if manifest.segments is not None else {}
        index.gone = set(index._indexed) - set(index.changed)
        return index

    def set_outputs(self, outputs: tuple[OutputSpec, ...]) -> None:
        """The outputs the next commit writes into its root (spec, "Model outputs"). The list's names and order
        are the dataset's for its life: ValueError for another list than the committed one."""
        if self.outputs and [o.name for o in outputs] != [o.name for o in self.outputs]:
            raise ValueError(f"outputs {[o.name for o in outputs]} differ from the dataset's "
                             f"{[o.name for o in self.outputs]}")
        self.outputs = tuple(outputs)

    def add_classes(self, names: list[str] | set[str]) -> dict[str, int]:
        """Append the ``names`` the class table lacks, sorted (spec, "Classes": a run killed and rerun
        appends the same names in the same order); returns the whole table as name -> id. The next commit
        writes it."""
        new = sorted(set(names) - set(self.classes))
        self.classes = (*self.classes, *new)
        return {name: number for number, name in enumerate(self.classes)}

    def pending(self) -> set[str]:
        """The names the next commit must compare (after ``from_manifest``: every one it knows of)."""
        return set(self.changed) | self.gone

    # --- reading -----------------------------------------------------------------------------------------

    def group(self, name: str) -> Group | None:
        """Input (or shard group) ``name`` as it stands now, with its shards; None if absent."""
        if name in self.changed:
            return self.changed[name]
        if name in self.gone or self._stack is None:
            return None
        return self._stack.group(name)

    def input(self, name: str) -> InputEntry | None:
        """The listed input ``name``'s entry, or None."""
        group = self.group(name)
        return group[0] if group is not None and group[2] else None

    def shards_of(self, name: str) -> list[ShardEntry]:
        group = self.group(name)
        return group[1] if group is not None else []

    @property
    def samples(self) -> int:
        return self.totals["samples"]

    # --- editing -----------------------------------------------------------------------------------------

    def put(self, name: str, group: Group) -> Group | None:
        """Make ``group`` input ``name``'s content; returns what it replaces (None if nothing)."""
        old = self.remove(name)
        self.changed[name] = group
        self.gone.discard(name)
        self._count(group, +1)
        return old

    def remove(self, name: str) -> Group | None:
        """Remove input (or group) ``name``; returns what it was (None if absent)."""
        old = self.group(name)
        if old is None:
            return None
        self.changed.pop(name, None)
        self.gone.add(name)
        self._count(old, -1)
        return old

    def retire(self, paths: list[str]) -> None:
        for path in paths:
            if path not in self._retired_paths:
                self.retired.append(RetiredFile(path))
                self._retired_paths.add(path)

    def unretire(self, paths: set[str]) -> None:
        """Files listed again (the same name is the same bytes): live, not retention's to collect."""
        if paths & self._retired_paths:
            self.retired = [r for r in self.retired if r.path not in paths]
            self._retired_paths -= paths

    def _count(self, group: Group, sign: int) -> None:
        entry, shards, listed = group
        totals = self.totals
        totals["shard_count"] += sign * len(shards)
        totals["samples"] += sign * sum(e.samples for e in shards)
        totals["bytes"] += sign * sum(e.bytes for e in shards)
        totals["meta_bytes"] += sign * sum(e.meta_bytes for e in shards)
        if listed:
            totals["input_count"] += sign
            totals["failed"] += sign * entry.failed

    # --- committing -------------------------------------------------------------------------------------

    def delta(self, touched: set[str]) -> Delta:
        """What the next segment must say for the index to be the fold of its segments: of the
        ``touched`` names, those whose content differs from what the segments say, and those removed.
        Before the first commit of a version 1/2 manifest or a new dataset (no segments): everything."""
        if self.segments is None:
            return Delta(dict(self.changed), set(), self.is_bucketed, len(self.outputs))
        changed: dict[str, Group] = {}
        removed: set[str] = set()
        for name in touched:
            now = self.group(name)
            was = self._indexed_signature(name)
            if now is None:
                if was is not None:
                    removed.add(name)
            elif was != input_signature(*now):
                changed[name] = now
        return Delta(changed, removed, self.is_bucketed, len(self.outputs))

    def _indexed_signature(self, name: str) -> tuple[Any, ...] | None:
        if self._stack is None:
            return self._indexed.get(name)
        group = self._stack.group(name)
        return input_signature(*group) if group is not None else None

    def committed(self, segments: list[SegmentRef], columns: list[SegmentColumns]) -> None:
        """A commit was published with ``segments`` (``columns``: the same, opened): what it wrote is
        read from them from now on, and the changes it held are let go."""
        self.segments = segments
        self._stack = _SegmentStack(columns, self._stack)
        self.changed, self.gone, self._indexed = {}, set(), {}

    def as_committed(self, path: str) -> DatasetIndex:
        """The generation this index last committed, as a reader's ``DatasetIndex`` (``path``: its root),
        folded from the segments it holds: after a run, retention reads it without fetching the index
        again (on object storage, a GET of every segment)."""
        if self.segments is None or self._stack is None:
            raise ValueError("as_committed() needs a committed index")
        table = fold_segments(self._stack.segments, path)
        totals = {k: self.totals[k] for k in ("input_count", "failed", "bytes", "meta_bytes")}
        return DatasetIndex(path, self.shape, self.config, self.versions, self.updated, self.generation, table,
                            list(self.retired), totals, self.source_version, list(self.segments), self.dataset_id,
                            self.name_fence, self.classes, self.outputs)

    def opened_segments(self) -> dict[str, SegmentColumns]:
        """The segments already open, by path (a commit reopens only the ones it wrote)."""
        return {s.path: s for s in self._stack.segments} if self._stack is not None else {}

    def to_manifest_fields(self, manifest: Manifest) -> None:
        """Copy the root's fields a commit changed back into ``manifest`` (a caller that committed a
        ``Manifest`` keeps using it: its generation, version and segments are the new ones)."""
        manifest.generation, manifest.updated, manifest.source_version = (
            self.generation, self.updated, self.source_version)
        manifest.dataset_id, manifest.name_fence = self.dataset_id, self.name_fence
        manifest.classes, manifest.outputs = self.classes, self.outputs
        manifest.retired, manifest.segments = list(self.retired), list(self.segments or [])
        manifest.indexed = {name: input_signature(*group) for name, group in current_inputs(manifest).items()}
