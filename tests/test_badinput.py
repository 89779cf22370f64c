"""Bad input against every command (issue 18): an answer or one line on stderr with exit 2, never a
traceback, never a hang. The table is bench/badinput.py's (that script prints the outcome counts)."""

from __future__ import annotations

import pytest
from tgtest import bench_module

badinput = bench_module("badinput")


@pytest.mark.slow  # 470 processes (issue 28: every reader against every damaged run-dir file)
@pytest.mark.parametrize("case", badinput.CASES, ids=[c.name for c in badinput.CASES])
def test_bad_input_gives_an_answer_or_one_line(case):
    r = badinput.run_case(case, time_limit_s=120)
    assert r.right, (r.outcome, r.rc, r.first_line)  # the expected outcome, and the after-check found nothing
    assert r.outcome not in ("traceback", "hang")
