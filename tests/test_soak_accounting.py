"""bench/soak.py's pure parts: the seeded fault schedule and the ETTR accounting (no job run)."""

from __future__ import annotations

import pytest
from tgtest import bench_module

acc = bench_module("soak_accounting")


def test_schedule_is_seeded_bounded_and_keeps_two_nodes_up() -> None:
    a = acc.schedule(7, 20, 120)
    assert a == acc.schedule(7, 20, 120)  # same seed, same faults
    assert a != acc.schedule(8, 20, 120)
    many = acc.schedule(3, 600, 60)  # long enough to draw every kind
    assert {f.kind for f in many} == {*acc.KINDS, "node-back"}
    down = None
    for f in many:
        assert acc.WARMUP_S < f.at <= 600 * 60 - acc.QUIET_END_S
        if f.kind in acc.NODE_FAULTS:
            assert down is None and f.node != "n1"  # n1 hosts the rendezvous; one node down at most
            down = f.node
        elif f.kind == "node-back":
            assert f.node == down
            down = None
        else:
            assert f.node != down  # a worker fault hits a node that is up
    assert [f.at for f in many] == sorted(f.at for f in many)


def _steps(t: float, first: int, n: int, world: int = 3, h: float = 0.1) -> list:
    return [acc.Step(t + i * h, first + i, world) for i in range(n)]


def test_ettr_arithmetic_and_breakdown_sums_to_wall() -> None:
    h = 0.1
    # 5 s startup; 100 steps; a fault at 15.0 s, a 3 s stall with a worker restart at 16.0 s, 20
    # steps redone; 100 new steps on 2 of 3 nodes; a stall with a restart and no fault (a false
    # kill); 1 s of steps at half speed; the run ends 0.5 s after the last step.
    steps = _steps(5.0, 1, 100)  # 5.0 .. 14.9
    steps += _steps(17.9, 81, 20) + _steps(19.9, 101, 100, world=2)  # redone 81..100 after the stall
    steps += _steps(32.0, 201, 10) + _steps(33.0, 211, 5, h=0.2)
    end = 33.8 + 0.5
    bd = acc.account(0.0, end, steps, restarts=[16.0, 30.0], faults=[(15.0, 15.0), (40.0, 70.0)], h=h)
    assert bd.steps == 215
    assert bd.trained == pytest.approx((200 + 15) * h - 100 * h / 3)
    assert bd.shrunk == pytest.approx(100 * h / 3)
    assert bd.ettr == pytest.approx(bd.trained / end)
    assert bd.startup == pytest.approx(5.0)
    assert bd.detection == pytest.approx(16.0 - 14.9)  # last step -> the worker restart
    assert bd.restart == pytest.approx(17.9 - 16.0 - h)  # the restart -> the step after it, less that step
    assert bd.redone == pytest.approx(20 * h)
    assert bd.false_kills == pytest.approx(32.0 - 29.8 - h)
    assert [c for _, _, c in bd.stalls] == ["fault", "false kill"]
    lasting = acc.account(0.0, end, steps, restarts=[16.0, 30.0], faults=[(15.0, 15.0), (20.0, 29.0)], h=h)
    assert lasting.false_kills == 0.0  # the stall began while a lasting fault (a full disk) acted
    assert sum(bd.parts().values()) == pytest.approx(bd.wall)
    assert acc.healthy_step(steps, 3) == pytest.approx(h)


def test_no_steps_is_all_startup_and_a_stall_at_the_end_is_counted() -> None:
    bd = acc.account(0.0, 60.0, [], [], [], 0.1)
    assert bd.ettr == 0.0 and bd.startup == 60.0 and sum(bd.parts().values()) == pytest.approx(60.0)
    bd = acc.account(0.0, 60.0, _steps(2.0, 1, 10), [], [(30.0, 30.0)], 0.1)  # wedged after a fault
    assert bd.detection == pytest.approx(60.0 - 2.9)
    assert sum(bd.parts().values()) == pytest.approx(60.0)
