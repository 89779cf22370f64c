"""The agent's exit order decides the first failure when the logs alone cannot."""

import json
import time

from trainguard.diagnose import diagnose_paths


def test_rank_the_agent_saw_exit_first_wins_over_a_peer_loss_logged_earlier(tmp_path):
    (tmp_path / "rank-0.log").write_text("2026-11-21T10:00:00.000000 [rank0]: step=1 rank=0 t=1\n")
    (tmp_path / "rank-1.log").write_text(
        "2026-11-21T10:00:00.100000 [rank1]: RuntimeError: [../gloo/transport/tcp/pair.cc:553] "
        "Connection closed by peer [127.0.0.1]:5555\n"
    )
    # rank 1's error file clock (whole seconds) says it failed before rank 0 exited
    (tmp_path / "error-1.json").write_text(json.dumps({"message": {"message": "Connection closed by peer",
                                                                   "extraInfo": {"timestamp": "100"}}}))
    later = time.time() + 100  # rank 0's exit time, after rank 1's error file was written
    failures = {0: {"exitcode": 3, "pid": 11, "timestamp": later, "first_failure": True}}
    got = diagnose_paths([tmp_path], failures=failures)
    assert got["first_failure"]["rank"] == 0
    assert got["category"] == "exit_nonzero"  # a bare exit code is not a Python exception
    assert 1 in {c["rank"] for c in got["cascade"]}
    without = diagnose_paths([tmp_path], failures={0: {"exitcode": 3, "pid": 11, "timestamp": later}})
    assert without["first_failure"]["rank"] == 1  # no agent order: the earlier error wins
