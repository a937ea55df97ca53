"""to_device / DeviceLoader: normalised float NCHW on the device (CPU here; CUDA when present); batches of varying
shape (a bucketed dataset's) staged in a pinned pool per shape, the pools' bookkeeping and the CUDA path's staging
checked here with plain buffers and stand-in events and streams; a mid-epoch resume through the prefetching
loader in either layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dataset_fixtures import indices, make_dataset
from layout_fixtures import Layout, LayoutDataset, batch_bucket
from varying_batches import SHAPES, FakeEvent, jpeg_batch, mixed_batches, plain_pools

from shardio import DeviceLoader, ShardDataset, ShardLoader, to_device
from shardio.read.jpeg_pixels import EncodedImages

DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.cuda)] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = str(tmp_path_factory.mktemp("device"))
    make_dataset(directory)
    return directory


@pytest.mark.parametrize("device", DEVICES)
def test_to_device_normalises_to_nchw(dataset_dir: str, device: str) -> None:
    batch = next(iter(ShardDataset(dataset_dir, 10)))
    out = to_device(batch, device, mean=(10.0, 20.0, 30.0), std=(2.0, 4.0, 8.0))
    image = out["image"]
    assert image.shape == (10, 3, 8, 8) and image.dtype == torch.float32 and image.device.type == device
    assert image.is_contiguous(memory_format=torch.channels_last)
    nchw = batch["image"].permute(0, 3, 1, 2).float()
    mean = torch.tensor([10.0, 20.0, 30.0]).view(1, 3, 1, 1)
    std = torch.tensor([2.0, 4.0, 8.0]).view(1, 3, 1, 1)
    expected = (nchw - mean) / std
    torch.testing.assert_close(image.cpu(), expected)
    assert out["cls"].device.type == device and out["__key__"] == batch["__key__"]


@pytest.mark.parametrize("device", DEVICES)
def test_device_loader_yields_every_batch_in_order(dataset_dir: str, device: str) -> None:
    ds = ShardDataset(dataset_dir, 10, shuffle=True)
    expected = [indices(b).tolist() for b in ds]
    ds.set_epoch(0)  # each iteration is the next epoch: this one repeats epoch 0
    loader = DeviceLoader(ShardLoader(ds, pin_memory=device == "cuda"), device)
    got = [b["cls"].cpu().tolist() for b in loader]
    assert got == expected and len(loader) == len(expected)
    assert loader.state_dict()["batches_seen"] == len(expected)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_device_loader_state_after_early_stop(dataset_dir: str, prefetch: int) -> None:
    """Prefetched batches are not counted: resuming from the state continues after the last one yielded."""
    expected = [indices(b).tolist() for b in ShardDataset(dataset_dir, 10, shuffle=True)]
    for wrap in (ShardLoader, lambda ds: ds):
        source = wrap(ShardDataset(dataset_dir, 10, shuffle=True))
        loader = DeviceLoader(source, "cpu", prefetch=prefetch)
        head = []
        for batch in loader:
            head.append(batch["cls"].tolist())
            if len(head) == 3:
                break
        state = loader.state_dict()
        assert state["batches_seen"] == 3
        again = ShardDataset(dataset_dir, 10, shuffle=True)
        resumed = DeviceLoader(ShardLoader(again), "cpu", prefetch=prefetch)
        resumed.load_state_dict(state)
        assert head + [b["cls"].tolist() for b in resumed] == expected


def test_device_loader_raises_the_loaders_error(dataset_dir: str) -> None:
    class Broken:
        def __iter__(self):
            yield next(iter(ShardDataset(dataset_dir, 10)))
            raise RuntimeError("disk on fire")

    batches = iter(DeviceLoader(Broken(), "cpu"))
    next(batches)
    with pytest.raises(RuntimeError, match="disk on fire"):
        next(batches)


def test_pin_memory_needs_cuda_or_pins(dataset_dir: str) -> None:
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            ShardDataset(dataset_dir, 10, pin_memory=True)
        return
    for shuffle in (False, True):
        ds = ShardDataset(dataset_dir, 10, shuffle=shuffle, pin_memory=True)
        batches = list(ds)
        assert all(b["image"].is_pinned() for b in batches)
        assert (np.concatenate([indices(b) for b in batches]) == ds.sample_order(0)).all()
        pinned = batches[0]["image"]
        assert pinned.pin_memory().data_ptr() == pinned.data_ptr()  # DataLoader's pinning copies nothing


def _identity_transform(image: torch.Tensor, *, epoch: int, positions: torch.Tensor,
                        content_box: torch.Tensor | None = None) -> torch.Tensor:
    return image.permute(0, 3, 1, 2).float()


@pytest.mark.parametrize("transform", [None, _identity_transform])
def test_the_sources_size_and_crop_go_to_the_device_untouched(dataset_dir: str, transform) -> None:
    # The "meta" device shows where a tensor went without a GPU; the values are checked on the CPU.
    on_host = list(ShardDataset(dataset_dir, 10, shuffle=True))
    for device in ("meta", "cpu"):
        moved = list(DeviceLoader(ShardDataset(dataset_dir, 10, shuffle=True), device, transform=transform))
        assert len(moved) == len(on_host)
        for batch, host in zip(moved, on_host):
            for name in ("original_size", "crop_top_left"):
                assert batch[name].device.type == device and batch[name].dtype == torch.int64
                assert batch[name].shape == (len(host["__key__"]), 2)
                if device == "cpu":
                    assert torch.equal(batch[name], host[name])


IDENTITY = {"mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)}


@pytest.fixture(scope="module")
def layout_data(tmp_path_factory: pytest.TempPathFactory, layout: Layout) -> LayoutDataset:
    return layout.make(str(tmp_path_factory.mktemp(f"device-{layout}") / "ds"))


def test_device_loader_resumes_at_the_next_batch(layout_data: LayoutDataset):
    """In either layout: 4 batches taken through the prefetching loader, its state, then the rest."""
    def loader() -> DeviceLoader:
        return DeviceLoader(ShardDataset(layout_data.path, 8, shuffle=True, drop_last=False), "cpu", prefetch=3,
                            **IDENTITY)

    reference = [(batch_bucket(b), b["__key__"]) for b in loader()]
    interrupted = loader()
    iterator = iter(interrupted)
    taken = [next(iterator) for _ in range(4)]
    resumed = loader()
    resumed.load_state_dict(interrupted.state_dict())
    rest = [(batch_bucket(b), b["__key__"]) for b in resumed]
    assert [(batch_bucket(b), b["__key__"]) for b in taken] + rest == reference



# --- batches of varying shape: a staging pool per shape --------------------------------------------------------

def test_one_pool_per_shape_reused_once_its_copies_have_run():
    pools = plain_pools()
    batches = mixed_batches() * 5  # 40 steps over 4 shapes
    for batch in batches:
        staged = pools.stage(batch["image"])
        assert torch.equal(staged.tensor, batch["image"])
        pools.release(staged, FakeEvent(done=True))  # the device copy ran before the next batch
    assert sorted(pools.shapes()) == sorted({(h, w, 3) for h, w in SHAPES})
    assert pools.allocations == 4, "one buffer per shape, reused every step after"


def test_a_buffer_is_not_reused_while_its_copy_may_still_read_it():
    pools = plain_pools(depth=3)
    image = mixed_batches()[0]["image"]
    pending = [FakeEvent(), FakeEvent()]
    first = pools.stage(image)
    pools.release(first, pending[0])
    second = pools.stage(image)
    assert second.buffer is not first.buffer, "the first buffer's copy has not run"
    pools.release(second, pending[1])
    pending[0].done = True
    third = pools.stage(image)
    assert third.buffer is first.buffer and pools.allocations == 2
    pools.release(third, FakeEvent())


def test_at_depth_the_oldest_copy_is_waited_for_instead_of_allocating():
    pools = plain_pools(depth=2)
    image = mixed_batches()[0]["image"]
    events = []
    for _ in range(2):
        staged = pools.stage(image)
        events.append(FakeEvent())
        pools.release(staged, events[-1])
    again = pools.stage(image)
    assert pools.allocations == 2 and events[0].waited == 1 and events[1].waited == 0
    assert torch.equal(again.tensor, image)


def test_a_shorter_last_batch_uses_its_shapes_pool_and_a_larger_one_grows_it():
    pools = plain_pools()
    full, short = torch.ones((8, 4, 6, 3), dtype=torch.uint8), torch.full((3, 4, 6, 3), 7, dtype=torch.uint8)
    staged = pools.stage(full)
    pools.release(staged, None)
    staged = pools.stage(short)
    assert staged.tensor.shape == (3, 4, 6, 3) and torch.equal(staged.tensor, short)
    assert pools.allocations == 1 and len(pools.pools) == 1
    pools.release(staged, None)
    larger = torch.zeros((10, 4, 6, 3), dtype=torch.uint8)
    staged = pools.stage(larger)
    assert staged.tensor.shape == (10, 4, 6, 3) and pools.allocations == 2 and len(pools.pools) == 1


def test_releasing_twice_or_never_is_an_error():
    pools = plain_pools(depth=1)
    image = torch.zeros((2, 3, 3, 3), dtype=torch.uint8)
    staged = pools.stage(image)
    with pytest.raises(RuntimeError, match="are taken and none was released"):
        pools.stage(image)
    pools.release(staged, None)
    with pytest.raises(RuntimeError, match="released twice"):
        pools.release(staged, None)


def test_device_loader_stages_unpinned_batches_in_their_shapes_pool():
    """The CUDA path's staging step (``DeviceLoader._staged``) with plain buffers for pinned ones."""
    loader = DeviceLoader(mixed_batches(), "cpu", prefetch=0)
    assert loader.staging is None, "nothing to pin on the CPU"
    loader.staging = plain_pools()
    for batch in mixed_batches() * 3:
        staged_batch, staged = loader._staged(batch)
        assert staged is not None and torch.equal(staged_batch["image"], batch["image"])
        assert staged_batch["bucket"] == batch["bucket"] and staged_batch["__key__"] == batch["__key__"]
        loader.staging.release(staged, FakeEvent(done=True))
    assert loader.staging.allocations == 4


