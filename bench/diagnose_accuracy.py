"""Accuracy of `trainguard diagnose` on the real-format corpus (tests/corpus/real/<case>/).

    python bench/diagnose_accuracy.py [--corpus DIR] [--engine auto|re|hyperscan] [--misses]

Every case holds log files as they were on disk and a SOURCE file: the public report it was written
from (url, project) and its label (category; rank and host when the report establishes them; the
key line). Prints the category accuracy per category, the confusion matrix, the first-failing-rank
and host accuracy (counted only over cases whose label gives them) and the cases per project.
Behaviour, not time: tests/test_diagnose_real_corpus.py keeps the same numbers from regressing.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from trainguard.diagnose import diagnose_paths

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "corpus" / "real"


@dataclass
class Case:
    name: str
    path: Path
    label: dict[str, str]

    @property
    def category(self) -> str:
        return self.label["category"]

    @property
    def rank(self) -> int | None:
        r = self.label.get("rank")
        return int(r) if r not in (None, "") else None

    def files(self) -> list[Path]:
        return sorted(p for p in self.path.rglob("*") if p.is_file() and p.name != "SOURCE")


@dataclass
class Outcome:
    case: Case
    category: str
    rank: int | None
    host: str | None
    line: str
    summary: str


@dataclass
class Report:
    outcomes: list[Outcome] = field(default_factory=list)

    def _of(self, pred) -> list[Outcome]:
        return [o for o in self.outcomes if pred(o)]

    @property
    def category_accuracy(self) -> float:
        ok = self._of(lambda o: o.category == o.case.category)
        return len(ok) / max(1, len(self.outcomes))

    @property
    def ranked(self) -> list[Outcome]:
        return self._of(lambda o: o.case.rank is not None)

    @property
    def rank_accuracy(self) -> float:
        ok = [o for o in self.ranked if o.rank == o.case.rank]
        return len(ok) / max(1, len(self.ranked))

    @property
    def hosted(self) -> list[Outcome]:
        return self._of(lambda o: bool(o.case.label.get("host")))

    @property
    def host_accuracy(self) -> float:
        ok = [o for o in self.hosted if o.host == o.case.label["host"]]
        return len(ok) / max(1, len(self.hosted))

    @property
    def key_accuracy(self) -> float:
        """Cases whose first-failure line contains the label's key line (category right or not)."""
        keyed = self._of(lambda o: bool(o.case.label.get("key")) and o.case.category != "healthy")
        ok = [o for o in keyed if o.case.label["key"] in o.line]
        return len(ok) / max(1, len(keyed))


def parse_source(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() and not key.startswith((" ", "\t")):
            out[key.strip()] = value.strip()
    return out


def load_cases(root: Path = CORPUS) -> list[Case]:
    cases = []
    for src in sorted(root.glob("*/SOURCE")):
        label = parse_source(src.read_text(encoding="utf-8"))
        if "category" not in label or "url" not in label:
            raise ValueError(f"{src}: needs at least url: and category:")
        cases.append(Case(src.parent.name, src.parent, label))
    return cases


def evaluate(cases: list[Case], engine: str = "auto") -> Report:
    rep = Report()
    for c in cases:
        r = diagnose_paths(c.files(), engine=engine)
        ff = r.get("first_failure") or {}
        rep.outcomes.append(Outcome(c, r["category"], ff.get("rank"), ff.get("host"), str(ff.get("line") or ""),
                                    r.get("summary", "")))  # fmt: skip
    return rep


def render(rep: Report, misses: bool = False) -> str:
    out = []
    cats = sorted({o.case.category for o in rep.outcomes} | {o.category for o in rep.outcomes})
    by_cat: dict[str, list[Outcome]] = {}
    for o in rep.outcomes:
        by_cat.setdefault(o.case.category, []).append(o)
    out.append(f"{'category':<20} {'cases':>5} {'right':>5} {'accuracy':>8}")
    for cat in sorted(by_cat):
        os_ = by_cat[cat]
        ok = sum(o.category == cat for o in os_)
        out.append(f"{cat:<20} {len(os_):>5} {ok:>5} {ok / len(os_):>8.0%}")
    n = len(rep.outcomes)
    out.append(f"{'all':<20} {n:>5} {round(rep.category_accuracy * n):>5} {rep.category_accuracy:>8.1%}")
    out.append("")
    out.append("confusion matrix (rows: label, columns: diagnosis; only non-empty columns)")
    used = [c for c in cats if any(o.category == c for o in rep.outcomes)]
    short = {c: c[:8] for c in used}
    out.append(" " * 20 + " ".join(f"{short[c]:>8}" for c in used))
    for cat in sorted(by_cat):
        counts = Counter(o.category for o in by_cat[cat])
        out.append(f"{cat:<20}" + " ".join(f"{counts.get(c, 0) or '.':>8}" for c in used))
    out.append("")
    rk = rep.ranked
    out.append(f"first failing rank: {sum(o.rank == o.case.rank for o in rk)}/{len(rk)} = {rep.rank_accuracy:.1%} "
               f"(cases whose report establishes the rank)")  # fmt: skip
    hs = rep.hosted
    out.append(
        f"first failing host: {sum(o.host == o.case.label['host'] for o in hs)}/{len(hs)} = {rep.host_accuracy:.1%}"
    )
    out.append(f"key line named as the first failure: {rep.key_accuracy:.1%}")
    held = [o for o in rep.outcomes if o.case.label.get("split") == "holdout"]
    if held:
        ok = sum(o.category == o.case.category for o in held)
        hr = [o for o in held if o.case.rank is not None]
        out.append(f"held-out split (cases written after the rules): category {ok}/{len(held)}, "
                   f"rank {sum(o.rank == o.case.rank for o in hr)}/{len(hr)}")  # fmt: skip
    projects = Counter(o.case.label.get("project", "?") for o in rep.outcomes)
    out.append("")
    out.append(f"sources: {len(rep.outcomes)} cases from {len(projects)} projects: "
               + ", ".join(f"{p} {k}" for p, k in sorted(projects.items(), key=lambda kv: (-kv[1], kv[0]))))  # fmt: skip
    if misses:
        out.append("")
        for o in rep.outcomes:
            bad = (
                o.category != o.case.category
                or (o.case.rank is not None and o.rank != o.case.rank)
                or (o.case.label.get("host") and o.host != o.case.label["host"])
            )
            if bad:
                out.append(f"MISS {o.case.name}: want {o.case.category} r{o.case.rank} got {o.category} r{o.rank} "
                           f"host {o.host}: {o.line[:140]}")  # fmt: skip
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=CORPUS)
    ap.add_argument("--engine", default="auto", choices=["auto", "re", "hyperscan"])
    ap.add_argument("--misses", action="store_true", help="list the cases diagnosed wrong")
    a = ap.parse_args()
    rep = evaluate(load_cases(a.corpus), a.engine)
    print(render(rep, a.misses))
    return 0


if __name__ == "__main__":
    sys.exit(main())
