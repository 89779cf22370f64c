"""bench/fleet.py's simulation: deterministic, its accounting exact, its decisions the real policy's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tgtest import bench_module

from trainguard import policy as P
from trainguard.policy import Action

sim = bench_module("fleet_sim")
REPO = Path(__file__).resolve().parents[1]
CAL = sim.Calibration(sim.load_json(sim.DEFAULT_CALIBRATION))
LLAMA3 = sim.Rates.from_dict(sim.load_json(sim.DEFAULT_RATES))


def rates(causes: dict, interruptions: float = 419) -> object:
    return sim.Rates.from_dict({"interruptions": interruptions, "days": 54, "gpus": 16384, "causes": causes})


def test_the_simulation_is_deterministic_for_a_seed() -> None:
    scn = sim.Scenario(4096, days=30, standbys=3)
    a, n = sim.simulate(scn, LLAMA3, CAL, 1.0, seed=3)
    b, m = sim.simulate(scn, LLAMA3, CAL, 1.0, seed=3)
    assert n == m > 10
    assert [(r.name, r.ettr, r.parts, r.trace) for r in a] == [(r.name, r.ettr, r.parts, r.trace) for r in b]
    other, _ = sim.simulate(scn, LLAMA3, CAL, 1.0, seed=4)
    assert [e.t for e in other[1].trace] != [e.t for e in a[1].trace]


def test_without_failures_ettr_is_one_minus_the_checkpoint_stall() -> None:
    scn = sim.Scenario(16384, days=30, standbys=11, ckpt_minutes=30)
    rows, n = sim.simulate(scn, rates({"faulty GPU": [1, "gpu"]}, interruptions=0), CAL)
    assert n == 0 and len(rows) == 3
    save = CAL.value("torch_save_stall_ms_per_126mb") / 1000 * CAL.value("state_mb_per_rank") / 126
    assert rows[0].stall_share == pytest.approx(save / (1800 + save), rel=1e-12)
    for r in rows:
        assert r.stall_share > 0
        assert r.ettr == pytest.approx(1 - r.stall_share, abs=1e-12), r.name
        assert r.parts[sim.STALL] == pytest.approx(r.stall_share, abs=1e-12)
        assert sum(v for k, v in r.parts.items() if k != sim.STALL) == 0
        assert r.trace == []


def test_a_hardware_failure_under_trainguard_is_an_exclusion_decided_by_the_real_policy(monkeypatch) -> None:
    made: list = []
    real = P.decide_on_failure

    def spy(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(P, "decide_on_failure", spy)
    rows, n = sim.simulate(sim.Scenario(512, days=30), rates({"GPU HBM3 memory": [17.2, "hbm"]}, 4190), CAL)
    trainguard = rows[1]
    decided = [e for e in trainguard.trace if e.action != "absorbed"]
    assert n > 0 and len(decided) == len(made)  # every decision came from the policy's own function
    assert {d.action for d in made} == {Action.EXCLUDE_NODE}
    for entry, decision in zip(decided, made, strict=True):
        assert entry.action == decision.action.value == "exclude_node"
        assert entry.source == "hardware_check" and "uncorrectable ECC" in entry.reason
    assert trainguard.history_records == len(decided)  # each one is a hardware record of the node history
    assert {e.action for e in rows[0].trace} <= {"relaunch", "absorbed"}  # torchrun re-launches the job


def test_torchrun_is_below_trainguard_at_llama3_rates_at_16384_ranks() -> None:
    rows, n = sim.simulate(sim.Scenario(16384, days=30, standbys=11), LLAMA3, CAL, 1.0, seed=1)
    torchrun, trainguard, standby = rows
    assert n > 100
    assert torchrun.ettr < trainguard.ettr < standby.ettr
    assert torchrun.parts[sim.DETECT] > trainguard.parts[sim.DETECT]  # the watchdog's 10 minutes per hang


def test_calibration_quotes_are_in_the_benchmarks_page() -> None:
    page = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    for name, spec in CAL.measured.items():
        for quote in spec["source"].split(" / "):
            assert quote in page, (name, quote)


def _bench(*args: str, tmp: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run([sys.executable, str(REPO / "bench" / "fleet.py"), *args], capture_output=True, text=True,
                          env=env, cwd=tmp, timeout=300)  # fmt: skip


def test_the_bench_prints_the_table_and_refuses_bad_input(tmp_path: Path) -> None:
    ok = _bench("--ranks", "64,512", "--days", "5", "--multipliers", "1,2", "--sweep-ranks", "512",
                "--png", str(tmp_path / "fleet.png"), tmp=tmp_path)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert "the real benches do not yet write this file" in ok.stdout and "wall time:" in ok.stdout
    assert "ETTR against scale:" in ok.stdout and "ETTR against the failure rate at 512 ranks:" in ok.stdout
    (tmp_path / "bad.json").write_text('{"interruptions": 3}')
    for bad in (["--ranks", "12"], ["--rates", str(tmp_path / "bad.json")], ["--ckpt-minutes", "soon"],
                ["--rates", str(tmp_path / "missing.json")], ["--days", "nan"]):  # fmt: skip
        out = _bench(*bad, tmp=tmp_path)
        assert out.returncode == 2, (bad, out.stderr)
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, (bad, out.stderr)
