"""The one event type every part of trainguard records."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from enum import IntEnum
from typing import Any


class Severity(IntEnum):
    INFO = 10
    WARNING = 20
    ERROR = 30
    CRITICAL = 40

    @classmethod
    def parse(cls, value: str | int | Severity) -> Severity:
        if isinstance(value, Severity):
            return value
        if isinstance(value, int):
            return cls(value)
        try:
            return cls[value.strip().upper()]
        except KeyError:
            names = ", ".join(s.name.lower() for s in cls)
            raise ValueError(f"unknown severity {value!r} (expected one of: {names})") from None

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass
class Event:
    """A fact about the job: what happened, where, how bad, and the evidence for it."""

    kind: str
    message: str
    severity: Severity = Severity.INFO
    node: str = ""
    rank: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)
    id: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["severity"] = self.severity.label
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), default=str, sort_keys=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Event:
        return cls(
            kind=d["kind"],
            message=d.get("message", ""),
            severity=Severity.parse(d.get("severity", "info")),
            node=d.get("node", ""),
            rank=d.get("rank"),
            evidence=d.get("evidence") or {},
            time=float(d.get("time", time.time())),
            id=d.get("id"),
        )