def test_device_loader_decodes_a_cpu_jpeg_batch_straight_into_its_pool():
    loader = DeviceLoader([], "cpu", prefetch=0)
    loader.staging = plain_pools()
    for images, pixels in [jpeg_batch(16, 24, 3), jpeg_batch(24, 16, 2, seed=1), jpeg_batch(16, 24, 3, seed=2)]:
        staged_batch, staged = loader._staged({"image": images})
        assert staged is not None and staged_batch["image"].shape == (len(pixels), *pixels.shape[1:])
        assert np.array_equal(staged_batch["image"].numpy(), images.decode())
        loader.staging.release(staged, None)
    assert loader.staging.allocations == 2


def test_device_loader_normalises_every_shape_in_order():
    batches = mixed_batches()
    out = list(DeviceLoader(batches, "cpu", prefetch=3, **IDENTITY))
    assert len(out) == len(batches)
    for got, batch in zip(out, batches):
        assert torch.equal(got["image"], batch["image"].permute(0, 3, 1, 2).float())
        assert got["__key__"] == batch["__key__"]


# --- the CUDA path's staging, by injection ---------------------------------------------------------------------

class FakeStream:
    def __init__(self) -> None:
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1


def cuda_path(monkeypatch, events: list, copies: list, fail_at: int | None = None) -> DeviceLoader:
    """A DeviceLoader whose ``_prepare`` takes its CUDA branch here: the streams (``LoaderStreams``), their
    events and the copy to the device (``to_device``) are stand-ins; each copy records the staging buffer it
    read."""
    import contextlib

    from shardio.train import loader as loader_module

    stream = FakeStream()

    class Event(FakeEvent):
        def __init__(self) -> None:
            super().__init__()
            events.append(self)

        def record(self, stream) -> None:
            pass

    class Streams:
        def producer(self):
            return stream

        def using(self, stream):
            return contextlib.nullcontext()

        def event(self):
            return Event()

    def to_device(batch, device, **kwargs):
        if fail_at is not None and len(copies) == fail_at:
            copies.append(None)
            raise RuntimeError("the step's device work failed")
        copies.append(batch["image"])
        return {**batch, "image": batch["image"].clone()}

    monkeypatch.setattr(loader_module, "to_device", to_device)
    loader = DeviceLoader([], "cpu", prefetch=0, streams=Streams())
    loader.device, loader.staging, loader.stream = torch.device("cuda"), plain_pools(depth=2), stream
    return loader


