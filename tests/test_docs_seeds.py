"""docs/seeds.md stays in step with the code: every test it names exists, every `file.py:Name` it
names is defined there, and its summary table counts the rows below it (a page a platform's user
trusts at a glance must not drift)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "seeds.md"
SRC = REPO / "src" / "trainguard"
VERDICTS = ("met", "partly", "not met", "n.a.")


def _rows() -> list[list[str]]:
    rows = []
    for line in PAGE.read_text().splitlines():
        if re.match(r"\| 00\d-\d+ \|", line):
            rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
    return rows


def _verdict(cell: str) -> str:
    cell = cell.replace("<!-- pending -->", "").strip()
    for v in ("not met", "partly", "n.a.", "met"):  # "not met" before "met"
        if cell.startswith(v):
            return v
    raise AssertionError(f"unknown verdict {cell!r}")


def test_every_row_has_five_cells_and_a_known_verdict():
    rows = _rows()
    assert len(rows) == 119 and len({r[0] for r in rows}) == 119
    for r in rows:
        assert len(r) == 5, r[0]
        _verdict(r[4])


def test_summary_table_counts_the_rows():
    counts: dict[str, Counter] = {}
    for r in _rows():
        counts.setdefault(r[0][:3], Counter())[_verdict(r[4])] += 1
    text = PAGE.read_text()
    for seed, c in counts.items():
        line = next(ln for ln in text.splitlines() if ln.startswith(f"| {seed} "))
        numbers = [int(x) for x in re.findall(r"\|\s*(\d+)\s*(?=\|)", line)]
        assert numbers == [sum(c.values()), *(c[v] for v in VERDICTS)], (seed, line)
    total = sum(counts.values(), Counter())
    line = next(ln for ln in text.splitlines() if ln.startswith("| **total**"))
    assert [int(x) for x in re.findall(r"\*\*(\d+)\*\*", line)] == [sum(total.values()), *(total[v] for v in VERDICTS)]


def test_every_named_test_exists():
    missing = []
    for ref in sorted(set(re.findall(r"tests/[\w/]+\.py::[\w\[\]/.-]+", PAGE.read_text()))):
        path, name = ref.split("::")
        base = name.split("[")[0]
        f = REPO / path
        if not f.exists() or not re.search(rf"^\s*(async\s+)?def {re.escape(base)}\(", f.read_text(), re.M):
            missing.append(ref)
    assert not missing, missing


def test_every_named_code_location_exists():
    missing = []
    for f, name in sorted(set(re.findall(r"`([\w/]+\.py):([\w.]+)`", PAGE.read_text()))):
        if f.startswith(("tests/", "bench/", "torch/")):
            continue
        p = SRC / f
        if not p.exists():
            missing.append(f)
            continue
        body = p.read_text()
        for part in name.split("."):
            if not re.search(rf"(def|class)\s+{part}\b|^\s*{part}\s*[:=]", body, re.M):
                missing.append(f"{f}:{name}")
    assert not missing, missing
