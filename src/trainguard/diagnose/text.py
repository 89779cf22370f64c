"""What a short failure text says, from the same rules as the log diagnosis (the one source).

The agent needs to know whether a failed worker only lost a peer (a cascade), the policy whether a
crash text points at the GPU, the network or the user's code. Both ask ``classify_text`` instead of
keeping regexes of their own::

    from trainguard.diagnose import classify_text
    v = classify_text(["RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer"])
    v.peer_loss, v.family, v.category   # True, "communication", "nccl_network"

Lines may carry the usual prefixes (timestamps, ``[rankN]:``): they are stripped as in the log
diagnosis. The most specific (highest priority) rule over all lines decides the category and family; ``peer_loss`` is
true when any line says the process lost a peer (rules with ``peer_loss = true``); when only
"mention" facts match (an exception text naming NCCL, gloo, the TCPStore, a timeout), their family
is given with no category. Fast: one keyword prefilter over the text, regexes only on candidate lines.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from trainguard.diagnose.lines import parse_line
from trainguard.diagnose.rules import Rule, RuleSet

MAX_TEXT = 1 << 20  # characters of text looked at (a log tail or an error message, not a whole log)


@dataclass(frozen=True)
class TextVerdict:
    category: str | None  # the diagnosis category of the most specific rule (None: no rule matched)
    family: str | None  # user_code | hardware | communication | signal | exit | environment | None
    peer_loss: bool  # some line says this process lost a peer that failed first
    line: str | None  # the line that decided (the peer-loss line when only that matched)
    rule: str | None  # id of the deciding rule
    role: str | None  # cause | symptom | fact

    def to_dict(self) -> dict:
        return dict(self.__dict__)


_NONE = TextVerdict(None, None, False, None, None, None)


def _lines(text: str | Iterable[str]) -> list[str]:
    if isinstance(text, str):
        return text[:MAX_TEXT].splitlines()
    out, size = [], 0
    for item in text:
        for ln in str(item).splitlines():
            out.append(ln)
            size += len(ln)
            if size > MAX_TEXT:
                return out
    return out


def classify_text(text: str | Iterable[str], rules: RuleSet | None = None) -> TextVerdict:
    """The verdict of the rules over ``text`` (a string or lines)."""
    if rules is None:
        from trainguard.diagnose.scanners import shared_scanner

        rules, scanner = shared_scanner(None)
        prefilter = scanner.text_prefilter
    else:
        prefilter = None
    lines = [ln for ln in _lines(text) if ln.strip()]
    if not lines:
        return _NONE
    if prefilter is not None:  # one pass over the text picks the lines worth matching
        blob = "\n".join(lines).encode("utf-8", errors="replace")
        lines = [blob[s:e].decode("utf-8", errors="replace") for s, e in prefilter.lines(blob)]
    best: tuple[Rule, str] | None = None
    fact: tuple[Rule, str] | None = None
    loss: str | None = None
    for raw in lines:
        msg = parse_line(raw).message
        for r in rules.match_line(msg):
            if r.peer_loss and loss is None:
                loss = raw
            if r.role == "fact":
                if fact is None and rules.family_for(r):
                    fact = (r, raw)
                continue
            if best is None or r.priority > best[0].priority:  # as the log diagnosis: most specific wins
                best = (r, raw)
    if best is not None:
        r, line = best
        return TextVerdict(r.category, rules.family_for(r), loss is not None, line, r.id, r.role)
    if fact is not None:
        r, line = fact
        return TextVerdict(None, rules.family_for(r), loss is not None, line, r.id, "fact")
    return _NONE if loss is None else TextVerdict(None, None, True, loss, None, None)
