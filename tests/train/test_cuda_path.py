"""The GPU path on a real GPU (skipped without CUDA; ``make gpu-check`` runs them on a GPU machine): each decode
library through ``DeviceDecoder``, the default choice, ``DeviceLoader`` decoding on the prefetch thread's own
stream with no corrupted trial of the stream-safety harness, Lightning decoding a JPEG dataset on the GPU, and
a corrupt sample named by shard and sample."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from dataset_fixtures import assert_exactly_once, make_photo_dataset

from shardio import DeviceLoader, ShardDataset
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
