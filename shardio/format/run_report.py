"""The run report: one JSON file per ``preprocess run``, ``DIR/reports/RUN_ID.json`` (the run history).

Written by the job (``preprocess.job``, through ``shardio.write.directory.save_report``), read by ``shardio
info``; this module is its one definition. A report is a JSON object with the fields of ``RunReport``
(all of them present; a reader of older reports uses ``.get`` with the defaults below) plus
``failures_by_reason`` ({category: count}, counted by code: ``shardio.failure_reasons``) and ``exit_code``
(the command's exit status). ``failures`` are ``{input, key, code, reason}`` per bad sample (``code`` a
``FailureCode`` value; reports from before codes have none, and count as ``unknown``); ``inputs_failed``
``{input, reason}`` per input that could not be processed, plus, for an input whose bytes are at fault (not
a tar, truncated: the same bytes fail again), ``fingerprint`` (``{size, mtime_ns, etag}`` as the input was
read) and ``failed_in`` (the run that read it), and ``samples_lost`` when samples decoded before the break
were not kept. ``files_ignored`` is ``{input, reason, files, first}`` per folder input and reason for its
files that are no sample (``preprocess.inputs.folder_samples``; absent from older reports). The newest report
(``latest_report``) is where a rerun finds the failures it remembers: an input with the same fingerprint
is reported failed again without being read (``preprocess.job``).

Report version 2 (``report_version``; a report without it is version 1): a rerun over a LAION-sized
dataset skips ~230k committed inputs, and a line per skipped input made its report ~15 MB of names
that ``manifest.json`` already holds. So ``inputs_skipped`` names only the first ``NAMED_SKIPPED`` in
path order (all of them when fewer) and ``inputs_skipped_count`` counts them all (``skipped_count``
reads both versions). Every other list is bounded by the run's work (inputs processed, failed, pruned).
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass, field
from typing import Any

from shardio.store.root import Place, open_root
from shardio.errors import EXIT_FAILED, EXIT_OK, signal_exit_code
from shardio.failure_reasons import count_by_category
from shardio.format.spec import REPORTS_DIR

__all__ = ["RunReport", "report_dict", "report_json", "run_history", "latest_report", "skipped_count",
           "NAMED_SKIPPED", "REPORT_VERSION"]

REPORT_VERSION = 2
# Names enough to see which inputs a rerun recognised (a cron's log, a test), never 230k lines.
NAMED_SKIPPED = 100


@dataclass
class RunReport:
    run_id: str
    output: str
    started: str
    config: dict[str, Any]
    samples_written: int = 0
    samples_failed: int = 0
    samples_upscaled: int = 0  # written, but smaller than the target on a side (see min_image_size)
    failures: list[dict[str, str]] = field(default_factory=list)  # {input, key, code, reason}
    inputs_processed: list[str] = field(default_factory=list)
    inputs_skipped: list[str] = field(default_factory=list)  # the first NAMED_SKIPPED, in path order
    inputs_skipped_count: int = 0  # every input skipped as committed unchanged
    inputs_failed: list[dict[str, str]] = field(default_factory=list)
    inputs_pruned: list[str] = field(default_factory=list)
    inputs_ignored: list[str] = field(default_factory=list)  # non-tar files a glob matched
    # Files of folder inputs that are no sample, one entry per folder and reason: {input, reason, files,
    # first} (images of a kind image_extensions leaves out, links that lead to no file; the first by path).
    files_ignored: list[dict[str, Any]] = field(default_factory=list)
    generation: int = 0  # the dataset's generation after this run
    files_collected: list[str] = field(default_factory=list)  # retired files retention deleted
    dataset_samples: int = 0
    elapsed_s: float = 0.0
    images_per_s: float = 0.0
    # Ray start-up (a few seconds locally) is a fixed cost: these two separate it from the steady rate.
    startup_s: float = 0.0
    processing_images_per_s: float = 0.0
    cluster: dict[str, Any] = field(default_factory=dict)
    inputs_per_node: dict[str, int] = field(default_factory=dict)
    versions: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    # A stop request (the CLI: SIGINT / SIGTERM) ended the run early: the signal's name, and the planned
    # inputs it left undone (not committed; the next run processes them).
    interrupted: str = ""
    inputs_unfinished: list[str] = field(default_factory=list)
    # A bucketed dataset's (``mode: bucket``): samples this run wrote per bucket, keyed "HxW" as ``shardio
    # info`` shows the shape; empty for a single-shape dataset (and in reports written before the key).
    samples_per_bucket: dict[str, int] = field(default_factory=dict)
    report_version: int = REPORT_VERSION

    @property
    def failed_fraction(self) -> float:
        total = self.samples_written + self.samples_failed
        return self.samples_failed / total if total else 0.0

    @property
    def exit_code(self) -> int:
        """0: every input processed (bad samples are counted, not fatal); 1: an input failed, or more
        samples failed than the config's ``max_failed_fraction`` allows; 128 + the signal's number (130
        SIGINT, 143 SIGTERM) when a signal stopped the run, as a shell reports a process it killed."""
        if self.interrupted:
            return signal_exit_code(signal.Signals[self.interrupted].value)
        too_many = self.failed_fraction > self.config.get("max_failed_fraction", 1.0)
        return EXIT_FAILED if self.inputs_failed or too_many else EXIT_OK

    def failures_by_reason(self) -> dict[str, int]:
        return count_by_category(self.failures)


def skipped_count(doc: dict[str, Any]) -> int:
    """How many inputs the run of report ``doc`` skipped: version 2 counts them, version 1 named them all."""
    count = doc.get("inputs_skipped_count")
    return int(count) if isinstance(count, int) else len(doc.get("inputs_skipped", []))


def report_dict(report: RunReport) -> dict[str, Any]:
    doc = {k: v for k, v in vars(report).items()}
    doc["failures_by_reason"] = report.failures_by_reason()
    doc["exit_code"] = report.exit_code
    return doc


def report_json(report: RunReport) -> bytes:
    """The report as UTF-8 JSON; never fails on content: a string that UTF-8 cannot hold (a lone surrogate
    from a non-UTF-8 name that reached a reason) falls back to ASCII ``\\uXXXX`` escapes, a value JSON
    has no type for to its ``str``. The report must survive whatever a run met."""
    doc = report_dict(report)
    try:
        return json.dumps(doc, indent=1, ensure_ascii=False, default=str).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(doc, indent=1, ensure_ascii=True, default=str).encode("ascii")


def run_history(place: Place) -> tuple[list[dict[str, Any]], list[str]]:
    """Every readable run report of ``directory`` (as JSON objects), oldest first, and one message per
    unreadable one."""
    root = open_root(place)
    store, directory = root.storage, root.path
    reports_dir = store.join(directory, REPORTS_DIR)
    runs, problems = [], []
    for name in sorted(store.list_dir(reports_dir)):
        if not name.endswith(".json"):
            continue
        path = store.join(reports_dir, name)
        try:
            with store.open_read(path) as f:
                doc = json.load(f)
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            problems.append(f"{path}: unreadable report ({e})")
            continue
        runs.append(doc)
    runs.sort(key=lambda r: (str(r.get("started", "")), str(r.get("run_id", ""))))
    return runs, problems


def latest_report(place: Place) -> dict[str, Any] | None:
    """The newest run report of ``directory``, or None if there is none or it cannot be read: one listing of
    ``reports/`` and a read of the reports of the newest second (a run id starts with its UTC start time to
    the second; among runs started in the same second, the greatest ``started``, written to the
    microsecond, is the newest)."""
    root = open_root(place)
    store, directory = root.storage, root.path
    reports_dir = store.join(directory, REPORTS_DIR)
    try:
        names = [name for name in store.list_dir(reports_dir) if name.endswith(".json") and not name.startswith(".")]
    except OSError:
        return None
    if not names:
        return None
    second = max(name.split("-", 1)[0] for name in names)
    newest: dict[str, Any] | None = None
    for name in sorted(name for name in names if name.split("-", 1)[0] == second):
        try:
            with store.open_read(store.join(reports_dir, name)) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and (newest is None or str(doc.get("started", "")) > str(newest.get("started", ""))):
            newest = doc
    return newest
