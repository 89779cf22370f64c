"""Find the log files behind PATH arguments and read them in big chunks, bounded.

A path is a file, a directory (searched recursively for log-like files), or a glob. What a file
holds is told from its first bytes (streams.py): gzip, bzip2, xz and zstd are decompressed in a
stream, UTF-16/32 decoded, binary data skipped; a truncated or corrupt archive is read up to the
damage. Lines end at LF, CRLF or a lone CR and are capped (linesplit.py). Every skip, cut and damage
is said in ``notes`` and in the file's ``ReadReport``. Only regular files are read from directories
and globs: a FIFO, a device (a link to /dev/zero) or a socket is skipped with a note, since reading
it could block or never end; a FIFO named explicitly (``<(zcat log.gz)``) is read. Each file's rank
and host are guessed from its name (``rank-3.log``, ``attempt_0/3/stderr.log``,
``node-a/rank-0.log``, ``worker-1.log``). With ``max_bytes`` only the first ``HEAD_BYTES`` and the
last ``max_bytes`` of a file's text are read (a compressed one is decompressed no further than
``DECOMPRESS_FACTOR * max_bytes``).
"""

from __future__ import annotations

import fnmatch
import glob
import os
import re
import stat
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from trainguard.diagnose.linesplit import Chunk, Cuts, Splitter
from trainguard.diagnose.streams import (
    COMPRESSED_SUFFIXES,
    SNIFF,
    UNSUPPORTED,
    ZSTD_HINT,
    Damaged,
    compression_of,
    encoding_of,
    file_blocks,
    inflate,
    peek,
    transcode,
    zstd_available,
)

__all__ = ["Chunk", "Cuts", "ReadReport", "Source", "SourceError", "describe", "error_files", "expand", "read_chunks"]

CHUNK = 8 << 20
HEAD_BYTES = 1 << 20
LOG_SUFFIXES = {".log", ".txt", ".out", ".err", ".jsonl", ".dmesg", ".stdout", ".stderr", ""} | set(COMPRESSED_SUFFIXES)
DECOMPRESS_FACTOR = 16  # with --max-mb M a compressed file is decompressed no further than 16 * M
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
    name = p.name[: -len(p.suffix)] if p.suffix.lower() in COMPRESSED_SUFFIXES else p.name
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
    return p.suffix.lower() in LOG_SUFFIXES and not p.name.startswith(".")


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
class ReadReport:
    """How one file was read and what of it was not (``diagnose --json``'s stats)."""

    compression: str | None = None  # gzip | bzip2 | xz | zstd, None for a plain file
    encoding: str = "utf-8"
    raw_bytes: int = 0  # compressed bytes read
    decompressed: int = 0  # bytes the decompressor gave (what --max-mb counts for a compressed file)
    skipped: str | None = None  # why nothing was read: binary | unsupported_compression | unreadable
    partial: str | None = None  # why part was not read: over_limit | damaged | unreadable
    detail: str = ""  # the line that says it
    cuts: Cuts = field(default_factory=Cuts)

    def skip(self, reason: str, detail: str, notes: list[str]) -> None:
        self.skipped, self.detail = reason, detail
        notes.append(detail)

    def part(self, reason: str, detail: str, notes: list[str] | None) -> None:
        self.partial, self.detail = reason, detail
        if notes is not None:
            notes.append(detail)


def read_chunks(
    path: Path, max_bytes: int | None = None, notes: list[str] | None = None, report: ReadReport | None = None
) -> Iterator[Chunk]:
    """Whole-line chunks of a file's text (decompressed, as UTF-8). Never raises for unreadable,
    corrupt or binary data: it stops there and says why in ``notes`` and ``report``."""
    notes = notes if notes is not None else []
    report = report if report is not None else ReadReport()
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed in finally
    except OSError as exc:
        report.skip("unreadable", f"could not read {path}: {exc.strerror or exc}", notes)
        return
    try:
        yield from _read_open(f, path, max_bytes, notes, report)
    except OSError as exc:
        report.part("unreadable", f"read error in {path}: {exc.strerror or exc}; read up to there", notes)
    finally:
        f.close()


