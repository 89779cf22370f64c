"""Seed rules for profiling files: naming, append, 10 MB rotation, 20 % aging; the switch + CLI."""

from __future__ import annotations

import json
import os
import time
from argparse import Namespace

import pytest

from trainguard.monitors.profiling import cli as profile_cli
from trainguard.rundir import profiling as pf
from trainguard.worker.ring import FLAG_BASIC, FLAG_COMM


def numbered(d):
    return sorted((p for p in d.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))


def test_default_limits_are_the_seeds():
    assert pf.ROTATE_BYTES == 10 * 1024 * 1024
    assert pf.AGING_FRACTION == 0.2


def test_appends_to_the_newest_file_and_rotates_past_the_limit(tmp_path):
    w = pf.RankFileWriter(tmp_path, rank=3, rotate_bytes=100)
    w.append(["a" * 59])  # 60 bytes
    w.append(["b" * 39])  # 100: not over the limit yet
    (first,) = numbered(tmp_path / "3")
    assert first.read_text() == "a" * 59 + "\n" + "b" * 39 + "\n"
    assert abs(int(first.name) - time.time() * 1000) < 60_000, "named by a unix-ms timestamp"
    w.append(["c"])  # 100 > 100 is false: still appended
    w.append(["d"])  # now 102 > 100: a new file
    files = numbered(tmp_path / "3")
    assert len(files) == 2 and files[1].read_text() == "d\n"
    assert int(files[1].name) > int(files[0].name)
    # A new writer (agent restart) appends to the newest file, it does not start another.
    pf.RankFileWriter(tmp_path, rank=3, rotate_bytes=100).append(["e"])
    assert numbered(tmp_path / "3")[-1].read_text() == "d\ne\n"
    assert w.append([]) == 0


def test_aging_deletes_the_oldest_20_percent_of_numbered_files_only(tmp_path):
    now = time.time()
    for rank in (0, 1):
        d = tmp_path / str(rank)
        d.mkdir()
        for i in range(5):  # mtimes interleave across ranks: oldest are rank 0/1 files 0, 0
            p = d / str(1000 + i)
            p.write_bytes(b"x" * 100)
            os.utime(p, (now - 100 + i * 10 + rank, now - 100 + i * 10 + rank))
    (tmp_path / "0" / "notes.txt").write_bytes(b"y" * 100)  # user file in a rank dir
    (tmp_path / "README").write_bytes(b"z" * 100)  # user file at the top
    (tmp_path / "profiling-extra").mkdir()
    (tmp_path / "profiling-extra" / "123").write_bytes(b"w" * 100)  # digit file outside a rank dir

    res = pf.age(tmp_path, cap_bytes=10_000)
    assert res.deleted == [] and res.total_bytes == 1300

    res = pf.age(tmp_path, cap_bytes=1300)  # reached the cap
    assert sorted(res.deleted) == [tmp_path / "0" / "1000", tmp_path / "1" / "1000"]  # 20 % of 10
    assert (tmp_path / "0" / "notes.txt").exists() and (tmp_path / "README").exists()
    assert (tmp_path / "profiling-extra" / "123").exists()

    res = pf.age(tmp_path, cap_bytes=100)  # 8 left: ceil(1.6) = 2, by modification time
    assert sorted(p.name for p in res.deleted) == ["1001", "1001"]
    assert len(numbered(tmp_path / "0")) + len(numbered(tmp_path / "1")) == 6


def test_aging_always_makes_progress(tmp_path):
    d = tmp_path / "0"
    d.mkdir()
    (d / "1").write_bytes(b"x" * 10)
    assert [p.name for p in pf.age(tmp_path, cap_bytes=1).deleted] == ["1"]
    assert pf.age(tmp_path / "missing", cap_bytes=0).deleted == []


def test_switch_file_is_the_seeds_format(tmp_path):
    pf.write_switch(tmp_path, FLAG_BASIC)
    assert json.loads((tmp_path / pf.SWITCH_FILE).read_text()) == {
        "CommunicationOperator": "off",
        "Step": "on",
        "SaveCheckpoint": "on",
        "FP": "on",
        "DataLoader": "on",
    }
    assert pf.read_switch(tmp_path) == FLAG_BASIC
    pf.write_switch(tmp_path, FLAG_BASIC | FLAG_COMM)
    assert pf.read_switch(tmp_path) == FLAG_BASIC | FLAG_COMM
    with pytest.raises(ValueError):
        pf.write_switch(tmp_path, FLAG_COMM)  # Communication alone: not allowed by the seed
    assert pf.read_switch(tmp_path) == FLAG_BASIC | FLAG_COMM


@pytest.mark.parametrize(
    "bad",
    [
        {"Step": "on", "FP": "off", "DataLoader": "on", "SaveCheckpoint": "on"},
        {"CommunicationOperator": "on"},
        {"Step": "yes"},
        [1],
    ],
)
def test_switch_rules_reject(bad):
    with pytest.raises(ValueError):
        pf.flags_from_switch(bad)


def run_cli(tmp_path, state=None, comm=None):
    return profile_cli.main(Namespace(run_dir=str(tmp_path), state=state, comm=comm))


def make_run_dir(path):
    from trainguard.events import EventStore
    from trainguard.events.store import node_db_path

    EventStore(node_db_path(path, "n0")).close()


def test_profile_cli(tmp_path, capsys):
    assert run_cli(tmp_path / "nope", "on") == 2
    assert "no run directory" in capsys.readouterr().err
    make_run_dir(tmp_path)
    assert run_cli(tmp_path) == 0
    assert "no profiling switch" in capsys.readouterr().out
    assert run_cli(tmp_path, "on", "on") == 0
    assert pf.read_switch(tmp_path) == FLAG_BASIC | FLAG_COMM
    assert run_cli(tmp_path, "on") == 0, "comm unchanged when not given"
    assert pf.read_switch(tmp_path) == FLAG_BASIC | FLAG_COMM
    assert run_cli(tmp_path, "off", "on") == 2
    assert pf.read_switch(tmp_path) == FLAG_BASIC | FLAG_COMM
    assert run_cli(tmp_path, "off") == 0
    assert pf.read_switch(tmp_path) == 0
    capsys.readouterr()
    assert run_cli(tmp_path) == 0
    assert json.loads(capsys.readouterr().out)["Step"] == "off"


def test_profile_switch_only_in_a_run_dir_and_never_through_a_link(tmp_path, capsys):
    """`profile /any/dir on` wrote a switch file anywhere; a symlink or FIFO at the
    switch's name is refused (not written through, not blocked on)."""
    import os

    assert run_cli(tmp_path, "on") == 2
    assert "not a trainguard run directory" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    make_run_dir(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / pf.SWITCH_FILE).symlink_to(victim)
    assert run_cli(tmp_path, "on") == 2
    assert "symlink" in capsys.readouterr().err and victim.read_text() == "keep"
    (tmp_path / pf.SWITCH_FILE).unlink()
    os.mkfifo(tmp_path / pf.SWITCH_FILE)
    with pytest.raises(ValueError, match="FIFO"):
        pf.read_switch(tmp_path)  # the agent's watcher: a warning, not a blocked thread
    assert run_cli(tmp_path, "on") == 2


def test_profile_cli_through_the_entry_point(tmp_path):
    import subprocess
    import sys

    make_run_dir(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "trainguard", "profile", str(tmp_path), "sideways"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "invalid choice" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "trainguard", "profile", str(tmp_path), "on"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert pf.read_switch(tmp_path) == FLAG_BASIC
