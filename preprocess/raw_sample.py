"""What every source of input yields: a sample's encoded image and metadata, or why a sample is unusable.

A tar (``preprocess.tar_samples``), a Parquet file (``preprocess.parquet_samples``), a folder of image
files (``preprocess.folder_samples``) and a source written through the Python API
(``preprocess.sources``) all yield these, and everything after them (decoding, the shards, the index,
the report and its failure reasons: ``preprocess.worker``) is the same code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardio.failure_reasons import FailureCode

__all__ = ["RawSample", "SampleProblem"]


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
