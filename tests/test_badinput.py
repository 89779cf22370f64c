"""Bad input against every command: an answer or one line on stderr with exit 2, never a
traceback, never a hang. The table is bench/badinput.py's (that script prints the outcome counts)."""

from __future__ import annotations

import pytest
from tgtest import bench_module

badinput = bench_module("badinput")


def _suite_cases() -> list:
    """Every case but the damaged-run-dir matrix (every reader against every damage, 351 cases,
    damage-major), of which the suite runs a third: damage i with reader j where (i + j) % 3 == 0,
    so each damage meets two readers and each reader a third of the damages (the whole matrix is
    bench/badinput.py's: ~2 minutes less in a suite that must stay near 20 on 2 cores)."""
    damage = badinput._damage_cases()
    first = len(badinput.CASES) - len(damage)
    readers = len(badinput.READERS)
    assert [c.name for c in badinput.CASES[first:]] == [c.name for c in damage]  # the matrix is last
    return badinput.CASES[:first] + [c for k, c in enumerate(damage) if (k // readers + k % readers) % 3 == 0]


SUITE_CASES = _suite_cases()


@pytest.mark.slow  # ~260 processes (every command, every kind of damaged run-dir file)
@pytest.mark.parametrize("case", SUITE_CASES, ids=[c.name for c in SUITE_CASES])
def test_bad_input_gives_an_answer_or_one_line(case):
    r = badinput.run_case(case, time_limit_s=120)
    assert r.right, (r.outcome, r.rc, r.first_line)  # the expected outcome, and the after-check found nothing
    assert r.outcome not in ("traceback", "hang")
