"""Find the log files behind PATH arguments and read them in big chunks, bounded.

A path is a file, a directory (searched recursively for log-like files), or a glob. ``.gz`` files
are decompressed on the fly; a truncated or corrupt one is read up to the damage (and a note says
so). Only regular files are read from directories and globs: a FIFO, a device (a link to
/dev/zero) or a socket is skipped with a note, since reading it could block or never end; a FIFO
named explicitly (``<(zcat log.gz)``) is read. Each file's rank and host are guessed from its name
(``rank-3.log``, ``attempt_0/3/stderr.log``, ``node-a/rank-0.log``, ``worker-1.log``).
With ``max_bytes`` only the first ``HEAD_BYTES`` and the last ``max_bytes`` of a file are read.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import re
import stat
import time
import zlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CHUNK = 8 << 20
HEAD_BYTES = 1 << 20
LOG_SUFFIXES = {".log", ".txt", ".out", ".err", ".gz", ".jsonl", ".dmesg", ".stdout", ".stderr", ""}
GZ_READ = 1 << 20
_RANK_NAME = re.compile(r"(?:^|[^a-z])rank[-_]?(\d+)(?:\D|$)", re.I)
_HOSTY = re.compile(r"(?i)^(?:.*(?:node|worker|host|pod|master|gpu|server)[\w.-]*|[a-z][\w-]*-\d+)$")
_GENERIC = {"stdout", "stderr", "log", "logs", "train", "output", "console", "err", "out"}
_NOT_HOST = re.compile(r"(?i)^(?:slurm|job|train|run|log|output|attempt|step|task)[-_]?\d+$")
# what a node's diagnostic dump is named after, around the host name: dmesg_cn-234, cn-238_checks
_DIAG_AFFIX = re.compile(r"(?i)^(?:dmesg|syslog|kern|journal|checks?)[-_]|[-_](?:dmesg|syslog|kern|journal|checks?)$")


class SourceError(ValueError):
    """A path argument names nothing readable."""


@dataclass(frozen=True)
class Source:
    path: Path
    rank: int | None
    host: str | None
    year: int


def _stem(p: Path) -> str:
    name = p.name[:-3] if p.name.endswith(".gz") else p.name
    return name.rsplit(".", 1)[0] if "." in name else name


def describe(path: Path) -> Source:
    """Rank and host from the file name and its parent folders."""
    stem = _stem(path)
    rank = None
    m = _RANK_NAME.search(stem)
    if m:
        rank = int(m[1])
    elif stem in ("stdout", "stderr") and path.parent.name.isdigit():  # torchrun --log-dir layout
        rank = int(path.parent.name)
    host = None
    named = _DIAG_AFFIX.sub("", stem) or stem
    parent = path.parent.name if path.parent.name and _HOSTY.match(path.parent.name) \
        and not path.parent.name.startswith("attempt") else None  # fmt: skip
    # a log's own name that starts with a generic word (train_sft_node1.log) in a host-like folder
    # (GPU01/): the per-host folder layout names the host; the file name only tells the logs apart
    generic_name = re.split(r"[-_.]", stem, maxsplit=1)[0].lower() in _GENERIC and parent is not None
    if m is None and stem.lower() not in _GENERIC and _HOSTY.match(named) and not _NOT_HOST.match(named) \
            and not generic_name:  # fmt: skip
        host = named
    elif parent is not None:
        host = parent
    try:
        year = time.localtime(path.stat().st_mtime).tm_year
    except OSError:
        year = time.localtime().tm_year
    return Source(path, rank, host, year)


def _is_log(p: Path) -> bool:
    suffix = p.suffix.lower() if not p.name.endswith(".gz") else ".gz"
    return suffix in LOG_SUFFIXES and not p.name.startswith(".")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):  # fmt: skip
        if test(mode):
            return name
    return "not a regular file"


def _regular(p: Path, notes: list[str] | None) -> bool:
    """A regular file (after following links); anything else is skipped with a note."""
    try:
        mode = os.stat(p).st_mode
    except OSError as exc:
        if notes is not None:
            notes.append(f"skipped {p}: {exc.strerror or exc}")
        return False
    if stat.S_ISREG(mode):
        return True
    if notes is not None:
        notes.append(f"skipped {p}: {_kind(mode)} (reading it could block or never end)")
    return False


def walk_files(top: Path, notes: list[str] | None) -> list[Path]:
    """Every file under ``top`` (hidden directories skipped, links to directories not followed),
    in os.walk's top-down sorted order. An explicit stack, not recursion: os.walk and
    Path.rglob recurse once per level and raise RecursionError in a tree ~1,000 levels deep."""
    out: list[Path] = []
    stack = [Path(top)]
    while stack:
        root = stack.pop()
        try:
            with os.scandir(root) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as exc:  # unreadable, or a path beyond PATH_MAX: skipped, as os.walk does
            if notes is not None and root != top:
                notes.append(f"skipped {root}: {exc.strerror or exc}")
            continue
        dirs = []
        for e in entries:
            try:
                is_dir, is_link = e.is_dir(), e.is_symlink()
            except OSError:
                is_dir = is_link = False
            if is_dir:  # a link to a directory is neither walked nor a file (os.walk's default)
                if not is_link and not e.name.startswith("."):
                    dirs.append(root / e.name)
            else:
                out.append(root / e.name)
        stack.extend(reversed(dirs))  # the first name is walked first
    return out


def expand(paths: list[str | Path], notes: list[str] | None = None) -> list[Path]:
    """The files to read, in a stable order, each once. Raises SourceError for a path naming nothing.
    Special files met in directories and globs are skipped (with a note in ``notes``)."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        try:
            mode = os.stat(p).st_mode
        except (OSError, ValueError):
            mode = None
        if mode is not None and stat.S_ISREG(mode):
            out.append(p)
        elif mode is not None and stat.S_ISFIFO(mode):
            out.append(p)  # named explicitly: a pipe the user means us to read (process substitution)
        elif mode is not None and stat.S_ISDIR(mode):
            out += [f for f in walk_files(p, notes) if _is_log(f) and _regular(f, notes)]
        elif mode is not None:
            if notes is not None:
                notes.append(f"skipped {p}: {_kind(mode)} (reading it could block or never end)")
        elif any(c in str(raw) for c in "*?["):
            try:
                hits = [Path(h) for h in sorted(glob.glob(str(raw), recursive=True))]
            except RecursionError:  # glob's ``**`` recurses per level: give the directory instead
                raise SourceError(f"{raw}: the tree is too deep for a '**' pattern; give its directory") from None
            files = [h for h in hits if not os.path.isdir(h) and _regular(h, notes)]
            if not files and not hits:
                raise SourceError(f"{raw}: no file matches")
            out += files
        else:
            raise SourceError(f"{raw}: no such file or directory")
    seen: set[Path] = set()
    uniq = []
    for f in out:
        try:
            key = f.resolve()
        except (OSError, RuntimeError):
            key = f
        if key not in seen:
            seen.add(key)
            uniq.append(f)
    return uniq


