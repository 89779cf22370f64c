"""One combined keyword search over big byte chunks: where might a rule match?

With the optional ``hyperscan`` package (``pip install trainguard[fast]``) all keywords are found in
one pass at hundreds of MB/s; without it one combined ``re`` alternation (each keyword anchored at
its rarest byte) does the same job, slower.
Both return the same lines: every line that contains at least one keyword.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator

try:  # optional accelerator
    import hyperscan as _hs
except ImportError:  # pragma: no cover - depends on the environment
    _hs = None


def _hs_escape(keyword: bytes) -> bytes:
    return b"".join(
        bytes([c]) if (48 <= c <= 57 or 65 <= c <= 90 or 97 <= c <= 122) else b"\\x%02x" % c for c in keyword
    )


# How common a byte is in training logs (higher: more common). The pure-re prefilter starts each
# keyword's match at its rarest byte, so the regex engine tries a match at few positions: the
# scan runs several times faster than a plain alternation of the keywords.
_COMMON = {c: 10 for c in b" etaoinsrl0123456789"} | {c: 8 for c in b".:-,/=[]()|_"}
_COMMON |= {c: 6 for c in b"cdhumpTEINFO"} | {c: 4 for c in b"fgwybvk"}


def _rarity(c: int) -> int:
    return _COMMON.get(c, 2 if 65 <= c <= 90 else 1)


def _rare_first_regex(kws: list[bytes]) -> re.Pattern[bytes]:
    """An alternation of the keywords where each begins at its rarest byte; a lookbehind checks the
    part before it: keyword k with rarest byte at i becomes ``k[i] k[i+1:] (?<=k)``."""
    groups: dict[bytes, list[bytes]] = {}
    for k in kws:
        i = min(range(len(k)), key=lambda j: (_rarity(k[j]), j))
        alt = re.escape(k[i + 1 :]) + (b"(?<=" + re.escape(k) + b")" if i > 0 else b"")
        groups.setdefault(k[i : i + 1], []).append(alt)
    return re.compile(
        b"|".join(re.escape(c) + b"(?:" + b"|".join(alts) + b")" for c, alts in sorted(groups.items()))
    )


class Prefilter:
    """``lines(buf)`` yields (start, end) of each line of ``buf`` that holds a keyword, in order."""

    def __init__(self, keywords: list[str], engine: str = "auto") -> None:
        uniq = {k.encode("utf-8") for k in keywords if k}
        # a keyword that contains another adds nothing: every line it is in, the shorter one finds
        kws = sorted(
            (k for k in uniq if not any(o != k and o in k for o in uniq)), key=lambda k: (-len(k), k)
        )
        if not kws:
            raise ValueError("no keywords")
        self.keywords = [k.decode("utf-8") for k in kws]  # the kept ones, by id (shortest forms)
        if engine == "auto":
            engine = "hyperscan" if _hs is not None else "re"
        self.engine = engine
        self._re = _rare_first_regex(kws)
        self._db = None
        # The agent scans from more than one thread (the warm-up thread, the failure path).
        self._scan_lock = threading.Lock()
        if engine == "hyperscan":
            if _hs is None:
                raise ValueError("hyperscan is not installed")
            db = _hs.Database(mode=_hs.HS_MODE_BLOCK)
            db.compile(
                expressions=[_hs_escape(k) for k in kws],
                ids=list(range(len(kws))),
                elements=len(kws),
                flags=[0] * len(kws),
            )
            self._db = db
        elif engine != "re":
            raise ValueError(f"unknown prefilter engine {engine!r}")

    def lines(self, buf: bytes | bytearray, size: int | None = None) -> Iterator[tuple[int, int]]:
        """Lines of ``buf[:size]`` (all of it by default)."""
        if self._db is not None:
            for start, end, _ in self.lines_ids(buf, size):
                yield start, end
            return
        search, find, rfind = self._re.search, buf.find, buf.rfind
        pos, n = 0, len(buf) if size is None else size
        while pos < n:
            m = search(buf, pos, n)
            if m is None:
                return
            start = rfind(b"\n", 0, m.start()) + 1
            end = find(b"\n", m.end(), n)
            if end < 0:
                end = n
            yield start, end
            pos = end + 1

    def positions(self, buf: bytes, limit: int) -> list[int]:
        """Start offsets of up to ``limit`` keyword occurrences in ``buf`` (used on huge single lines)."""
        out = []
        for m in self._re.finditer(buf):
            out.append(m.start())
            if len(out) >= limit:
                break
        return out

    def lines_ids(
        self, buf: bytes | bytearray, size: int | None = None
    ) -> Iterator[tuple[int, int, set[int] | None]]:
        """Like ``lines``, with the ids (indexes into ``keywords``) of the keywords found in each line
        where the engine reports them (hyperscan); None where it does not (re)."""
        if self._db is None:
            for start, end in self.lines(buf, size):
                yield start, end, None
            return
        n = len(buf) if size is None else size
        ends: list[int] = []
        ids: dict[int, set[int]] = {}
        state = [-1]  # end of the line the last hit was in
        find = buf.find

        def on_match(kid: int, _from: int, to: int, _flags: int, _ctx: object) -> None:
            if to > state[0]:
                e = find(b"\n", to - 1, n)
                state[0] = n if e < 0 else e
                ends.append(state[0])
                ids[state[0]] = {kid}
            else:
                ids[state[0]].add(kid)
            return None

        with self._scan_lock:  # one scratch per database: two threads at once raise ScratchInUseError
            if n == len(buf):
                self._db.scan(buf, match_event_handler=on_match)
            else:
                with memoryview(buf)[:n] as part:
                    self._db.scan(part, match_event_handler=on_match)
        prev_end = -1
        for end in sorted(set(ends)):  # hits arrive in end order; sets guard against duplicates
            if end <= prev_end:
                continue
            found = ids[end]
            start = buf.rfind(b"\n", 0, end) + 1 if end > 0 else 0
            if end < n and buf[end : end + 1] != b"\n":
                end = n
            yield start, end, found
            prev_end = end
