"""The training side on batches of varying shape (a bucketed dataset's: each batch one bucket's
[B, h, w, 3]): pinned staging pools per shape, augmentation that keeps or fixes the shape, the device
decode of JPEG batches of any shape, and DeviceLoader carrying them, all on synthetic batch sequences.

The CUDA-only lines (events, pinned allocation) are injected: ``StagingPools(allocate=...)`` and events
that say when they are done, so the pools' bookkeeping runs here without a GPU.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from shardio import DeviceLoader
from shardio.read.jpeg_pixels import EncodedImages
from shardio.train.augment import EvalTransform, TrainAugment
from shardio.train.device_decode import DeviceDecoder
from shardio.train.staging import StagingPools

IDENTITY = {"mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)}
SHAPES = [(16, 24), (24, 16), (20, 20), (16, 24), (12, 32), (24, 16), (20, 20), (16, 24)]


def mixed_batches(shapes=SHAPES, batch: int = 4) -> list[dict]:
    """One batch per shape, each sample's pixels its running number (mod 251) plus the row, so a copy
    that lands in the wrong place or the wrong batch shows."""
    out, number = [], 0
    for index, (h, w) in enumerate(shapes):
        image = torch.empty((batch, h, w, 3), dtype=torch.uint8)
        for i in range(batch):
            image[i] = (number % 251) + torch.arange(h, dtype=torch.uint8)[:, None, None] % 4
            number += 1
        out.append({"image": image, "bucket": index % 3, "__key__": [f"s{number - batch + i}"
                                                                     for i in range(batch)]})
    return out


class FakeEvent:
    """A CUDA event stand-in: done when the test says so; ``synchronize`` (a wait) makes it done."""

    def __init__(self, done: bool = False) -> None:
        self.done, self.waited = done, 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


def plain_pools(depth: int = 4) -> StagingPools:
    return StagingPools(depth, allocate=lambda shape, dtype: torch.empty(shape, dtype=dtype))


# --- staging pools -----------------------------------------------------------------------------------------

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


# --- augmentation --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("transform", [TrainAugment(seed=3, **IDENTITY), EvalTransform(**IDENTITY)],
                         ids=["train", "eval"])
def test_by_default_each_batch_keeps_its_own_shape(transform):
    for number, batch in enumerate(mixed_batches()):
        image = batch["image"]
        positions = torch.arange(number * 4, number * 4 + 4)
        out = transform(image, epoch=0, positions=positions)
        assert out.shape == (4, 3, image.shape[1], image.shape[2]) and out.dtype == torch.float32
        assert out.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("size, expected", [(12, (12, 12)), ((10, 18), (10, 18))])
@pytest.mark.parametrize("kind", ["train", "eval"])
def test_an_explicit_size_is_every_batchs_shape(size, expected, kind):
    transform = TrainAugment(size, seed=3) if kind == "train" else EvalTransform(size)
    for number, batch in enumerate(mixed_batches()):
        out = transform(batch["image"], epoch=0, positions=torch.arange(number * 4, number * 4 + 4))
        assert out.shape == (4, 3, *expected)


def test_eval_with_the_whole_image_kept_is_the_image_itself():
    for batch in mixed_batches():
        out = EvalTransform(crop_fraction=1.0, **IDENTITY)(batch["image"])
        # bilinear at exact pixel centres: the pixels, up to float rounding of the grid
        torch.testing.assert_close(out, batch["image"].permute(0, 3, 1, 2).float(), atol=1e-3, rtol=0)


def test_kept_shape_crops_keep_the_batchs_aspect_ratio_within_ratio():
    """With the shape kept, ``ratio`` is relative to the batch's aspect: a 1:2 bucket's crops are about
    1:2 (within 3/4..4/3 of it, and so stretched at most that much when resized back), not square."""
    augment = TrainAugment(seed=1)
    positions = torch.arange(4000)
    for height, width in [(32, 64), (64, 32), (48, 48)]:
        crops = augment.params((height, width), epoch=0, positions=positions)
        relative = (crops.width / crops.height) / (width / height)
        inside = (crops.x0 >= 0) & (crops.y0 >= 0) & (crops.x0 + crops.width <= width) \
            & (crops.y0 + crops.height <= height)
        assert bool(inside.all())
        # Rounding to whole pixels moves a small crop's aspect a little past the range.
        large = crops.width * crops.height >= 0.2 * height * width
        assert float(relative[large].min()) > 0.7 and float(relative[large].max()) < 1.43
        assert abs(float(torch.log(relative[large]).median())) < 0.05


def test_a_samples_crop_depends_on_its_position_not_on_the_batch_it_is_in():
    augment = TrainAugment(seed=5, **IDENTITY)
    image = mixed_batches()[0]["image"]
    whole = augment(image, epoch=2, positions=torch.arange(10, 14))
    parts = torch.cat([augment(image[:2], epoch=2, positions=torch.arange(10, 12)),
                       augment(image[2:], epoch=2, positions=torch.arange(12, 14))])
    assert torch.equal(whole, parts)


def test_device_loader_with_a_transform_carries_every_shape():
    batches = mixed_batches()
    for number, batch in enumerate(batches):
        batch["__position__"], batch["__epoch__"] = torch.arange(number * 4, number * 4 + 4), 0
    for transform, fixed in [(TrainAugment(seed=0), None), (TrainAugment(10, seed=0), (10, 10))]:
        out = list(DeviceLoader(batches, "cpu", transform=transform, prefetch=2))
        assert [tuple(b["image"].shape[2:]) for b in out] == [fixed or shape for shape in SHAPES]
        assert [b["bucket"] for b in out] == [b["bucket"] for b in batches]


def test_device_loader_normalises_every_shape_in_order():
    batches = mixed_batches()
    out = list(DeviceLoader(batches, "cpu", prefetch=3, **IDENTITY))
    assert len(out) == len(batches)
    for got, batch in zip(out, batches):
        assert torch.equal(got["image"], batch["image"].permute(0, 3, 1, 2).float())
        assert got["__key__"] == batch["__key__"]


# --- device decode -------------------------------------------------------------------------------------------

def jpeg_batch(height: int, width: int, count: int, seed: int = 0) -> tuple[EncodedImages, np.ndarray]:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (count, height // 4, width // 4, 3), dtype=np.uint8)
    pixels = pixels.repeat(4, axis=1).repeat(4, axis=2)  # blocks: a JPEG keeps them near exactly
    jpegs = []
    for image in pixels:
        out = io.BytesIO()
        Image.fromarray(image).save(out, "JPEG", quality=95)
        jpegs.append(np.frombuffer(out.getvalue(), np.uint8).copy())
    return EncodedImages(jpegs, height, width, [(f"b-{height}x{width}.jpg.npy", 0, count)]), pixels


class PillowDecode:
    """``decode_jpeg(list, device)`` stand-in: Pillow per image, CHW uint8; records each call's sizes."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, jpegs: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        self.calls.append(len(jpegs))
        return [torch.from_numpy(np.asarray(Image.open(io.BytesIO(j.numpy().tobytes())).convert("RGB")).copy())
                .permute(2, 0, 1).to(device) for j in jpegs]


