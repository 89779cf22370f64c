"""What a log file holds: its compression and text encoding, told from its first bytes, and its text
as a stream of UTF-8 blocks of at most ``BLOCK`` bytes, never the whole file in memory.

Compression: gzip, bzip2 and xz (standard library), zstd with the optional ``zstandard`` module, told
by magic bytes (a ``.gz`` that holds plain text is read as text; a gzip named ``.log`` is
decompressed); several concatenated members/streams are read; a cut or corrupt archive is read up
to the damage. Zip, 7z and lz4 are skipped (named). Encodings: UTF-8 (with or without a BOM),
UTF-16 and UTF-32 (LE/BE, told by the BOM or, without one, by where the NUL bytes fall in the first
KB); undecodable bytes of a UTF-8 log read as Latin-1 (``TEXT_ERRORS``). Binary data is skipped.
"""

from __future__ import annotations

import bz2
import codecs
import itertools
import lzma
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

BLOCK = 1 << 20  # decompressed bytes per step: a bomb is inflated a block at a time
RAW_READ = 1 << 16
ZSTD_FEED = 1 << 10
SNIFF = 4096
ZSTD_HINT = "pip install zstandard"
TEXT_ERRORS = "trainguard-latin1"


def _latin1(exc: UnicodeError) -> tuple[str, int]:
    """Bytes that are not UTF-8 (a Latin-1 or cp1252 log) read as Latin-1, not as U+FFFD."""
    if not isinstance(exc, UnicodeDecodeError):
        raise exc
    return exc.object[exc.start : exc.end].decode("latin-1"), exc.end


codecs.register_error(TEXT_ERRORS, _latin1)

try:  # optional: zstd-compressed logs
    import zstandard as _zstd
except ImportError:  # pragma: no cover - depends on the environment
    _zstd = None

COMPRESSED_SUFFIXES = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "zstd", ".zstd": "zstd"}
_MAGIC = (
    (b"\x1f\x8b", "gzip"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"PK\x03\x04", "zip"),
    (b"7z\xbc\xaf\x27\x1c", "7z"),
    (b"\x04\x22\x4d\x18", "lz4"),
)
UNSUPPORTED = {"zip": "a zip archive: unzip it first", "7z": "a 7z archive: extract it first",
               "lz4": "lz4-compressed: lz4 -d it first"}  # fmt: skip
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32-le"),
    (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF8, "utf-8"),
    (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"),
)
# control bytes no text log is made of (tab, newlines, form feed, ESC of colour codes are text)
_CONTROL = bytes(c for c in range(32) if c not in (8, 9, 10, 11, 12, 13, 27))


class Damaged(Exception):
    """The compressed data ends early or is corrupt: what came before it was given."""


@dataclass
class Form:
    compression: str | None  # gzip | bzip2 | xz | zstd | zip | 7z | lz4 | None (plain)
    encoding: str  # a codec name, or "binary"
    bom: int = 0  # bytes of byte-order mark to skip


def compression_of(head: bytes) -> str | None:
    for magic, name in _MAGIC:
        if head.startswith(magic):
            return name
    # bzip2: "BZh" + block size digit + a block's or the end's magic (a log may start with "BZh")
    if head[:3] == b"BZh" and head[3:4].isdigit() and head[4:10] in (b"1AY&SY", b"\x17rE8P\x90"):
        return "bzip2"
    return None


