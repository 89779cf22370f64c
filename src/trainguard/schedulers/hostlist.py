"""Slurm host lists: ``n[1-3,7],gpu-a[01-02]-ib`` -> ``[n1, n2, n3, n7, gpu-a01-ib, gpu-a02-ib]``.

``expand`` prefers ``scontrol show hostnames`` (Slurm's own parser, when the client tools are
installed); ``parse`` is the pure fallback for the syntax Slurm documents: comma-separated names,
each with any number of bracketed ranges (``[1-3,7]``), zero padding kept (``[01-10]``).
"""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess

_MAX_HOSTS = 1_000_000  # a bracket such as [0-99999999] must not eat the agent's memory


class HostlistError(ValueError):
    pass


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
            if depth > 1:
                raise HostlistError(f"nested '[' in host list {text!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"unbalanced ']' in host list {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise HostlistError(f"unbalanced '[' in host list {text!r}")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _range(spec: str, whole: str) -> list[str]:
    out: list[str] = []
    for item in spec.split(","):
        item = item.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not m:
            raise HostlistError(f"bad range {item!r} in host list {whole!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise HostlistError(f"descending range {item!r} in host list {whole!r}")
        if int(hi) - int(lo) >= _MAX_HOSTS:
            raise HostlistError(f"range {item!r} in host list {whole!r} is too large")
        width = len(lo) if lo.startswith("0") and len(lo) > 1 else 0
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def _expand_one(name: str, whole: str) -> list[str]:
    pieces: list[list[str]] = []
    pos = 0
    for m in re.finditer(r"\[([^\]]*)\]", name):
        pieces.append([name[pos : m.start()]])
        pieces.append(_range(m.group(1), whole))
        pos = m.end()
    pieces.append([name[pos:]])
    return ["".join(p) for p in itertools.product(*pieces)]


def parse(text: str) -> list[str]:
    """Expand a Slurm host list without Slurm. Raises HostlistError on bad syntax."""
    hosts: list[str] = []
    for name in _split_top(text.strip()):
        hosts.extend(_expand_one(name, text))
        if len(hosts) > _MAX_HOSTS:
            raise HostlistError(f"host list {text[:80]!r} names more than {_MAX_HOSTS} hosts")
    return hosts


def expand(text: str, *, scontrol: str | None = "scontrol", timeout: float = 10.0) -> list[str]:
    """The hosts of ``text``: Slurm's ``scontrol show hostnames`` when it is there and answers,
    else ``parse``."""
    exe = shutil.which(scontrol) if scontrol else None
    if exe:
        try:
            out = subprocess.run([exe, "show", "hostnames", text], capture_output=True, text=True, timeout=timeout)
            if out.returncode == 0 and out.stdout.split():
                return out.stdout.split()
        except (OSError, subprocess.SubprocessError):
            pass
    return parse(text)
