"""The GPU path on a real GPU (skipped without CUDA; ``make gpu-check`` runs them on a GPU machine): each decode
library through ``DeviceDecoder``, the default choice, ``DeviceLoader`` decoding on the prefetch thread's own
stream with no corrupted trial of the stream-safety harness, Lightning decoding a JPEG dataset on the GPU, and
a corrupt sample named by shard and sample; bucketed datasets: batches of every bucket's shape staged in pinned
pools per shape and reused, augmentation keeping each batch's shape, a bucketed JPEG dataset decoded at each
bucket's shape."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from bucket_fixtures import BUCKETS, key_bucket, make_bucketed_dataset
from dataset_fixtures import assert_exactly_once, make_photo_dataset
from layout_fixtures import READ_BUCKET_SIZES, READ_BUCKETS

from shardio import DeviceLoader, ShardDataset, ShardLoader
from shardio.train.augment import TrainAugment
from shardio.errors import ShardIntegrityError
from shardio.read.jpeg_pixels import EncodedImages
from shardio.train import device_decode
from shardio.train.device_decode import DeviceDecoder

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              # torchvision serves where torchcodec does not load, and says it is deprecated
              pytest.mark.filterwarnings("ignore:decoding JPEG batches on the device with torchvision"),
              pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
              pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")]

IDENTITY = {"mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)}
SAMPLES = 100


@pytest.fixture(scope="module")
def photo_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = str(tmp_path_factory.mktemp("cuda-photos"))
    make_photo_dataset(directory, (60, 40), side=48, samples_per_shard=16)
    return directory


def within_bound(decoded: torch.Tensor, reference: np.ndarray) -> None:
    """docs/reader.md, "Decoding JPEG batches on the GPU": every pixel within 8 levels, mean under 1."""
    difference = (decoded.cpu().float() - torch.from_numpy(reference).float()).abs()
    assert difference.max() <= 8, f"nvJPEG differs from libjpeg-turbo by {difference.max():.0f} levels"
    assert difference.mean() < 1.0, f"mean difference {difference.mean():.2f} levels"


@pytest.mark.parametrize("library", ["torchcodec", "torchvision"])
def test_each_library_decodes_within_the_bound_of_the_cpu_decode(photo_dir, library):
    backend, why = device_decode.library(library)
    if backend is None:
        pytest.skip(why)
    decoder = DeviceDecoder("cuda", decode=backend.decode)
    for batch in ShardDataset(photo_dir, 32, shuffle=True, decode="device"):
        images = batch["image"]
        decoded = decoder(images)
        assert decoded.is_cuda and decoded.shape == images.shape and decoded.is_contiguous()
        within_bound(decoded, images.decode())


def test_the_default_library_is_torchcodec_where_it_loads():
    backend, why = device_decode.library("torchcodec")
    if backend is None:
        pytest.skip(why)
    assert DeviceDecoder("cuda").backend.name == "torchcodec"


def test_device_loader_decodes_on_the_prefetch_threads_own_stream(photo_dir):
    inner = DeviceDecoder("cuda")
    seen: list[tuple[str, bool]] = []

    def decoder(images: EncodedImages) -> torch.Tensor:
        stream = torch.cuda.current_stream()
        seen.append((threading.current_thread().name, stream == torch.cuda.default_stream()))
        return inner(images)

    expected = [b["image"] for b in ShardDataset(photo_dir, 16, shuffle=True)]
    got = [b["image"] for b in DeviceLoader(ShardDataset(photo_dir, 16, shuffle=True), "cuda",
                                            device_decoder=decoder, **IDENTITY)]
    assert seen and all(name == "shardio-prefetch" and not default for name, default in seen), seen
    assert len(got) == len(expected)
    for image, reference in zip(got, expected):
        within_bound(image.permute(0, 2, 3, 1), reference.numpy())


def test_no_trial_of_the_stream_safety_harness_is_corrupted_under_device_loader(photo_dir):
    from bench.gpu_safety import under_device_loader

    row = under_device_loader(photo_dir, torch.device("cuda"), batch=16, trials=30)
    assert row["trials"] >= 30 and row["corrupted"] == 0, row  # the prefetch thread may run a trial or two ahead
    assert row["max_abs_vs_cpu_decode"] <= 8


def test_a_sample_that_is_no_jpeg_is_named_by_shard_and_sample(photo_dir):
    images = next(iter(ShardDataset(photo_dir, 8, decode="device")))["image"]
    jpegs = list(images.jpegs)
    jpegs[5] = np.frombuffer(b"\x89PNG\r\n\x1a\n" + bytes(200), np.uint8).copy()
    bad = EncodedImages(jpegs, images.height, images.width, images.sources)
    with pytest.raises(ShardIntegrityError, match=r"input-0-00000\.jpg\.npy: sample 5: corrupt JPEG \(cuda"):
        DeviceDecoder("cuda")(bad)


def test_lightning_trains_from_a_jpeg_dataset_decoded_on_the_gpu(photo_dir):
    pl = pytest.importorskip("lightning.pytorch")
    from shardio.train.lightning import ShardDataModule

    class Recorder(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)
            self.keys: list[int] = []

        def training_step(self, batch, batch_idx):
            assert batch["image"].is_cuda and batch["image"].dtype == torch.float32
            self.keys += [int(key[1:]) for key in batch["__key__"]]
            return self.layer(batch["image"].mean(dim=(2, 3))).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    model = Recorder()
    module = ShardDataModule(photo_dir, 16, shuffle=True, drop_last=False)
    pl.Trainer(accelerator="gpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
               enable_model_summary=False, enable_checkpointing=False).fit(model, module)
    assert isinstance(module._decoder(module.train_dataset), DeviceDecoder), "decoded on the GPU by default"
    assert_exactly_once(np.array(model.keys), SAMPLES)


# --- bucketed datasets ---------------------------------------------------------------------------------------

BUCKET_SAMPLES = (100, 150, 60)


@pytest.fixture(scope="module")
def bucketed_raw_dir(tmp_path_factory) -> str:
    return make_bucketed_dataset(str(tmp_path_factory.mktemp("cuda-buckets") / "ds"), samples=BUCKET_SAMPLES)


@pytest.fixture(scope="module")
def bucketed_jpeg_dir(tmp_path_factory) -> str:
    return make_bucketed_dataset(str(tmp_path_factory.mktemp("cuda-buckets-jpeg") / "ds"), samples=BUCKET_SAMPLES,
                                 encoding="jpeg")


def bucketed_dataset(path: str) -> ShardDataset:
    return ShardDataset(path, 8, shuffle=True, drop_last=False)


def test_unpinned_bucketed_batches_are_staged_in_a_pool_per_shape_and_arrive_intact(bucketed_raw_dir):
    reference = [(b["__key__"], b["image"].clone()) for b in bucketed_dataset(bucketed_raw_dir)]
    loader = DeviceLoader(ShardLoader(bucketed_dataset(bucketed_raw_dir)), "cuda", prefetch=2, **IDENTITY)  # unpinned
    got = [(b["__key__"], b["image"]) for b in loader]
    torch.cuda.synchronize()
    assert len(got) == len(reference) > 30
    for (keys, image), (ref_keys, ref_image) in zip(got, reference):
        assert keys == ref_keys and image.is_cuda
        assert torch.equal(image.permute(0, 2, 3, 1).to(torch.uint8).cpu(), ref_image)
    staging = loader.staging
    assert staging is not None and set(staging.shapes()) == {(h, w, 3) for h, w in BUCKETS}
    # at most depth buffers a shape, each made again at most once (a short batch of a shape came first)
    assert staging.allocations <= 2 * len(BUCKETS) * staging.depth < len(got), "reused, not made per step"
    assert all(slot.buffer.is_pinned() for pool in staging.pools.values() for slot in pool)


def test_augment_keeps_each_bucketed_batchs_shape_on_the_gpu(bucketed_raw_dir):
    for batch in DeviceLoader(bucketed_dataset(bucketed_raw_dir), "cuda", transform=TrainAugment(seed=0)):
        bucket = batch["bucket"]
        assert {key_bucket(k) for k in batch["__key__"]} == {bucket}
        assert batch["image"].is_cuda and tuple(batch["image"].shape[2:]) == BUCKETS[bucket]


def test_a_bucketed_jpeg_dataset_decodes_on_the_gpu_at_each_buckets_shape(bucketed_jpeg_dir):
    if not device_decode.available():
        pytest.skip("neither torchcodec nor torchvision decodes here")
    cpu = [b["image"].clone() for b in bucketed_dataset(bucketed_jpeg_dir)]
    gpu = list(DeviceLoader(bucketed_dataset(bucketed_jpeg_dir), "cuda", decode_on_device=True, **IDENTITY))
    assert len(gpu) == len(cpu)
    for batch, reference in zip(gpu, cpu):
        assert tuple(batch["image"].shape[2:]) == BUCKETS[batch["bucket"]]
        difference = (batch["image"].permute(0, 2, 3, 1).cpu() - reference.float()).abs()
        # docs/reader.md, "Decoding JPEG batches on the GPU": every pixel within 8 levels, mean under 1
        assert float(difference.max()) <= 8 and float(difference.mean()) < 1.0
    assert np.isfinite(float(gpu[-1]["image"].mean().cpu()))


@pytest.mark.parametrize("encoding", ["raw", "jpeg"])
def test_pinned_batches_of_every_bucket_reuse_a_few_blocks(tmp_path, encoding):
    directory = make_bucketed_dataset(str(tmp_path / "ds"), buckets=READ_BUCKETS, samples=READ_BUCKET_SIZES,
                                      samples_per_shard=6, encoding=encoding)
    ds = ShardDataset(directory, 4, shuffle=True, pin_memory=True, prefetch=0)
    blocks = set()
    buckets = set()
    for _ in range(3):
        for batch in ds:
            assert batch["image"].is_pinned()
            blocks.add(batch["image"].untyped_storage().data_ptr())
            buckets.add(batch["bucket"])
            del batch
    assert len(buckets) == len(READ_BUCKETS) and len(blocks) <= 4  # not one block per bucket shape, nor per step