def test_the_cuda_path_stages_each_shape_in_its_pool_and_reuses_after_the_event(monkeypatch):
    events: list[FakeEvent] = []
    copies: list[torch.Tensor] = []
    loader = cuda_path(monkeypatch, events, copies)
    batches = mixed_batches()
    out = []
    for number, batch in enumerate(batches * 2, 1):
        out.append(loader._prepare((batch, number)))
        events[-1].done = True  # the GPU ran the step's copy before the next batch was staged
    assert [torch.equal(got[0]["image"], batch["image"]) for got, batch in zip(out, batches * 2)] == [True] * 16
    assert [ready for _, _, ready in out] == events
    assert loader.staging.allocations == 4, "one pinned buffer per shape for 16 steps"
    # the copies read staging buffers: the same one for a shape every time
    by_shape: dict = {}
    for copy in copies:
        by_shape.setdefault(tuple(copy.shape), set()).add(copy.untyped_storage().data_ptr())
    assert all(len(pointers) == 1 for pointers in by_shape.values()) and len(by_shape) == 4


def test_the_cuda_path_waits_for_the_oldest_copy_rather_than_allocating(monkeypatch):
    events: list[FakeEvent] = []
    loader = cuda_path(monkeypatch, events, [])
    batch = mixed_batches()[0]
    for number in range(1, 6):  # the GPU never catches up on its own: depth 2 is the bound
        loader._prepare((batch, number))
    assert loader.staging.allocations == 2
    assert [event.waited for event in events] == [1, 1, 1, 0, 0]


