"""`trainguard nodecheck` with real processes: 4 "nodes" on loopback, one broken or slow."""

from __future__ import annotations

import json

import pytest
from tgtest import free_port


@pytest.mark.slow
def test_two_nodes_as_separate_processes_measure_with_per_op_units(jobs):
    # (A broken node among 4 agents is tested through `trainguard run` in test_checks_e2e.py.)
    port = free_port()
    procs = [
        jobs("nodecheck", "--nnodes", "2", "--node-rank", str(i), "--master-port", str(port), name=f"node{i}")
        for i in range(2)
    ]
    codes = [p.wait() for p in procs]
    outs = [p.output() for p in procs]
    assert codes == [0, 0], outs
    for i, out in enumerate(outs):
        assert "nodecheck verdict: all 2 node(s) healthy" in out, out
        line = next(ln for ln in out.splitlines() if "ms/op" in ln)
        assert line.startswith(f"nodecheck node {i} group [0, 1]: gemm ")
        assert (
            "all-reduce" in line
            and "all-gather" in line
            and "busbw" in line
            and "GB/s" in line
            and "gloo" in line
        )


@pytest.mark.slow
def test_local_simulation_names_the_slow_node_straggler(jobs):
    job = jobs("nodecheck", "--local", "4", "--chaos", "1=slow:10", "--json")
    code = job.wait()
    out = job.output()
    data = json.loads(out[out.index("{") :])
    assert code == 3, out
    assert list(data["stragglers"]) == ["1"], data
    assert not data["faulty"] and not data["undetermined"]
    times = data["times_s_per_iteration"]
    assert times["1"] > 2 * sorted(times.values())[1]
    # The slow node and its first partner were retested with other partners in round 2.
    groups = {tuple(r["group"]) for r in data["results"]}
    assert any(1 in g and 0 not in g for g in groups)


def test_usage_errors_exit_2(jobs):
    assert jobs("nodecheck", "--local", "2", "--chaos", "5=fail").wait() == 2
    assert jobs("nodecheck", "--chaos", "0=fail").wait() == 2
    assert jobs("nodecheck", "--local", "2", "--chaos", "0=explode").wait() == 2
