"""Where ``DeviceLoader`` places its device work, checked on the CPU with fake streams and events
(``shardio.train.device_streams``): the prefetch thread's stream is made with the device's highest
priority; each batch's copy (and a JPEG batch's decode, behind its barrier) is queued on it and ends with an
event of the batch's own; the training loop's stream waits for that event before the batch is handed out
(no device sync), and the batch's tensors are marked used on the loop's stream."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import pytest
import torch
from dataset_fixtures import make_dataset

from shardio import DeviceLoader, ShardDataset
from shardio.read.batches import BatchAssembler
from shardio.train import loader as loader_module
from shardio.train.device_decode import DeviceDecoder
from shardio.train.device_streams import CudaStreams, highest_priority, thread_stream
from tests.train.test_device_decode import PillowDecode

IDENTITY = {"mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)}
PRIORITIES = (0, -3)  # (lowest, highest) as torch.cuda.Stream.priority_range() gives them


class Log:
    def __init__(self) -> None:
        self.entries: list[tuple[Any, ...]] = []
        self.lock = threading.Lock()

    def add(self, *entry: Any) -> None:
        with self.lock:
            self.entries.append(entry)

    def index(self, *entry: Any) -> int:
        return self.entries.index(entry)


class FakeStream:
    made = 0

    def __init__(self, log: Log, name: str, priority: int | None = None) -> None:
        self.log, self.name, self.priority = log, name, priority

    def wait_event(self, event: FakeEvent) -> None:
        self.log.add("wait", self.name, event.number)

    def synchronize(self) -> None:
        self.log.add("host sync", self.name)


class FakeEvent:
    def __init__(self, log: Log, number: int) -> None:
        self.log, self.number = log, number

    def record(self, stream: FakeStream) -> None:
        self.log.add("record", stream.name, self.number)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.log.add("event sync", self.number)


class CpuAsDevice(CudaStreams):
    """``CudaStreams`` with every torch call a fake, and the CPU's tensors taken for the device's."""

    def __init__(self, log: Log) -> None:
        self.log, self.events, self.made = log, 0, []
        consumer = FakeStream(log, "consumer")

        def new_stream(device: torch.device, priority: int) -> FakeStream:
            stream = FakeStream(log, f"producer {len(self.made)}", priority)
            self.made.append(stream)
            return stream

        @contextlib.contextmanager
        def use_stream(stream: FakeStream):
            log.add("enter", stream.name)
            try:
                yield
            finally:
                log.add("exit", stream.name)

        def new_event() -> FakeEvent:
            self.events += 1
            return FakeEvent(log, self.events)

        super().__init__("cpu", new_stream=new_stream, priorities=lambda: PRIORITIES,
                         current_stream=lambda device: consumer, use_stream=use_stream, new_event=new_event)

    def on_device(self, tensor: torch.Tensor) -> bool:
        return True

    def record_use(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        self.log.add("record_stream", stream.name, id(tensor))


@pytest.fixture(scope="module")
def raw_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = str(tmp_path_factory.mktemp("streams-raw"))
    make_dataset(directory, (40, 24), height=8, width=8)
    return directory


@pytest.fixture(scope="module")
def jpeg_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = str(tmp_path_factory.mktemp("streams-jpeg"))
    make_dataset(directory, (40, 24), encoding="jpeg", height=16, width=16)
    return directory


def test_the_loaders_stream_has_the_highest_priority_and_is_the_threads_own() -> None:
    made: list[tuple[torch.device, int]] = []

    def new_stream(device: torch.device, priority: int) -> object:
        made.append((device, priority))
        return object()

    device = torch.device("cuda:0")
    assert highest_priority(lambda: PRIORITIES) == -3 and highest_priority(lambda: (0, 0)) == 0
    first = thread_stream(device, new_stream, lambda: PRIORITIES)
    assert thread_stream(device, new_stream, lambda: PRIORITIES) is first  # one per thread and device
    other: list[object] = []
    worker = threading.Thread(target=lambda: other.append(thread_stream(device, new_stream, lambda: PRIORITIES)))
    worker.start()
    worker.join()
    assert other[0] is not first
    assert made == [(device, -3), (device, -3)]


def handed_out(loader: DeviceLoader, log: Log) -> list[dict[str, Any]]:
    got = []
    for number, batch in enumerate(loader, 1):
        log.add("handed out", number, tuple(id(value) for value in batch.values() if isinstance(value, torch.Tensor)))
        got.append(batch)
    return got


def copies_logged(monkeypatch: pytest.MonkeyPatch, log: Log) -> None:
    to_device = loader_module.to_device

    def logged(batch, device, **kwargs):
        log.add("copy", batch["cls"][0].item())
        return to_device(batch, device, **kwargs)

    monkeypatch.setattr(loader_module, "to_device", logged)


def test_each_batch_is_copied_on_the_producer_stream_behind_its_own_event(raw_dir: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    log = Log()
    streams = CpuAsDevice(log)
    copies_logged(monkeypatch, log)
    assemble = BatchAssembler.assemble

    def assembled(assembler, pieces, *args, **kwargs):
        log.add("assemble", len(log.entries))
        return assemble(assembler, pieces, *args, **kwargs)

    monkeypatch.setattr(BatchAssembler, "assemble", assembled)
    ds = ShardDataset(raw_dir, 16)
    loader = DeviceLoader(ds, "cpu", streams=streams, prefetch=2, **IDENTITY)
    got = handed_out(loader, log)
    assert len(got) == 4
    loader.passes.join_ahead()
    (producer,) = streams.made  # made once, on the prefetch thread, with the highest priority
    assert producer.priority == -3
    for number, batch in enumerate(got, 1):
        first = batch["cls"][0].item()
        copied = log.index("copy", first)
        # the copy queued on the producer stream, then this batch's event recorded on it, inside the block
        entered = max(i for i, e in enumerate(log.entries[:copied]) if e == ("enter", producer.name))
        recorded = log.index("record", producer.name, number)
        exited = min(i for i, e in enumerate(log.entries) if e == ("exit", producer.name) and i > copied)
        assert entered < copied < recorded < exited
        # the loop's stream waits for this batch's event, and marks each tensor used, before it has the batch
        handed = next(i for i, e in enumerate(log.entries) if e[:2] == ("handed out", number))
        waited = log.index("wait", "consumer", number)
        tensors = log.entries[handed][2]
        assert tensors and all(recorded < waited < log.index("record_stream", "consumer", t) < handed for t in tensors)
    assert not [e for e in log.entries if e[0] in ("host sync", "event sync")], "no host waits for a raw batch"
    # Batch k's copy is queued (its event recorded) before batch k+1 is assembled, and nothing waits in
    # between: the host assembles the next batch while the device copies this one.
    steps = [e[0] if e[0] != "record" else ("record", e[2]) for e in log.entries
             if e[0] in ("assemble", "record")]
    assert steps == ["assemble", ("record", 1), "assemble", ("record", 2), "assemble", ("record", 3),
                     "assemble", ("record", 4), "assemble", ("record", 5), "assemble", ("record", 6)]


def test_a_jpeg_batch_is_decoded_behind_a_barrier_on_the_producer_stream(jpeg_dir: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    log = Log()
    streams = CpuAsDevice(log)
    copies_logged(monkeypatch, log)
    pillow = PillowDecode()

    def decode(jpegs, device):
        log.add("decode", len(jpegs))
        return pillow(jpegs, device)

    decoder = DeviceDecoder("cpu", decode=decode, synchronize=lambda device: log.add("barrier"))
    ds = ShardDataset(jpeg_dir, 16)
    loader = DeviceLoader(ds, "cpu", streams=streams, device_decoder=decoder, **IDENTITY)
    got = handed_out(loader, log)
    assert len(got) == 4
    loader.passes.join_ahead()  # and the next epoch's first two, made at this one's end
    (producer,) = streams.made
    name = producer.name
    # The prefetch thread's own steps, in order (the loop's waits interleave with them in the log).
    steps = [e for e in log.entries if e[0] not in ("wait", "record_stream", "handed out")]
    decodes = [i for i, e in enumerate(steps) if e[0] == "decode"]
    assert len(decodes) == 4 + 2
    for number, at in enumerate(decodes, 1):
        # enter the producer stream, the barrier, the decode, leave, wait for it; then the copy, its event
        assert steps[at - 2: at + 3] == [("enter", name), ("barrier",), steps[at], ("exit", name),
                                         ("host sync", name)]
        assert steps[at + 3] == ("enter", name) and steps[at + 4][0] == "copy"
        assert steps[at + 5] == ("record", name, number) and steps[at + 6] == ("exit", name)
    for number in range(1, 5):
        assert log.index("record", name, number) < log.index("wait", "consumer", number)
