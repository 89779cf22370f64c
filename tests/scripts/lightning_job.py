"""A real Lightning job (CPU, DDP on gloo, a tiny module) with trainguard's callback: snapshots
every 5 steps, validation and ModelCheckpoint saves every 10. Rank 1 SIGKILLs itself at
--kill-step on the first attempt; the restarted attempt resumes from the snapshot."""

import argparse
import os
import signal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainguard.integrations.lightning import TrainguardCallback

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=30)
p.add_argument("--kill-step", type=int, default=-1)
p.add_argument("--out", required=True)
args = p.parse_args()
rank, attempt = int(os.environ["RANK"]), int(os.environ["TRAINGUARD_RESTART_COUNT"])


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.01)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=10)}


class Report(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        print(f"train begins at step {trainer.global_step}", flush=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if rank == 1 and attempt == 0 and trainer.global_step == args.kill_step:
            print(f"killing myself at step {trainer.global_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_end(self, trainer, pl_module):
        print(f"train ends at step {trainer.global_step}", flush=True)


gen = torch.Generator().manual_seed(0)
x = torch.randn(1024, 16, generator=gen)
data = TensorDataset(x, x.sum(dim=1, keepdim=True))
torch.manual_seed(0)
trainguard_cb = TrainguardCallback(checkpoint_every=5)
trainer = pl.Trainer(
    accelerator="cpu", devices=2, strategy="ddp", max_steps=args.steps, val_check_interval=10,
    limit_val_batches=2, num_sanity_val_steps=0, logger=False, enable_model_summary=False,
    default_root_dir=args.out,
    callbacks=[trainguard_cb, Report(), ModelCheckpoint(dirpath=args.out, every_n_train_steps=10, save_top_k=-1)],
)  # fmt: skip
trainer.fit(Regressor(), DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
print(f"resumed_from={trainguard_cb.resumed_from}", flush=True)
torch.distributed.barrier()
torch.distributed.destroy_process_group()
os._exit(0)  # skip gloo's teardown race under load (see tests/tgtest.py)
