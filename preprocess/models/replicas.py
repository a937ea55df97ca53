"""Models run by Ray actors (``replicas:``): one replica per GPU of the cluster, fed by the input tasks.

A model whose spec resolves to replicas (``ModelSpec.replica_count``: ``auto`` is one per GPU of the cluster
where ``device`` is ``auto`` or ``cuda`` and the cluster has GPUs, else 0; an explicit N runs N even on the CPU)
runs in ``ModelReplica`` actors, created once per run by the job (``start_replicas``) after it has identified
the models and before any task, and killed when the run ends, however it ends. Replica ``k`` serves every
model with more than ``k`` replicas; input number ``i`` (in the order the job submits them) is sent to replica
``i mod N`` of each model, so the inputs spread over the replicas. A model with 0 replicas runs in each task
as before (``preprocess.worker``).

A task (``ReplicaFeed``, one per model and input) sends its samples, as the reader yields them, in chunks of
``CHUNK_SAMPLES`` (or ``CHUNK_BYTES``) without waiting, at most ``CHUNKS_IN_FLIGHT`` unanswered at once (the
object store holds ~64 MB per task at most; a task faster than its replica waits), then ends the input and
takes its outputs back. The replica batches the samples of every input it serves together (``ReplicaCore``:
a full batch runs as it fills, a short one only once every input begun there has ended), so batches stay full
whatever the inputs' sizes; the decode tasks never load the model nor import torch.

The actor is an asyncio one: a task waiting in ``take`` for its batch to fill holds no thread, so any number of
waiting tasks never keeps the samples that would fill it out (a threaded actor with N threads would hang once N
tasks wait). The model runs on a worker thread under one lock (the runners are not thread-safe), so the actor
keeps taking chunks meanwhile. A replica on a GPU takes ``num_gpus=1`` (Ray sets the GPU it sees, ``cuda``);
a replica on the CPU takes ``num_cpus=0``: the tasks it serves reserve the cluster's CPUs, and each would
otherwise run the model in its own slot, so the replica does their work, not more; a replica reserving a CPU
of its own could take the last slot the tasks feeding it need (the 2-node, 1-CPU test cluster would run no
task at all with 2 replicas). A replica that dies (out of memory, a node lost) fails the inputs it served;
the next run processes them again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import ray

from preprocess.models.model_config import ModelSpec
from preprocess.models.outputs import ModelOutputs
from shardio.errors import ConfigError, InputError

__all__ = ["ModelReplica", "ReplicaFeed", "ModelReplicas", "start_replicas", "replica_counts", "CHUNK_SAMPLES",
           "CHUNK_BYTES", "CHUNKS_IN_FLIGHT"]

# A chunk: at most 32 samples or 16 MB (five 1024² RGB images), whichever comes first; at most 4 chunks a task
# unanswered. Small enough that a replica gets samples from every task all the time, large enough that a
# sample's Ray call costs nothing next to its decode (~4 ms).
CHUNK_SAMPLES = 32
CHUNK_BYTES = 16 << 20
CHUNKS_IN_FLIGHT = 4
# How often the driver looks for a stop request while the replicas load their models.
WAIT_S = 0.5


def replica_counts(specs: Sequence[ModelSpec], cluster_gpus: int) -> dict[str, int]:
    """Each output's replicas on a cluster with ``cluster_gpus`` GPUs (``ModelSpec.replica_count``, 0 left out);
    ConfigError for more replicas on the GPU than the cluster has GPUs, or a GPU asked for where there is none."""
    counts = {}
    for spec in specs:
        count = spec.replica_count(cluster_gpus)
        if count and spec.device.startswith("cuda") and cluster_gpus == 0:
            raise ConfigError(f"models: {spec.name}: device {spec.device} with replicas: {count}, but the Ray "
                              "cluster has no GPU: use device: auto or cpu")
        if spec.runs_on_gpu(cluster_gpus) and count > cluster_gpus:
            raise ConfigError(f"models: {spec.name}: replicas: {count} on the GPU, but the Ray cluster has "
                              f"{cluster_gpus} GPU(s): a replica takes one")
        if count:
            counts[spec.name] = count
    return counts


class ModelReplica:
    """One replica (a Ray actor): a ``ReplicaCore`` over ``specs`` (as dicts), on the GPU Ray gives it when
    ``on_gpu``, else the CPU. A model that fails to load is answered by ``ready`` (its ConfigError)."""

    def __init__(self, specs: Sequence[dict[str, Any]], on_gpu: bool) -> None:
        import torch  # the replica's process: torch, and the models, live here only

        from preprocess.models.replica_core import ReplicaCore

        self._core: Any = None
        self._error: ConfigError | None = None
        try:
            self._core = ReplicaCore([ModelSpec(**spec) for spec in specs],
                                     torch.device("cuda" if on_gpu else "cpu"))
        except ConfigError as e:
            self._error = e
        self._changed = asyncio.Condition()

    async def ready(self) -> dict[str, dict[str, Any]] | ConfigError:
        """Each model's identity, or the ConfigError its loading raised."""
        return self._error if self._error is not None else self._core.identities

    async def begin(self, name: str, input: str) -> tuple[int, dict[str, Any]]:
        """A task's start on ``input`` for output ``name``: its attempt and the model's identity."""
        async with self._changed:
            attempt = await asyncio.to_thread(self._core.begin, name, input)
            self._changed.notify_all()
        return attempt, self._core.identities[name]

    async def add(self, name: str, input: str, attempt: int, indices: list[int], items: list[Any],
                  buckets: list[int]) -> InputError | ConfigError | None:
        async with self._changed:
            answer = await asyncio.to_thread(self._core.add, name, input, attempt, indices, items, buckets)
            self._changed.notify_all()
        return answer  # type: ignore[no-any-return]

    async def end(self, name: str, input: str, attempt: int) -> None:
        async with self._changed:
            await asyncio.to_thread(self._core.end, name, input, attempt)
            self._changed.notify_all()

    async def drop(self, input: str) -> None:
        async with self._changed:
            await asyncio.to_thread(self._core.drop, input)
            self._changed.notify_all()

    async def take(self, name: str, input: str, attempt: int) -> tuple[ModelOutputs | ConfigError | str, str | None]:
        """Once all of ``input``'s samples are through: its outputs and the output's dtype."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._core.ready(name, input, attempt))
            return self._core.take(name, input, attempt), self._core.dtype(name)


class ReplicaFeed:
    """One input's samples to one model's replica, from the input's task (the module docstring): ``add`` each
    sample, ``end`` once, then ``take`` the outputs. ``identity``: the model's, as the replica computed it."""

    def __init__(self, replica: Any, name: str, input: str) -> None:
        self.replica, self.name, self.input = replica, name, input
        self.attempt, self.identity = ray.get(replica.begin.remote(name, input))
        self.dtype: str | None = None
        self._chunk: tuple[list[int], list[Any], list[int]] = ([], [], [])
        self._chunk_bytes = 0
        self._in_flight: list[Any] = []

    def add(self, index: int, item: Any, bucket: int) -> None:
        """Queues a sample; raises the input's InputError once a batch of it failed (nothing of it will be
        stored), or the model's ConfigError."""
        indices, items, buckets = self._chunk
        indices.append(index)
        items.append(item)
        buckets.append(bucket)
        self._chunk_bytes += item.nbytes if isinstance(item, np.ndarray) else len(item)
        if len(indices) >= CHUNK_SAMPLES or self._chunk_bytes >= CHUNK_BYTES:
            self._send()

    def end(self) -> None:
        """Sends the last chunk, waits until the replica has every one, and ends the input there."""
        self._send()
        while self._in_flight:
            self._answered(self._in_flight.pop(0))
        ray.get(self.replica.end.remote(self.name, self.input, self.attempt))

    def take(self) -> ModelOutputs:
        """The input's outputs, once its samples are through the model (after ``end``)."""
        outputs, self.dtype = ray.get(self.replica.take.remote(self.name, self.input, self.attempt))
        if isinstance(outputs, ConfigError):
            raise outputs
        if not isinstance(outputs, ModelOutputs):
            raise InputError(self.input, f"models: {self.name}: another attempt of this input took its place on "
                             "the model's replica", lasting=False)
        return outputs

    def abandon(self) -> None:
        """The task stops without ending the input: the replica forgets its samples (no reply waited for; never
        raises, as the task is already failing for another reason)."""
        try:
            self.replica.drop.remote(self.input)
        except Exception:  # noqa: BLE001 - a replica gone, or Ray shutting down: nothing left to forget
            pass

    def _send(self) -> None:
        indices, items, buckets = self._chunk
        if not indices:
            return
        self._in_flight.append(self.replica.add.remote(self.name, self.input, self.attempt, indices, items, buckets))
        self._chunk, self._chunk_bytes = ([], [], []), 0
        while len(self._in_flight) > CHUNKS_IN_FLIGHT:
            self._answered(self._in_flight.pop(0))

    def _answered(self, ref: Any) -> None:
        answer = ray.get(ref)
        if isinstance(answer, (InputError, ConfigError)):
            raise answer


