"""One gloo rank of a restarted attempt: load_latest() from the given shm and checkpoint dirs, then
(when SAVE_STEP is set) save that step with the weight VALUE and wait until it is in memory. Env:
RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, SHM_DIR, CKPT_DIR, NSLOTS, SAVE_STEP, VALUE. Prints one
JSON line: the loaded step and weight (null for nothing loaded).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from trainguard.checkpoint.client import Checkpointer


def main() -> None:
    dist.init_process_group("gloo")
    ck = Checkpointer(Path(os.environ["SHM_DIR"]), Path(os.environ["CKPT_DIR"]), dist.get_rank(),
                      dist.get_world_size(), nslots=int(os.environ["NSLOTS"]))
    try:
        state = ck.load_latest()
        save = os.environ.get("SAVE_STEP")
        if save:
            value = float(os.environ["VALUE"])
            assert ck.save({"w": torch.full((256,), value), "step": int(save)}, int(save), overlap=False)
            ck.wait()
        loaded = None if state is None else {"step": state["step"], "w": float(state["w"][0])}
        print(json.dumps({"rank": dist.get_rank(), "loaded": loaded}), flush=True)
    finally:
        ck.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
