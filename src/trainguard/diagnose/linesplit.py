"""Whole-line chunks from a byte stream, in one buffer used again for every chunk, bounded.

A line ends at ``\\n``, ``\\r\\n`` or a lone ``\\r``: a progress bar redrawn with ``\\r`` only (tqdm
in a file) is many lines, not one line of 100 MB that hides what follows it. A lone ``\\r`` is
turned into ``\\n`` in place (same length: file offsets stay true), so everything downstream splits
on ``\\n`` alone. A line longer than ``LINE_CAP`` (counting the CR of a CRLF) is cut: its first
and last ``LINE_CAP // 2`` bytes are kept (as two pieces: a message appended to junk is at the
end), its middle is neither held nor matched, and ``cuts.lines`` counts it. A line that ends within
one read is handed over whole and only counted here; the scanner matches its two ends alone. So
memory is one buffer of ``chunk + LINE_CAP`` bytes whatever the input (a 4 GB line included).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

LINE_CAP = 64 << 10
HALF = LINE_CAP // 2
_LONE_CR = re.compile(rb"\r(?!\n)")


@dataclass
class Chunk:
    """Whole lines: ``data[:end]`` (the last line may lack its newline). ``data`` is one buffer the
    reader fills again for the next chunk: copy what you keep."""

    data: bytes | bytearray
    start_line: int | None  # 0-based line number of the first line, None when not known (tail reads)
    offset: int | None = None  # byte offset of data in the file (None: decompressed or transcoded)
    end: int = -1  # the length of the valid data; -1: all of it

    def __post_init__(self) -> None:
        if self.end < 0:
            self.end = len(self.data)


@dataclass
class Cuts:
    """What the line cap left out of one file."""

    lines: int = 0  # lines longer than LINE_CAP (only their first and last HALF bytes were read)
    bytes: int = 0  # bytes of those lines not held (the middles of the lines cut by the reader)


def long_lines(buf: bytes | bytearray, lo: int, hi: int, cap: int = LINE_CAP) -> int:
    """How many lines of ``buf[lo:hi]`` (whole lines) are longer than ``cap``: one backward search
    per ``cap`` bytes, so a chunk of short lines costs next to nothing."""
    n, s = 0, lo
    while hi - s > cap:
        q = buf.rfind(b"\n", s, s + cap + 1)
        if q >= 0:
            s = q + 1  # every line that starts before q + 1 ends by q: none is longer than cap
            continue
        e = buf.find(b"\n", s + cap + 1, hi)
        if e < 0:
            return n + 1  # the last line, without its newline
        n, s = n + 1, e + 1
    return n


class Splitter:
    """Feed it bytes (``file``: read straight into the buffer; ``blocks``: copied in); it yields
    ``Chunk``s of whole lines. ``skip_partial``: the data starts mid-line (a tail read)."""

    def __init__(self, chunk: int, first_line: int | None, offset: int | None, expect: int | None = None,
                 skip_partial: bool = False, cuts: Cuts | None = None) -> None:  # fmt: skip
        self.chunk = chunk
        self.full = chunk + LINE_CAP + 1
        self.buf = bytearray(self.full if expect is None else min(self.full, expect + 1))
        self.view = memoryview(self.buf)
        self.have = 0  # buf[:have]: the start of a line not ended yet (its last bytes while cutting)
        self.fixed = 0  # buf[:fixed] has its lone CRs turned into LFs
        self.line_no = first_line
        self.at = offset  # file offset of buf[0]
        self.skipping = skip_partial  # inside a line whose middle is not kept
        self.discard = skip_partial  # ... and whose end is not kept either (a tail read's first line)
        self.cuts = cuts if cuts is not None else Cuts()

    def close(self) -> None:
        self.view.release()

    def _room(self) -> int:
        if self.have >= len(self.buf):  # more than expected (a live file grows): the full buffer
            grown = bytearray(self.full)
            grown[: self.have] = self.view[: self.have]
            self.view.release()
            self.buf, self.view = grown, memoryview(grown)
        return len(self.buf) - self.have

    def file(self, f, limit: int | None = None) -> Iterator[Chunk]:
        left = limit
        while True:
            want = min(self.chunk if left is None else min(self.chunk, left), self._room())
            n = (f.readinto(self.view[self.have : self.have + want]) or 0) if want > 0 else 0
            if n == 0:
                yield from self.finish()
                return
            left = None if left is None else left - n
            yield from self._fill(n)

    def blocks(self, blocks: Iterable[bytes]) -> Iterator[Chunk]:
        for b in blocks:
            yield from self.feed(b)
        yield from self.finish()

    def feed(self, b: bytes) -> Iterator[Chunk]:
        i = 0
        while i < len(b):
            k = min(self._room(), len(b) - i, self.chunk)
            self.buf[self.have : self.have + k] = b[i : i + k]
            i += k
            yield from self._fill(k)

    def _fix_cr(self, total: int, eof: bool) -> None:
        hi = total - 1 if total > self.fixed and not eof and self.buf[total - 1] == 13 else total
        lo, self.fixed = self.fixed, hi  # a CR last in the data may start a CRLF: looked at next time
        if hi <= lo or self.buf.find(b"\r", lo, hi) < 0:
            return
        crlf = self.buf.count(b"\r\n", lo, hi)
        if crlf == 0:  # CR line ends only (a progress bar): a plain replace, at memcpy speed
            self.buf[lo:hi] = bytes(self.view[lo:hi]).replace(b"\r", b"\n")
        elif self.buf.count(b"\r", lo, hi) != crlf:  # both kinds: only the lone CRs change
            self.buf[lo:hi] = _LONE_CR.sub(b"\n", self.view[lo:hi])

    def _drop(self, k: int, total: int) -> int:
        """Forget buf[:k] (the data moves to the front); the new total."""
        if k <= 0:
            return total
        rest = bytes(self.view[k:total])
        self.buf[: len(rest)] = rest
        self.at = None if self.at is None else self.at + k
        self.fixed = max(0, self.fixed - k)
        return total - k

    def _fill(self, n: int, eof: bool = False) -> Iterator[Chunk]:
        total = self.have + n
        self._fix_cr(total, eof)
        if self.skipping:
            nl = self.buf.find(b"\n", 0, self.fixed)
            if nl < 0:  # the line goes on: keep its last HALF bytes (and one for a CR before the LF)
                keep = 0 if self.discard else HALF + 1
                drop = max(0, total - keep)
                self.cuts.bytes += 0 if self.discard else drop
                self.have = self._drop(drop, total)
                return
            text_end = nl - 1 if nl and self.buf[nl - 1] == 13 else nl  # the line's last byte before CRLF/LF
            start = nl + 1 if self.discard else max(0, text_end - HALF)
            self.cuts.bytes += 0 if self.discard else start
            total = self._drop(start, total)
            self.skipping = self.discard = False
        end = self.buf.rfind(b"\n", 0, self.fixed) + 1
        if end:
            self.cuts.lines += long_lines(self.buf, 0, end)
            yield Chunk(self.buf, self.line_no, self.at, end=end)
            if self.line_no is not None:
                self.line_no += self.buf.count(b"\n", 0, end)
            total = self._drop(end, total)
        self.have = total
        if self.fixed > LINE_CAP:  # a line longer than the cap: its head now, its tail when it ends
            self.cuts.lines += 1
            yield Chunk(self.buf, self.line_no, self.at, end=HALF)
            self.skipping = True
            self.have = self._drop(max(0, total - HALF - 1), total)
            self.cuts.bytes += max(0, total - 2 * HALF - 1)

    def finish(self) -> Iterator[Chunk]:
        """The end of the data: the last line, even without its newline."""
        total = self.have
        self._fix_cr(total, eof=True)
        if total and not self.discard:
            yield from self._fill(0, eof=True) if self.buf.find(b"\n", 0, total) >= 0 else ()
            total = self.have
            if total and not self.discard:
                yield Chunk(self.buf, self.line_no, self.at, end=total)
        self.have = 0