def _read_open(f, path: Path, max_bytes: int | None, notes: list[str], report: ReadReport) -> Iterator[Chunk]:
    head = f.peek(SNIFF)[:SNIFF]
    kind = compression_of(head)
    named = COMPRESSED_SUFFIXES.get(path.suffix.lower())
    if kind is None and named and head:
        notes.append(f"{path}: named {path.suffix} but holds no {named} data; read as plain text")
    if kind in UNSUPPORTED:
        report.skip("unsupported_compression", f"skipped {path}: {UNSUPPORTED[kind]}", notes)
        return
    if kind == "zstd" and not zstd_available():
        report.skip("unsupported_compression", f"skipped {path}: zstd-compressed; `{ZSTD_HINT}` to read it", notes)
        return
    if kind is not None:
        report.compression = kind
        yield from _compressed(f, path, kind, max_bytes, notes, report)
        return
    enc, bom = encoding_of(head)
    report.encoding = enc
    if enc == "binary":
        report.skip("binary", f"skipped {path}: binary data, not a text log", notes)
        return
    st = os.fstat(f.fileno())
    size = st.st_size if stat.S_ISREG(st.st_mode) else 0
    over = max_bytes is not None and size > HEAD_BYTES + max_bytes
    if over:
        report.part("over_limit", f"{path}: read its first {HEAD_BYTES / 1e6:.1f} MB and last "
                    f"{max_bytes / 1e6:.1f} MB of {size / 1e6:.1f} MB (--max-mb)", None)  # fmt: skip
    if enc == "utf-8":
        yield from _plain(f, bom, size, max_bytes if over else None, report.cuts)
    else:
        yield from _transcoded(f, enc, bom, size, max_bytes if over else None, report.cuts)


def _plain(f, bom: int, size: int, max_bytes: int | None, cuts: Cuts) -> Iterator[Chunk]:
    if bom and not f.seekable():
        f.read(bom)
    if max_bytes is not None:
        yield from _file_chunks(f, bom, HEAD_BYTES - bom, first_line=0, expect=HEAD_BYTES, cuts=cuts)
        yield from _file_chunks(f, size - max_bytes, None, first_line=None, skip_partial=True, expect=max_bytes,
                                cuts=cuts)  # fmt: skip
    else:
        yield from _file_chunks(f, bom, None, first_line=0, known_offsets=bool(size), expect=size or None, cuts=cuts)


