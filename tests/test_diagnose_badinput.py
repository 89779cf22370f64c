"""Bad input to `trainguard diagnose`: every case gives an answer or one clear line
(exit 2), never a traceback and never a hang. Each runs the real CLI in a subprocess with a
deadline, so a hang fails the test instead of blocking the suite."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainguard.diagnose import diagnose_paths
from trainguard.diagnose.rules import _re2, backtracking_risk, builtin_rules, parse_rules

DEADLINE = 120  # generous: 2 shared cores

OOM = "2026-11-21T09:30:02.000000 [rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n"


def run_cli(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainguard", "diagnose", *map(str, args)],
                          capture_output=True, text=True, timeout=DEADLINE)  # fmt: skip


def no_traceback(p: subprocess.CompletedProcess) -> None:
    assert "Traceback (most recent call last)" not in p.stderr, p.stderr


def test_truncated_gz_is_read_up_to_the_cut_and_says_so(tmp_path: Path):
    filler = "".join(
        f"2026-11-21T09:{i // 600 % 60:02d}:{i % 60:02d}.000000 [rank1]: step={i} loss=2.1\n"
        for i in range(40000)
    )
    data = gzip.compress((filler[: len(filler) // 4] + OOM + filler).encode())
    (tmp_path / "rank-1.log.gz").write_bytes(data[: len(data) // 2])  # cut in the middle
    p = run_cli(tmp_path / "rank-1.log.gz", "--json")
    no_traceback(p)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["category"] == "cuda_oom" and r["first_failure"]["rank"] == 1
    assert r["stats"]["bytes"] > 500_000
    assert any("truncated gzip" in n for n in r["notes"])
    text = run_cli(tmp_path / "rank-1.log.gz")
    assert "truncated gzip" in text.stdout and "cuda_oom" in text.stdout


def test_a_gz_that_is_not_gzip_is_read_as_text_with_a_note(tmp_path: Path):
    """The magic bytes decide, not the name: a log saved decompressed under its .gz name is read."""
    (tmp_path / "rank-0.log.gz").write_bytes(b"this is not gzip data at all\n" * 10 + OOM.encode())
    r = diagnose_paths([tmp_path])
    assert r["category"] == "cuda_oom", r
    assert any("rank-0.log.gz" in n and "read as plain text" in n for n in r["notes"])


def test_special_files_in_a_directory_are_skipped_not_read(tmp_path: Path):
    (tmp_path / "rank-1.log").write_text(OOM)
    os.mkfifo(tmp_path / "rank-2.log")  # nobody ever writes: opening it would block forever
    (tmp_path / "rank-3.log").symlink_to("/dev/zero")  # reading it would never end
    p = run_cli(tmp_path)
    no_traceback(p)
    assert p.returncode == 0, p.stderr
    assert "cuda_oom" in p.stdout
    assert "skipped" in p.stdout and "FIFO" in p.stdout and "character device" in p.stdout
    g = run_cli(str(tmp_path / "rank-*.log"), "--json")  # the same through a glob
    assert g.returncode == 0 and json.loads(g.stdout)["category"] == "cuda_oom"


def test_an_explicit_device_is_skipped_and_nothing_else_is_one_line(tmp_path: Path):
    p = run_cli("/dev/zero", "--json")
    no_traceback(p)
    assert p.returncode == 0 and any("character device" in n for n in json.loads(p.stdout)["notes"])


def test_an_explicit_fifo_with_a_writer_is_read(tmp_path: Path):
    """`trainguard diagnose <(zcat log.gz)`: a pipe named on the command line is read."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, "-m", "trainguard", "diagnose", str(fifo), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        with open(fifo, "w") as w:
            w.write(OOM)
        out, err = proc.communicate(timeout=DEADLINE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert json.loads(out)["category"] == "cuda_oom"


@pytest.mark.parametrize("pad", [20_000, 12 << 20])
def test_text_far_into_a_long_line_is_read(tmp_path: Path, pad: int):
    """The error sits past 8 KB (and past a whole read chunk) of one line."""
    (tmp_path / "rank-1.log").write_text("2026-11-21T09:30:02.000000 [rank1]: " + "x" * pad + " " + OOM)
    r = diagnose_paths([tmp_path])
    assert r["category"] == "cuda_oom" and r["first_failure"]["rank"] == 1
    assert len(r["first_failure"]["line"]) < 20_000  # the evidence is a window, not the whole line


def test_binary_and_non_utf8_input_gives_an_answer(tmp_path: Path):
    (tmp_path / "rank-0.log").write_bytes(bytes(range(256)) * 4000 + b"\xff\xfe" + OOM.encode("utf-16"))
    (tmp_path / "rank-1.log").write_bytes(b"\xe9t\xe9 " + OOM.encode("latin-1"))
    p = run_cli(tmp_path, "--json")
    no_traceback(p)
    assert p.returncode == 0 and json.loads(p.stdout)["category"] == "cuda_oom"


REDOS = """
[[rule]]
id = "user.redos"
category = "python_exception"
keywords = ["aa"]
pattern = '(a+)+$'
"""


def test_a_catastrophic_user_regex_cannot_hang_the_diagnosis(tmp_path: Path):
    rules = tmp_path / "mine.toml"
    rules.write_text(REDOS)
    (tmp_path / "rank-0.log").write_text("a" * 5000 + "b\n" + "a" * 50 + "\n")
    p = run_cli(tmp_path / "rank-0.log", "--rules", rules, "--json")
    no_traceback(p)
    if _re2 is not None:  # user rules run on RE2: linear time, and the pattern still works
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["first_failure"]["rule"] == "user.redos"
    else:  # without RE2 such a pattern is refused up front, in one line
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "exponential" in p.stderr


@pytest.mark.parametrize("pattern", ["(a+)+$", "(a*)*b", "(x|xy)*z", "(?:\\d+\\s?)+$", "((ab)+c?)+"])
def test_nested_quantifiers_are_flagged(pattern: str):
    assert backtracking_risk(pattern)


@pytest.mark.parametrize(
    "pattern", ["CUDA out of memory", "a+b+c+", "(?:ab){1,3}", "x(?:from peer .* )?with", "(a|b)c+"]
)
def test_safe_patterns_are_not_flagged(pattern: str):
    assert backtracking_risk(pattern) is None


def test_the_builtin_rules_have_no_backtracking_risk():
    rs = builtin_rules()
    risky = {
        r.id: backtracking_risk(r.pattern.pattern) for r in rs.rules if backtracking_risk(r.pattern.pattern)
    }
    assert not risky


def test_user_patterns_re2_cannot_run_are_refused_clearly():
    if _re2 is None:
        pytest.skip("without RE2 user patterns use Python re")
    with pytest.raises(Exception, match="not supported by the RE2 engine"):
        parse_rules(
            '[[rule]]\nid="u"\ncategory="x"\nkeywords=["ab"]\npattern=\'(?<=a)b\'\n', "mine.toml", user=True
        )


@pytest.mark.parametrize("chunk", [64, 1000])
def test_reused_read_buffer_gives_every_line_once_with_its_number_and_offset(
    tmp_path: Path, monkeypatch, chunk
):
    """The plain-file reader fills one buffer again for each chunk: lines cut by a read, lines longer
    than a chunk, the head+tail mode and a file larger than expected all come out whole and placed."""
    import random

    from trainguard.diagnose import sources

    monkeypatch.setattr(sources, "CHUNK", chunk)
    rnd = random.Random(chunk)
    lines = [(b"x" * rnd.choice([0, 1, 5, 30, 63, 64, 65, 200, 3 * chunk])) + b" %d" % i for i in range(400)]
    data = b"\n".join(lines) + b"\n"
    p = tmp_path / "rank-0.log"
    p.write_bytes(data)
    seen = b""
    for c in sources.read_chunks(p):
        piece = bytes(c.data[: c.end])
        assert c.offset == len(seen) and data[c.offset : c.offset + c.end] == piece
        assert c.start_line == seen.count(b"\n")  # a chunk that goes on with a long line: that line's number
        seen += piece
    assert seen == data
    # a file that gives more than its size said when it was opened (a live log): read to the end
    with open(p, "rb") as f:
        got = b"".join(
            bytes(c.data[: c.end]) for c in sources._file_chunks(f, 0, None, first_line=0, expect=10)
        )
    assert got == data
    # head and tail: the head, then whole lines of the tail
    monkeypatch.setattr(sources, "HEAD_BYTES", 8 * chunk)
    cs = [(c.offset, bytes(c.data[: c.end])) for c in sources.read_chunks(p, max_bytes=40 * chunk)]
    head = b"".join(b for off, b in cs if off < 8 * chunk)
    tail = b"".join(b for off, b in cs if off >= 8 * chunk)
    assert head == data[: 8 * chunk]
    start = len(data) - len(tail)
    assert tail and data[start:] == tail and data[start - 1 : start] == b"\n"
    assert len(data) - 40 * chunk <= start


def test_nothing_read_is_not_called_healthy(tmp_path: Path):
    """An empty directory or an empty log was diagnosed "healthy"."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "empty.log").write_bytes(b"")
    for path in (tmp_path / "logs", tmp_path / "empty.log"):
        r = diagnose_paths([path])
        assert r["category"] == "no_logs" and r["confidence"] == "none", r
    (tmp_path / "ok.log").write_text("step=1 loss=1.0\nstep=2 loss=0.9\ntraining finished\n")
    assert diagnose_paths([tmp_path / "ok.log"])["category"] == "healthy"
