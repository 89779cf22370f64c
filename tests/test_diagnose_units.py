"""Diagnosis building blocks: line prefixes, rules files, sources, CLI, and bad input (fuzzed)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from trainguard.cli import main as cli_main
from trainguard.diagnose import diagnose_paths
from trainguard.diagnose.lines import iso, parse_line
from trainguard.diagnose.prefilter import Prefilter, _hs
from trainguard.diagnose.rules import RuleError, builtin_rules, load_rules, parse_rules
from trainguard.diagnose.sources import SourceError, describe

ENGINES = ["re"] + (["hyperscan"] if _hs is not None else [])


@pytest.mark.parametrize(
    "line, t, rank, host, msg",
    [
        ("2026-11-21T09:30:01.123456 [rank1]: RuntimeError: x", "2026-11-21T09:30:01.123456", 1, None, "RuntimeError: x"),
        ("2026-11-21T09:30:01.123456 [rank1]: [rank1]: ValueError: y", "2026-11-21T09:30:01.123456", 1, None, "ValueError: y"),
        ("[rank0]:E1206 18:44:12.715298 1234 ProcessGroupNCCL.cpp:1534] boom", "2026-12-06T18:44:12.715298", 0, None,
         "ProcessGroupNCCL.cpp:1534] boom"),
        ("E1206 18:44:12.715298 1234 file.cc:12] glog", "2026-12-06T18:44:12.715298", None, None, "file.cc:12] glog"),
        ("[2022-04-26 13:57:20,757][INFO][train_epoch]:Rank:2 Epoch:[48]", "2022-04-26T13:57:20.757000", None, None,
         "[INFO][train_epoch]:Rank:2 Epoch:[48]"),
        ("Nov 21 09:30:01 node-a kernel: Out of memory: Killed process 1", "2026-11-21T09:30:01.000000", None, "node-a",
         "kernel: Out of memory: Killed process 1"),
        ("[pod/job-worker-1/pytorch] 2024-11-21T09:30:01.123456789Z stdout F hi", "2024-11-21T09:30:01.123457", None,
         "job-worker-1", "hi"),
        ("w-1:1136:1191 [2] transport/net_ib.cc:12 NCCL WARN x", None, None, "w-1", "w-1:1136:1191 [2] transport/net_ib.cc:12 NCCL WARN x"),
        ("[default0]:hello", None, 0, None, "hello"),
        ("2026-13-45T99:99:99 [rank1]: bad date", None, 1, None, "bad date"),
    ],
)  # fmt: skip
def test_parse_line_prefixes(line, t, rank, host, msg):
    info = parse_line(line, 2026)
    assert (iso(info.time), info.rank, info.host, info.message) == (t, rank, host, msg)


def test_builtin_rules_load_and_cover_the_categories():
    rs = builtin_rules()
    cats = {r.category for r in rs.rules}
    for c in ("nccl_timeout", "nccl_network", "cuda_oom", "gpu_hardware", "cuda_error_other", "rendezvous_failure",
              "dataloader", "host_oom", "disk_full_or_io", "python_exception", "nan_loss", "segfault", "hang_no_error"):  # fmt: skip
        assert c in cats
        assert rs.fix_for(c), c


@pytest.mark.parametrize(
    "text, error",
    [
        ("[[rule]]\nid='a'\ncategory='x'\npattern='a.*b'\n", "needs keywords"),
        ("[[rule]]\nid='a'\ncategory='x'\npattern='('\nkeywords=['ab']\n", "bad pattern"),
        ("[[rule]]\ncategory='x'\npattern='ab'\n", "missing id"),
        ("[[rule]]\nid='a'\ncategory='x'\npattern='ab'\nrole='boss'\n", "role must be"),
        ("[[rule]]\nid='a'\ncategory='x'\npattern='ab'\nprio=3\n", "unknown field"),
        (
            "[[rule]]\nid='a'\ncategory='x'\npattern='ab'\n[[rule]]\nid='a'\ncategory='x'\npattern='cd'\n",
            "duplicate",
        ),
        ("rule = 3\n", "array of tables"),
        ("[[rule]\n", "not valid TOML"),
        ("[stuff]\n", "unknown table"),
    ],
)
def test_bad_rules_files_are_named_clearly(text, error):
    with pytest.raises(RuleError, match=error) as exc:
        parse_rules(text, "my.toml")
    assert "my.toml" in str(exc.value)


def test_user_rules_extend_and_override(tmp_path: Path):
    (tmp_path / "rank-0.log").write_text(
        "2026-11-21T09:30:01.000000 [rank0]: step=1 rank=0\n"
        "2026-11-21T09:30:02.000000 [rank0]: FATAL: quota of the feature store exhausted (code 17)\n"
    )
    assert diagnose_paths([tmp_path])["category"] == "healthy"
    rules = tmp_path / "mine.toml"
    rules.write_text(
        '[category.feature_store]\nfix = "Ask for more feature-store quota."\n'
        '[[rule]]\nid = "mine.quota"\ncategory = "feature_store"\nkeywords = ["quota of the feature store"]\n'
        "pattern = 'quota of the feature store exhausted \\(code (\\d+)\\)'\npriority = 95\n"
    )
    r = diagnose_paths([tmp_path], [rules])
    assert r["category"] == "feature_store" and r["fix"] == "Ask for more feature-store quota."
    assert r["first_failure"]["rank"] == 0 and "code 17" in r["first_failure"]["line"]
    # the same id replaces a built-in rule: OOM lines no longer count as cuda_oom
    (tmp_path / "rank-1.log").write_text(
        "2026-11-21T09:30:00.000000 [rank1]: torch.OutOfMemoryError: CUDA out of memory.\n"
    )
    override = tmp_path / "override.toml"
    override.write_text(
        "[[rule]]\nid = 'cuda_oom.torch'\ncategory = 'cuda_oom'\npattern = 'never matches this'\n"
    )
    assert load_rules([override]).rules[0].id == "cuda_oom.torch"
    assert diagnose_paths([tmp_path / "rank-1.log"], [override])["category"] == "python_exception"


def test_sources_name_ranks_and_hosts(tmp_path: Path):
    assert describe(tmp_path / "rank-3.log").rank == 3
    assert describe(tmp_path / "attempt_0" / "2" / "stderr.log").rank == 2
    assert describe(tmp_path / "worker-1.log").host == "worker-1"
    assert describe(tmp_path / "node-b" / "rank-0.log").host == "node-b"
    assert describe(tmp_path / "train.log").host is None


def test_missing_paths_are_an_error(tmp_path: Path):
    with pytest.raises(SourceError, match="no such file"):
        diagnose_paths([tmp_path / "nope.log"])
    with pytest.raises(SourceError, match="no file matches"):
        diagnose_paths([str(tmp_path / "*.log")])


def test_cli_json_and_usage_errors(tmp_path: Path, capsys):
    case = Path(__file__).parent / "corpus" / "cuda_oom" / "oom_then_watchdog"
    assert cli_main(["diagnose", str(case), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert {"category", "first_failure", "evidence", "fix", "findings"} <= set(d)
    assert {"rank", "host", "time", "line"} <= set(d["first_failure"])
    assert cli_main(["diagnose", str(case)]) == 0
    out = capsys.readouterr().out
    assert "cuda_oom" in out and "fix:" in out and "cascade" in out
    assert cli_main(["diagnose", str(tmp_path / "missing")]) == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("[[rule]]\nid='x'\n")
    assert cli_main(["diagnose", str(case), "--rules", str(bad)]) == 2
    assert "bad.toml" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli_main(["diagnose"])
    assert exc.value.code == 2


@pytest.mark.parametrize("engine", ENGINES)
def test_prefilter_finds_every_line_with_a_keyword(engine):
    p = Prefilter(["Error", "NaN", "a\\b"], engine)
    buf = b"ok\nan Error here\n\nNaN Error\nx a\\b y\nlast Error"
    assert [buf[s:e] for s, e in p.lines(buf)] == [b"an Error here", b"NaN Error", b"x a\\b y", b"last Error"]


@pytest.mark.parametrize("engine", ENGINES)
def test_prefilter_scans_from_two_threads_at_once(engine):
    """The agent's warm-up thread and its failure path scan with one prefilter: a job that fails
    within its first second once took the agent down with hyperscan's ScratchInUseError."""
    from concurrent.futures import ThreadPoolExecutor

    p = Prefilter(["Error", "NaN"], engine)
    buf = b"ok line\nan Error here\n" * 20000

    def scan(_: int) -> int:
        return sum(1 for _ in p.lines(buf))

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(scan, range(16))) == [20000] * 16


