"""What one model replica does, without Ray: ``ReplicaCore`` holds one ``ModelRunner`` per model it serves and
feeds it the samples of every input sent to it, so batches fill across inputs.

The Ray actor around it (``preprocess.models.replicas.ModelReplica``) calls it under one lock; its rules:

- **Attempts.** An input's task calls ``begin`` first and gets an attempt number; what it sends later carries
  it. A new attempt of the same input (Ray retried the task, or the job restarted it without a stuck member)
  forgets the previous one's samples, and a late chunk of an old attempt is ignored: a dead task leaves no
  sample in a batch. ``drop`` does the same when the job sees an input's task end (``preprocess.cluster.
  ray_tasks``), so a task gone for good holds no short batch back.
- **Short batches.** A full batch runs as soon as it fills (``ModelRunner``). A model's queues' rests run only
  once every input begun on it has ended (or been dropped): until then a running task may still fill them.
  Waiting for the inputs with samples queued alone is not enough: a task sends its samples in chunks, so a queue
  often holds one input's samples while another's next chunk is on its way. 4 inputs of 250 captions, batches
  of 24, 2 CPUs, one replica: that rule made 44 calls, 4 of them short, as many as the tasks alone make; this
  one 42 or 43 (42 is the fewest possible). The wait is bounded: the job has at most 2 tasks per CPU under
  way, a new one starts only when one finishes, and a task waiting for its outputs has ended its input. Nothing
  is timed, so which samples share a batch depends only on the order begins, chunks and ends arrive.
- **Failures.** A batch that raises fails the inputs it held (``ModelOutputs.failure``, as in a task); a model
  breaking its contract (``ConfigError``) breaks the replica: every call after it answers that error, which
  the task raises as is, so the run stops as it does when the model runs in the task.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from preprocess.models.identity import model_identity
from preprocess.models.loading import load_model
from preprocess.models.model_config import IMAGE, ModelSpec
from preprocess.models.outputs import ModelOutputs
from preprocess.models.runner import ModelRunner
from shardio.errors import ConfigError, InputError

__all__ = ["ReplicaCore", "STALE"]

# What ``take`` answers an attempt that a newer one (or ``drop``) replaced: its task is gone.
STALE = "stale"


class ReplicaCore:
    """One ``ModelRunner`` per spec of ``specs`` on ``device``, fed by many inputs (the module docstring). Each
    method takes the output's name and the input; ``identities`` holds each model's identity as a root records it
    (what the task reports, computed here, where the model runs)."""

    def __init__(self, specs: Sequence[ModelSpec], device: torch.device) -> None:
        self.runners: dict[str, ModelRunner] = {}
        self.identities: dict[str, dict[str, Any]] = {}
        for spec in specs:
            model = load_model(spec)
            self.runners[spec.name] = ModelRunner(spec, model, device)
            self.identities[spec.name] = model_identity(spec, model).to_dict()
        self.broken: ConfigError | None = None
        self._attempts: dict[tuple[str, str], int] = {}  # (output, input) -> its current attempt
        self._done: dict[tuple[str, str], ModelOutputs] = {}  # ended and through the model, not taken yet
        self._open: dict[str, set[str]] = {name: set() for name in self.runners}  # output -> inputs begun, not ended

    def begin(self, name: str, input: str) -> int:
        """A new attempt of ``input`` for output ``name``: whatever an earlier one sent is forgotten."""
        key = (name, input)
        self._attempts[key] = self._attempts.get(key, 0) + 1
        self._open[name].add(input)
        self._forget(name, input)
        return self._attempts[key]

    def add(self, name: str, input: str, attempt: int, indices: Sequence[int], items: Sequence[Any],
            buckets: Sequence[int]) -> InputError | ConfigError | None:
        """A chunk of ``input``'s samples (sample ``indices[i]`` is ``items[i]`` of bucket ``buckets[i]``); full
        batches run at once. Returns the input's failure once a batch of it failed, the replica's ConfigError
        once the model broke its contract, else None."""
        if self.broken is not None:
            return self.broken
        if self._attempts.get((name, input)) != attempt:
            return None  # a replaced attempt's late chunk
        runner = self.runners[name]
        image = runner.spec.input == IMAGE
        try:
            for index, item, bucket in zip(indices, items, buckets):
                # An array from Ray's object store is read-only, and torch takes none: the sample's own copy.
                runner.add(input, index, np.array(item) if image else item, bucket)
        except ConfigError as e:
            self.broken = e
            return e
        self._collect(name)
        return runner.failure(input)

    def end(self, name: str, input: str, attempt: int) -> None:
        """No sample of ``input`` comes after this; a short batch runs if no input queued may still fill it."""
        if self.broken is None and self._attempts.get((name, input)) == attempt:
            self.runners[name].end_input(input)
            self._open[name].discard(input)
            self._flush_if_settled(name)

    def drop(self, input: str) -> None:
        """``input``'s task is gone: every attempt of it is replaced, its queued samples forgotten."""
        for name in self.runners:
            key = (name, input)
            if key in self._attempts:
                self._attempts[key] += 1
                self._open[name].discard(input)
                self._forget(name, input)

    def ready(self, name: str, input: str, attempt: int) -> bool:
        """Whether ``take`` answers now (the input is through the model, replaced, or the replica broken)."""
        return self.broken is not None or self._attempts.get((name, input)) != attempt or (name, input) in self._done

    def take(self, name: str, input: str, attempt: int) -> ModelOutputs | ConfigError | str:
        """Once ``ready``: the input's outputs (and forgets it), the replica's ConfigError, or ``STALE``."""
        if self.broken is not None:
            return self.broken
        if self._attempts.get((name, input)) != attempt:
            return STALE
        del self._attempts[(name, input)]
        return self._done.pop((name, input))

    def dtype(self, name: str) -> str | None:
        """The dtype output ``name`` is handed back in (``ModelRunner.dtype``)."""
        return self.runners[name].dtype

    def _forget(self, name: str, input: str) -> None:
        self.runners[name].discard(input)
        self._done.pop((name, input), None)
        self._flush_if_settled(name)

    def _flush_if_settled(self, name: str) -> None:
        runner = self.runners[name]
        if not self._open[name] and runner.queued_inputs():
            try:
                runner.flush()
            except ConfigError as e:
                self.broken = e
                return
        self._collect(name)

    def _collect(self, name: str) -> None:
        for input, outputs in self.runners[name].take_done().items():
            self._done[(name, input)] = outputs
