"""bench/faults.py, lean: a whole node SIGKILLed and a node's network cut, across three
network-namespace nodes (needs root; CI runs as root). Every case must be survived."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tgtest import REPO

from trainguard.chaos import testbed

pytestmark = [pytest.mark.slow, pytest.mark.skipif(testbed.available() is not None, reason=str(testbed.available()))]


@pytest.mark.timeout(900)
def test_fault_matrix_kill_node_and_net_cut(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "faults.py"), "--faults", "kill-node,net-cut", "--steps", "100", "--keep", tmp_path],
        capture_output=True, text=True, timeout=850,
    )  # fmt: skip
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0, done.stdout + done.stderr
    assert lines[-1] == "2/2 faults survived, 0 steps lost beyond 1", done.stdout
    rows = {ln.split()[0]: ln for ln in lines[1:-1]}
    assert "node_lost: node n3 lost" in rows["kill-node"], rows
    assert "node_lost: node n3 lost" in rows["net-cut"] and "unreachable" in rows["net-cut"], rows