def error_files(paths: list[Path]) -> list[Path]:
    """torch elastic error files (``error-<rank>.json``) next to the given files or inside given dirs."""
    out = []
    for p in paths:
        try:
            if p.is_dir():
                found = sorted(f for f in walk_files(p, None) if fnmatch.fnmatch(f.name, "error-*.json"))
            else:
                found = sorted(p.parent.glob("error-*.json"))
        except OSError:
            continue
        out += [f for f in found if _regular(f, None)]
    return sorted(set(out))


@dataclass
class Chunk:
    """Whole lines: ``data[:end]`` (the last line may lack its newline). For plain files ``data`` is
    one buffer the reader fills again for the next chunk: copy what you keep."""

    data: bytes | bytearray
    start_line: int | None  # 0-based line number of the first line, None when not known (tail reads)
    offset: int | None = None  # byte offset of data in the file (None for .gz)
    end: int = -1  # the length of the valid data; -1: all of it

    def __post_init__(self) -> None:
        if self.end < 0:
            self.end = len(self.data)


def read_chunks(path: Path, max_bytes: int | None = None, notes: list[str] | None = None) -> Iterator[Chunk]:
    """Whole-line chunks of a file. Never raises for unreadable or corrupt data: it stops there and
    says why in ``notes``."""
    notes = notes if notes is not None else []
    if path.name.endswith(".gz"):
        yield from _lines_of(_gz_blocks(path, max_bytes, notes), first_line=0 if max_bytes is None else None)
        return
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed in finally
    except OSError as exc:
        notes.append(f"could not read {path}: {exc.strerror or exc}")
        return
    try:
        st = os.fstat(f.fileno())
        size = st.st_size if stat.S_ISREG(st.st_mode) else 0
        if max_bytes is not None and size > HEAD_BYTES + max_bytes:
            yield from _file_chunks(f, 0, HEAD_BYTES, first_line=0, expect=HEAD_BYTES)
            yield from _file_chunks(
                f, size - max_bytes, None, first_line=None, skip_partial=True, expect=max_bytes
            )
        else:
            yield from _file_chunks(f, 0, None, first_line=0, known_offsets=bool(size), expect=size or None)
    except OSError as exc:
        notes.append(f"read error in {path}: {exc.strerror or exc}; read up to there")
        return
    finally:
        f.close()


