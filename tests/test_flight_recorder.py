"""torch's Flight Recorder read from a worker (probes/flight_recorder.py, worker/flight.py) and the
sequence finding made from it (detect/sequence.flight_calls). The end-to-end case (a rank that
skipped an all_reduce, named from the recorder in the hang report) is in tests/test_hang_waits.py."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainguard.detect.sequence import compare_sequences, flight_calls
from trainguard.probes import flight_recorder as fr
from trainguard.probes.stacks import StackDump


def _entry(seq: int, op: str, pg: str = "0", desc: str = "default_pg", **kw) -> dict:
    return {"collective_seq_id": seq, "p2p_seq_id": 0, "is_p2p": False, "profiling_name": op,
            "process_group": [pg, desc], "pg_id": int(pg), "state": "scheduled", "retired": True, **kw}  # fmt: skip


def test_parse_gloo_and_nccl_dumps() -> None:
    gloo = {"entries": [_entry(i, "gloo:all_reduce") for i in range(1, 4)]
            + [_entry(4, "gloo:broadcast", retired=False), {"bogus": 1}, _entry(0, "gloo:barrier")]}  # fmt: skip
    v = fr.parse(0, [gloo])
    g = v.groups["0"]
    assert (g.desc, g.last_seq, g.first_seq) == ("default_pg", 4, 1)
    assert g.in_flight == fr.InFlight(4, "broadcast", "scheduled")
    assert g.history == ((1, "all_reduce"), (2, "all_reduce"), (3, "all_reduce"), (4, "broadcast"))
    # NCCL: finished means its end event fired; the oldest unfinished call is the one waited on
    # (later calls may be queued behind it on the stream). Point-to-point has its own numbering.
    nccl = {"entries": [_entry(7, "nccl:all_reduce", "1", "tp", state="completed", retired=False),
                        _entry(8, "nccl:all_gather", "1", "tp", state="started", retired=False),
                        _entry(9, "nccl:all_reduce", "1", "tp", state="scheduled", retired=False),
                        _entry(0, "nccl:send", "1", "tp", is_p2p=True, retired=False)]}  # fmt: skip
    v = fr.parse(3, [gloo, nccl])
    assert set(v.groups) == {"0", "1"}
    assert v.groups["1"].in_flight == fr.InFlight(8, "all_gather", "started") and v.groups["1"].last_seq == 9
    assert v.to_dict()["1"]["in_flight"] == {"seq": 8, "op": "all_gather", "state": "started"}
    assert fr.parse(0, [{"entries": []}]).groups == {}


def _groups(*ranks: list[dict]) -> dict[int, dict]:
    return {r: fr.parse(r, [{"entries": e}]).groups for r, e in enumerate(ranks)}


def test_flight_calls_names_the_rank_that_skipped_a_collective() -> None:
    loop = [_entry(i, "gloo:all_reduce") for i in range(1, 20)]
    rank0 = loop + [_entry(20, "gloo:all_reduce", retired=False)]
    rank1 = loop[:-1] + [_entry(19, "gloo:barrier", retired=False)]  # it left out one all_reduce
    label, calls, counts = flight_calls(_groups(rank0, rank1))
    assert label == "process group 0 (default_pg)"
    assert {r: c.op for r, c in calls.items()} == {0: "all_reduce", 1: "barrier"}
    f = compare_sequences(calls, counts)
    assert f.out_of_sequence == [1] and "started fewer collectives" in f.why, f  # #19 against #20
    # At one sequence number: rank 1 left the established all_reduce one call early.
    rank1 = loop + [_entry(20, "gloo:barrier", retired=False)]
    f = compare_sequences(*flight_calls(_groups(rank0, rank1))[1:])
    assert f.out_of_sequence == [1] and "made 19 all_reduce calls to rank 0's 20" in f.why, f


def test_flight_calls_counts_only_what_every_buffer_holds() -> None:
    # Rank 0's ring buffer lost its oldest calls: counting them for rank 1 only would make rank 0
    # look as if it had skipped some.
    rank0 = [_entry(i, "nccl:all_reduce") for i in range(11, 20)] + [_entry(20, "nccl:all_reduce", retired=False)]
    rank1 = [_entry(i, "nccl:all_reduce") for i in range(1, 20)] + [_entry(20, "nccl:broadcast", retired=False)]
    _, calls, counts = flight_calls(_groups(rank0, rank1))
    assert counts[0].calls == {"all_reduce": 10} and counts[1].calls == {"all_reduce": 9, "broadcast": 1}
    assert compare_sequences(calls, counts).out_of_sequence == [1]


def test_flight_calls_without_a_disagreement_says_nothing() -> None:
    same = [_entry(1, "gloo:all_reduce"), _entry(2, "gloo:all_reduce", retired=False)]
    assert flight_calls(_groups(same, same)) == ("", {}, {})
    idle = [_entry(1, "gloo:all_reduce")]  # nothing in flight on rank 1 (its stack says where it is)
    assert flight_calls(_groups(same, idle)) == ("", {}, {})
    # Another group disagrees: that one is named.
    other = same + [_entry(5, "gloo:all_gather", "2", "dp", retired=False)]
    other1 = same + [_entry(5, "gloo:reduce_scatter", "2", "dp", retired=False)]
    label, calls, _ = flight_calls(_groups(other, other1))
    assert label == "process group 2 (dp)" and calls[1].op == "reduce_scatter"


def test_worker_env_keeps_the_users_setting() -> None:
    assert fr.worker_env({}) == {"TORCH_FR_BUFFER_SIZE": "2000"}
    assert fr.worker_env({"TORCH_FR_BUFFER_SIZE": "0"}) == {}  # the user turned it off
    assert fr.worker_env({"TORCH_NCCL_TRACE_BUFFER_SIZE": "500"}) == {}


def test_stopped_and_gone_ranks_are_not_asked(tmp_path: Path) -> None:
    from trainguard.monitors.hang.monitor import read_flight

    sockets = {r: str(tmp_path / f"r{r}.fr") for r in range(4)}
    dumps = {0: StackDump(0, 10, "T", []), 1: StackDump(1, 11, "", []), 2: StackDump(2, 12, "S", [])}
    got = read_flight(sockets, dumps)
    assert list(got) == [2] and "No such file" in (got[2].error or ""), got  # rank 3: no stack dump


_WORKER = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from trainguard.worker import flight
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
    assert flight.start(sys.argv[1]) is None
    assert flight.start(sys.argv[1]) is None  # once per process
    t = torch.ones(2)
    for _ in range(3):
        dist.all_reduce(t)
    dist.broadcast(t, 0)
    print("ready", flush=True)
    sys.stdin.readline()
    os._exit(0)
""")


