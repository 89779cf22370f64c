"""The rule library: log patterns as data (TOML), not code.

A rules file holds ``[[rule]]`` tables and optional ``[category.NAME]`` tables::

    [category.cuda_oom]
    summary = "CUDA out of memory"
    fix = "Lower the micro-batch size ..."

    [[rule]]
    id = "cuda_oom.torch"            # unique; a user rule with an existing id replaces it
    category = "cuda_oom"
    keywords = ["out of memory"]     # literal, case-sensitive; every matching line contains one
    pattern = 'CUDA out of memory'   # Python regex searched in the line's message (prefixes removed)
    unless = 'NCCL INFO'             # optional regex: the line does not count when this matches
    role = "cause"                   # cause | symptom (usually a consequence) | fact (context only)
    priority = 90                    # the most specific rule of the first failing rank decides
    confidence = "high"              # optional: high | medium | low (default: from role and priority)
    fix = "..."                      # optional, else the category's fix

``keywords`` feed one combined prefilter run over big chunks; only lines containing a keyword are
matched against the rules' regexes. A rule without keywords must have a plain-literal pattern.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

ROLES = ("cause", "symptom", "fact")
CATEGORIES = (
    "nccl_timeout", "nccl_network", "cuda_oom", "gpu_hardware", "cuda_error_other", "rendezvous_failure",
    "dataloader", "host_oom", "disk_full_or_io", "python_exception", "nan_loss", "segfault",
    "hang_no_error", "slowdown", "healthy",
    "exit_nonzero",  # exited with an error code and logged no error: cause unknown, worth a retry
)  # fmt: skip
_REGEX_META = set(".^$*+?{}[]\\|()")


class RuleError(ValueError):
    """A rules file is malformed; the message names the file and the rule."""


@dataclass(frozen=True)
class Rule:
    id: str
    category: str
    pattern: re.Pattern[str]
    keywords: tuple[str, ...]
    role: str = "cause"
    priority: int = 50
    unless: re.Pattern[str] | None = None
    fix: str = ""
    summary: str = ""
    confidence: str = ""
    origin: str = ""

    def match(self, message: str) -> re.Match[str] | None:
        if not any(k in message for k in self.keywords):
            return None
        m = self.pattern.search(message)
        if m is None or (self.unless is not None and self.unless.search(message)):
            return None
        return m


@dataclass
class RuleSet:
    rules: list[Rule]
    category_fix: dict[str, str] = field(default_factory=dict)
    category_summary: dict[str, str] = field(default_factory=dict)

    def keywords(self) -> list[str]:
        return sorted({k for r in self.rules for k in r.keywords}, key=lambda k: (-len(k), k))

    def fix_for(self, rule_or_category: Rule | str) -> str:
        if isinstance(rule_or_category, Rule):
            return rule_or_category.fix or self.category_fix.get(rule_or_category.category, "")
        return self.category_fix.get(rule_or_category, "")

    def summary_for(self, category: str) -> str:
        return self.category_summary.get(category, category)

    def match_line(self, message: str) -> list[Rule]:
        """Every rule that matches, most specific (highest priority) first."""
        hits = [r for r in self.rules if r.match(message) is not None]
        hits.sort(key=lambda r: -r.priority)
        return hits


def _compile(where: str, text: object, what: str) -> re.Pattern[str]:
    if not isinstance(text, str) or not text:
        raise RuleError(f"{where}: {what} must be a non-empty string")
    try:
        return re.compile(text)
    except re.error as exc:
        raise RuleError(f"{where}: bad {what} regex {text!r}: {exc}") from None


def _rule(d: dict, origin: str, index: int) -> Rule:
    rid = d.get("id")
    where = f"{origin}: rule #{index + 1}" + (f" ({rid})" if rid else "")
    if not isinstance(rid, str) or not rid:
        raise RuleError(f"{where}: missing id")
    unknown = set(d) - {"id", "category", "pattern", "keywords", "role", "priority", "unless", "fix", "summary",
                          "confidence"}  # fmt: skip
    if unknown:
        raise RuleError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    cat = d.get("category")
    if not isinstance(cat, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", cat):
        raise RuleError(f"{where}: category must be a lower_snake name")
    pattern = _compile(where, d.get("pattern"), "pattern")
    kws = d.get("keywords")
    if kws is None:
        if any(c in _REGEX_META for c in pattern.pattern):
            raise RuleError(
                f"{where}: a regex pattern needs keywords = [...] (literal substrings every match contains)"
            )
        kws = [pattern.pattern]
    if not isinstance(kws, list) or not kws or not all(isinstance(k, str) and len(k) >= 2 for k in kws):
        raise RuleError(f"{where}: keywords must be a list of strings of 2+ characters")
    role = d.get("role", "cause")
    if role not in ROLES:
        raise RuleError(f"{where}: role must be one of {', '.join(ROLES)}")
    prio = d.get("priority", 50)
    if not isinstance(prio, int) or isinstance(prio, bool):
        raise RuleError(f"{where}: priority must be an integer")
    unless = _compile(where, d["unless"], "unless") if "unless" in d else None
    conf = d.get("confidence", "")
    if conf not in ("", "high", "medium", "low"):
        raise RuleError(f"{where}: confidence must be high, medium or low")
    return Rule(
        id=rid, category=cat, pattern=pattern, keywords=tuple(kws), role=role, priority=prio, unless=unless,
        fix=str(d.get("fix", "")).strip(), summary=str(d.get("summary", "")).strip(), confidence=conf, origin=origin,
    )  # fmt: skip


def parse_rules(text: str, origin: str) -> RuleSet:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RuleError(f"{origin}: not valid TOML: {exc}") from None
    unknown = set(data) - {"rule", "category"}
    if unknown:
        raise RuleError(
            f"{origin}: unknown table(s) {', '.join(sorted(unknown))} (expected [[rule]], [category.X])"
        )
    raw = data.get("rule", [])
    if not isinstance(raw, list):
        raise RuleError(f"{origin}: use [[rule]] (an array of tables)")
    rules = [_rule(d, origin, i) for i, d in enumerate(raw)]
    fixes, summaries = {}, {}
    for name, meta in (data.get("category") or {}).items():
        if not isinstance(meta, dict):
            raise RuleError(f"{origin}: [category.{name}] must be a table")
        if "fix" in meta:
            fixes[name] = str(meta["fix"]).strip()
        if "summary" in meta:
            summaries[name] = str(meta["summary"]).strip()
    return _check_unique(RuleSet(rules, fixes, summaries))


def merge(base: RuleSet, extra: RuleSet) -> RuleSet:
    """Extra rules come first and replace base rules of the same id; category texts override."""
    ids = {r.id for r in extra.rules}
    return RuleSet(
        extra.rules + [r for r in base.rules if r.id not in ids],
        {**base.category_fix, **extra.category_fix},
        {**base.category_summary, **extra.category_summary},
    )


def builtin_rules() -> RuleSet:
    out = RuleSet([])
    files = sorted(
        (
            p
            for p in resources.files("trainguard.diagnose").joinpath("rules").iterdir()
            if p.name.endswith(".toml")
        ),
        key=lambda p: p.name,
    )
    for p in files:
        part = parse_rules(p.read_text(encoding="utf-8"), f"rules/{p.name}")
        out = _check_unique(
            RuleSet(
                out.rules + part.rules,
                {**out.category_fix, **part.category_fix},
                {**out.category_summary, **part.category_summary},
            )
        )
    return out


def _check_unique(rs: RuleSet) -> RuleSet:
    seen: set[str] = set()
    for r in rs.rules:
        if r.id in seen:
            raise RuleError(f"{r.origin}: duplicate rule id {r.id}")
        seen.add(r.id)
    return rs


def load_rules(extra: list[Path] | None = None) -> RuleSet:
    rs = builtin_rules()
    for path in extra or []:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise RuleError(f"{p}: cannot read rules file: {exc}") from None
        rs = merge(rs, parse_rules(text, str(p)))
    return rs
