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


@pytest.mark.slow
def test_several_check_processes_per_node_measure_across_every_process(jobs):
    """The node check runs one process per GPU; on the CPU --procs N runs N gloo processes per node:
    the collectives span every process of the group's nodes, the GEMM runs in each, and each node
    reports its slowest process. A node whose processes die is found faulty."""
    job = jobs("nodecheck", "--local", "3", "--procs", "2", "--chaos", "2=fail", "--json")
    code = job.wait()
    out = job.output()
    data = json.loads(out[out.index("{") :])
    assert code == 1, out
    assert list(data["faulty"]) == ["2"] and "check process exit 17" in data["faulty"]["2"], data
    measured = [m for runs in data["measurements"].values() for m in runs]
    assert measured and {m["procs"] for m in measured} == {2}
    for m in measured:
        assert m["world_size"] == 2 * len(m["group"])  # every process of every node of the group
        ranks = sorted(p["rank"] for p in m["per_process"])
        assert len(ranks) == 2 and len(m["gemm_s_per_device"]) == 2
        assert m["gemm_s"] == max(m["gemm_s_per_device"])
        assert m["allreduce_s"] == max(p["allreduce_s"] for p in m["per_process"])
    # node 0 and node 1 measured together: their ranks are 0-1 and 2-3 of a world of 4
    pair = [next(m for m in data["measurements"][n] if sorted(m["group"]) == [0, 1]) for n in ("0", "1")]
    assert sorted(p["rank"] for m in pair for p in m["per_process"]) == [0, 1, 2, 3]


def test_usage_errors_exit_2(jobs):
    assert jobs("nodecheck", "--local", "2", "--chaos", "5=fail").wait() == 2
    assert jobs("nodecheck", "--chaos", "0=fail").wait() == 2
    assert jobs("nodecheck", "--local", "2", "--chaos", "0=explode").wait() == 2


def test_unreachable_store_answers_within_about_the_timeout_in_one_line():
    """--timeout 5 against a store nobody listens on took 114 s and printed torch's
    C++ retry frames; it answers within about the timeout, one line, and exit 1 (faulty)."""
    import subprocess

    from tgtest import trainguard_cmd

    cmd = trainguard_cmd("nodecheck", "--node-rank", "1", "--nnodes", "2", "--master-addr", "127.0.0.1",
                         "--master-port", str(free_port()), "--timeout", "5")
    # 5 s of waiting plus a start that imports torch on a loaded machine; torch's own client waits 60 s+
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=55, stdin=subprocess.DEVNULL)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "not reachable within 5 s" in lines[0], done.stderr
    assert "frame" not in done.stderr and "c10d" not in done.stderr


def test_timeouts_are_finite_and_bounded():
    """A timeout of 1e308 never answered (clocks and timedeltas overflow)."""
    import argparse

    from trainguard.options import MAX_SECONDS, number, seconds

    for bad in ("nan", "inf", "-inf", "1e308", "1e400", str(MAX_SECONDS * 2), "0", "-1", "abc"):
        with pytest.raises(argparse.ArgumentTypeError):
            seconds(bad)
    assert seconds("5") == 5.0 and seconds(str(MAX_SECONDS)) == MAX_SECONDS
    assert number("an integer", integer=True, maximum=10)("10") == 10


def test_local_simulated_nodes_each_get_their_own_gpu() -> None:
    # NCCL refuses two ranks of one group on one GPU: with --local on a GPU machine every simulated
    # node's benchmark sees its own device (round robin when there are fewer GPUs than nodes).
    from trainguard.checks.nodecheck_cli import local_gpu_env

    assert local_gpu_env(0, 0, None) == {}  # no GPU: nothing changes (gloo on the CPU)
    assert [local_gpu_env(i, 4, None) for i in range(5)] == [{"CUDA_VISIBLE_DEVICES": d} for d in "01230"]
    assert local_gpu_env(1, 2, "5, 7") == {"CUDA_VISIBLE_DEVICES": "7"}  # the user's own selection kept
    assert local_gpu_env(2, 2, "GPU-aaaa,GPU-bbbb") == {"CUDA_VISIBLE_DEVICES": "GPU-aaaa"}
