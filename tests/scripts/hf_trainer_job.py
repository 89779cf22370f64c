"""A real Hugging Face Trainer job (tiny GPT-2 built from a config, CPU, gloo, no downloads) with
trainguard's callback: snapshots every 5 steps, evaluation and saves every 10. Rank 1 SIGKILLs
itself at --kill-step on the first attempt; the restarted attempt resumes from the snapshot.
With --stop-after-save N, rank 1 freezes (SIGSTOP) right after the Trainer's save at step N of
the first attempt (a stopped rank is never "saving a checkpoint")."""

import argparse
import os
import signal

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from token_data import Tokens  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from trainguard.integrations.hf import TrainguardCallback  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=30)
p.add_argument("--kill-step", type=int, default=-1)
p.add_argument("--stop-after-save", type=int, default=-1)
p.add_argument("--out", required=True)
args = p.parse_args()
rank, attempt = int(os.environ["RANK"]), int(os.environ["TRAINGUARD_RESTART_COUNT"])


class Report(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        print(f"train begins at step {state.global_step}", flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        if rank == 1 and attempt == 0 and state.global_step == kill_step:
            print(f"killing myself at step {state.global_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def on_save(self, args, state, control, **kwargs):
        if rank == 1 and attempt == 0 and state.global_step == stop_after_save:
            print(f"fault=stop rank={rank} after the save of step {state.global_step}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)

    def on_train_end(self, args, state, control, **kwargs):
        print(f"train ends at step {state.global_step}", flush=True)


kill_step, stop_after_save = args.kill_step, args.stop_after_save
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=128, n_positions=16,
                                   bos_token_id=0, eos_token_id=0))  # fmt: skip
targs = TrainingArguments(
    output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=4, per_device_eval_batch_size=8,
    eval_strategy="steps", eval_steps=10, save_strategy="steps", save_steps=10, logging_steps=5,
    report_to=[], use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0, seed=0,
)  # fmt: skip
trainguard_cb = TrainguardCallback(checkpoint_every=5)
trainer = Trainer(model=model, args=targs, train_dataset=Tokens(512), eval_dataset=Tokens(32),
                  callbacks=[trainguard_cb, Report()])  # fmt: skip
trainer.train()
print(f"resumed_from={trainguard_cb.resumed_from}", flush=True)
torch.distributed.barrier()
torch.distributed.destroy_process_group()
os._exit(0)  # skip gloo's teardown race under load (see tests/tgtest.py)
