"""The rule library: log patterns as data (TOML), not code.

A rules file holds ``[[rule]]`` tables and optional ``[category.NAME]`` tables::

    [category.cuda_oom]
    summary = "CUDA out of memory"
    fix = "Lower the micro-batch size ..."
    family = "user_code"             # cause family the policy acts on (see FAMILIES)

    [[rule]]
    id = "cuda_oom.torch"            # unique; a user rule with an existing id replaces it
    category = "cuda_oom"
    keywords = ["out of memory"]     # literal, case-sensitive; every matching line contains one
    pattern = 'CUDA out of memory'   # regex searched in the line's message (prefixes removed)
    unless = 'NCCL INFO'             # optional regex: the line does not count when this matches
    role = "cause"                   # cause | symptom (usually a consequence) | fact (context only)
    priority = 90                    # the most specific rule of the first failing rank decides
    confidence = "high"              # optional: high | medium | low (default: from role and priority)
    fix = "..."                      # optional, else the category's fix
    peer_loss = false                # true: the line says this rank lost a peer that failed first
    family = "..."                   # optional, else the category's family
    tags = ["oom_kill"]              # optional markers the analysis uses (see TAGS)

A cause or symptom pattern may name a group ``rank``: the line blames that rank ("collective
mismatch around rank 1", "check rank 0 logs for faulty rank"), so the failure is counted there.

``keywords`` feed one combined prefilter run over big chunks; only lines containing a keyword are
matched against the rules' regexes. A rule without keywords must have a plain-literal pattern.

Built-in rules are Python regexes (vetted, tested against the ReDoS check below). User rules
(``--rules FILE``) are compiled with RE2 (``google-re2``: linear time, no backtracking), so a
pattern such as ``(a+)+$`` cannot hang the diagnosis; without RE2 they are checked for nested
quantifiers and rejected when one could backtrack catastrophically.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

try:  # linear-time engine for user-supplied patterns
    import re2 as _re2
except ImportError:  # pragma: no cover - depends on the environment
    _re2 = None

try:  # the regex parser behind re (3.11+: re._parser; the sre_parse alias is deprecated)
    from re import _constants as sre_constants
    from re import _parser as sre_parse
except ImportError:  # pragma: no cover - older Pythons
    import sre_constants  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

ROLES = ("cause", "symptom", "fact")
CATEGORIES = (
    "nccl_timeout", "nccl_network", "cuda_oom", "gpu_hardware", "cuda_error_other", "rendezvous_failure",
    "dataloader", "host_oom", "disk_full_or_io", "python_exception", "nan_loss", "segfault",
    "hang_no_error", "slowdown", "healthy",
    "exit_nonzero",  # exited with an error code and logged no error: cause unknown, worth a retry
    "killed_external",  # SIGKILL with no OOM-killer event: a scheduler, a person, a watchdog, the job itself
    "early_exit",  # a rank exited 0 while the others trained on: they then lost their peer
    "environment",  # the image or the start shell lacks what the job needs (conda set-up, CUDA toolkit, cuDNN)
)  # fmt: skip
# Cause families: what kind of failure a category is, for the policy (restart, exclude, stop).
FAMILIES = ("user_code", "hardware", "communication", "signal", "exit", "environment")
# Markers rules can carry for the cross-line analysis:
#   oom_kill   the kernel or the scheduler says its OOM killer fired (upgrades a SIGKILL to host_oom)
#   exit       a launcher line reporting how one process ended (exit code or signal)
#   completion training finished normally (role "fact")
#   startup    the job got through start-up (role "fact"); a log ending there stopped at start
#   text       for short failure texts only (classify_text), not for scanning logs
#   needs_exit counts only when a launcher's exit report of the same rank follows it closely
#   stackdump  a stack dump of a live process (py-spy): someone looked at a stuck job (tail only)
#   loading    loading a model, shards or optimizer state (tail only; offline SIGKILL -> host OOM likely)
#   memreport  the log's own host memory report, with a group ``percent`` (tail only)
#   stall      ranks wait for the others (tail only): a hang when no progress line follows it
#   interrupt  the user's ^C / KeyboardInterrupt (tail only): not a failure by itself
#   waitframe  a traceback frame inside a collective or barrier (tail only): an interrupt right after
#              it shows where the process waited
#   waiting    a process saying it still waits for its peers (tail only): a hang when it repeats
#              with no progress between and after
TAGS = ("oom_kill", "exit", "completion", "startup", "text", "needs_exit", "stackdump", "loading", "memreport", "stall",
        "interrupt", "waitframe", "waiting", "timed")  # fmt: skip  # timed: a fact kept with its time
TAIL_TAGS = {"startup", "stackdump", "loading", "memreport", "stall", "interrupt", "waitframe", "waiting"}  # tail only
_REGEX_META = set(".^$*+?{}[]\\|()")
MAX_USER_PATTERN = 2000


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
    peer_loss: bool = False
    family: str = ""
    tags: tuple[str, ...] = ()

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
    category_family: dict[str, str] = field(default_factory=dict)
    _kw_index: tuple | None = field(default=None, repr=False, compare=False)

    def keywords(self) -> list[str]:
        return sorted({k for r in self.rules for k in r.keywords}, key=lambda k: (-len(k), k))

    def fix_for(self, rule_or_category: Rule | str) -> str:
        if isinstance(rule_or_category, Rule):
            return rule_or_category.fix or self.category_fix.get(rule_or_category.category, "")
        return self.category_fix.get(rule_or_category, "")

    def summary_for(self, category: str) -> str:
        return self.category_summary.get(category, category)

    def family_for(self, rule_or_category: Rule | str | None) -> str | None:
        if rule_or_category is None:
            return None
        if isinstance(rule_or_category, Rule):
            return rule_or_category.family or self.category_family.get(rule_or_category.category)
        return self.category_family.get(rule_or_category)

    def match_line(self, message: str) -> list[Rule]:
        """Every rule that matches, most specific (highest priority) first."""
        return [r for r, _ in self.match_rules(message)]

    def match_rules(self, message: str, found: list[str] | None = None) -> list[tuple[Rule, object]]:
        """(rule, match) of every rule that matches, highest priority first. ``found``: keywords a
        prefilter saw in the line (its shortest forms): only rules with a keyword containing one are
        tried; None tests every keyword."""
        index = self._index()
        if found is None:
            found = [k for k in index[0] if k in message]
            cands = {i for k in found for i in index[1][k]}
        else:
            cands = {i for k in found for i in index[2].get(k, ())}
        hits = []
        for i in sorted(cands):
            r = self.rules[i]
            if found is not None and not any(k in message for k in r.keywords):
                continue
            m = r.pattern.search(message)
            if m is not None and (r.unless is None or not r.unless.search(message)):
                hits.append((r, m))
        hits.sort(key=lambda rm: -rm[0].priority)
        return hits

    def _index(self) -> tuple[list[str], dict[str, list[int]], dict[str, list[int]]]:
        """(distinct keywords, keyword -> rules using it, keyword -> rules with a keyword containing
        it), built once."""
        if self._kw_index is not None and self._kw_index[0] == len(self.rules):
            return self._kw_index[1]
        by_kw: dict[str, list[int]] = {}
        for i, r in enumerate(self.rules):
            for k in r.keywords:
                by_kw.setdefault(k, []).append(i)
        sup: dict[str, list[int]] = {}
        for k in by_kw:
            sup[k] = sorted({i for k2, rs in by_kw.items() if k in k2 for i in rs})
        self._kw_index = (len(self.rules), (list(by_kw), by_kw, sup))
        return self._kw_index[1]

    def for_logs(self) -> RuleSet:
        """The rules the keyword scan of a log uses: without the ones tagged "text" (short failure
        texts only) and "startup" (looked for in a log's tail only, see scan.py)."""
        skip = {"text"} | TAIL_TAGS
        if not any(skip & set(r.tags) for r in self.rules):
            return self
        return RuleSet([r for r in self.rules if not skip & set(r.tags)], self.category_fix,
                       self.category_summary, self.category_family)  # fmt: skip

    def by_id(self, rule_id: str) -> Rule | None:
        return next((r for r in self.rules if r.id == rule_id), None)


def _has_branch(tokens) -> bool:
    for op, av in tokens:
        if op == sre_constants.BRANCH:
            return True
        if op == sre_constants.SUBPATTERN and _has_branch(av[-1]):
            return True
    return False


def _repeats(tokens, inside: bool) -> str | None:
    """The first nested unbounded repeat (``(a+)+``, ``(a*)*``, ``(a|ab)*`` ...) in a parsed regex."""
    for op, av in tokens:
        if op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT, sre_constants.POSSESSIVE_REPEAT):
            lo, hi, sub = av
            unbounded = hi is sre_constants.MAXREPEAT or hi > 16
            if unbounded and inside:
                return "a quantifier inside a quantified group"
            if unbounded and _has_branch(sub):
                return "an alternation inside a quantified group"
            found = _repeats(sub, inside or unbounded)
            if found:
                return found
        elif op == sre_constants.SUBPATTERN:
            found = _repeats(av[-1], inside)
            if found:
                return found
        elif op == sre_constants.BRANCH:
            for alt in av[1]:
                found = _repeats(alt, inside)
                if found:
                    return found
        elif op in (sre_constants.ASSERT, sre_constants.ASSERT_NOT):
            found = _repeats(av[1], inside)
            if found:
                return found
    return None