def _transcoded(f, enc: str, bom: int, size: int, max_bytes: int | None, cuts: Cuts) -> Iterator[Chunk]:
    """UTF-16/32 text: decoded in a stream (no file offsets); with max_bytes its head and its tail,
    the tail read from a code-unit boundary."""
    if max_bytes is None:
        yield from _split(transcode(file_blocks(f, 0), enc, bom), 0, cuts=cuts)
        return
    unit = 4 if "32" in enc else 2
    yield from _split(transcode(file_blocks(f, 0, HEAD_BYTES), enc, bom), 0, cuts=cuts)
    tail = transcode(file_blocks(f, (size - max_bytes) // unit * unit), enc, 0)
    yield from _split(tail, None, skip_partial=True, cuts=cuts)


def _split(blocks: Iterator[bytes], first_line: int | None, skip_partial: bool = False,
           cuts: Cuts | None = None) -> Iterator[Chunk]:  # fmt: skip
    sp = Splitter(CHUNK, first_line, None, skip_partial=skip_partial, cuts=cuts)
    try:
        yield from sp.blocks(blocks)
    finally:
        sp.close()


def _guarded(blocks: Iterator[bytes], path: Path, notes: list[str], report: ReadReport) -> Iterator[bytes]:
    """The blocks up to where the compressed data is damaged; a note says where."""
    produced = 0
    try:
        for b in blocks:
            produced += len(b)
            report.decompressed = produced
            yield b
    except Damaged as exc:
        report.part("damaged", f"{path}: {exc}; read {produced / 1e6:.1f} MB before the damage", notes)


def _compressed(f, path: Path, kind: str, max_bytes: int | None, notes: list[str], report: ReadReport) -> Iterator[Chunk]:
    counter = [0]
    try:
        head, blocks = peek(_guarded(inflate(f, kind, counter), path, notes, report), SNIFF)
        enc, bom = encoding_of(head)
        report.encoding = enc
        if enc == "binary":
            report.skip("binary", f"skipped {path}: binary data after {kind} decompression, not a text log", notes)
            return
        yield from _head_tail(transcode(blocks, enc, bom), path, max_bytes, notes, report)
    finally:
        report.raw_bytes = counter[0]


def _head_tail(blocks: Iterator[bytes], path: Path, max_bytes: int | None, notes: list[str],
               report: ReadReport) -> Iterator[Chunk]:  # fmt: skip
    """A compressed file's text; with max_bytes its first HEAD_BYTES and its last max_bytes, and it
    is decompressed no further than DECOMPRESS_FACTOR * max_bytes (a bomb stops there)."""
    head = Splitter(CHUNK, 0, None, cuts=report.cuts)
    if max_bytes is None:
        yield from head.blocks(blocks)
        head.close()
        return
    budget = HEAD_BYTES + DECOMPRESS_FACTOR * max_bytes
    ring: deque[bytes] = deque()
    seen = kept = dropped = 0
    for b in blocks:
        if seen < HEAD_BYTES:
            part = b[: HEAD_BYTES - seen]
            yield from head.feed(part)
            seen, b = seen + len(part), b[len(part) :]
        if b:
            ring.append(b)
            seen, kept = seen + len(b), kept + len(b)
            while kept - len(ring[0]) >= max_bytes:
                dropped += len(ring[0])
                kept -= len(ring.popleft())
        if seen >= budget:
            report.part("over_limit", f"{path}: stopped after {seen / 1e6:.1f} MB of decompressed text "
                        f"({DECOMPRESS_FACTOR} x --max-mb) without reaching its end; read its first "
                        f"{HEAD_BYTES / 1e6:.1f} MB and the {kept / 1e6:.1f} MB before the stop", notes)  # fmt: skip
            break
    if not dropped:
        yield from head.blocks(ring)
        head.close()
        return
    yield from head.finish()
    head.close()
    if report.partial is None:
        report.part("over_limit", f"{path}: read the first {HEAD_BYTES / 1e6:.1f} MB and the last "
                    f"{kept / 1e6:.1f} MB of {seen / 1e6:.1f} MB of decompressed text (--max-mb)", None)  # fmt: skip
    yield from _split(iter(ring), None, skip_partial=True, cuts=report.cuts)


def _file_chunks(
    f,
    offset: int,
    limit: int | None,
    first_line: int | None,
    skip_partial: bool = False,
    known_offsets: bool = True,
    expect: int | None = None,
    cuts: Cuts | None = None,
) -> Iterator[Chunk]:
    """Whole-line chunks of an open plain file (or FIFO), read into one buffer used again for each
    chunk: a fresh 8 MB ``bytes`` per read costs the kernel 2,048 new zeroed pages, and the copies
    that join a carried partial line to the next read as many again (a third of the scan's time).
    ``expect`` (the bytes the file should give) keeps the buffer small for small files; it grows if
    a live file grows."""
    if offset and f.seekable():
        f.seek(offset)
    sp = Splitter(CHUNK, first_line, offset if known_offsets else None, expect, skip_partial, cuts)
    try:
        yield from sp.file(f, limit)
    finally:
        sp.close()
