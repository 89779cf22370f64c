"""`trainguard nodecheck --burn/--sweep`: the pure parts (nccl-tests table, throttle judgement,
checksum comparison, what the verdict judges) and real runs of two simulated nodes on gloo."""

from __future__ import annotations

import re

import pytest

from trainguard.checks.burn import burn_fault, checksum_outliers, node_burn, throttle
from trainguard.checks.nodecheck_run import _judged_times
from trainguard.checks.sweep import (
    format_table,
    largest_times,
    op_count,
    slowest_rows,
    sweep_sizes,
    table_row,
)


def test_sweep_sizes_double_from_8_bytes_up_to_the_max():
    assert sweep_sizes(64) == [8, 16, 32, 64]
    assert sweep_sizes(100) == [8, 16, 32, 64]
    assert sweep_sizes(2**20)[-1] == 2**20 and len(sweep_sizes(2**20)) == 18
    assert sweep_sizes(1) == [8]  # at least one size


def test_op_count_all_gather_takes_one_element_from_each_rank_at_least():
    assert op_count("all_reduce", 8, 4) == (2, 8)
    assert op_count("all_gather", 8, 4) == (1, 16)  # 4 ranks x 1 float
    assert op_count("all_gather", 1024, 4) == (64, 1024)


def test_table_row_uses_nccl_tests_bandwidths():
    r = table_row("all_reduce", 100_000_000, 25_000_000, 0.010, 8)
    assert r["time_us"] == pytest.approx(10_000)
    assert (r["algbw"], r["busbw"]) == pytest.approx((10.0, 17.5))
    r = table_row("all_gather", 100_000_000, 6_250_000, 0.010, 4)
    assert (r["algbw"], r["busbw"], r["type"]) == (pytest.approx(10.0), pytest.approx(7.5), "float")


def test_node_row_is_the_slowest_process_per_size():
    fast = [table_row("all_reduce", 8, 2, 1e-4, 2), table_row("all_reduce", 16, 4, 1e-4, 2)]
    slow = [table_row("all_reduce", 8, 2, 5e-5, 2), table_row("all_reduce", 16, 4, 4e-4, 2)]
    rows = slowest_rows([fast, slow], "all_reduce", 2)
    assert [r["time_us"] for r in rows] == pytest.approx([100.0, 400.0])
    assert rows[1]["algbw"] == pytest.approx(16 / 4e-4 / 1e9)
    assert largest_times({"all_reduce": rows, "all_gather": fast}) == pytest.approx((4e-4, 1e-4))


def test_table_has_the_nccl_tests_columns():
    lines = format_table("t", [table_row("all_reduce", 1024, 256, 2e-5, 2)])
    assert lines[1].split() == ["size", "count", "type", "time", "algbw", "busbw"]
    assert lines[3].split() == ["1024", "256", "float", "20.0", "0.051", "0.051"]


def test_throttle_compares_work_over_time_of_the_first_and_last_fifth():
    steady = throttle([0.01] * 10, 1.0)
    assert steady.first_gflops == pytest.approx(100.0) and not steady.throttled
    hot = throttle([0.01] * 8 + [0.02] * 2, 1.0)  # the last fifth at half the rate
    assert hot.last_gflops == pytest.approx(50.0) and hot.drop == pytest.approx(0.5) and hot.throttled
    stall = throttle([0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.05], 1.0)
    assert stall.last_gflops == pytest.approx(2 / 0.06)  # a stall counts, a median would hide it
    assert throttle([], 1.0).first_gflops == 0.0 and not throttle([], 1.0).throttled


def test_checksum_outliers_name_the_device_that_disagrees():
    assert checksum_outliers([1e10, 1e10, 1e10, 1.1e10]) == [3]
    assert checksum_outliers([1e10, 1e10 * (1 + 1e-5)]) == []  # within the tolerance
    assert checksum_outliers([1e10, 2e10]) == [0, 1]  # two that disagree: neither can be trusted
    assert checksum_outliers([1e10]) == []


def _proc(wrong=0, checksum=1e10, steps=(0.01,) * 10):
    return {"device": "cuda:0", "burn_wrong": wrong, "burn_iters": 100, "burn_checksum": checksum,
            "burn_step_s": list(steps), "burn_gflop_per_step": 1.0, "burn_seconds": 1.0,
            "burn_sustained_gflops": 100.0}  # fmt: skip


