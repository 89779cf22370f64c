"""A plain training script (no trainguard code except one optional span) that exercises every
automatic span kind; at the end it reads its own ring and prints what was recorded as JSON.

Run through trainguard's worker entry with the profiling env set (see tests/test_profiling_worker.py).
"""

from __future__ import annotations

import collections
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import trainguard

dist.init_process_group("gloo")
model = DDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
hook_calls = []


def my_hook(state, bucket):  # registered after DDP was built: must replace the default, not fail
    hook_calls.append(bucket.index())
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


model.register_comm_hook(None, my_hook)
loss_fn = nn.MSELoss()  # a top-level module without parameters: not "FP"
opt = torch.optim.SGD(model.parameters(), lr=0.1)
opt2 = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # a second optimizer: no double steps
loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8)
for _epoch in range(2):
    for x, y in loader:
        with trainguard.span("fwd+bwd"):
            loss = loss_fn(model(x), y)
            loss.backward()
        opt.step()
        opt2.step()
        dist.all_gather_object([None] * dist.get_world_size(), {"loss": loss.item()})
with tempfile.TemporaryDirectory() as d:
    torch.save(model.state_dict(), os.path.join(d, "m.pt"))
    import torch.distributed.checkpoint as dcp

    dcp.save({"m": model.state_dict()}, checkpoint_id=os.path.join(d, "dcp"))

from trainguard.probes.ring_reader import RingReader  # noqa: E402
from trainguard.worker import ring as R  # noqa: E402

reader = RingReader(R.ring_path(os.environ["TRAINGUARD_RING_PREFIX"], os.environ["TRAINGUARD_RESTART_COUNT"],
                                os.environ["RANK"]))
records = reader.read_new()
per_step = collections.defaultdict(collections.Counter)
for r in records:
    per_step[r.step][R.KIND_NAMES[r.kind]] += 1
print(json.dumps({
    "steps": reader.step_count,
    "per_step": {str(k): dict(v) for k, v in sorted(per_step.items())},
    "names": sorted({reader.name(r.name_id) for r in records if r.kind == R.USER}),
    "hook_calls": len(hook_calls),
    "ordered": all(r.start_ns <= r.end_ns for r in records),
}))
sys.stdout.flush()
dist.destroy_process_group()
# Leave without interpreter teardown: under heavy load torch's gloo teardown at exit has
# aborted a finished worker here ("terminate called without an active exception"); these
# tests check trainguard, not torch's exit path.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
