"""Running one model over samples in full batches: ``ModelRunner``.

Samples come one at a time, as the job makes them: ``add(input, index, item, bucket)`` with an image model's
pixels (uint8 [h, w, 3], what the reader yields a row of) or a text model's caption (a str). They wait in one
queue per bucket (image models: a batch is one shape, stacked to uint8 [B, h, w, 3]) or in one queue (text
models: a batch is a list of B captions), shared by every input, so a batch is full whatever the inputs'
sizes: ``batch_size`` samples make a call at once; ``finish`` calls the model on what is left, one short batch
a queue. Each call runs under ``torch.inference_mode()`` on the spec's device.

What a model returns is checked: a tensor [B, ...] with B the batch's samples, one per-sample shape per bucket
(the first batch fixes it; text models: one for the whole output), one dtype (``dtype:`` when configured: a
floating output is cast to it, any other must be it; else the first batch's). A model that breaks this
contract is a ConfigError naming the output (and the bucket and both shapes, or both dtypes): it stops the run,
as the same model would break it again. A model that raises on a batch fails the inputs that batch held: each
gets an InputError naming the output and every input of the batch (``ModelOutputs.failure``; not ``lasting``:
the model, not the bytes, may be at fault, e.g. out of memory), its samples still queued are dropped, and the
run goes on with the other inputs.

Outputs come back per input, as numpy arrays on the CPU, in the order the input's samples were added
(``ModelOutputs``): an input is handed back by ``take_done`` once ``end_input`` was called for it and all its
samples have been through the model, and by ``finish`` at the end. A bfloat16 output (numpy has none) is
handed back as its raw bits, ``uint16``, as a file stores it.

A runner serving many inputs at once (a replica, ``preprocess.models.replicas``) decides itself when a short
batch runs (``preprocess.models.replica_core``): ``queued_inputs`` says whether a sample waits, ``flush`` runs
the queues' rests, ``discard`` forgets an input whose task is gone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from shardio.errors import ConfigError, InputError
from preprocess.models.identity import torch_module_of
from preprocess.models.model_config import DTYPES, IMAGE, ModelSpec
from preprocess.models.outputs import ModelOutputs

__all__ = ["ModelRunner", "ModelOutputs", "resolve_device"]


def resolve_device(spec: ModelSpec) -> torch.device:
    """The device ``spec.device`` names here: ``auto`` is the first GPU when there is one, else the CPU."""
    if spec.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec.device)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ConfigError(f"models: {spec.name}: device {spec.device} asked for, but this machine has "
                              f"{count} CUDA device(s)")
    return device


@dataclass
class _Sample:
    input: str
    index: int
    bucket: int
    item: Any  # torch.Tensor [h, w, 3] uint8, or str


@dataclass
class _Input:
    order: list[int] = field(default_factory=list)  # sample indices, as added
    buckets: dict[int, int] = field(default_factory=dict)  # index -> bucket
    values: dict[int, np.ndarray] = field(default_factory=dict)  # index -> output
    pending: int = 0
    ended: bool = False
    failure: InputError | None = None


class ModelRunner:
    """Runs ``model`` (made by ``spec.fn``) over the samples added, in batches of ``spec.batch_size`` (the
    module docstring). A torch module the model is or holds (``preprocess.models.identity.torch_module_of``) is
    moved to the device and set to eval mode (dropout off: the same pixels give the same output)."""

    def __init__(self, spec: ModelSpec, model: Callable[..., Any], device: torch.device | None = None) -> None:
        self.spec, self.model = spec, model
        self.device = resolve_device(spec) if device is None else device
        self.target_dtype = None if spec.dtype is None else getattr(torch, spec.dtype)
        module = torch_module_of(model)
        if module is not None:
            module.to(self.device).eval()
        self._where = f"models: {spec.name}"
        self._queues: dict[int | None, list[_Sample]] = {}
        self._pixel_shapes: dict[int, tuple[int, ...]] = {}  # bucket -> (h, w, 3)
        self._output_shapes: dict[int | None, tuple[int, ...]] = {}  # bucket (None: text) -> per-sample shape
        self._dtype: torch.dtype | None = self.target_dtype
        self._inputs: dict[str, _Input] = {}
        self.batches = 0  # model calls made: full ones while adding, short ones at the end

    def add(self, input: str, index: int, item: Any, bucket: int = 0) -> None:
        """Queue sample ``index`` of ``input``: uint8 pixels [h, w, 3] (a tensor or an array) of ``bucket`` for
        an image model, a caption for a text model; a full queue runs the model at once."""
        state = self._inputs.setdefault(input, _Input())
        if state.ended:
            raise ValueError(f"{input}: sample {index} added after end_input")
        if index in state.buckets:
            raise ValueError(f"{input}: sample {index} added twice")
        item = self._checked_item(item, bucket)
        state.order.append(index)
        state.buckets[index] = bucket
        if state.failure is not None:
            return  # a batch of this input failed: nothing of it will be stored
        key = bucket if self.spec.input == IMAGE else None
        queue = self._queues.setdefault(key, [])
        queue.append(_Sample(input, index, bucket, item))
        state.pending += 1
        if len(queue) >= self.spec.batch_size:
            self._queues[key] = []
            self._run(key, queue)

    def end_input(self, input: str) -> None:
        """No sample of ``input`` comes after this: it is handed back once its samples are through."""
        self._inputs.setdefault(input, _Input()).ended = True

    @property
    def dtype(self) -> str | None:
        """The torch dtype's name the outputs are handed back in (``dtype:``, else the first batch's; None before
        any batch without ``dtype:``)."""
        return None if self._dtype is None else _name(self._dtype)

    def failure(self, input: str) -> InputError | None:
        """The InputError of ``input`` once a batch holding one of its samples failed (None otherwise): its caller
        may stop feeding it, as nothing of it will be stored."""
        state = self._inputs.get(input)
        return None if state is None else state.failure

    def take_done(self) -> dict[str, ModelOutputs]:
        """The inputs ended and wholly through the model (or failed) since the last call, and forgets them."""
        done = [name for name, state in self._inputs.items() if state.ended and state.pending == 0]
        return {name: self._hand_back(name) for name in done}

    def finish(self) -> dict[str, ModelOutputs]:
        """Runs the model on every queue's rest (``flush``) and hands back every input not handed back yet, ended
        or not."""
        self.flush()
        return {name: self._hand_back(name) for name in list(self._inputs)}

    def flush(self) -> None:
        """Runs the model on every queue's rest: one short batch a queue, buckets in order."""
        for key in sorted(self._queues, key=lambda k: -1 if k is None else k):
            queue, self._queues[key] = self._queues[key], []
            for start in range(0, len(queue), self.spec.batch_size):  # a full batch is run as it fills
                self._run(key, queue[start:start + self.spec.batch_size])

    def queued_inputs(self) -> set[str]:
        """The inputs with a sample waiting in a queue for its batch to fill."""
        return {sample.input for queue in self._queues.values() for sample in queue}

    def discard(self, input: str) -> None:
        """Forgets ``input``: its queued samples are dropped and nothing of it is handed back (its task is gone;
        another attempt of it may start afresh)."""
        if self._inputs.pop(input, None) is not None:
            for key, queue in self._queues.items():
                self._queues[key] = [s for s in queue if s.input != input]

    def _hand_back(self, name: str) -> ModelOutputs:
        state = self._inputs.pop(name)
        done = [index for index in state.order if index in state.values]
        return ModelOutputs(name, done, [state.buckets[i] for i in done], [state.values[i] for i in done],
                            state.failure)

    def _checked_item(self, item: Any, bucket: int) -> Any:
        if self.spec.input != IMAGE:
            if not isinstance(item, str):
                raise ValueError(f"{self._where}: a text model takes captions (str), got {type(item).__name__}")
            return item
        pixels = torch.from_numpy(item) if isinstance(item, np.ndarray) else item
        if not isinstance(pixels, torch.Tensor) or pixels.dtype != torch.uint8 or pixels.ndim != 3 \
                or pixels.shape[2] != 3:
            raise ValueError(f"{self._where}: an image model takes uint8 pixels [h, w, 3], got "
                             f"{getattr(pixels, 'dtype', type(pixels).__name__)} {list(getattr(pixels, 'shape', []))}")
        shape = self._pixel_shapes.setdefault(bucket, tuple(pixels.shape))
        if tuple(pixels.shape) != shape:
            raise ValueError(f"{self._where}: bucket {bucket} holds pixels of {list(shape)}, got {list(pixels.shape)}")
        return pixels

    def _run(self, key: int | None, batch: list[_Sample]) -> None:
        batch = [s for s in batch if self._inputs[s.input].failure is None]
        if not batch:
            return
        if self.spec.input == IMAGE:
            model_input: Any = torch.stack([s.item for s in batch]).to(self.device)
        else:
            model_input = [s.item for s in batch]
        self.batches += 1
        try:
            with torch.inference_mode():
                output = self.model(model_input)
        except Exception as e:
            self._fail(batch, e)
            return
        values = self._checked_output(output, len(batch), key)
        for sample, value in zip(batch, values):
            state = self._inputs[sample.input]
            state.values[sample.index] = value
            state.pending -= 1

    def _fail(self, batch: list[_Sample], error: Exception) -> None:
        inputs = sorted({s.input for s in batch})
        reason = (f"model output {self.spec.name!r} ({self.spec.fn}) raised {type(error).__name__}: {error} on a "
                  f"batch of {len(batch)} samples of the inputs {', '.join(inputs)}")
        for name in inputs:
            failure = InputError(name, reason, lasting=False)
            failure.__cause__ = error
            self._inputs[name].failure = failure
        # Their samples in this batch and in every queue are through: nothing of these inputs will be stored.
        for state in (self._inputs[name] for name in inputs):
            state.pending = 0
        for key, queue in self._queues.items():
            self._queues[key] = [s for s in queue if s.input not in inputs]

    def _checked_output(self, output: Any, count: int, key: int | None) -> np.ndarray:
        where = self._where if key is None else f"{self._where}: bucket {key}"
        if not isinstance(output, torch.Tensor):
            raise ConfigError(f"{where}: the model returned {type(output).__name__}, not a tensor [B, ...]")
        if output.ndim < 1 or output.shape[0] != count:
            raise ConfigError(f"{where}: the model returned {list(output.shape)} for a batch of {count} samples: "
                              f"the first dimension must be {count}")
        if self.target_dtype is not None and output.dtype != self.target_dtype:
            if not (output.dtype.is_floating_point and self.target_dtype.is_floating_point):
                raise ConfigError(f"{where}: the model returned {_name(output.dtype)}, dtype is "
                                  f"{_name(self.target_dtype)} (only a floating output is cast to a floating dtype)")
            output = output.to(self.target_dtype)
        if _name(output.dtype) not in DTYPES:
            raise ConfigError(f"{where}: the model returned {_name(output.dtype)}, which no output stores (the "
                              f"dtypes: {', '.join(DTYPES)}): set dtype: to cast a floating output to one")
        if self._dtype is None:
            self._dtype = output.dtype
        elif output.dtype != self._dtype:
            raise ConfigError(f"{where}: the model returned {_name(output.dtype)}, its first batch "
                              f"{_name(self._dtype)}: an output has one dtype (set dtype: to cast to one)")
        shape = tuple(output.shape[1:])
        first = self._output_shapes.setdefault(key, shape)
        if shape != first:
            raise ConfigError(f"{where}: the model returned samples of {list(shape)}, its first batch "
                              f"{list(first)}: an output has one shape per bucket")
        on_cpu = output.device.type == "cpu"
        output = output.detach().to("cpu").contiguous()
        if output.dtype == torch.bfloat16:
            values = output.view(torch.int16).numpy().view(np.uint16)
        else:
            values = output.numpy()
        # A model may return a view of its own buffers, reused by its next call: keep a copy of our own (the
        # copy from a GPU is one already).
        return values.copy() if on_cpu else values


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