def test_burn_fault_on_a_wrong_element_a_checksum_or_a_missing_result():
    assert burn_fault([_proc(), _proc()]) == ""
    assert "process 1 (cuda:0): 3 wrong element(s) in 100 matmuls" in burn_fault([_proc(), _proc(wrong=3)])
    assert "process 2 (cuda:0): result checksum" in burn_fault([_proc(), _proc(), _proc(checksum=2e10)])
    assert "process 0 reported no burn result" in burn_fault([{"device": "cpu"}])


def test_node_burn_takes_the_slowest_sustained_rate_and_judges_it():
    slow = {**_proc(steps=[0.01] * 8 + [0.02] * 2), "burn_sustained_gflops": 40.0}
    burn = node_burn([_proc(), slow])
    assert burn["sustained_gflops"] == 40.0 and burn["fault"] == ""
    assert [p["throttled"] for p in burn["processes"]] == [False, True]
    base = {"gemm_s": 1.0, "allreduce_s": 1.0, "allgather_s": 1.0, "burn_n": 1000}
    # the verdict judges the sustained rate: 2 * 1000^3 flop at 40 GFLOP/s = 0.05 s per matmul
    assert _judged_times({**base, "burn": burn})["gemm_s"] == pytest.approx(0.05)
    assert _judged_times(base) == {"gemm_s": 1.0, "allreduce_s": 1.0, "allgather_s": 1.0}


@pytest.mark.parametrize(
    "args, says",
    [(["--burn", "-1"], "--burn"), (["--sweep-max-mb", "0", "--sweep"], "--sweep-max-mb"),
     (["--sweep-max-mb", "4"], "--sweep-max-mb needs --sweep")],
)  # fmt: skip
def test_bad_burn_or_sweep_options_say_one_line_and_exit_2(args, says):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "trainguard", "nodecheck", "--local", "2", *args],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 2, p.stderr
    assert says in p.stderr and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) <= 2, p.stderr


ROW = re.compile(r"^\s+(\d+)\s+(\d+)\s+float\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$")


@pytest.mark.slow
def test_burn_reports_each_process_rate_over_time_and_a_verdict(jobs):
    job = jobs("nodecheck", "--local", "2", "--burn", "2")
    code, out = job.wait(), job.output()
    assert code == 0, out
    burn = [ln for ln in out.splitlines() if " burn process " in ln]
    assert [ln.split(" burn ")[0] for ln in burn] == [f"nodecheck node {i} group [0, 1]" for i in (0, 1)], out
    for ln in burn:
        assert re.search(r"\(cpu\): \d+ matmuls in [\d.]+ s, sustained [\d.]+ GFLOP/s, first fifth [\d.]+, "
                         r"last fifth [\d.]+ \([+-]\d+%\)( THROTTLED)?, wrong elements 0$", ln), ln  # fmt: skip
    assert "nodecheck verdict: all 2 node(s) healthy" in out


@pytest.mark.slow
def test_burn_names_the_node_with_a_wrong_result_faulty(jobs):
    job = jobs("nodecheck", "--local", "2", "--burn", "1", "--chaos", "1=corrupt")
    code, out = job.wait(), job.output()
    assert code == 1, out
    assert re.search(r"nodecheck verdict: node 1 is faulty: .*burn: process 0 \(cpu\): 1 wrong element", out), out
    assert "node 0 is faulty" not in out


@pytest.mark.slow
def test_sweep_prints_an_nccl_tests_table_per_op(jobs):
    job = jobs("nodecheck", "--local", "2", "--sweep", "--sweep-max-mb", "1")
    code, out = job.wait(), job.output()
    assert code == 0, out
    lines = out.splitlines()
    for node in (0, 1):
        for op in ("all_reduce", "all_gather"):
            start = lines.index(f"nodecheck node {node} group [0, 1] sweep {op} (world 2, slowest process per size):")
            assert lines[start + 1].split() == ["size", "count", "type", "time", "algbw", "busbw"]
            rows = [ROW.match(ln) for ln in lines[start + 3 : start + 3 + 18]]
            assert all(rows), lines[start : start + 21]
            assert [int(r[1]) for r in rows] == [8 * 2**i for i in range(18)]  # 8 B .. 1 MiB
            per_rank = 2 if op == "all_gather" else 1  # all-gather: count is each rank's share
            assert [int(r[2]) for r in rows] == [max(1, 2 * 2**i // per_rank) for i in range(18)]
            last = lines[start + 3 + 18]
            assert re.fullmatch(rf"nodecheck node {node} group \[0, 1\] sweep {op}: busbw [\d.]+ GB/s at 1048576 B \(verdict\)", last)
    assert "nodecheck verdict: all 2 node(s) healthy" in out
