"""The GPU kit (bench/gpu.py) as tests: each scenario runs on a machine with enough NVIDIA GPUs and
is skipped, with the reason, elsewhere (CI has none: these skip there). ``python bench/gpu.py``
runs the same scenarios as one command and prints what they measured."""

from __future__ import annotations

from pathlib import Path

import pytest
from tgtest import bench_module

kit = bench_module("gpu")
NGPU, WHY = kit.gpu_count()


@pytest.mark.slow
@pytest.mark.parametrize("scenario", kit.SCENARIOS, ids=lambda s: s.name)
def test_gpu_scenario(scenario, tmp_path: Path) -> None:
    if NGPU < scenario.gpus:
        pytest.skip(f"needs {scenario.gpus} NVIDIA GPU(s): {WHY or f'{NGPU} here'}")
    r = kit.run_one(scenario, tmp_path, NGPU, WHY)
    assert r.status == "pass", (r.detail, r.data)


def test_without_a_gpu_every_scenario_says_why(tmp_path: Path) -> None:
    # The kit itself on this machine: a scenario the GPUs do not allow is skipped with the reason.
    r = kit.run_one(kit.SCENARIOS[-1], tmp_path, 0, "no CUDA device (test)")
    assert (r.status, r.detail) == ("skip", "no CUDA device (test)")
    r = kit.run_one(kit.Scenario("two", 2, kit.s_sigstop), tmp_path, 1, "")
    assert (r.status, r.detail) == ("skip", "needs 2 GPUs, 1 here")


@pytest.mark.slow
def test_the_kit_itself_on_the_cpu(tmp_path: Path) -> None:
    # The dry run (gloo, CPU) of one multi-rank scenario: the kit's job, fault and event reading
    # keep working here, so a GPU's few minutes are not spent finding a broken kit.
    sigstop = next(s for s in kit.SCENARIOS if s.name == "sigstop")
    r = kit.run_one(sigstop, tmp_path, 0, "", cpu=True)
    assert r.status == "pass", (r.detail, r.data)
    assert kit.run_one(kit.SCENARIOS[0], tmp_path, 0, "", cpu=True).status == "skip"  # nvml: no dry run
