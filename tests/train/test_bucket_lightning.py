"""``ShardDataModule`` on a bucketed dataset under a real Lightning Trainer on CPU: each step gets one bucket's
batch in that bucket's shape (or the transform's fixed size), a tiny conv net with global pooling trains on
them, every sample is seen once an epoch, and a checkpoint mid-epoch resumes at exactly the next batch."""

from __future__ import annotations

import glob

import pytest
import torch
from bucket_fixtures import BUCKETS, key_bucket, key_index, make_bucketed_dataset

pytest.importorskip("lightning")
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from shardio.train.augment import TrainAugment  # noqa: E402
from shardio.train.lightning import ShardDataModule  # noqa: E402

SAMPLES, BATCH = 60, 8  # buckets of 20, 27 and 13: 3 + 4 + 2 batches an epoch without drop_last

pytestmark = [pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
              pytest.mark.filterwarnings("ignore:.*GPU available but not used.*"),
              pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`"),
              pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")]


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
def dataset(tmp_path_factory) -> str:
    return make_bucketed_dataset(str(tmp_path_factory.mktemp("lightning-buckets") / "ds"))


def fit(path: str, ckpt_path: str | None = None, transform=None, **options) -> AnyShapeNet:
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
def test_each_step_gets_one_buckets_batch_in_its_shape_and_a_model_trains(dataset, transform, fixed):
    torch.manual_seed(0)  # the initial weights fit() starts from
    before = {k: v.clone() for k, v in AnyShapeNet().state_dict().items()}
    model = fit(dataset, transform=transform, max_epochs=2)
    for epoch in (0, 1):
        steps = [s for s in model.seen if s[0] == epoch]
        assert sorted(i for s in steps for i in s[3]) == list(range(SAMPLES)), "every sample once an epoch"
        assert len(steps) == 3 + 4 + 2
    assert all(shape == (fixed or BUCKETS[bucket]) for _, bucket, shape, _ in model.seen)
    assert {bucket for _, bucket, _, _ in model.seen} == {0, 1, 2}
    assert all(torch.isfinite(torch.tensor(model.losses)))
    after = model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before), "the optimizer stepped"


def test_a_bucketed_run_resumes_mid_epoch_at_exactly_the_next_batch(dataset, tmp_path):
    reference = fit(dataset, max_epochs=2)
    stop = 9 + 4  # into the second epoch
    checkpoints = ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=stop, save_top_k=-1)
    interrupted = fit(dataset, max_steps=stop, callbacks=[checkpoints], enable_checkpointing=True)
    (saved,) = glob.glob(str(tmp_path / f"*step={stop}.ckpt"))
    resumed = fit(dataset, ckpt_path=saved, max_epochs=2)
    assert interrupted.seen + resumed.seen == reference.seen