def test_the_device_decoder_decodes_batches_of_any_shape_in_one_call_each():
    decode = PillowDecode()
    decoder = DeviceDecoder("cpu", decode=decode)
    shapes = [(16, 24), (24, 16), (32, 32), (16, 24)]
    for index, (h, w) in enumerate(shapes):
        images, _ = jpeg_batch(h, w, 3 + index, seed=index)
        out = decoder(images)
        assert out.shape == (3 + index, h, w, 3) and out.is_contiguous()
        assert np.array_equal(out.numpy(), images.decode())
    assert decode.calls == [3, 4, 5, 6]


def test_a_sample_of_another_shape_than_its_batch_is_named():
    images, _ = jpeg_batch(16, 24, 3)
    other, _ = jpeg_batch(24, 16, 1)
    mixed = EncodedImages(images.jpegs[:2] + other.jpegs, 16, 24, images.sources)
    with pytest.raises(Exception, match=r"b-16x24\.jpg\.npy: sample 2: decodes to .*\(3, 24, 16\).*not the "
                                        r"dataset's uint8 \(3, 16, 24\)"):
        DeviceDecoder("cpu", decode=PillowDecode())(mixed)


def test_device_loader_decodes_encoded_batches_of_varying_shape():
    batches, expected = [], []
    for index, (h, w) in enumerate(SHAPES):
        images, _ = jpeg_batch(h, w, 2, seed=index)
        batches.append({"image": images, "bucket": index})
        expected.append(images.decode())
    loader = DeviceLoader(batches, "cpu", device_decoder=DeviceDecoder("cpu", decode=PillowDecode()),
                          prefetch=2, **IDENTITY)
    out = list(loader)
    assert [b["bucket"] for b in out] == list(range(len(SHAPES)))
    for got, reference in zip(out, expected):
        assert torch.equal(got["image"], torch.from_numpy(reference).permute(0, 3, 1, 2).float())


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
