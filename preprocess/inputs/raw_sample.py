"""What every source of input yields: a sample's encoded image and metadata, or why a sample is unusable.

A tar (``preprocess.inputs.tar_samples``), a Parquet file (``preprocess.inputs.parquet_samples``), a folder of image
files (``preprocess.inputs.folder_samples``) and a source written through the Python API
(``preprocess.inputs.sources``) all yield these, and everything after them (decoding, the shards, the index,
the report and its failure reasons: ``preprocess.worker``) is the same code.

Beside the samples, a reader says how far it is through its input (``InputExtent``), so that progress
within one input reaches the logs: a Parquet file's rows and a folder's images are counted before the first
sample, a tar's bytes as its members are read (its sample count is known only at its end).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardio.failure_reasons import FailureCode

__all__ = ["RawSample", "SampleProblem", "InputExtent", "SAMPLES", "BYTES"]

SAMPLES, BYTES = "samples", "bytes"  # what an InputExtent counts


@dataclass
class RawSample:
    key: str
    # Where the image came from inside its input, for the metadata's ``member`` and the reasons of a failed
    # sample: a tar's member name, a Parquet file's ``row 17``, a folder's relative file path.
    image_member: str
    image: bytes
    fields: dict[str, bytes] = field(default_factory=dict)  # "txt", "cls", "json" when present


@dataclass
class SampleProblem:
    """A sample its input itself makes unusable (no image, a key seen twice, an unsafe member): its code
    (``shardio.failure_reasons``) and the reason, which names the member or row."""

    key: str
    code: FailureCode
    reason: str
    member: str = ""


@dataclass
class InputExtent:
    """How far a reader is through its input: ``total`` things of ``unit``; with ``unit`` ``SAMPLES`` each
    item yielded (sample or problem) is one (the worker counts them), with ``BYTES`` the reader moves
    ``position`` as it reads (a tar: the end of the last member read, or the compressed bytes consumed).
    A reader that cannot tell (a Python source) leaves it unset, and progress then has no fraction."""

    unit: str = ""
    total: int = 0
    position: int = 0

    def expect(self, total: int, unit: str) -> None:
        self.unit, self.total = unit, max(0, int(total))

    def fraction(self, items_seen: int) -> float | None:
        """The share of the input read (0..1), or None if the reader did not say."""
        if not self.unit or self.total <= 0:
            return None
        done = items_seen if self.unit == SAMPLES else self.position
        return min(1.0, done / self.total)

    def expected_samples(self) -> int | None:
        """The input's sample count where the reader counted it first (rows, images), else None."""
        return self.total if self.unit == SAMPLES else None