def _nul_pattern(head: bytes) -> str | None:
    """UTF-16/32 without a BOM: mostly-ASCII text has a NUL in fixed byte positions of each unit."""
    n = min(len(head), 1024) // 4 * 4
    if n < 16:
        return None
    frac = [head[r:n:4].count(0) / (n // 4) for r in range(4)]
    for enc, zero, text in (("utf-32-le", (1, 2, 3), (0,)), ("utf-32-be", (0, 1, 2), (3,)),
                            ("utf-16-le", (1, 3), (0, 2)), ("utf-16-be", (0, 2), (1, 3))):  # fmt: skip
        if all(frac[r] >= 0.6 for r in zero) and all(frac[r] <= 0.1 for r in text):
            return enc
    return None


def encoding_of(head: bytes) -> tuple[str, int]:
    """(codec, BOM length) of text starting with ``head``; ("binary", 0) for data that is no text."""
    for bom, enc in _BOMS:
        if head.startswith(bom):
            return enc, len(bom)
    enc = _nul_pattern(head)
    if enc is not None:
        return enc, 0
    sample = head.lstrip(b"\x00")[:SNIFF]  # a log truncated in place (copytruncate) starts with NULs
    if sample and len(sample.translate(None, _CONTROL)) < 0.95 * len(sample):
        return "binary", 0
    return "utf-8", 0


def _std_decompressor(kind: str) -> Callable[[], object]:
    if kind == "gzip":
        return lambda: zlib.decompressobj(16 + zlib.MAX_WBITS)
    if kind == "bzip2":
        return bz2.BZ2Decompressor
    return lambda: lzma.LZMADecompressor(lzma.FORMAT_AUTO)


def _steps(d, raw: bytes) -> Iterator[bytes]:
    """Everything ``raw`` gives, BLOCK bytes at a time (zlib keeps the rest in unconsumed_tail,
    bz2/lzma inside the object)."""
    if hasattr(d, "unconsumed_tail"):
        while raw:
            out = d.decompress(raw, BLOCK)
            raw = d.unconsumed_tail
            if out:
                yield out
            if d.eof:
                return
        return
    out = d.decompress(raw, BLOCK)
    while True:
        if out:
            yield out
        if d.eof or d.needs_input:
            return
        out = d.decompress(b"", BLOCK)


def inflate(f, kind: str, counter: list[int]) -> Iterator[bytes]:
    """Decompressed blocks of an open compressed file, member after member. Raises Damaged at a cut
    or corrupt data (after giving what came before); ``counter[0]`` counts compressed bytes read."""
    if kind == "zstd":
        yield from _unzstd(f, counter)
        return
    new = _std_decompressor(kind)
    d, fed = new(), False
    err = (zlib.error, lzma.LZMAError, OSError, EOFError, ValueError)
    while raw := f.read(RAW_READ):
        counter[0] += len(raw)
        while raw:
            fed = True
            try:
                yield from _steps(d, raw)
            except err as exc:
                raise Damaged(f"corrupt {kind} data ({exc})") from None
            if not d.eof:
                break
            raw, fed = d.unused_data, False
            if not raw.strip(b"\x00"):
                raw = b""  # padding after the last member (xz stream padding, tape blocks)
            else:
                d = new()  # the next member
    if fed:
        raise Damaged(f"truncated {kind} (the compressed data ends early)")


def _unzstd(f, counter: list[int]) -> Iterator[bytes]:
    """zstd frames one after another. The decompress object has no output bound, so it is fed
    ZSTD_FEED bytes at a time (a frame of RLE blocks inflates at most 32768:1: 32 MB a call)."""
    d, fed = _zstd.ZstdDecompressor().decompressobj(), False
    while raw := f.read(RAW_READ):
        counter[0] += len(raw)
        for i in range(0, len(raw), ZSTD_FEED):
            piece = raw[i : i + ZSTD_FEED]
            while piece:
                fed = True
                try:
                    out = d.decompress(piece)
                except _zstd.ZstdError as exc:
                    raise Damaged(f"corrupt zstd data ({exc})") from None
                for j in range(0, len(out), BLOCK):
                    yield out[j : j + BLOCK]
                if not d.eof:
                    break
                piece, fed = d.unused_data, False
                d = _zstd.ZstdDecompressor().decompressobj()  # the next frame, if any
                if not piece.strip(b"\x00"):
                    piece = b""
    if fed:
        raise Damaged("truncated zstd (the compressed data ends early)")


def zstd_available() -> bool:
    return _zstd is not None


def transcode(blocks: Iterator[bytes], encoding: str, bom: int) -> Iterator[bytes]:
    """UTF-8 blocks from blocks in ``encoding`` (the BOM dropped; bad units become U+FFFD)."""
    if encoding == "utf-8":  # kept as it is: bytes that are not UTF-8 read as Latin-1 later
        yield from _after(blocks, bom)
        return
    dec = codecs.getincrementaldecoder(encoding)(errors="replace")
    first = True
    for b in blocks:
        if first:
            b, first = b[bom:], False
        s = dec.decode(b)
        if s:
            yield s.encode("utf-8")
    s = dec.decode(b"", final=True)
    if s:
        yield s.encode("utf-8")


def _after(blocks: Iterator[bytes], skip: int) -> Iterator[bytes]:
    for b in blocks:
        if skip:
            b, skip = b[skip:], max(0, skip - len(b))
        if b:
            yield b


def peek(blocks: Iterator[bytes], n: int) -> tuple[bytes, Iterator[bytes]]:
    """The first ``n`` bytes of a block stream, and the whole stream again."""
    got: list[bytes] = []
    size = 0
    for b in blocks:
        got.append(b)
        size += len(b)
        if size >= n:
            break
    return b"".join(got)[:n], itertools.chain(got, blocks)


def file_blocks(f, start: int, limit: int | None = None) -> Iterator[bytes]:
    if f.seekable():
        f.seek(start)
    left = limit
    while left is None or left > 0:
        b = f.read(BLOCK if left is None else min(BLOCK, left))
        if not b:
            return
        left = None if left is None else left - len(b)
        yield b
