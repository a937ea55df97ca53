"""``shardio.train.lightning.ShardDataModule`` under a real Lightning Trainer on CPU.

Every sample carries its index in its pixels and key (``tests/training_helpers.py``); the module records
the keys each training step gets, so one comparison catches missing, repeated and reordered samples.
117 samples in batches of 8 (``drop_last=False``) make 15 batches an epoch, the last one of 5.
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
from tests.dataset_fixtures import assert_exactly_once  # noqa: E402
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

    def training_step(self, batch, batch_idx):
        image = batch["image"]
        assert image.dtype == torch.float32 and image.shape[1] == 3  # normalised NCHW after the transfer
        self.seen.append((self.current_epoch, batch_idx, [int(k[1:]) for k in batch["__key__"]]))
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


def test_epochs_are_different_permutations_and_repeat_when_rerun(dataset):
    first = fit(dataset, max_epochs=2).epochs()
    assert sorted(first) == [0, 1]
    for epoch in (0, 1):
        assert_exactly_once(np.array(first[epoch]), SAMPLES)
    assert first[0] != first[1], "the Trainer's epochs reached the dataset: each has its own order"
    again = fit(dataset, max_epochs=2).epochs()
    assert again == first, "same seed, same orders"


@pytest.mark.parametrize("stop_after", [6, BATCHES + 6, BATCHES])
def test_checkpoint_mid_epoch_resumes_at_exactly_the_next_batch(dataset, tmp_path, stop_after):
    reference = fit(dataset, max_epochs=2)
    checkpoints = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=stop_after, save_top_k=-1)
    interrupted = fit(dataset, max_steps=stop_after, callbacks=[checkpoints], enable_checkpointing=True)
    saved = glob.glob(str(tmp_path / f"*step={stop_after}.ckpt"))
    assert len(saved) == 1, saved
    resumed = fit(dataset, ckpt_path=saved[0], max_epochs=2)

    assert [keys for _, _, keys in interrupted.seen] == [keys for _, _, keys in reference.seen[:stop_after]]
    # The resumed run starts with the batch after the checkpoint, with Lightning's own batch_idx.
    assert [(e, i) for e, i, _ in resumed.seen] == [(e, i) for e, i, _ in reference.seen[stop_after:]]
    combined = interrupted.epochs()
    for epoch, keys in resumed.epochs().items():
        combined.setdefault(epoch, []).extend(keys)
    for epoch in (0, 1):
        assert_exactly_once(np.array(combined[epoch]), SAMPLES)  # nothing missing or repeated
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
    from shardio.train.augment import TrainAugment

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
    from shardio.train.augment import TrainAugment

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
