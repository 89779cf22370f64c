"""`trainguard diagnose` reads the logs users hand it in every form they come in (UTF-16/32 with and
without a BOM, gzip/bzip2/xz/zstd told by their magic bytes, progress bars redrawn with CR only),
bounds what one file may cost (a gzip bomb, a line of gigabytes) and says what it could not read."""

from __future__ import annotations

import bz2
import codecs
import gzip
import json
import lzma
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from trainguard.diagnose import diagnose_paths
from trainguard.diagnose.streams import zstd_available

DEADLINE = 300  # generous: 2 shared cores

OOM = """2026-11-21T09:30:00.000000 [rank0]: iteration 10/100 | loss 2.31
2026-11-21T09:30:01.000000 [rank1]: Traceback (most recent call last):
2026-11-21T09:30:01.000000 [rank1]:   File "/workspace/train.py", line 88, in <module>
2026-11-21T09:30:01.000000 [rank1]:     loss.backward()
2026-11-21T09:30:02.000000 [rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 79.15 GiB of which 1.02 GiB is free.
"""
NCCL = """2026-11-20T10:10:15.200000 [rank0]: [rank0]:[E1120 10:10:15.200000 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3011, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600021 milliseconds before timing out.
2026-11-20T10:10:15.200001 [rank1]: [rank1]:[E1120 10:10:15.200001 ProcessGroupNCCL.cpp:607] [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3011, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600021 milliseconds before timing out.
"""


def cli(*args: str | Path) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "trainguard", "diagnose", *map(str, args)],
                       capture_output=True, text=True, timeout=DEADLINE)  # fmt: skip
    assert "Traceback (most recent call last)" not in p.stderr, p.stderr
    assert p.returncode == 0, p.stderr
    return p


def assert_oom(r: dict) -> None:
    assert r["category"] == "cuda_oom", (r["category"], r.get("notes"))
    assert r["first_failure"]["rank"] == 1 and "CUDA out of memory" in r["first_failure"]["line"]


ENCODINGS = [("utf-16-le", codecs.BOM_UTF16_LE), ("utf-16-be", codecs.BOM_UTF16_BE), ("utf-16-le", b""),
             ("utf-16-be", b""), ("utf-32-le", codecs.BOM_UTF32_LE), ("utf-32-be", codecs.BOM_UTF32_BE),
             ("utf-32-le", b""), ("utf-32-be", b""), ("utf-8", codecs.BOM_UTF8)]  # fmt: skip


@pytest.mark.parametrize("encoding,bom", ENCODINGS, ids=[f"{e}{'-bom' if b else ''}" for e, b in ENCODINGS])
def test_utf16_and_utf32_logs_are_decoded(tmp_path: Path, encoding: str, bom: bytes):
    """Without a BOM the NUL-byte pattern of the first KB tells the encoding."""
    (tmp_path / "train.log").write_bytes(bom + OOM.encode(encoding))
    r = diagnose_paths([tmp_path / "train.log"])
    assert_oom(r)
    assert r["stats"]["encodings"] == ([] if encoding == "utf-8" else [encoding])


def _zstd_frame(data: bytes) -> bytes:
    """A zstd frame holding ``data`` in one raw block (256..65791 bytes), made by hand: this test
    must not need the zstandard module it checks the absence of."""
    assert 256 <= len(data) < 65792
    header = b"\x28\xb5\x2f\xfd" + bytes([0x60]) + (len(data) - 256).to_bytes(2, "little")
    return header + ((len(data) << 3) | 1).to_bytes(3, "little") + data


COMPRESSED = {
    "gzip": lambda b: gzip.compress(b),
    "bzip2": lambda b: bz2.compress(b),
    "xz": lambda b: lzma.compress(b),
    "zstd": _zstd_frame,
}


@pytest.mark.parametrize("kind", sorted(COMPRESSED))
@pytest.mark.parametrize("name", ["rank-1.log", "rank-1.log.{ext}"])
def test_compressed_logs_are_read_by_their_magic_bytes(tmp_path: Path, kind: str, name: str):
    """Named for what they are or named .log: the first bytes decide. zstd without the zstandard
    module: skipped, with one line that names the install."""
    ext = {"gzip": "gz", "bzip2": "bz2", "xz": "xz", "zstd": "zst"}[kind]
    path = tmp_path / name.format(ext=ext)
    path.write_bytes(COMPRESSED[kind]((OOM + NCCL).encode()))
    r = json.loads(cli(tmp_path, "--json").stdout)
    if kind == "zstd" and not zstd_available():
        assert r["category"] == "no_logs"
        assert [s["reason"] for s in r["stats"]["skipped"]] == ["unsupported_compression"]
        assert any("pip install zstandard" in n for n in r["notes"])
        assert "pip install zstandard" in cli(path).stdout
        return
    assert_oom(r)
    assert r["stats"]["compressed"]["files"] == 1 and r["stats"]["compressed"]["bytes_out"] == len(OOM + NCCL)