class ModelReplicas:
    """A run's replicas: ``actors`` (replica ``k`` serves every output with more than ``k``) and ``counts``
    (output -> its replicas)."""

    def __init__(self, actors: list[Any], counts: Mapping[str, int]) -> None:
        self.actors, self.counts = actors, dict(counts)

    def for_input(self, number: int) -> dict[str, Any]:
        """Output -> the replica input number ``number`` sends its samples to (``number mod`` its count)."""
        return {name: self.actors[number % count] for name, count in self.counts.items()}

    def drop(self, input: str, replicas: Mapping[str, Any]) -> None:
        """``input``'s task is gone for good: the replicas it fed forget its samples."""
        for actor in {id(a): a for a in replicas.values()}.values():
            actor.drop.remote(input)


@contextmanager
def start_replicas(specs: Sequence[ModelSpec], should_stop: Callable[[], bool] = lambda: False
                   ) -> Iterator[ModelReplicas | None]:
    """The replicas of ``specs`` on the connected Ray cluster, loaded (ConfigError: a model that fails to load
    there, or ``replica_counts``'), killed on exit; None when no model has replicas. Gives up waiting for them
    to load once ``should_stop()``."""
    gpus = int(ray.cluster_resources().get("GPU", 0))
    counts = replica_counts(specs, gpus)
    if not counts:
        yield None
        return
    remote = ray.remote(ModelReplica)
    actors = []
    try:
        for k in range(max(counts.values())):
            served = [spec for spec in specs if counts.get(spec.name, 0) > k]
            on_gpu = any(spec.runs_on_gpu(gpus) for spec in served)
            resources = {"num_gpus": 1, "num_cpus": 0} if on_gpu else {"num_cpus": 0}
            actors.append(remote.options(**resources, scheduling_strategy="SPREAD").remote(
                [spec.to_dict() | {"name": spec.name} for spec in served], on_gpu))
        _wait_ready(actors, should_stop)
        yield ModelReplicas(actors, counts)
    finally:
        for actor in actors:
            ray.kill(actor)


def _wait_ready(actors: list[Any], should_stop: Callable[[], bool]) -> None:
    waiting = [actor.ready.remote() for actor in actors]
    while waiting and not should_stop():
        done, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=WAIT_S)
        for answer in ray.get(done):
            if isinstance(answer, ConfigError):
                raise answer
