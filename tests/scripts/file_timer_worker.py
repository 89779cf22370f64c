"""A worker that uses torch elastic's file timer as torchrun documents it: the agent exports
TORCHELASTIC_TIMER_FILE when TORCHELASTIC_ENABLE_FILE_TIMER=1, the worker arms a timer around a
step. ``--overrun`` makes rank 0 sleep far past its timer: the agent's FileTimerServer must kill it."""

import argparse
import os
import sys
import time

from torch.distributed.elastic import timer

p = argparse.ArgumentParser()
p.add_argument("--overrun", action="store_true")
args = p.parse_args()
path = os.environ.get("TORCHELASTIC_TIMER_FILE")
if not path:
    sys.exit("TORCHELASTIC_TIMER_FILE is not set")
timer.configure(timer.FileTimerClient(path))
with timer.expires(after=60):
    print(f"rank {os.environ['RANK']}: timer armed at {path}", flush=True)
if args.overrun and os.environ["RANK"] == "0":
    with timer.expires(after=1):
        time.sleep(600)  # bounded: the timer server kills this well before
print(f"rank {os.environ['RANK']}: done", flush=True)
