"""Checkpoints across a world-size change: a DDP job that loses one of three nodes
resumes on two from the newest snapshot; a DTensor state saved by 4 ranks is resharded onto 2 by
torch.distributed.checkpoint, exported as a DCP directory, and refused with a clear error where it
cannot be resharded."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from tgtest import SCRIPTS, events, free_port, kill_tree, wait_for

from trainguard import checkpoint
from trainguard.checkpoint import disk

pytestmark = pytest.mark.slow
WORKER = SCRIPTS / "checkpoint_worker.py"
RESHARD = SCRIPTS / "checkpoint_reshard.py"


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def worker_logs(run: Path) -> dict[Path, str]:
    return {p: p.read_text(errors="replace") for p in sorted((run / "logs").glob("attempt-*/rank-*.log"))}


def at_world(run: Path, world: int) -> dict[Path, str]:
    """Logs of the workers that ran at this world size."""
    return {p: t for p, t in worker_logs(run).items() if re.search(rf"resume step=\d+ digest=\S+ world={world} ", t)}


def saved(text: str) -> dict[int, str]:
    return {int(m[1]): m[2] for m in re.finditer(r"saved step=(\d+) digest=(\w+) ok=True", text)}


def test_checkpoint_ddp_job_resumes_after_a_3_to_2_node_shrink(jobs, tmp_path, shm_root):
    run = tmp_path / "run"
    port = free_port()
    common = ["--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "shrink", "--rdzv-conf", "last_call_timeout=3",
              "--max-restarts", "1", "--run-dir", run, "--ckpt-shm-dir", shm_root, "--precheck", "off", "--quiet"]
    script = [WORKER, "--steps", "100000", "--every", "1", "--step-sleep", "0.05", "--steps-after-resize", "3"]
    nodes = {"node0": jobs("run", *common, "--node-name", "node0", *script, name="node0")}
    wait_for(lambda: port_open(port), what="node0 hosting the rendezvous store")
    for name in ("node1", "node2"):
        nodes[name] = jobs("run", *common, "--node-name", name, *script, name=name)

    def three_ranks_saved() -> bool:
        logs = at_world(run, 3)
        return len(logs) == 3 and all(len(saved(t)) >= 4 for t in logs.values())

    wait_for(three_ranks_saved, what="3 ranks at world size 3 with 4 snapshots each")
    kill_tree(nodes["node2"].proc.pid)  # the node is lost: agent, worker and its shared memory
    for name in ("node0", "node1"):
        assert nodes[name].wait() == 0, nodes[name].output()

    before = at_world(run, 3)
    after = at_world(run, 2)
    assert len(after) == 2, f"expected 2 workers at world size 2, got {list(after)}"
    resumed = {int(re.search(r"resume step=(\d+) digest=(\S+)", t)[1]) for t in after.values()}
    digests = {re.search(r"resume step=\d+ digest=(\S+)", t)[1] for t in after.values()}
    assert len(resumed) == 1 and len(digests) == 1, "both ranks resume the same state"
    (step,), (digest,) = resumed, digests
    # Replicated state: every old rank that saved this step saved the same bytes, and that is
    # exactly what both new ranks loaded.
    at_step = {saved(t)[step] for t in before.values() if step in saved(t)}
    assert at_step == {digest}
    # Nothing newer than the newest snapshot on the surviving nodes was lost.
    survivors_last = [max(saved(t)) for p, t in before.items() if "saved_world=3" in t]
    assert step >= min(survivors_last), (step, survivors_last)
    for t in after.values():
        assert "saved_world=3" in t and "done" in t

    [loaded] = [e for e in events(run, "checkpoint_loaded") if e.evidence.get("world_size") == 2]
    assert loaded.evidence["saved_world_size"] == 3 and loaded.evidence["mode"] == "replicated"
    assert loaded.evidence["step"] == step
    # The surviving nodes still held their old ranks' newest snapshots in shared memory.
    assert loaded.evidence["source"] == "memory", loaded.evidence
    assert not events(run, "checkpoint_incompatible")


def _ranks(script: Path, n: int, env: dict[str, str], timeout: float = 240) -> list[dict]:
    port = str(free_port())
    procs = []
    try:
        for rank in range(n):
            penv = dict(os.environ, **env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
            penv.pop("TRAINGUARD_CKPT_SHM_DIR", None)
            procs.append(subprocess.Popen([sys.executable, str(script)], env=penv, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, start_new_session=True))
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            kill_tree(p.pid)
    results = []
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_checkpoint_dtensor_state_resharded_from_4_to_2_ranks_and_exported_to_dcp(tmp_path, shm_root):
    ckpt_dir = tmp_path / "ckpt"
    env = {"TRAINGUARD_CKPT_DIR": str(ckpt_dir), "SHM_ROOT": str(shm_root), "TRAINGUARD_CKPT_SHM_ROOT": str(shm_root)}
    saved4 = _ranks(RESHARD, 4, dict(env, PHASE="save"))
    assert all(r["saved"] == [1, 2] for r in saved4)
    assert disk.ranks_at(ckpt_dir, 2) == [0, 1, 2, 3]

    # A real DCP directory, written from the trainguard files in this (non-distributed) process.
    assert checkpoint.export_dcp(tmp_path / "dcp", ckpt_dir) == 2
    assert (tmp_path / "dcp" / ".metadata").is_file()

    # Rank 3's file of step 2 is gone (its node died before persisting it): step 2 cannot be
    # resharded, step 1 can. Then with step 1's gone too, nothing can: a clear error, not a fresh start.
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    for name in (disk.manifest_name(3), disk.data_name(3)):
        shutil.move(disk.step_dir(ckpt_dir, 2) / name, hidden / name)
    results = _ranks(RESHARD, 2, dict(env, PHASE="load", DCP_DIR=str(tmp_path / "dcp")))
    for r in results:
        assert r["world2_step"] == 1 and r["fallback_step"] == 1, r
        assert r["resharded_ok"] and r["local_rows"] == 5 and r["placements"] == ["S(0)"], r
        assert r["optim_step"] == 1.0 and r["extra"] == "meta-1", r
        assert r["dcp_ok"], r  # the exported DCP checkpoint (step 2), loaded by torch at world size 2
        assert "rank(s) [3]" in r["fallback_reason"]
        assert "pass mesh=" in r["no_mesh_error"]
        assert "no checkpoint can be loaded at world size 2" in r["refused_error"] and "rank(s) [3]" in r["refused_error"]