def backtracking_risk(pattern: str) -> str | None:
    """Why ``pattern`` could take exponential time in a backtracking engine, or None."""
    try:
        return _repeats(sre_parse.parse(pattern), False)
    except (re.error, RecursionError, OverflowError):
        return None  # re.compile reports the error itself


def _compile(where: str, text: object, what: str, user: bool = False):
    if not isinstance(text, str) or not text:
        raise RuleError(f"{where}: {what} must be a non-empty string")
    try:
        compiled = re.compile(text)  # the syntax check, and the engine for built-in rules
    except (re.error, RecursionError, OverflowError) as exc:
        raise RuleError(f"{where}: bad {what} regex {text!r}: {exc}") from None
    if not user:
        return compiled
    if len(text) > MAX_USER_PATTERN:
        raise RuleError(f"{where}: {what} is longer than {MAX_USER_PATTERN} characters")
    if _re2 is not None:
        try:
            return _re2.compile(text)
        except Exception as exc:  # re2.error: lookaround, backreferences ... are not supported
            raise RuleError(f"{where}: {what} {text!r} is not supported by the RE2 engine used for user rules "
                            f"(no lookaround or backreferences): {exc}") from None  # fmt: skip
    risk = backtracking_risk(text)
    if risk:
        raise RuleError(f"{where}: {what} {text!r} has {risk}: it can take exponential time on some lines; "
                        "rewrite it (or install google-re2)")  # fmt: skip
    return compiled


