"""`trainguard stacks` on a two-node job (two agents on loopback sharing one run dir): this host's
node is dumped directly, the other node answers through the request file in the run dir."""

from __future__ import annotations

import re
import subprocess

import pytest
from tgtest import EXAMPLE, events, free_port, rank_log, trainguard_cmd, wait_for, wait_log

pytestmark = pytest.mark.slow


def test_stacks_of_two_nodes_through_the_run_dir(jobs, tmp_path):
    run = tmp_path / "run"
    port = free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", "stacks", "--run-dir", run, "--precheck", "off", "--quiet"]
    script = [EXAMPLE, "--steps", "100000", "--step-time-ms", "50"]
    jobs("run", *common, "--node-name", "node-a", *script, name="a")
    jobs("run", *common, "--node-name", "node-b", *script, name="b")
    wait_for(lambda: {e.node for e in events(run, "job_started")} == {"node-a", "node-b"}, what="both nodes started")
    for rank in (0, 1):
        wait_log(rank_log(run, 0, rank), "step=3 ")
    res = subprocess.run(trainguard_cmd("stacks", run, "--node-name", "node-a", "--timeout", "60"),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    heads = re.findall(r"^=== rank (\d) \(node (\S+)( via its agent)?, pid \d+", res.stdout, re.MULTILINE)
    assert sorted((node, via) for _, node, via in heads) == [("node-a", ""), ("node-b", " via its agent")], res.stdout
    assert sorted(rank for rank, _, _ in heads) == ["0", "1"]
    assert res.stdout.count("train_mlp.py") >= 2
    assert list((run / "stacks").iterdir()) == []  # the request was cleaned up