def test_a_worker_serves_its_recorder_privately_and_quietly(tmp_path: Path) -> None:
    sock = tmp_path / "ring-a0-r0.fr"
    env = dict(os.environ, TORCH_FR_BUFFER_SIZE="100")
    p = subprocess.Popen([sys.executable, "-c", _WORKER, str(sock), str(tmp_path / "store")], env=env,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n", p.communicate(timeout=60)
        assert stat.S_ISSOCK(os.stat(sock).st_mode) and stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        v = fr.read(0, str(sock))
        assert v.error is None, v
        assert [op for _, op in v.groups["0"].history] == ["all_reduce"] * 3 + ["broadcast"]
        assert fr.ask(str(sock), "no_such_handler") is None
    finally:
        out, err = p.communicate("\n", timeout=60)
    assert p.returncode == 0, err
    assert "WorkerServer" not in err, err  # torch's start and exit lines are not the user's business


def test_no_server_is_one_clear_error(tmp_path: Path) -> None:
    v = fr.read(5, str(tmp_path / "absent.fr"))
    assert v.groups == {} and v.error and "fr_trace_json" in v.error
    assert v.to_dict() == {"error": v.error}


def test_sweep_removes_the_agents_sockets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainguard.monitors.profiling import monitor as pm

    monkeypatch.setattr(pm.R, "shm_dir", lambda: str(tmp_path))
    prefix = str(tmp_path / "trainguard-123-0123abcd")
    for name in ("-a0-r0", "-a0-r0.fr", "-a1-r3.fr"):
        Path(prefix + name).write_bytes(b"")
    other = tmp_path / "trainguard-123-89abcdef-a0-r0.fr"
    other.write_bytes(b"")
    assert sorted(Path(p).name for p in pm.sweep_rings(prefix)) == [
        "trainguard-123-0123abcd-a0-r0", "trainguard-123-0123abcd-a0-r0.fr", "trainguard-123-0123abcd-a1-r3.fr"]
    assert other.exists()
