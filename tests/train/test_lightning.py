"""``shardio.train.lightning.ShardDataModule`` under a real Lightning Trainer on CPU.

Every sample carries its index in its pixels and key (``tests/training_helpers.py``); the module records
the keys each training step gets, so one comparison catches missing, repeated and reordered samples.
117 samples in batches of 8 (``drop_last=False``) make 15 batches an epoch, the last one of 5. A bucketed
dataset (``tests/bucket_fixtures.py``: 60 samples in 3 shapes, 3 + 4 + 2 batches an epoch) gives each step one
bucket's batch in that bucket's shape (or the transform's size), trains a net that takes any shape, resumes at
exactly the next batch, and under DDP both ranks train on the same bucket at every step.
"""

from __future__ import annotations

import glob
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("lightning")
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from shardio.read.dataset import ShardDataset  # noqa: E402
from shardio.train.lightning import ShardDataModule  # noqa: E402
from shardio.read.mixing import MixedDataset  # noqa: E402
from shardio.train.augment import TrainAugment  # noqa: E402
from tests.bucket_fixtures import BUCKETS, key_bucket, key_index, make_bucketed_dataset  # noqa: E402
from tests.dataset_fixtures import assert_exactly_once  # noqa: E402
from tests.layout_fixtures import READ_BUCKETS, Layout, LayoutDataset, batch_bucket, sample_number  # noqa: E402
from tests.lightning_ddp_worker import run_ranks  # noqa: E402
from tests.training_helpers import make_mixed_dataset  # noqa: E402