def test_bad_bytes_huge_lines_and_odd_encodings_do_not_crash(tmp_path: Path):
    (tmp_path / "empty.log").write_bytes(b"")
    (tmp_path / "binary.log").write_bytes(bytes(range(256)) * 1000)
    (tmp_path / "huge.log").write_bytes(b"x" * (9 << 20) + b" RuntimeError: boom " + b"y" * 100 + b"\n")
    (tmp_path / "utf16.log").write_bytes("RuntimeError: CUDA out of memory\n".encode("utf-16"))
    (tmp_path / "latin1.log").write_bytes(
        "2026-11-21T09:30:01.000000 [rank2]: café Error: naïve\n".encode("latin-1")
    )
    (tmp_path / "broken.log.gz").write_bytes(gzip.compress(b"RuntimeError: CUDA out of memory\n" * 100)[:-20])
    (tmp_path / "notgz.log.gz").write_bytes(b"plain text, not gzip\n")
    r = diagnose_paths([tmp_path])
    json.dumps(r)
    assert r["stats"]["files"] == 7


def test_nccl_network_fixes_give_seed_003s_debugging_variables(tmp_path: Path):
    """Seed 003's NCCL debugging advice reaches the user with a network failure: pin the interface
    (NCCL_SOCKET_IFNAME=eth0) and rule out a broken NGC/SHARP network plugin (NCCL_NET_PLUGIN=none)."""
    log = tmp_path / "rank-0.log"
    log.write_text(
        "2026-12-08T10:00:00.000001 [rank0]: step=12 loss=2.1\n"
        "2026-12-08T10:00:01.000001 [rank0]: w-0:311:402 [0] misc/socket.cc:538 NCCL WARN NET/Socket : "
        "socketProgress: Connection closed by remote peer w-1<46411> error\n"
        "2026-12-08T10:00:01.000002 [rank0]: RuntimeError: NCCL communicator was aborted on rank 0\n"
    )
    d = diagnose_paths([log])
    assert d["category"] == "nccl_network", d["category"]
    assert "NCCL_SOCKET_IFNAME=eth0" in d["fix"] and "NCCL_NET_PLUGIN=none" in d["fix"], d["fix"]
