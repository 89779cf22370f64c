"""Command-line options shared by every command: value types that refuse bad input with one clear
line, and settings dataclasses built once from the parsed options.

Defaults live in one place: a flag whose value feeds a settings dataclass has ``default=None`` in
argparse, and ``given`` passes on only the flags the user set, so the dataclass default applies
otherwise (help texts quote the dataclass default).
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any


class SettingsError(ValueError):
    """A setting (flag or environment variable) that cannot be right. The message names it and is
    printed as the one error line of the command."""


MAX_SECONDS = 7 * 86400.0  # the longest timeout a flag takes: larger ones overflow clocks and timedeltas


def number(what: str, *, integer: bool = False, minimum: float = 0.0, inclusive: bool = False,
           maximum: float | None = None) -> Callable[[str], Any]:
    """An argparse ``type``: a finite number above ``minimum`` (or equal to it with ``inclusive``),
    and at most ``maximum`` when given. NaN and infinities are refused here, once for every command."""
    bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
    if maximum is not None:
        bound += f" and <= {maximum:g}"

    def parse(text: str) -> Any:
        try:
            value: Any = int(text) if integer else float(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        ok = value >= minimum if inclusive else value > minimum
        if not (ok and math.isfinite(value)) or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected {what} {bound}, got {text!r}")
        return value

    parse.__name__ = what  # argparse names the type in its messages
    return parse


positive = number("a number")
positive_int = number("a positive integer", integer=True)
non_negative = number("a number", inclusive=True)
non_negative_int = number("an integer", integer=True, inclusive=True)
seconds = number("seconds", maximum=MAX_SECONDS)  # a timeout or an interval


def port(text: str) -> int:
    """An argparse ``type``: a TCP port, 1..65535 (0 would mean "any port", never what a peer can reach)."""
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port (1-65535), got {text!r}")
    return value


port.__name__ = "port"


def port_or_zero(text: str) -> int:
    """A port to listen on: 0 asks the kernel for a free one."""
    return 0 if text.strip() == "0" else port(text)


port_or_zero.__name__ = "port"


def endpoint(text: str) -> str:
    """An argparse ``type``: HOST, HOST:PORT or [V6]:PORT, the port 1..65535 where given."""
    text = text.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else None
        if rest and port_text is None:
            raise argparse.ArgumentTypeError(f"expected HOST[:PORT], got {text!r}")
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:
        host, port_text = text, None
    if not host or any(c.isspace() or c in "/@?#" for c in host):
        raise argparse.ArgumentTypeError(f"expected HOST[:PORT], got {text!r}")
    if port_text is not None:
        try:
            port(port_text)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"expected HOST[:PORT] with a port 1-65535, got {text!r}") from None
    return text


endpoint.__name__ = "endpoint"


def dir_path(text: str) -> str:
    """An argparse ``type``: a path that is a directory where it exists (a missing one is the
    caller's to judge: a check may skip it)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a directory, got ''")
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is not a directory")
    return text


dir_path.__name__ = "directory"


# Letters, digits, '.', '_' and '-' (what hostnames, Slurm and Kubernetes node names use): a node
# name goes into file names, `scontrol ... NodeName=`, comma-separated Slurm lists (a comma would
# name other nodes) and a printed `sbatch` line, so nothing else is taken.
_NODE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,252}")


def node_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a node name (None: it can)."""
    if _NODE_NAME.fullmatch(name):
        return None
    return (f"{name!r} is not a node name: use letters, digits, '.', '_' and '-' only (no commas, spaces, "
            "'/' or shell characters), at most 253")


def node_name(text: str) -> str:
    """An argparse ``type``: a node name (see ``node_name_problem``)."""
    problem = node_name_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


node_name.__name__ = "node name"


def given(options: Any, fields: Mapping[str, str]) -> dict[str, Any]:
    """``{field: value}`` for each ``field: option_name`` the user set (value not None)."""
    out = {}
    for name, option in fields.items():
        value = getattr(options, option, None)
        if value is not None:
            out[name] = value
    return out