def _rule(d: dict, origin: str, index: int, user: bool = False) -> Rule:
    rid = d.get("id")
    where = f"{origin}: rule #{index + 1}" + (f" ({rid})" if rid else "")
    if not isinstance(rid, str) or not rid:
        raise RuleError(f"{where}: missing id")
    unknown = set(d) - {"id", "category", "pattern", "keywords", "role", "priority", "unless", "fix", "summary",
                          "confidence", "peer_loss", "family", "tags"}  # fmt: skip
    if unknown:
        raise RuleError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    cat = d.get("category")
    if not isinstance(cat, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", cat):
        raise RuleError(f"{where}: category must be a lower_snake name")
    text = d.get("pattern")
    pattern = _compile(where, text, "pattern", user)
    kws = d.get("keywords")
    if kws is None:
        if any(c in _REGEX_META for c in str(text)):
            raise RuleError(
                f"{where}: a regex pattern needs keywords = [...] (literal substrings every match contains)"
            )
        kws = [text]
    if not isinstance(kws, list) or not kws or not all(isinstance(k, str) and len(k) >= 2 for k in kws):
        raise RuleError(f"{where}: keywords must be a list of strings of 2+ characters")
    role = d.get("role", "cause")
    if role not in ROLES:
        raise RuleError(f"{where}: role must be one of {', '.join(ROLES)}")
    prio = d.get("priority", 50)
    if not isinstance(prio, int) or isinstance(prio, bool):
        raise RuleError(f"{where}: priority must be an integer")
    unless = _compile(where, d["unless"], "unless", user) if "unless" in d else None
    conf = d.get("confidence", "")
    if conf not in ("", "high", "medium", "low"):
        raise RuleError(f"{where}: confidence must be high, medium or low")
    peer_loss = d.get("peer_loss", False)
    if not isinstance(peer_loss, bool):
        raise RuleError(f"{where}: peer_loss must be true or false")
    family = d.get("family", "")
    if family and family not in FAMILIES:
        raise RuleError(f"{where}: family must be one of {', '.join(FAMILIES)}")
    tags = d.get("tags", [])
    if not isinstance(tags, list) or not all(isinstance(t, str) and t in TAGS for t in tags):
        raise RuleError(f"{where}: tags must be a list of {', '.join(TAGS)}")
    return Rule(
        id=rid, category=cat, pattern=pattern, keywords=tuple(kws), role=role, priority=prio, unless=unless,
        fix=str(d.get("fix", "")).strip(), summary=str(d.get("summary", "")).strip(), confidence=conf, origin=origin,
        peer_loss=peer_loss, family=family, tags=tuple(tags),
    )  # fmt: skip


def parse_rules(text: str, origin: str, user: bool = False) -> RuleSet:
    """Rules from TOML text. ``user``: patterns come from a user's file (compiled safely, see above)."""
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
    rules = [_rule(d, origin, i, user) for i, d in enumerate(raw)]
    fixes, summaries, families = {}, {}, {}
    for name, meta in (data.get("category") or {}).items():
        if not isinstance(meta, dict):
            raise RuleError(f"{origin}: [category.{name}] must be a table")
        if "fix" in meta:
            fixes[name] = str(meta["fix"]).strip()
        if "summary" in meta:
            summaries[name] = str(meta["summary"]).strip()
        if "family" in meta:
            if meta["family"] not in FAMILIES:
                raise RuleError(f"{origin}: [category.{name}] family must be one of {', '.join(FAMILIES)}")
            families[name] = meta["family"]
    return _check_unique(RuleSet(rules, fixes, summaries, families))


def merge(base: RuleSet, extra: RuleSet) -> RuleSet:
    """Extra rules come first and replace base rules of the same id; category texts override."""
    ids = {r.id for r in extra.rules}
    return RuleSet(
        extra.rules + [r for r in base.rules if r.id not in ids],
        {**base.category_fix, **extra.category_fix},
        {**base.category_summary, **extra.category_summary},
        {**base.category_family, **extra.category_family},
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
        out = _check_unique(RuleSet(
            out.rules + part.rules,
            {**out.category_fix, **part.category_fix},
            {**out.category_summary, **part.category_summary},
            {**out.category_family, **part.category_family},
        ))  # fmt: skip
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
            if not p.is_file():
                raise OSError("not a regular file")
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise RuleError(f"{p}: cannot read rules file: {exc}") from None
        rs = merge(rs, parse_rules(text, str(p), user=True))
    return rs
