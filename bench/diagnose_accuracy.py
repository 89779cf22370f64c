"""Accuracy of `trainguard diagnose` on the real-format corpus (tests/corpus/real/<case>/).

    python bench/diagnose_accuracy.py [--corpus DIR] [--frozen DIR] [--engine auto|re|hyperscan] [--misses]

Every case holds log files as they were on disk and a SOURCE file: the public report it was written
from (url, project, family: the framework or launcher), and its label (category; rank and host when
the report establishes them; the key line). Prints, for the tuning corpus (tests/corpus/real/):
the category accuracy per category, the confusion matrix, the first-failing-rank and host accuracy
(counted only over cases whose label gives them), healthy vs failure and hang vs healthy confusion
both ways, and the calibration table (of the verdicts said with each confidence, how many are right).

Generalisation, not fit:
- leave-one-framework-out: each family's cases are scored without the rules that decide cases of
  that family only (a rule written while looking at one family is not credited on it); the rules
  that also decide another family's cases stay. Code heuristics (endings, rank order) are not left
  out: this bounds the rules' fit, not the code's.
- the frozen split (tests/corpus/frozen6/ by default, --frozen DIR; cases written before the rules were changed and never
  looked at while changing them) is scored on its own line, never mixed into the tuning numbers; when the directory
  is not there the bench says so in one line and prints no frozen line.
Behaviour, not time: tests/test_diagnose_real_corpus.py keeps the same numbers from regressing.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from trainguard.diagnose import diagnose_paths
from trainguard.diagnose.rules import RuleSet, builtin_rules

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "corpus" / "real"
# frozen splits 1 to 5 (tests/corpus/frozen/, frozen2/ to frozen5/) were scored once and burned into
# the tuning corpus
FROZEN = CORPUS.parent / "frozen6"
LEVELS = ("high", "medium", "low")


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

    @property
    def family(self) -> str:
        return self.label.get("family", "?")

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
    confidence: str = ""
    rules: frozenset[str] = frozenset()  # the rules that decided the verdict (first failure, evidence)

    @property
    def right(self) -> bool:
        return self.category == self.case.category


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


def _rules_used(r: dict) -> frozenset[str]:
    ids = [(r.get("first_failure") or {}).get("rule")] + [e.get("rule") for e in r.get("evidence") or [] if isinstance(e, dict)]
    return frozenset(str(i).split("+", 1)[0] for i in ids if i)


def evaluate(cases: list[Case], engine: str = "auto", rules: RuleSet | None = None) -> Report:
    rep = Report()
    for c in cases:
        r = diagnose_paths(c.files(), engine=engine, ruleset=rules)
        ff = r.get("first_failure") or {}
        rep.outcomes.append(Outcome(c, r["category"], ff.get("rank"), ff.get("host"), str(ff.get("line") or ""),
                                    r.get("summary", ""), r.get("confidence", ""), _rules_used(r)))  # fmt: skip
    return rep


@dataclass
class HeldOut:
    """Leave-one-framework-out: every case scored without the rules only its own family uses."""

    report: Report
    dropped: dict[str, list[str]]  # family -> the rule ids left out when scoring it


def leave_one_family_out(full: Report, engine: str = "auto") -> HeldOut:
    base = builtin_rules()
    used: dict[str, set[str]] = {}
    for o in full.outcomes:
        used.setdefault(o.case.family, set()).update(o.rules)
    rep, dropped = Report(), {}
    for fam in sorted(used):
        others = set().union(*(u for f, u in used.items() if f != fam))
        only = sorted(used[fam] - others)
        mine = [o for o in full.outcomes if o.case.family == fam]
        if only:
            dropped[fam] = only
            rs = RuleSet([r for r in base.rules if r.id not in only], base.category_fix, base.category_summary,
                         base.category_family)  # fmt: skip
            mine = evaluate([o.case for o in mine], engine, rs).outcomes
        rep.outcomes += mine
    return HeldOut(rep, dropped)


def _pct(k: int, n: int) -> str:
    return f"{k}/{n} = {k / n:.1%}" if n else "0/0"


def _category_table(rep: Report) -> list[str]:
    by_cat: dict[str, list[Outcome]] = {}
    for o in rep.outcomes:
        by_cat.setdefault(o.case.category, []).append(o)
    out = [f"{'category':<20} {'cases':>5} {'right':>5} {'accuracy':>8}"]
    for cat in sorted(by_cat):
        ok = sum(o.right for o in by_cat[cat])
        out.append(f"{cat:<20} {len(by_cat[cat]):>5} {ok:>5} {ok / len(by_cat[cat]):>8.0%}")
    n = len(rep.outcomes)
    out.append(f"{'all':<20} {n:>5} {round(rep.category_accuracy * n):>5} {rep.category_accuracy:>8.1%}")
    out += ["", "confusion matrix (rows: label, columns: diagnosis; only non-empty columns)"]
    used = sorted({o.category for o in rep.outcomes})
    out.append(" " * 20 + " ".join(f"{c[:8]:>8}" for c in used))
    for cat in sorted(by_cat):
        counts = Counter(o.category for o in by_cat[cat])
        out.append(f"{cat:<20}" + " ".join(f"{counts.get(c, 0) or '.':>8}" for c in used))
    return out


def _ranks(rep: Report) -> list[str]:
    rk, hs = rep.ranked, rep.hosted
    return [
        f"first failing rank: {_pct(sum(o.rank == o.case.rank for o in rk), len(rk))} "
        "(cases whose report establishes the rank)",
        f"first failing host: {_pct(sum(o.host == o.case.label['host'] for o in hs), len(hs))}",
        f"key line named as the first failure: {rep.key_accuracy:.1%}",
    ]


def confusion(rep: Report) -> dict[str, tuple[int, int]]:
    """(wrong, of) for the four confusions the accuracy goals name."""
    def count(label, wrong) -> tuple[int, int]:  # noqa: E306
        os_ = [o for o in rep.outcomes if label(o.case.category)]
        return sum(wrong(o.category) for o in os_), len(os_)

    return {
        "healthy called a failure": count(lambda c: c == "healthy", lambda d: d != "healthy"),
        "failure called healthy": count(lambda c: c != "healthy", lambda d: d == "healthy"),
        "hang called healthy": count(lambda c: c == "hang_no_error", lambda d: d == "healthy"),
        "healthy called a hang": count(lambda c: c == "healthy", lambda d: d == "hang_no_error"),
    }


def _confusion_lines(rep: Report) -> list[str]:
    return [f"{k}: {w}/{n}" for k, (w, n) in confusion(rep).items()]


def calibration(rep: Report) -> dict[str, tuple[int, int]]:
    """confidence -> (right, verdicts said with it)."""
    out = {}
    for level in LEVELS:
        os_ = [o for o in rep.outcomes if o.confidence == level]
        out[level] = (sum(o.right for o in os_), len(os_))
    return out


def _calibration_lines(rep: Report) -> list[str]:
    out = ["calibration (of the verdicts said with each confidence, how many are right):"]
    for level, (ok, n) in calibration(rep).items():
        out.append(f"  {level:<7} {ok:>4}/{n:<4} right" + (f" = {ok / n:.1%}" if n else ""))
    return out


def summary_line(name: str, rep: Report) -> str:
    """One line: category, first rank, first host, healthy/hang confusion."""
    rk, hs = rep.ranked, rep.hosted
    c = confusion(rep)
    return (f"{name}: {len(rep.outcomes)} cases: category {_pct(sum(o.right for o in rep.outcomes), len(rep.outcomes))}, "
            f"first rank {_pct(sum(o.rank == o.case.rank for o in rk), len(rk))}, "
            f"first host {_pct(sum(o.host == o.case.label['host'] for o in hs), len(hs))}; "
            f"healthy called a failure {c['healthy called a failure'][0]}/{c['healthy called a failure'][1]}, "
            f"hang called healthy {c['hang called healthy'][0]}/{c['hang called healthy'][1]}")  # fmt: skip


def _lofo_lines(held: HeldOut) -> list[str]:
    out = [summary_line("leave-one-framework-out", held.report)]
    out.append("  calibration: " + ", ".join(f"{lv} {ok}/{n}" for lv, (ok, n) in calibration(held.report).items()))
    fams: dict[str, list[Outcome]] = {}
    for o in held.report.outcomes:
        fams.setdefault(o.case.family, []).append(o)
    out.append("  per family: " + ", ".join(
        f"{f} {sum(o.right for o in os_)}/{len(os_)}" + (f" (-{len(held.dropped[f])} rules)" if f in held.dropped else "")
        for f, os_ in sorted(fams.items())))  # fmt: skip
    return out


def _miss_lines(rep: Report) -> list[str]:
    out = []
    for o in rep.outcomes:
        bad = (not o.right or (o.case.rank is not None and o.rank != o.case.rank)
               or (o.case.label.get("host") and o.host != o.case.label["host"]))  # fmt: skip
        if bad:
            out.append(f"MISS {o.case.name}: want {o.case.category} r{o.case.rank} got {o.category} r{o.rank} "
                       f"host {o.host} [{o.confidence}]: {o.line[:140]}")  # fmt: skip
    return out


def render(rep: Report, misses: bool = False, held: HeldOut | None = None, frozen: Report | None = None) -> str:
    out = _category_table(rep) + [""] + _ranks(rep) + [""] + _confusion_lines(rep) + [""] + _calibration_lines(rep)
    old = [o for o in rep.outcomes if o.case.label.get("split") == "holdout"]
    if old:
        hr = [o for o in old if o.case.rank is not None]
        out.append(f"held-out split (cases written after the real-world format rules): category {sum(o.right for o in old)}/{len(old)}, "
                   f"rank {sum(o.rank == o.case.rank for o in hr)}/{len(hr)}")  # fmt: skip
    out.append("")
    out.append(summary_line("tuning corpus", rep))
    if held is not None:
        out += _lofo_lines(held)
    if frozen is not None:
        out.append(summary_line("FROZEN split", frozen))
        out.append("  calibration: " + ", ".join(f"{lv} {ok}/{n}" for lv, (ok, n) in calibration(frozen).items()))
    projects = Counter(o.case.label.get("project", "?") for o in rep.outcomes)
    families = Counter(o.case.family for o in rep.outcomes)
    out += ["", f"sources: {len(rep.outcomes)} cases from {len(projects)} projects, {len(families)} families: "
            + ", ".join(f"{f} {k}" for f, k in sorted(families.items(), key=lambda kv: (-kv[1], kv[0])))]  # fmt: skip
    if misses:
        out += [""] + _miss_lines(rep)
        if frozen is not None:
            out += [f"FROZEN {m}" for m in _miss_lines(frozen)]
    return "\n".join(out)


def frozen_report(root: Path, engine: str = "auto") -> Report | None:
    """The frozen split scored on its own, or None when there is none."""
    if not root.is_dir():
        return None
    cases = load_cases(root)
    return evaluate(cases, engine) if cases else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=CORPUS)
    ap.add_argument("--engine", default="auto", choices=["auto", "re", "hyperscan"])
    ap.add_argument("--frozen", type=Path, default=FROZEN, help="the frozen split, scored on its own line when present")
    ap.add_argument("--misses", action="store_true", help="list the cases diagnosed wrong")
    ap.add_argument("--no-lofo", action="store_true", help="skip leave-one-framework-out")
    a = ap.parse_args()
    rep = evaluate(load_cases(a.corpus), a.engine)
    held = None if a.no_lofo else leave_one_family_out(rep, a.engine)
    frozen = frozen_report(a.frozen, a.engine)
    print(render(rep, a.misses, held, frozen))
    if frozen is None:
        print(f"\nno frozen split scored: {a.frozen} is missing or holds no case")
    return 0


if __name__ == "__main__":
    sys.exit(main())
