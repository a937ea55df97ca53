"""One input (a tar, a Parquet file, ...) -> its committed shard files: the unit of work a Ray task runs.

Pure Python, no Ray: the job wraps it in a task, ``diagnose`` and the tests call it directly. Image bytes
and pixels never leave the worker: it returns only the shard entries and per-sample failures (and the
library versions it ran with, which the manifest records). Memory is one image plus the tar member being
read (the shard writer streams to disk); a tar in a bucket adds the chunks being downloaded (at most two of
8 MB: ``preprocess.inputs.remote_tar``), never the whole tar.

With ``models:`` (``preprocess.models``) each model is given every sample as the reader would yield it (the
stored pixels, decoded back for ``encoding: jpeg`` and ``yuv420``; a text model the caption): a model with
replicas in its replica (``preprocess.models.replicas.ReplicaFeed``, given by the task), any other here, in
the task. Each shard gets one output file per model (``shardio.write.shard_writer.OutputFileWriter``) once the
input's samples are through: an input's outputs are held until then (a latent is a small fraction of its
pixels). A model raising on a batch fails its input, which leaves no file, like any other failed input.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Collection, Generator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple


from preprocess.config import JobConfig
from preprocess.image.decode_watch import (Heartbeat, hang_if_test_member, hang_pattern_for_tests, hard_bound_s,
                                           stuck_reason)
from preprocess.inputs.resolve import InputFingerprint
from preprocess.models.input_models import InputModels, ModelFeed
from preprocess.image.jpeg_encode import stored_pixels
from preprocess.inputs.kinds import SampleReader, samples_of, strip_kind_suffix
from preprocess.inputs.raw_sample import InputExtent, RawSample, SampleProblem
from preprocess.image.resize_modes import resize_mode
from preprocess.image.transform import process_image
from preprocess.image.versions import library_versions
from shardio.errors import InputError, SampleError
from shardio.failure_reasons import FailureCode
from shardio.format import ShardEntry
from shardio.write.shard_writer import InputShardWriter
from shardio.store.root import Place, open_input

__all__ = ["InputResult", "InputProgress", "shard_stem", "process_input", "iter_process_input",
           "parse_fields", "PROGRESS_EVERY"]

# Samples between progress reports from a worker: often enough for a live images/s, rare enough to cost
# nothing (one small message per ~0.1 s of decode at ~4 ms per image).
PROGRESS_EVERY = 32


class InputProgress(NamedTuple):
    """How far one input is: samples written and failed so far, the share of the input read (0..1) and
    its sample count, each where its reader can tell (``preprocess.inputs.raw_sample.InputExtent``), else None."""

    done: int
    failed: int
    fraction: float | None = None
    expected: int | None = None


@dataclass
class InputResult:
    input: str
    size: int
    mtime_ns: int
    samples: int = 0
    shards: list[dict[str, Any]] = field(default_factory=list)  # ShardEntry as dicts (plain data for Ray)
    failures: list[dict[str, str]] = field(default_factory=list)  # {input, key, code, reason} (run report's)
    upscaled: int = 0  # samples written whose kept region was smaller than the target (pixels invented)
    error: str | None = None  # the input itself could not be processed
    elapsed_s: float = 0.0
    node: str = ""
    versions: dict[str, Any] = field(default_factory=dict)  # library_versions() of the worker that ran it
    etag: str = ""  # an object-storage input's ETag (from the LIST that found it)
    # ``error`` is the input's bytes' own (InputError.lasting): the same bytes fail again; a rerun
    # remembers it by the input's fingerprint instead of reading it again (preprocess.job).
    lasting: bool = False
    samples_lost: int = 0  # samples decoded before the input failed, not kept (all or nothing per input)
    # One per output of ``models:``, in the config's order: {"name", "input", "identity" (of the model that ran here),
    # "dtype": the torch dtype's name (None: no sample), "shapes": [[bucket, per-sample shape], ...]} for the
    # buckets the input's samples reached.
    outputs: list[dict[str, Any]] = field(default_factory=list)


def shard_stem(source: Place, size: int, mtime_ns: int, etag: str = "", name_fence: str = "") -> str:
    """``{tar name}-{fingerprint}``: deterministic for the same input, new when the input changes, so a
    changed input's new shards never overwrite the ones the current manifest still lists. The fingerprint
    hashes (path, size, mtime_ns) of a local file, (URL, size, ETag) of an object: an object re-uploaded
    with the same bytes gets a new LastModified but keeps its ETag, and its shards. ``-{name_fence}``
    follows where the dataset has one (``shardio.format.spec``, "Fencing names"). ``source``: the input as the
    task opened it, or its path."""
    opened = open_input(source)
    input_path = opened.path
    base = strip_kind_suffix(os.path.basename(input_path.rstrip("/")))  # a prefix's name ends in "/"
    # A source's input (preprocess.inputs.sources) is a name with a version (held as its ETag), never a file.
    stamp = etag if etag or not opened.is_local else mtime_ns
    fingerprint = hashlib.sha1(f"{input_path}\0{size}\0{stamp}".encode()).hexdigest()[:10]
    return f"{base}-{fingerprint}" + (f"-{name_fence}" if name_fence else "")


def parse_fields(fields: dict[str, bytes]) -> dict[str, Any]:
    """The carried metadata (.txt, .cls, .json) as JSON values; raises SampleError if one is malformed.

    .txt is UTF-8 (undecodable bytes become U+FFFD). .cls is a decimal integer 0..2**63-1: the reader
    keeps labels in an int64 column with -1 for "no label". .json is one strict JSON object: no NaN or
    Infinity, no lone surrogate (the UTF-8 metadata file cannot hold one), and nesting too deep for the
    parser is malformed too, never an error that would abort the whole input.
    """
    out: dict[str, Any] = {"txt": None, "cls": None, "json": None}
    if "txt" in fields:
        out["txt"] = fields["txt"].decode("utf-8", errors="replace")
    if "cls" in fields:
        text = fields["cls"].decode("utf-8-sig", errors="replace").strip()
        # At most 19 digits: int64's largest is 9223372036854775807 (and int() refuses > 4300 digits).
        if not _CLS_DIGITS.fullmatch(text) or int(text) > _INT64_MAX:
            raise SampleError(FailureCode.BAD_CLS, f".cls is not an integer in 0..2**63-1: {text[:40]!r}")
        out["cls"] = int(text)
    if "json" in fields:
        try:
            value = json.loads(fields["json"], parse_constant=_reject_constant)
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeError are ValueErrors
            raise SampleError(FailureCode.BAD_JSON, f".json is not valid JSON ({str(e)[:200]})") from None
        if not isinstance(value, dict):
            raise SampleError(FailureCode.JSON_NOT_OBJECT,
                              f".json is not a JSON object but a {type(value).__name__}")
        out["json"] = value
    return out


_CLS_DIGITS = re.compile(r"[0-9]{1,19}")
_INT64_MAX = 2**63 - 1


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def process_input(input_path: str, output_dir: Place, cfg: JobConfig,
                  fingerprint: InputFingerprint | tuple[int, int], skip_members: Collection[str] = (),
                  reader: SampleReader | None = None, name_fence: str = "",
                  model_feeds: Mapping[str, ModelFeed] | None = None) -> InputResult:
    """Decode every sample of ``input_path`` into shards under ``output_dir`` (the output's root, opened by the
    job and sent as its path, or a path); never raises for bad data.
    (Unwatched: ``iter_process_input`` says how the Ray task bounds each decode.)"""
    steps = iter_process_input(input_path, output_dir, cfg, fingerprint, skip_members, reader=reader,
                               name_fence=name_fence, model_feeds=model_feeds)
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def iter_process_input(
    input_path: str, output_dir: Place, cfg: JobConfig, fingerprint: InputFingerprint | tuple[int, int],
    skip_members: Collection[str] = (), heartbeat: Heartbeat | None = None, reader: SampleReader | None = None,
    name_fence: str = "", model_feeds: Mapping[str, ModelFeed] | None = None,
) -> Generator[InputProgress, None, InputResult]:
    """``process_input`` as a generator: yields an ``InputProgress`` every ``PROGRESS_EVERY`` samples and
    returns the ``InputResult``; the Ray task streams these to the driver (its progress bar and log).

    All or nothing per input: if the tar itself turns out unreadable (truncated, not a tar), the shards
    already written for it are removed and ``error`` says why, so a rerun retries the whole input.

    ``heartbeat`` is stamped around each decode (``preprocess.image.decode_watch`` ends a decode that never
    returns); image members in ``skip_members`` (ones whose decode got stuck in an earlier attempt) are
    not decoded but recorded as failed samples, so the input still commits and a rerun skips it.
    ``reader``: the input's samples from a source written in Python (``preprocess.inputs.sources``); by default
    the reader of the input's kind (``preprocess.inputs.kinds.samples_of``). ``name_fence``: what the shards'
    names carry (``shard_stem``). ``model_feeds``: output name -> where its model runs for this input, for the
    models with replicas (``preprocess.models.replicas.ReplicaFeed``); the others run here.
    """
    started = time.perf_counter()
    size, mtime_ns, etag = InputFingerprint(*fingerprint)
    result = InputResult(input=input_path, size=size, mtime_ns=mtime_ns, node=os.uname().nodename,
                         versions=library_versions(), etag=etag)
    # One open shard a shape (mode: bucket has several), each sample routed to its bucket's
    # (shardio.write.shard_writer).
    # The input opened once in this task: its backend serves the stem's fingerprint and the reader.
    source = open_input(input_path)
    writer = InputShardWriter(
        output_dir, shard_stem(source, size, mtime_ns, etag, name_fence), cfg.height, cfg.width,
        cfg.samples_per_shard, cfg.encoding, buckets=cfg.shapes,
    )
    done = failed = 0
    extent = InputExtent()  # a kind's reader says how far it is; a Python source's leaves it unset
    heartbeat = heartbeat or Heartbeat()
    # models: (preprocess.models): loaded once per process, run over each sample as the reader yields it.
    models = InputModels(cfg, input_path, model_feeds or {}) if cfg.model_specs else None
    bound_s = hard_bound_s(cfg.max_decode_seconds)
    hang_pattern = hang_pattern_for_tests()
    try:
        # The reader of the input's kind (preprocess.inputs.kinds): a tar, a Parquet file, ...
        items = (reader or samples_of)(source, cfg, size, etag, extent)
        for item in items:
            if isinstance(item, SampleProblem):
                result.failures.append({"input": input_path, "key": item.key, "code": item.code.value,
                                        "reason": item.reason})
                failed += 1
            elif item.image_member in skip_members:
                result.failures.append({"input": input_path, "key": item.key,
                                        "code": FailureCode.DECODE_STUCK.value,
                                        "reason": stuck_reason(item.image_member, bound_s)})
                failed += 1
            else:
                heartbeat.begin(item.key, item.image_member)
                hang_if_test_member(item.image_member, hang_pattern)
                meta = _decode(item, input_path, cfg, result)
                heartbeat.end()
                if meta is None:
                    failed += 1
                else:
                    pixels, bucket = meta.pop("__pixels__"), meta.pop("__bucket__")
                    shard = writer.add(pixels, meta, input_path, bucket)
                    done += 1
                    if models is not None:
                        models.add(done - 1, pixels, meta["txt"], bucket, shard)
            if (done + failed) % PROGRESS_EVERY == 0:
                yield InputProgress(done, failed, extent.fraction(done + failed), extent.expected_samples())
        entries: list[ShardEntry] = writer.close(input_path)
        if models is not None:
            entries = writer.add_outputs(models.finish())
            result.outputs = models.summary()
    except InputError as e:
        writer.abort()
        if models is not None:
            models.abandon()
        result.error = e.reason
        result.lasting = e.lasting
        result.samples_lost = done
        if done:
            result.error += (f"; the {done} sample(s) decoded before it were not kept: an input is committed "
                             "whole or not at all")
        result.failures = []
        result.elapsed_s = time.perf_counter() - started
        return result
    except BaseException:
        writer.abort()
        if models is not None:
            models.abandon()
        raise
    result.samples = done
    result.shards = [asdict(e) for e in entries]
    result.elapsed_s = time.perf_counter() - started
    return result


def _decode(sample: RawSample, input_path: str, cfg: JobConfig, result: InputResult) -> dict[str, Any] | None:
    try:
        fields = parse_fields(sample.fields)
        image = process_image(sample.image, cfg)
    except SampleError as e:
        result.failures.append({"input": input_path, "key": sample.key, "code": e.code.value,
                                "reason": f"{sample.image_member}: {e}"})
        return None
    result.upscaled += image.upscaled
    meta = {
        # encoding: jpeg: each image encoded once, here, from exactly the pixels a raw dataset would store.
        "__pixels__": stored_pixels(image.pixels, cfg),
        "__bucket__": image.bucket,  # 0 but in mode: bucket
        "key": sample.key,
        "tar": input_path,
        "member": sample.image_member,
        "width": image.width,
        "height": image.height,
        **fields,
    }
    if image.content_box is not None:  # mode: pad only; other modes' lines stay byte-identical
        meta["box"] = list(image.content_box)
    if resize_mode(cfg.mode).writes_crop:  # center_crop, bucket: what the crop cut (shardio.format, "Metadata")
        meta["crop"] = list(image.crop_top_left)
    return meta
