"""The real-format corpus (tests/corpus/real/): accuracy floors, so the diagnosis cannot regress.

Each case is a log written in the format of a public report (SOURCE names it). The floors are the
issue's done-when bar with room to spare; bench/diagnose_accuracy.py prints the full table."""

from __future__ import annotations

import pytest
from tgtest import bench_module

from trainguard.diagnose.prefilter import _hs
from trainguard.diagnose.rules import CATEGORIES

acc = bench_module("diagnose_accuracy")

CASES = acc.load_cases()
ENGINES = ["re"] + (["hyperscan"] if _hs is not None else [])
CATEGORY_FLOOR = 0.95  # issue 12 asks for >= 0.90
RANK_FLOOR = 0.90  # issue 12 asks for >= 0.80


def test_the_corpus_is_large_labelled_and_covers_every_category():
    assert len(CASES) >= 80
    for c in CASES:
        assert c.label["url"].startswith("https://"), c.name
        assert c.label.get("project") and c.label.get("key"), c.name
        # slowdown cases live in tests/corpus/slowdown
        assert c.category in CATEGORIES and c.category != "slowdown", c.name
        assert c.files(), c.name
    # early_exit is read from trainguard's own record of a rank that finished first, not a log's text
    wanted = set(CATEGORIES) - {"slowdown", "exit_nonzero", "early_exit"}
    assert wanted <= {c.category for c in CASES}
    assert sum(c.rank is not None for c in CASES) >= 30


@pytest.mark.parametrize("engine", ENGINES)
def test_accuracy_floors(engine: str):
    rep = acc.evaluate(CASES, engine)
    wrong = [f"{o.case.name}: {o.category} r{o.rank}" for o in rep.outcomes
             if o.category != o.case.category or (o.case.rank is not None and o.rank != o.case.rank)]  # fmt: skip
    assert rep.category_accuracy >= CATEGORY_FLOOR, (rep.category_accuracy, wrong)
    assert rep.rank_accuracy >= RANK_FLOOR, (rep.rank_accuracy, wrong)
    text = acc.render(rep)
    assert "confusion matrix" in text and "first failing rank" in text
