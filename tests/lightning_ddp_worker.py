"""One rank of the DDP tests (``tests/train/test_lightning.py``: a single-shape and a bucketed dataset), run under
torchrun: trains one epoch with ``ShardDataModule`` on CPU (gloo) and writes what this rank trained on to
OUT/rank{R}.json: the sample indices, or with ``buckets`` as third argument each step's bucket, image shape
and keys (a bucketed dataset's)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import lightning.pytorch as pl
import torch

from shardio.train.lightning import ShardDataModule


class Recorder(pl.LightningModule):
    def __init__(self, buckets: bool = False) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.buckets = buckets
        self.seen: list = []

    def training_step(self, batch, batch_idx):
        if self.buckets:  # one entry a step: (bucket, [h, w], keys)
            self.seen.append((int(batch["bucket"]), list(batch["image"].shape[2:]), list(batch["__key__"])))
        else:
            self.seen.extend(int(k[1:]) for k in batch["__key__"])
        return self.layer(batch["image"].mean(dim=(2, 3))).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main(path: str, out: str, mode: str = "") -> None:
    model = Recorder(buckets=mode == "buckets")
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy="ddp",
                         max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False)
    data = ShardDataModule(path, 8, shuffle=True, seed=1, drop_last=True)
    trainer.fit(model, data)
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump({"seen": model.seen, "world": data.train_dataset.world_size,
                   "rank": data.train_dataset.rank}, f)
    # Lightning leaves the process group up; torch's gloo threads then race interpreter exit, and a rank
    # sometimes aborted there ("terminate called without an active exception") after a good epoch.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def run_ranks(dataset: str, out: str, *args: str, world: int = 2) -> list[dict]:
    """Run this file under torchrun with ``world`` CPU ranks (a session of its own: on a timeout the ranks
    are killed with torchrun, not left behind); each rank's record, in rank order."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--standalone",
               os.path.abspath(__file__), dataset, out, *args]
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise
    assert process.returncode == 0, stdout[-2000:] + stderr[-3000:]
    ranks = []
    for rank in range(world):
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            ranks.append(json.load(f))
    return ranks


if __name__ == "__main__":
    main(*sys.argv[1:4])
