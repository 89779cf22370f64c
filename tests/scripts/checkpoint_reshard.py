"""gloo ranks for the resharding test. PHASE=save (4 ranks): a DTensor state (a weight of 10 rows
sharded over 4 ranks: 3, 3, 3, 1 rows; a replicated optimizer step; a plain value) saved at steps 1
and 2 without an agent. PHASE=load (2 ranks): resume it resharded (5, 5 rows) from the disk, where
rank 3's file of step 2 is missing; load the exported DCP directory with torch's own reader; then
check the refusals. Env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TRAINGUARD_CKPT_DIR, SHM_ROOT,
PHASE, DCP_DIR. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from trainguard.checkpoint import disk
from trainguard.checkpoint.client import Checkpointer
from trainguard.checkpoint.reshard import IncompatibleCheckpoint
from trainguard.checkpoint.shm import make_shm_dir, release_shm_dir


def full(step: int) -> torch.Tensor:
    return torch.arange(30, dtype=torch.float32).view(10, 3) * step


def state(mesh, step: int) -> dict:
    return {"model": {"w": distribute_tensor(full(step), mesh, [Shard(0)])},
            "optim": {"step": torch.tensor(float(step))}, "extra": f"meta-{step}", "step": step}


def load(ckpt_dir: Path, shm_root: Path, rank: int, world: int, mesh) -> tuple[object, list[str]]:
    shm = make_shm_dir(shm_root)
    ck = Checkpointer(shm, ckpt_dir, rank, world)
    try:
        got = ck.load_latest(mesh=mesh)
        reports = [json.loads(p.read_text()) for p in sorted((shm / "reports").glob("*.json"))]
        return got, [json.dumps(r["evidence"]) for r in reports if r["kind"] == "checkpoint_fallback"]
    finally:
        ck.close()
        release_shm_dir(shm)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    ckpt_dir, shm_root = Path(os.environ["TRAINGUARD_CKPT_DIR"]), Path(os.environ["SHM_ROOT"])
    out: dict = {"rank": rank}
    if os.environ["PHASE"] == "save":
        ck = Checkpointer.from_env()  # local mode: this process persists its own snapshots
        for step in (1, 2):
            assert ck.save(state(mesh, step), step)
            ck.wait()
        ck.close()
        out["saved"] = disk.list_steps(ckpt_dir, rank)[::-1]
    else:
        got, fallbacks = load(ckpt_dir, shm_root, rank, world, mesh)
        w = got["model"]["w"]
        out.update(world2_step=got["step"], fallback_step=got["step"], extra=got["extra"],
                   optim_step=float(got["optim"]["step"]), resharded_ok=isinstance(w, DTensor)
                   and bool(torch.equal(w.full_tensor(), full(got["step"]))),
                   local_rows=w.to_local().shape[0], placements=[str(p) for p in w.placements],
                   fallback_reason=" ".join(fallbacks))
        # The exported DCP directory (step 2, all 4 ranks' shards), read by torch's FileSystemReader.
        target = {"model": {"w": distribute_tensor(torch.zeros(10, 3), mesh, [Shard(0)])}}
        dcp.load(target, checkpoint_id=os.environ["DCP_DIR"])
        out["dcp_ok"] = bool(torch.equal(target["model"]["w"].full_tensor(), full(2)))
        dist.barrier()
        try:  # sharded state at another world size without a mesh: refused, with the reason
            load(ckpt_dir, shm_root, rank, world, None)
            out["no_mesh_error"] = "loaded without a mesh"
        except IncompatibleCheckpoint as exc:
            out["no_mesh_error"] = str(exc)
        dist.barrier()
        if rank == 0:  # step 1 loses rank 3's file too: nothing can be resharded any more
            hidden = ckpt_dir.parent / "hidden1"
            hidden.mkdir()
            for name in (disk.manifest_name(3), disk.data_name(3)):
                shutil.move(disk.step_dir(ckpt_dir, 1) / name, hidden / name)
        dist.barrier()
        try:
            load(ckpt_dir, shm_root, rank, world, mesh)
            out["refused_error"] = "loaded"
        except IncompatibleCheckpoint as exc:
            out["refused_error"] = str(exc)
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()
    # Leave without interpreter teardown: under heavy load torch's gloo teardown at exit has
    # aborted a finished worker ("terminate called without an active exception").
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