def test_a_failed_step_gives_its_staging_buffer_back_after_the_stream(monkeypatch):
    events: list[FakeEvent] = []
    loader = cuda_path(monkeypatch, events, [], fail_at=1)
    batch = mixed_batches()[0]
    loader._prepare((batch, 1))
    with pytest.raises(RuntimeError, match="device work failed"):
        loader._prepare((batch, 2))
    assert loader.stream.synchronized == 1
    (pool,) = loader.staging.pools.values()
    assert [slot.taken for slot in pool] == [False, False], "the failed step's buffer is not leaked"
    assert pool[1].event is None, "reusable at once: its stream has run"
    loader._prepare((batch, 3))
    assert loader.staging.allocations == 2 and events[0].waited == 0


def test_a_corrupt_jpeg_batch_decoded_into_staging_gives_its_buffer_back():
    loader = DeviceLoader([], "cpu", prefetch=0)
    loader.staging = plain_pools(depth=1)
    images, _ = jpeg_batch(16, 24, 3)
    bad = EncodedImages(images.jpegs[:2] + [np.frombuffer(b"\xff\xd8not a jpeg" + bytes(64), np.uint8).copy()],
                        16, 24, images.sources)
    with pytest.raises(Exception, match=r"b-16x24\.jpg\.npy"):
        loader._staged({"image": bad})
    staged_batch, staged = loader._staged({"image": images})  # depth 1: only if the buffer came back
    assert np.array_equal(staged_batch["image"].numpy(), images.decode())