SAMPLES, BATCH = 117, 8
BATCHES = -(-SAMPLES // BATCH)  # 15

# Lightning's advice for real runs (workers, logging intervals) is noise for a 15-batch CPU test.
pytestmark = [pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
              pytest.mark.filterwarnings("ignore:.*GPU available but not used.*"),
              pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`"),
              # Lightning 2.6's own use of torch's pytree on torch 2.9+; not ours.
              pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")]


class KeyRecorder(pl.LightningModule):
    """A linear model that notes, per epoch, the sample indices of each batch it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.seen: list[tuple[int, int, list[int]]] = []  # (epoch, batch_idx, indices)
        self.shapes: list[tuple[int, tuple[int, int]]] = []  # (bucket, image shape): a bucketed dataset's vary

    def training_step(self, batch, batch_idx):
        image = batch["image"]
        assert image.dtype == torch.float32 and image.shape[1] == 3  # normalised NCHW after the transfer
        self.seen.append((self.current_epoch, batch_idx, [sample_number(k) for k in batch["__key__"]]))
        self.shapes.append((batch_bucket(batch), tuple(image.shape[2:])))
        return self.layer(image.mean(dim=(2, 3))).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def epochs(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for epoch, _, keys in self.seen:
            out.setdefault(epoch, []).extend(keys)
        return out


def trainer(**kwargs) -> pl.Trainer:
    defaults = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
    return pl.Trainer(**{**defaults, **kwargs})


def fit(path, ckpt_path: str | None = None, **kwargs) -> KeyRecorder:
    """``path``: a dataset directory, or a function making the train dataset (a new one per fit, as a
    new process would)."""
    torch.manual_seed(0)
    model = KeyRecorder()
    module = ShardDataModule(path if isinstance(path, str) else path(), BATCH, shuffle=True, seed=3,
                             drop_last=False)
    trainer(**kwargs).fit(model, module, ckpt_path=ckpt_path)
    return model


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("lightning") / "ds")
    make_mixed_dataset(path)
    return path


@pytest.fixture(scope="module")
def layout_data(tmp_path_factory, layout: Layout) -> LayoutDataset:
    """This suite's dataset (117 samples, some inputs caption-only) or the bucketed one (60 in 3 shapes)."""
    path = str(tmp_path_factory.mktemp(f"lightning-{layout}") / "ds")
    if layout.bucketed:
        return layout.make(path, buckets=list(BUCKETS), sizes=[20, 27, 13], samples_per_shard=8)
    make_mixed_dataset(path)
    return LayoutDataset(path, "single", "raw", [(8, 8)], [SAMPLES])


def test_epochs_are_different_permutations_and_repeat_when_rerun(dataset):
    first = fit(dataset, max_epochs=2).epochs()
    assert sorted(first) == [0, 1]
    for epoch in (0, 1):
        assert_exactly_once(np.array(first[epoch]), SAMPLES)
    assert first[0] != first[1], "the Trainer's epochs reached the dataset: each has its own order"
    again = fit(dataset, max_epochs=2).epochs()
    assert again == first, "same seed, same orders"


@pytest.mark.parametrize("layout, stop_after", [("single", 6), ("single", BATCHES + 6), ("single", BATCHES),
                                               ("buckets", 9 + 4)], indirect=["layout"])
def test_checkpoint_mid_epoch_resumes_at_exactly_the_next_batch(layout_data, tmp_path, stop_after):
    """A bucketed run too (stopped 4 batches into the second epoch of 9): the same buckets at the same shapes."""
    path, samples = layout_data.path, layout_data.samples
    reference = fit(path, max_epochs=2)
    checkpoints = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=stop_after, save_top_k=-1)
    interrupted = fit(path, max_steps=stop_after, callbacks=[checkpoints], enable_checkpointing=True)
    saved = glob.glob(str(tmp_path / f"*step={stop_after}.ckpt"))
    assert len(saved) == 1, saved
    resumed = fit(path, ckpt_path=saved[0], max_epochs=2)

    assert [keys for _, _, keys in interrupted.seen] == [keys for _, _, keys in reference.seen[:stop_after]]
    # The resumed run starts with the batch after the checkpoint, with Lightning's own batch_idx.
    assert [(e, i) for e, i, _ in resumed.seen] == [(e, i) for e, i, _ in reference.seen[stop_after:]]
    assert interrupted.shapes + resumed.shapes == reference.shapes
    assert {shape for _, shape in reference.shapes} == set(layout_data.shapes)
    combined = interrupted.epochs()
    for epoch, keys in resumed.epochs().items():
        combined.setdefault(epoch, []).extend(keys)
    for epoch in (0, 1):
        assert_exactly_once(np.array(combined[epoch]), samples)  # nothing missing or repeated
    assert combined == reference.epochs(), "and in the uninterrupted order"


def test_a_mixed_dataset_resumes_mid_epoch_under_the_trainer(dataset, tmp_path):
    other = str(tmp_path / "b")
    make_mixed_dataset(other, (30,), (False,), first_index=1000)

    def mixed() -> MixedDataset:
        parts = [ShardDataset(dataset, BATCH, shuffle=True), ShardDataset(other, BATCH, shuffle=True)]
        return MixedDataset(parts, [2, 1], seed=4)

    reference = fit(mixed, max_epochs=2)
    per_epoch = len(mixed())
    assert [e for e, _, _ in reference.seen] == [0] * per_epoch + [1] * per_epoch
    assert reference.epochs()[0] != reference.epochs()[1]
    stop = per_epoch + 4
    checkpoints = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=stop, save_top_k=-1)
    interrupted = fit(mixed, max_steps=stop, callbacks=[checkpoints], enable_checkpointing=True)
    (saved,) = glob.glob(str(tmp_path / "ckpt" / f"*step={stop}.ckpt"))
    resumed = fit(mixed, ckpt_path=saved, max_epochs=2)
    assert [k for _, _, k in interrupted.seen + resumed.seen] == [k for _, _, k in reference.seen]


class AugmentedRecorder(KeyRecorder):
    def training_step(self, batch, batch_idx):
        assert batch["image"].shape[1:] == (3, 6, 6), "TrainAugment(6) ran after the transfer"
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        assert batch["image"].dtype == torch.float32 and batch["image"].shape[1:] == (3, 8, 8)
        self.validated = getattr(self, "validated", []) + [int(k[1:]) for k in batch["__key__"]]


def test_train_transform_and_validation_set(dataset):
    model = AugmentedRecorder()
    module = ShardDataModule(dataset, BATCH, val=dataset, train_transform=TrainAugment(6, seed=0))
    trainer(max_epochs=1).fit(model, module)
    assert len(model.seen) == SAMPLES // BATCH  # drop_last=True by default for training
    assert_exactly_once(np.array(model.validated), SAMPLES)  # validation: every sample, in stored order
    assert model.validated == sorted(model.validated)


# --- JPEG datasets decoded on the device (here an injected decoder on the CPU: the same path as CUDA's) ---

class ImageRecorder(KeyRecorder):
    """Notes each step's keys and its images (normalised float NCHW) as they reach training_step."""

    def __init__(self) -> None:
        super().__init__()
        self.images: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        self.images.append(batch["image"].detach().clone())
        return super().training_step(batch, batch_idx)


@pytest.fixture(scope="module")
def jpeg_dataset(tmp_path_factory) -> str:
    from tests.dataset_fixtures import make_photo_dataset

    path = str(tmp_path_factory.mktemp("lightning-jpeg") / "ds")
    make_photo_dataset(path, (SAMPLES,), side=16, samples_per_shard=BATCH)
    return path


class ThreadNotingDecoder:
    """A device decoder (``DeviceDecoder`` with Pillow's decode) that notes the thread of each call."""

    def __init__(self) -> None:
        from shardio.train.device_decode import DeviceDecoder
        from tests.train.test_device_decode import PillowDecode

        self.inner = DeviceDecoder("cpu", decode=PillowDecode())
        self.threads: list[str] = []

    def __call__(self, images):
        import threading

        self.threads.append(threading.current_thread().name)
        return self.inner(images)


def fit_jpeg(path: str, ckpt_path: str | None = None, **options) -> tuple[ImageRecorder, ThreadNotingDecoder]:
    torch.manual_seed(0)
    model, decoder = ImageRecorder(), ThreadNotingDecoder()
    device = {} if options.pop("on_cpu", False) else {"device_decoder": decoder}
    module = ShardDataModule(path, BATCH, shuffle=True, seed=3, drop_last=False,
                             train_transform=TrainAugment(12, seed=1), **device)
    trainer(**options).fit(model, module, ckpt_path=ckpt_path)
    from shardio.read.prefetch import Prefetcher

    for prefetcher in list(Prefetcher.live):  # the epoch after the last: its first batches, then it ends
        prefetcher.thread.join(60)
    return model, decoder


def test_a_jpeg_dataset_is_decoded_on_the_device_on_the_prefetch_thread_with_the_cpu_decodes_result(
        jpeg_dataset):
    on_cpu, _ = fit_jpeg(jpeg_dataset, max_epochs=2, on_cpu=True)
    on_device, decoder = fit_jpeg(jpeg_dataset, max_epochs=2)
    # Two epochs' batches, and the third epoch's first two, decoded at the second one's end.
    assert len(decoder.threads) == 2 * BATCHES + 2 and set(decoder.threads) == {"shardio-prefetch"}, decoder.threads
    assert on_device.seen == on_cpu.seen
    assert all(torch.equal(a, b) for a, b in zip(on_device.images, on_cpu.images))


def test_a_device_decoded_run_resumes_mid_epoch_at_exactly_the_next_batch(jpeg_dataset, tmp_path):
    """The decode runs ahead on the prefetch thread; the checkpoint still counts only the trained batches."""
    stop = BATCHES + 4
    reference, _ = fit_jpeg(jpeg_dataset, max_epochs=2)
    checkpoints = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=stop, save_top_k=-1)
    interrupted, _ = fit_jpeg(jpeg_dataset, max_steps=stop, callbacks=[checkpoints], enable_checkpointing=True)
    (saved,) = glob.glob(str(tmp_path / f"*step={stop}.ckpt"))
    resumed, _ = fit_jpeg(jpeg_dataset, ckpt_path=saved, max_epochs=2)
    assert [k for _, _, k in interrupted.seen + resumed.seen] == [k for _, _, k in reference.seen]
    assert all(torch.equal(a, b) for a, b in zip(interrupted.images + resumed.images, reference.images))


# --- yuv420 datasets: planes moved and converted on the device (the CPU here: the same path as CUDA's) ---

@pytest.fixture(scope="module")
def yuv_dataset(tmp_path_factory) -> str:
    from tests.dataset_fixtures import make_dataset

    path = str(tmp_path_factory.mktemp("lightning-yuv") / "ds")
    make_dataset(path, (SAMPLES,), height=16, width=16, samples_per_shard=BATCH, encoding="yuv420")
    return path


class PlaneNotingModule(ShardDataModule):
    """Notes the type of the image each batch has before the device conversion (planes or RGB)."""

    def _converter(self):
        convert = super()._converter()
        self.before: list[str] = []

        def noting(batch):
            self.before.append(type(batch["image"]).__name__)
            return convert(batch)

        return noting


def fit_yuv(path: str, on_device: bool) -> tuple[ImageRecorder, ShardDataModule]:
    torch.manual_seed(0)
    model = ImageRecorder()
    module = PlaneNotingModule(path, BATCH, shuffle=True, seed=3, drop_last=False, decode_on_device=on_device,
                               train_transform=TrainAugment(12, seed=1))
    trainer(max_epochs=2).fit(model, module)
    from shardio.read.prefetch import Prefetcher

    for prefetcher in list(Prefetcher.live):
        prefetcher.thread.join(60)
    return model, module


def test_a_yuv420_datasets_planes_are_converted_on_the_device_with_the_cpu_conversions_result(yuv_dataset):
    on_cpu, _ = fit_yuv(yuv_dataset, on_device=False)
    on_device, module = fit_yuv(yuv_dataset, on_device=True)
    assert module.before and set(module.before) == {"YuvPlanes"}, module.before
    assert on_device.seen == on_cpu.seen and len(on_device.images) == 2 * BATCHES
    assert all(torch.equal(a, b) for a, b in zip(on_device.images, on_cpu.images))


def test_device_decode_is_refused_for_a_raw_dataset_and_a_contradiction(dataset):
    with pytest.raises(ValueError, match=r"contradicts decode_on_device=False"):
        ShardDataModule(dataset, BATCH, decode_on_device=False, device_decoder=lambda images: images)
    with pytest.raises(ValueError, match=r"decode_on_device=True is for JPEG datasets"):
        trainer(max_epochs=1).fit(KeyRecorder(), ShardDataModule(dataset, BATCH, decode_on_device=True))


@pytest.mark.slow
def test_torchrun_ddp_ranks_split_the_epoch(dataset, tmp_path):
    """Two CPU processes under torchrun: each rank opens the dataset in setup() with its rank from
    torch.distributed; the ranks train on disjoint samples, as many batches each."""
    ranks = run_ranks(dataset, str(tmp_path))
    assert [(r["rank"], r["world"]) for r in ranks] == [(0, 2), (1, 2)]
    per_rank = SAMPLES // (BATCH * 2) * BATCH  # drop_last: 7 batches of 8 each
    assert [len(r["seen"]) for r in ranks] == [per_rank, per_rank]
    assert not set(ranks[0]["seen"]) & set(ranks[1]["seen"])


def test_importing_shardio_does_not_import_lightning():
    code = ("import sys, shardio; shardio.ShardDataset, shardio.MixedDataset, shardio.SubsetDataset; "
            "assert 'lightning' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- a bucketed dataset: one bucket's batch a step ----------------------------------------------------------

BUCKETED_SAMPLES = 60  # buckets of 20, 27 and 13: 3 + 4 + 2 batches an epoch without drop_last


class AnyShapeNet(pl.LightningModule):
    """A convolution, global average pooling and a linear layer: any (h, w) goes through. Notes each step's
    epoch, bucket, image shape and sample numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(),
                                       torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 1))
        self.seen: list[tuple[int, int, tuple[int, int], list[int]]] = []
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        image = batch["image"]
        assert image.dtype == torch.float32 and image.shape[1] == 3
        assert {key_bucket(k) for k in batch["__key__"]} == {int(batch["bucket"])}
        self.seen.append((self.current_epoch, int(batch["bucket"]), tuple(image.shape[2:]),
                          [key_index(k) for k in batch["__key__"]]))
        target = (torch.tensor([key_index(k) for k in batch["__key__"]]) % 2).float()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(self.net(image)[:, 0], target)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.fixture(scope="module")
def bucketed(tmp_path_factory) -> str:
    return make_bucketed_dataset(str(tmp_path_factory.mktemp("lightning-buckets") / "ds"))


def fit_any_shape(path: str, ckpt_path: str | None = None, transform=None, **options) -> AnyShapeNet:
    torch.manual_seed(0)
    model = AnyShapeNet()
    module = ShardDataModule(path, BATCH, shuffle=True, seed=3, drop_last=False, train_transform=transform)
    defaults = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
    pl.Trainer(**{**defaults, **options}).fit(model, module, ckpt_path=ckpt_path)
    return model


@pytest.mark.parametrize("transform, fixed", [(None, None), (TrainAugment(seed=1), None),
                                              (TrainAugment(10, seed=1), (10, 10))],
                         ids=["normalised", "augmented", "fixed-size"])
def test_each_step_gets_one_buckets_batch_in_its_shape_and_a_model_trains(bucketed, transform, fixed):
    torch.manual_seed(0)  # the initial weights fit() starts from
    before = {k: v.clone() for k, v in AnyShapeNet().state_dict().items()}
    model = fit_any_shape(bucketed, transform=transform, max_epochs=2)
    for epoch in (0, 1):
        steps = [s for s in model.seen if s[0] == epoch]
        assert sorted(i for s in steps for i in s[3]) == list(range(BUCKETED_SAMPLES)), "every sample once an epoch"
        assert len(steps) == 3 + 4 + 2
    assert all(shape == (fixed or BUCKETS[bucket]) for _, bucket, shape, _ in model.seen)
    assert {bucket for _, bucket, _, _ in model.seen} == {0, 1, 2}
    assert all(torch.isfinite(torch.tensor(model.losses)))
    after = model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before), "the optimizer stepped"


DDP_SIZES = [37, 29, 21]
DDP_WORLD = 2  # ShardDataModule(path, 8, drop_last=True) in tests/lightning_ddp_worker.py


@pytest.fixture(scope="module")
def ddp_bucketed(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_bucketed_dataset(str(tmp_path_factory.mktemp("ddp-buckets") / "ds"), buckets=READ_BUCKETS,
                                 samples=DDP_SIZES, samples_per_shard=6)


def test_torchrun_ranks_train_the_same_bucket_at_every_step_on_disjoint_samples(ddp_bucketed: str, tmp_path) -> None:
    ranks = run_ranks(ddp_bucketed, str(tmp_path), "buckets", world=DDP_WORLD)
    assert [(r["rank"], r["world"]) for r in ranks] == [(0, DDP_WORLD), (1, DDP_WORLD)]
    steps = [r["seen"] for r in ranks]
    rounds = [n // (BATCH * DDP_WORLD) for n in DDP_SIZES]  # drop_last: each bucket's full rounds only
    assert len(steps[0]) == len(steps[1]) == sum(rounds)
    for step, (first, second) in enumerate(zip(*steps)):
        assert first[0] == second[0], f"step {step}: rank 0 bucket {first[0]}, rank 1 bucket {second[0]}"
        bucket = first[0]
        for _, shape, keys in (first, second):
            assert tuple(shape) == READ_BUCKETS[bucket] and len(keys) == BATCH
            assert {key_bucket(k) for k in keys} == {bucket}
    keys = [[k for _, _, ks in rank for k in ks] for rank in steps]
    assert not set(keys[0]) & set(keys[1]) and all(len(set(k)) == len(k) for k in keys)
    per_bucket = [sum(1 for k in keys[0] + keys[1] if key_bucket(k) == b) for b in range(len(READ_BUCKETS))]
    assert per_bucket == [n * BATCH * DDP_WORLD for n in rounds]  # every bucket's rest, and only that, dropped
    assert [sum(1 for s in steps[0] if s[0] == b) for b in range(len(READ_BUCKETS))] == rounds
