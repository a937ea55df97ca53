"""A run's inputs, taken the one way they were given: paths (tars, Parquet files, folders: listed by
``preprocess.inputs.resolve``) or a Python source (``preprocess.inputs.sources``), chosen once at the start of the run.

Either way the run gets the same listing (``ResolvedInputs``: names and the fingerprints a rerun compares)
and later asks the same three things, never which way the inputs came: is the output apart from them
(``check_apart``: files near the output), which of them every node must reach (``files``), and what every
task reads its input with (``reader``: a source's function, or with folder classes the dataset's class
table extended by this run's new names).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from preprocess.inputs.class_table import extend_class_table, folder_class_names
from preprocess.config import JobConfig
from preprocess.inputs.kinds import KindReader, SampleReader
from preprocess.inputs.resolve import InputFingerprint, ResolvedInputs, resolve_inputs
from preprocess.plan import check_output_apart
from preprocess.inputs.sources import Source
from shardio.errors import NoInputsMatched
from shardio.write.editable_index import EditableIndex
from shardio.store.root import DatasetRoot

__all__ = ["PathInputs", "SourceInputs", "RunInputs", "resolve_run_inputs"]


@dataclass
class PathInputs:
    """Inputs named by path or URL; under ``folder_classes``, the class names each folder input brings."""

    resolved: ResolvedInputs
    class_names: dict[str, set[str]] = field(default_factory=dict)

    def check_apart(self, output: DatasetRoot) -> None:
        """``OutputUnusable`` if an input lies in the output directory (``plan.check_output_apart``)."""
        check_output_apart(output, self.resolved)

    def files(self, todo: list[tuple[str, InputFingerprint]]) -> list[str]:
        """The inputs every node must be able to read (``preprocess.cluster.cluster_access``)."""
        return [path for path, _ in todo]

    def reader(self, index: EditableIndex, todo: list[tuple[str, InputFingerprint]]) -> SampleReader | None:
        """The kinds the resolution read of the inputs whose name claims none (``ResolvedInputs.kinds``: the
        tasks are told, never read them again) and, with folder classes, the dataset's class table with this
        run's new names appended, before any task (spec, "Classes"); None where there is neither: each kind's
        own reader (``samples_of``)."""
        class_ids = extend_class_table(index, self.class_names, todo) if self.class_names else None
        told = self.resolved.kinds
        return KindReader(told, class_ids) if told or class_ids is not None else None


@dataclass
class SourceInputs:
    """A Python source's inputs: names, not files, read by the source's own function."""

    resolved: ResolvedInputs
    source: Source

    def check_apart(self, output: DatasetRoot) -> None:
        """Nothing to check: a source's inputs are names, not files near the output."""

    def files(self, todo: list[tuple[str, InputFingerprint]]) -> list[str]:
        return []  # a source's inputs are no files

    def reader(self, index: EditableIndex, todo: list[tuple[str, InputFingerprint]]) -> SampleReader:
        return self.source.reader()


RunInputs = PathInputs | SourceInputs


def resolve_run_inputs(paths: list[str], source: Source | None, cfg: JobConfig) -> RunInputs:
    """The run's inputs, from ``source`` if given, else from ``paths``. ``NoInputsMatched`` before the output
    is touched: a glob matching nothing, both ways given, or every INPUT failed (a folder, missing paths)."""
    inputs = _source_inputs(paths, source) if source is not None else _path_inputs(paths, cfg)
    resolved = inputs.resolved
    if not resolved.paths:
        reasons = "; ".join(f"{failed['input']}: {failed['reason']}" for failed in resolved.failed[:5])
        more = f" (and {len(resolved.failed) - 5} more)" if len(resolved.failed) > 5 else ""
        reasons = reasons or "no INPUT was given"
        raise NoInputsMatched(f"no input to process: {reasons}{more}; nothing was read or written")
    return inputs


def _path_inputs(paths: list[str], cfg: JobConfig) -> PathInputs:
    resolved = resolve_inputs(paths, cfg.image_extensions)
    # folder_classes: the names the folder inputs bring; a folder with no class folder fails here, unread.
    return PathInputs(resolved, folder_class_names(resolved) if cfg.folder_classes else {})


def _source_inputs(paths: list[str], source: Source) -> SourceInputs:
    """A Python source's inputs as the job's: ``{source}/{input}`` names, each recognised by its version
    (held where an object's ETag is: a rerun compares it, as it compares an object's)."""
    if paths:
        raise NoInputsMatched("give INPUT paths or a source, not both; nothing was read or written")
    listed = {source.input_path(item): InputFingerprint(0, 0, str(item.version)) for item in source.inputs}
    return SourceInputs(ResolvedInputs(sorted(listed), listed=listed), source)
