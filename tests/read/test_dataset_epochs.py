"""Epochs advance by themselves: each new iteration is the next epoch, standalone, through ShardLoader,
a plain DataLoader without workers and Lightning's Trainer with no hook; ``set_epoch`` pins one; resume
restores it; where nothing can advance it (a plain DataLoader with workers) a repeated epoch warns."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
from dataset_fixtures import indices, make_dataset
from torch.utils.data import DataLoader

from shardio import ShardDataset, ShardLoader


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory: pytest.TempPathFactory, encoding: str) -> str:
    directory = str(tmp_path_factory.mktemp("epochs"))
    make_dataset(directory, encoding=encoding)
    return directory


def make(dataset_dir: str, **kwargs) -> ShardDataset:
    return ShardDataset(dataset_dir, 10, shuffle=True, seed=3, **kwargs)


def order_of(source) -> np.ndarray:
    return np.concatenate([indices(b) for b in source])


def test_each_iteration_is_the_next_epoch(dataset_dir: str) -> None:
    ds = make(dataset_dir)
    orders = [order_of(ds) for _ in range(3)]
    for epoch, order in enumerate(orders):
        assert (order == ds.sample_order(epoch)).all(), f"iteration {epoch} is not epoch {epoch}"
    assert ds.epoch == 2 and not (orders[0] == orders[1]).all()


@pytest.mark.parametrize("workers", [0, 2])
def test_shard_loader_advances_the_epoch(dataset_dir: str, workers: int) -> None:
    ds = make(dataset_dir)
    loader = ShardLoader(ds, num_workers=workers)
    for epoch in range(2):
        assert (order_of(loader) == ds.sample_order(epoch)).all()
        assert ds.state_dict()["epoch"] == epoch


def test_plain_dataloader_without_workers_advances_the_epoch(dataset_dir: str) -> None:
    ds = make(dataset_dir)
    loader = DataLoader(ds, batch_size=None)
    for epoch in range(2):
        assert (order_of(loader) == ds.sample_order(epoch)).all()


def test_set_epoch_pins_and_later_iterations_count_on(dataset_dir: str) -> None:
    ds = make(dataset_dir)
    ds.set_epoch(5)
    assert (order_of(ds) == ds.sample_order(5)).all()
    assert (order_of(ds) == ds.sample_order(6)).all()
    ds.set_epoch(6)  # pinning the same epoch again repeats it
    assert (order_of(ds) == ds.sample_order(6)).all()


def test_resume_restores_the_epoch_and_the_next_one_follows(dataset_dir: str) -> None:
    ds = make(dataset_dir)
    order_of(ds), order_of(ds)  # epochs 0, 1
    batches = iter(ds)  # epoch 2
    head = [indices(next(batches)) for _ in range(4)]
    state = ds.state_dict()
    assert state["epoch"] == 2

    resumed = make(dataset_dir)
    resumed.load_state_dict(state)
    tail = order_of(resumed)
    assert (np.concatenate(head + [tail]) == ds.sample_order(2)).all()
    assert (order_of(resumed) == ds.sample_order(3)).all()


def test_epoch_loop_with_set_epoch_after_load_still_resumes(dataset_dir: str) -> None:
    """The classic loop calls ``set_epoch(state_epoch)`` after ``load_state_dict``: the resume holds."""
    ds = make(dataset_dir)
    batches = iter(ds)
    head = [indices(next(batches)) for _ in range(3)]
    resumed = make(dataset_dir)
    resumed.load_state_dict(ds.state_dict())
    resumed.set_epoch(resumed.epoch)
    assert (np.concatenate(head + [order_of(resumed)]) == ds.sample_order(0)).all()


def _warnings_to_stderr(worker_id: int) -> None:
    # pytest records warnings in the parent; a forked worker would record them in its own copy, unseen.
    warnings.simplefilter("always")
    warnings.showwarning = lambda message, *args, **kwargs: os.write(2, f"WARNING {message}\n".encode())


def test_a_plain_dataloader_with_workers_warns_on_a_repeated_epoch(dataset_dir: str, capfd) -> None:
    """Its workers get a fresh copy of the main process's dataset every epoch, so the epoch cannot
    advance; the copies share (in shared memory) which epoch each worker id started last, and warn."""
    ds = make(dataset_dir)
    loader = DataLoader(ds, batch_size=None, num_workers=2, worker_init_fn=_warnings_to_stderr)
    first = order_of(loader)
    assert "WARNING" not in capfd.readouterr().err
    again = order_of(loader)
    assert sorted(first) == sorted(again)
    err = capfd.readouterr().err
    assert err.count("starts epoch 0 again") == 2 and "set_epoch" in err, err
    ds.set_epoch(1)  # what the warning says to do
    order_of(loader)
    assert "WARNING" not in capfd.readouterr().err


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning:lightning")
def test_lightning_trainer_advances_epochs_without_a_hook(dataset_dir: str, tmp_path) -> None:
    lightning = pytest.importorskip("lightning")

    class Record(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))
            self.seen: list[np.ndarray] = []

        def training_step(self, batch, batch_index):
            self.seen.append(indices(batch))
            return (self.weight * batch["cls"].float().mean()).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    ds = make(dataset_dir)
    model = Record()
    trainer = lightning.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(model, train_dataloaders=ShardLoader(ds))
    per_epoch = len(ds)
    assert len(model.seen) == 2 * per_epoch
    for epoch in range(2):
        seen = np.concatenate(model.seen[epoch * per_epoch : (epoch + 1) * per_epoch])
        assert (seen == ds.sample_order(epoch)).all(), f"Lightning's epoch {epoch} had another order"


def test_state_after_set_epoch_is_the_start_of_the_pinned_epoch(dataset_dir: str) -> None:
    ds = make(dataset_dir)
    batches = iter(ds)
    next(batches), next(batches)
    ds.set_epoch(4)
    state = ds.state_dict()
    assert (state["epoch"], state["position"], state["batches_seen"]) == (4, 0, 0)
    resumed = make(dataset_dir)
    resumed.load_state_dict(state)
    assert (order_of(resumed) == ds.sample_order(4)).all()