def test_a_utf16_log_inside_gzip_is_decompressed_then_decoded(tmp_path: Path):
    (tmp_path / "rank-0.log.gz").write_bytes(gzip.compress(codecs.BOM_UTF16_LE + NCCL.encode("utf-16-le")))
    r = diagnose_paths([tmp_path])
    assert r["category"] == "nccl_timeout" and r["stats"]["encodings"] == ["utf-16-le"]


def test_a_truncated_xz_is_read_up_to_the_cut_and_says_so(tmp_path: Path):
    filler = "".join(f"2026-11-21T09:{i // 600 % 60:02d}:{i % 60:02d}.000000 [rank0]: step={i} loss=2.1\n"
                     for i in range(40000))  # fmt: skip
    data = lzma.compress((OOM + filler).encode())
    (tmp_path / "rank-1.log.xz").write_bytes(data[: len(data) // 2])
    r = json.loads(cli(tmp_path, "--json").stdout)
    assert_oom(r)
    assert any("truncated xz" in n for n in r["notes"])
    assert [p["reason"] for p in r["stats"]["partial"]] == ["damaged"]


def test_the_oom_after_a_100_mb_progress_bar_redrawn_with_cr_only_is_found(tmp_path: Path):
    """tqdm writing to a file: ~100 MB without one newline, then the OOM."""
    bar = "".join(f"\r 45%|####5     | {i}/1000 [00:{i % 60:02d}<01:10,  7.12it/s, loss=2.31]" for i in range(1000))
    block = (bar * max(1, (4 << 20) // len(bar))).encode()
    path = tmp_path / "rank-1.log"
    with open(path, "wb") as f:
        f.write(b"2026-11-21T09:29:59.000000 [rank1]: starting training\n")
        for _ in range(100 << 20 // len(block) + 1):
            f.write(block)
        f.write(OOM.replace("\n", "\r").encode())
    assert path.stat().st_size > 100 << 20
    r = json.loads(cli(path, "--json").stdout)
    assert_oom(r)
    assert r["stats"]["lines_cut"] == 0


def _gzip_bomb(path: Path, head: bytes, size: int = 4 << 30) -> None:
    """``head``, then ``size`` bytes of "a" on one line, gzipped (~18 MB for 4 GB): one block of "a"
    compressed after a full flush gives the same bytes every time, so it is written again and again
    instead of compressing 4 GB."""
    block = b"a" * (16 << 20)
    c = zlib.compressobj(1, zlib.DEFLATED, 31)
    first = c.compress(head) + c.flush(zlib.Z_FULL_FLUSH)
    piece = c.compress(block) + c.flush(zlib.Z_FULL_FLUSH)
    crc = zlib.crc32(head)
    with open(path, "wb") as f:
        f.write(first)
        for _ in range(size // len(block)):
            f.write(piece)
            crc = zlib.crc32(block, crc)
        f.write(c.flush())  # the final empty block and a trailer, whose CRC and size are set here:
        f.seek(-8, 2)
        f.write(crc.to_bytes(4, "little") + ((len(head) + size) & 0xFFFFFFFF).to_bytes(4, "little"))


def test_a_gzip_bomb_with_max_mb_ends_soon_in_bounded_memory(tmp_path: Path):
    """18 MB that inflate to 4 GB on one line: with --max-mb 16 decompression stops at 16 x 16 MB, a
    note says so, and the reader never holds more than a block, the tail kept and one line's cap.
    Measured as the peak RSS of the diagnose process (its own parent reports it)."""
    bomb = tmp_path / "rank-1.log.gz"
    _gzip_bomb(bomb, OOM.encode())
    assert bomb.stat().st_size < 32 << 20
    with gzip.open(bomb) as g:  # the bomb is a valid gzip of the size claimed (checked on its start)
        assert g.read(len(OOM)) == OOM.encode()
    code = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
            "print(p.stdout); print(p.stderr, file=sys.stderr); "
            "print('MAXRSS', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")  # fmt: skip
    p = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "trainguard", "diagnose", str(bomb),
                        "--max-mb", "16", "--json"], capture_output=True, text=True, timeout=DEADLINE)  # fmt: skip
    assert "Traceback" not in p.stderr, p.stderr
    out, rss = p.stdout.rsplit("MAXRSS", 1)
    r = json.loads(out)
    assert_oom(r)
    assert int(rss) < 200 << 10, f"peak RSS {int(rss) >> 10} MB"  # KB
    assert [x["reason"] for x in r["stats"]["partial"]] == ["over_limit"]
    assert 16 * (16 << 20) <= r["stats"]["compressed"]["bytes_out"] < 1 << 30  # decompression stopped
    assert any("stopped after" in n and "--max-mb" in n for n in r["notes"])
    assert r["stats"]["lines_cut"] >= 1


def test_a_line_over_the_cap_keeps_its_ends_and_is_counted(tmp_path: Path):
    """A 12 MB line with the OOM at its end: found; the line is cut and counted."""
    oom = OOM.splitlines()[-1].split(": ", 1)[1]
    (tmp_path / "rank-1.log").write_text("2026-11-21T09:30:02.000000 [rank1]: " + "x" * (12 << 20) + " " + oom + "\n")
    r = diagnose_paths([tmp_path])
    assert r["category"] == "cuda_oom" and r["first_failure"]["rank"] == 1
    assert r["stats"]["lines_cut"] == 1


def test_no_failure_found_says_what_was_read_and_what_was_skipped(tmp_path: Path):
    (tmp_path / "rank-0.log").write_text("step=1 loss=1.0\nstep=2 loss=0.9\ntraining finished\n")
    (tmp_path / "rank-1.log").write_bytes(bytes(range(256)) * 64)
    (tmp_path / "rank-2.log.gz").write_bytes(b"PK\x03\x04" + b"\x00" * 60)
    (tmp_path / "rank-3.log").write_bytes(gzip.compress(b"\x00\x01\x02\x03\xff" * 2000))
    r = json.loads(cli(tmp_path, "--json").stdout)
    assert r["category"] == "healthy"
    s = r["stats"]
    assert s["files"] == 4 and s["files_read"] == 1
    assert sorted((Path(x["file"]).name, x["reason"]) for x in s["skipped"]) == [
        ("rank-1.log", "binary"), ("rank-2.log.gz", "unsupported_compression"), ("rank-3.log", "binary")]
    text = cli(tmp_path).stdout
    assert "no failure found" in text and "3 skipped (binary: 2, unsupported_compression: 1)" in text
    assert "skipped" in text and "zip archive" in text and "binary data" in text


def test_bytes_that_are_not_utf8_read_as_latin1(tmp_path: Path):
    (tmp_path / "rank-1.log").write_bytes(OOM.replace("loss.backward()", "café").encode("latin-1"))
    r = diagnose_paths([tmp_path])
    assert_oom(r)
    assert any("café" in c for c in r["first_failure"].get("context", [])), r["first_failure"]


@pytest.mark.skipif(shutil.which("zstd") is None or not zstd_available(), reason="needs zstd and zstandard")
def test_a_zstd_log_of_several_frames_is_read(tmp_path: Path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text(NCCL)
    b.write_text(OOM)
    frames = b"".join(subprocess.run(["zstd", "-c", str(x)], capture_output=True, check=True).stdout for x in (a, b))
    (tmp_path / "rank-1.log.zst").write_bytes(frames)
    a.unlink()
    b.unlink()
    r = diagnose_paths([tmp_path])
    assert r["stats"]["compressed"]["bytes_out"] == len(NCCL + OOM)
    (tmp_path / "rank-1.log.zst").write_bytes(frames[: len(frames) - 5])
    r = diagnose_paths([tmp_path])
    assert any("truncated zstd" in n for n in r["notes"]), r.get("notes")


@pytest.mark.parametrize("seed", range(6))
def test_the_line_splitter_gives_every_line_once_whatever_the_read_boundaries(seed: int):
    """LF, CRLF and lone CR line ends (a CR last in one read and its LF first in the next included),
    lines over the cap kept as their first and last halves and counted, whether the bytes come
    from a file or as blocks of any size."""
    import io
    import random
    import re

    from trainguard.diagnose.linesplit import HALF, LINE_CAP, Cuts, Splitter

    rnd = random.Random(seed)
    parts = []
    for _ in range(300):
        n = rnd.choice([0, 1, 10, 100, 5000, LINE_CAP - 1, LINE_CAP, LINE_CAP + 1, 3 * LINE_CAP])
        parts.append(bytes(rnd.choice(b"abc \t") for _ in range(min(n, 50))) * (n // 50 + 1))
        parts[-1] = parts[-1][:n] + rnd.choice([b"\n", b"\r\n", b"\r", b"\r\r\n"])
    data = b"".join(parts)
    lines = re.split(rb"\r\n|\r|\n", data)[:-1]
    want = b"".join((x[:HALF] + x[-HALF:] if len(x) > LINE_CAP else x) + b"\n" for x in lines)
    long = sum(len(c) + (e == b"\r\n") > LINE_CAP for c, e in re.findall(rb"([^\r\n]*)(\r\n|\r|\n)", data))

    def gather(chunks) -> bytes:
        """The lines as the scanner matches them: a line the reader kept whole (it ended within
        one read) is cut there, to its first and last halves too."""
        out = b"".join(bytes(c.data[: c.end]) for c in chunks).replace(b"\r\n", b"\n").split(b"\n")[:-1]
        return b"".join((x[:HALF] + x[-HALF:] if len(x) > LINE_CAP else x) + b"\n" for x in out)

    cuts = Cuts()
    assert gather(Splitter(4096, 0, 0, cuts=cuts).file(io.BytesIO(data))) == want
    assert cuts.lines == long
    blocks, at = [], 0
    while at < len(data):
        s = rnd.choice([1, 2, 7, 4096, 70000])
        blocks.append(data[at : at + s])
        at += s
    cuts = Cuts()
    assert gather(Splitter(4096, 0, None, cuts=cuts).blocks(blocks)) == want
    assert cuts.lines == long
