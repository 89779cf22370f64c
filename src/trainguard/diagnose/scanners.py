"""Compiled rule scanners, cached per process: the built-in rules are compiled once, a user's rule
files are read again on every call. The scanner module (and its regex engines) loads on first use."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainguard.diagnose.rules import RuleSet, load_rules

_cache: dict[tuple[str, ...], tuple[RuleSet, Any]] = {}


def shared_scanner(extra_rules: list[Path] | None, engine: str = "auto"):
    from trainguard.diagnose.scan import Scanner

    key = (engine, *(str(p) for p in extra_rules or []))
    if key not in _cache or extra_rules:  # built-in rules are compiled once per process; user files re-read
        rules = load_rules([Path(p) for p in extra_rules or []])
        _cache[key] = (rules, Scanner(rules, engine))
    return _cache[key]


def own_scanner(rules: RuleSet, engine: str):
    from trainguard.diagnose.scan import Scanner

    key = ("own", engine, id(rules))
    if key not in _cache or _cache[key][0] is not rules:
        _cache[key] = (rules, Scanner(rules, engine))
    return _cache[key]
