"""One input's samples through the job's ``models:`` (``InputModels``), each model where it runs: in the task
(``LocalModel``: ``replicas: 0``) or in a replica (``preprocess.models.replicas``), both behind ``ModelFeed``.
The task body (``preprocess.worker``) hands each sample over as it stores it and gathers the outputs per shard."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from preprocess.config import JobConfig
from preprocess.models.loading import load_model
from preprocess.models.model_config import ModelSpec
from preprocess.models.outputs import ModelOutputs
from shardio.format import JPEG, YUV420
from shardio.format.yuv_shard import yuv420_to_rgb
from shardio.read.jpeg_pixels import EncodedImages

__all__ = ["InputModels", "LocalModel", "ModelFeed"]

_IDENTITIES: dict[str, dict[str, Any]] = {}  # a model's fn -> its identity, in this process


class ModelFeed(Protocol):
    """Where one model runs over one input's samples: ``add`` each sample (raising the input's InputError once a
    batch of it failed, or the model's ConfigError), ``end`` once, then ``take`` its outputs; ``abandon`` when the
    input stops unfinished. ``identity``: the model's, where it runs; ``dtype``: its outputs' (after ``take``)."""

    @property
    def identity(self) -> dict[str, Any]: ...
    @property
    def dtype(self) -> str | None: ...

    def add(self, index: int, item: Any, bucket: int) -> None: ...
    def end(self) -> None: ...
    def take(self) -> ModelOutputs: ...
    def abandon(self) -> None: ...


class LocalModel:
    """A model run here, in the task (``replicas: 0``): a ``ModelRunner`` of its own (on the device its spec
    names) as a ``ModelFeed``. Torch is imported only here, so a task without such a model never loads it."""

    def __init__(self, spec: ModelSpec, input_path: str) -> None:
        from preprocess.models.identity import model_identity  # torch: a task running a model only
        from preprocess.models.runner import ModelRunner

        self.input = input_path
        self.runner = ModelRunner(spec, load_model(spec))
        # Digested once per process (a model is loaded once per process too): the driver refuses an input
        # processed with another model than the one it identified (another node's copy).
        if spec.fn not in _IDENTITIES:
            _IDENTITIES[spec.fn] = model_identity(spec, load_model(spec)).to_dict()
        self.identity = _IDENTITIES[spec.fn]

    @property
    def dtype(self) -> str | None:
        return self.runner.dtype

    def add(self, index: int, item: Any, bucket: int) -> None:
        self.runner.add(self.input, index, item, bucket)
        failure = self.runner.failure(self.input)
        if failure is not None:  # nothing of the input will be stored: stop reading it
            raise failure

    def end(self) -> None:
        self.runner.end_input(self.input)

    def take(self) -> ModelOutputs:
        return self.runner.finish().get(self.input) or ModelOutputs(self.input)

    def abandon(self) -> None:
        pass


class InputModels:
    """The ``models:`` of ``cfg`` over one input's samples, each where it runs (``model_feeds`` for a model with
    replicas, else ``LocalModel``): each sample given as the reader yields it (an image model: its stored pixels,
    uint8 [h, w, 3] of its bucket, decoded back from the stored JPEG or yuv420 planes for those encodings; a text
    model: its caption, "" without one), and its outputs gathered per shard at the end."""

    def __init__(self, cfg: JobConfig, input_path: str, model_feeds: Mapping[str, ModelFeed]) -> None:
        self.cfg, self.input = cfg, input_path
        self.models: list[tuple[ModelSpec, ModelFeed]] = [
            (spec, model_feeds[spec.name] if spec.name in model_feeds else LocalModel(spec, input_path))
            for spec in cfg.model_specs]
        self.identities = {spec.name: model.identity for spec, model in self.models}
        self.rows: dict[str, list[int]] = {}  # a shard's pixel file -> the indices of its samples, in order
        self.shapes: dict[str, dict[int, list[int]]] = {spec.name: {} for spec in cfg.model_specs}
        self.dtypes: dict[str, str | None] = {}  # an output's torch dtype, once a sample of this input has one

    def add(self, index: int, stored: np.ndarray | bytes, caption: str | None, bucket: int, shard: str) -> None:
        self.rows.setdefault(shard, []).append(index)
        pixels = None
        for spec, model in self.models:
            if spec.input == "text":
                model.add(index, caption or "", bucket)
            else:
                if pixels is None:
                    pixels = self._pixels(stored, bucket)
                model.add(index, pixels, bucket)

    def _pixels(self, stored: np.ndarray | bytes, bucket: int) -> np.ndarray:
        """What the reader yields for a sample stored as ``stored``."""
        height, width = self.cfg.shapes[bucket]
        if self.cfg.encoding == JPEG:
            return EncodedImages([stored], height, width, [(self.input, 0, 1)]).decode()[0]
        if self.cfg.encoding == YUV420:
            return yuv420_to_rgb(np.asarray(stored), height, width)
        pixels = np.asarray(stored)
        return pixels if pixels.flags.writeable else pixels.copy()  # torch takes no read-only array

    def finish(self) -> dict[str, list[tuple[str, np.ndarray]]]:
        """Every model run over the rest of its samples: each shard's (name, values) in the config's order;
        the input's InputError when a model raised on a batch of it."""
        for _, model in self.models:  # every model ended before any is waited for: no replica waits on another
            model.end()
        values: list[dict[int, np.ndarray]] = []
        for spec, model in self.models:
            done = model.take()
            if done.failure is not None:
                raise done.failure
            by_index = dict(zip(done.indices, done.values))
            for index, bucket in zip(done.indices, done.buckets):
                self.shapes[spec.name].setdefault(bucket, list(by_index[index].shape))
            if done.values:
                self.dtypes[spec.name] = model.dtype
            values.append(by_index)
        return {shard: [(spec.name, np.stack([found[i] for i in rows]))
                        for (spec, _), found in zip(self.models, values)]
                for shard, rows in self.rows.items()}

    def abandon(self) -> None:
        """The input stops unfinished: its samples are forgotten where its models run."""
        for _, model in self.models:
            model.abandon()

    def summary(self) -> list[dict[str, Any]]:
        """``InputResult.outputs``: each output's dtype and the shapes of the buckets its samples reached."""
        return [{"name": spec.name, "input": spec.input, "identity": self.identities[spec.name],
                 "dtype": self.dtypes.get(spec.name),
                 "shapes": [[bucket, shape] for bucket, shape in sorted(self.shapes[spec.name].items())]}
                for spec in self.cfg.model_specs]