def _file_chunks(
    f,
    offset: int,
    limit: int | None,
    first_line: int | None,
    skip_partial: bool = False,
    known_offsets: bool = True,
    expect: int | None = None,
) -> Iterator[Chunk]:
    """Whole-line chunks of an open plain file (or FIFO), read into one buffer used again for each
    chunk: a fresh 8 MB ``bytes`` per read costs the kernel 2,048 new zeroed pages, and the copies
    that join a carried partial line to the next read as many again (a third of the scan's time).
    ``expect`` (the bytes the file should give) keeps the buffer small for small files; it grows if
    a live file grows."""
    if offset:
        f.seek(offset)
    at: int | None = offset if known_offsets else None
    left = limit
    if skip_partial:  # a tail read starts mid-line: skip to the next line
        while True:
            part = f.readline(CHUNK)
            at = None if at is None else at + len(part)
            left = None if left is None else left - len(part)
            if not part or part.endswith(b"\n"):
                break
    buf = bytearray(2 * CHUNK if expect is None else min(2 * CHUNK, expect + 1))
    view = memoryview(buf)
    have = 0  # the start of a line carried over from the last read (it holds no newline)
    line_no = first_line
    try:
        while True:
            want = CHUNK if left is None else min(CHUNK, left)
            if have + want > len(buf) and have < len(buf):
                want = len(buf) - have  # a small buffer for a small file
            elif have + want > len(buf):  # the file gave more than expected (it grows): grow
                grown = bytearray(2 * CHUNK)
                grown[:have] = view[:have]
                view.release()
                buf, view = grown, memoryview(grown)
            n = (f.readinto(view[have : have + want]) or 0) if want > 0 else 0
            left = None if left is None else left - n
            total = have + n
            if n == 0:
                if total:
                    yield Chunk(buf, line_no, at, end=total)
                return
            cut = buf.rfind(b"\n", have, total)
            if cut < 0:
                if total >= CHUNK:  # a giant line: hand it over as it is rather than grow forever
                    yield Chunk(buf, line_no, at, end=total)  # the next chunk goes on with this line
                    at = None if at is None else at + total
                    have = 0
                else:
                    have = total
                continue
            end = cut + 1
            yield Chunk(buf, line_no, at, end=end)
            if line_no is not None:
                line_no += buf.count(b"\n", 0, end)
            at = None if at is None else at + end
            have = total - end
            if have:
                buf[:have] = bytes(view[end:total])
    finally:
        view.release()


def _gunzip(path: Path, notes: list[str]) -> Iterator[bytes]:
    """Decompressed blocks of a gzip file (several members too), as far as the data goes: a file cut
    short yields everything before the cut (gzip.open would raise and lose the last read)."""
    produced = 0
    fed = False  # the current member's decompressor got data and has not reached its end
    try:
        with open(path, "rb") as f:
            d = zlib.decompressobj(16 + zlib.MAX_WBITS)
            while raw := f.read(GZ_READ):
                while raw:
                    fed = True
                    out = d.decompress(raw)
                    if out:
                        produced += len(out)
                        yield out
                    if not d.eof:
                        break
                    raw, fed = d.unused_data, False  # the next gzip member, if any
                    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
            if fed or produced == 0:
                rest = d.flush()
                if rest:
                    produced += len(rest)
                    yield rest
                notes.append(f"{path}: truncated gzip (the compressed data ends early); read "
                             f"{produced / 1e6:.1f} MB before the cut")  # fmt: skip
    except zlib.error as exc:
        notes.append(f"{path}: corrupt gzip data after {produced / 1e6:.1f} MB ({exc}); read up to there")
    except OSError as exc:
        notes.append(f"could not read {path}: {exc.strerror or exc}")


def _gz_blocks(path: Path, max_bytes: int | None, notes: list[str]) -> Iterator[bytes]:
    """Decompressed blocks; with max_bytes, the head and the last max_bytes only (bounded memory)."""
    tail: deque[bytes] = deque()
    kept = 0
    seen = 0
    for b in _gunzip(path, notes):
        if max_bytes is None or seen < HEAD_BYTES:
            seen += len(b)
            yield b
            continue
        tail.append(b)
        kept += len(b)
        while kept - len(tail[0]) >= max_bytes:
            kept -= len(tail.popleft())
    if tail:
        yield b"\n"  # the head and the tail are not contiguous
        yield from tail


def _lines_of(
    blocks: Iterator[bytes], first_line: int | None = 0, skip_partial: bool = False, offset: int | None = None
) -> Iterator[Chunk]:
    carry = b""
    line_no = first_line
    first = True
    for b in blocks:
        buf = carry + b if carry else b
        cut = buf.rfind(b"\n")
        if cut < 0:
            if len(buf) > CHUNK:  # a giant line: hand it over as it is rather than grow forever
                carry = b""
                yield Chunk(buf, line_no, offset)  # the next chunk goes on with this line
                offset = None if offset is None else offset + len(buf)
            else:
                carry = buf
            continue
        data, carry = buf[: cut + 1], buf[cut + 1 :]
        if first and skip_partial:  # a tail read starts mid-line
            nl = data.find(b"\n")
            data = data[nl + 1 :]
            offset = None if offset is None else offset + nl + 1
        first = False
        if data:
            yield Chunk(data, line_no, offset)
            if line_no is not None:
                line_no += data.count(b"\n")
            offset = None if offset is None else offset + len(data)
    if carry:
        yield Chunk(carry, line_no, offset)
