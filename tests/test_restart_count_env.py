"""TORCHELASTIC_RESTART_COUNT, as torchrun sets it: the restarts of this agent's worker group that
torchrun would have made from a failed group (its budget-spending ones), whether or not trainguard
charged them to --max-restarts. A NaN replay is such a restart (torchrun would have restarted the
failed workers); a new rendezvous round for a node that joined or a peer that moved on is not
(torchrun's membership change). The rule on its own, then real 2-rank jobs under `trainguard run`."""

from __future__ import annotations

import re

import pytest
from tgtest import SCRIPTS, events

from trainguard.agent.elastic import counts_as_torchrun_restart

COUNT_WORKER = SCRIPTS / "restart_count_worker.py"
NAN_WORKER = SCRIPTS / "nan_worker.py"


@pytest.mark.parametrize(
    ("membership", "workers_failed", "counts"),
    [
        (False, True, True),  # a worker failure restarted with the budget (torchrun: the same)
        (False, False, True),  # a monitor's restart of running workers (a hang): it spends the budget
        (True, True, True),  # a node lost or left, seen as this node's workers failing: torchrun restarts a failed group
        (True, False, False),  # a node joined / a peer moved on while the workers ran: torchrun's membership change
    ],
)
def test_which_restarts_count_in_torchelastic_restart_count(membership, workers_failed, counts):
    assert counts_as_torchrun_restart(membership=membership, workers_failed=workers_failed) is counts


def _counts(run_dir, attempt: int) -> set[int]:
    """The TORCHELASTIC_RESTART_COUNT each rank of the attempt printed."""
    found = set()
    for log in sorted((run_dir / "logs" / f"attempt-{attempt}").glob("rank-*.log")):
        m = re.search(r"TORCHELASTIC_RESTART_COUNT=(\d+)", log.read_text())
        assert m, f"{log} has no TORCHELASTIC_RESTART_COUNT line:\n{log.read_text()}"
        found.add(int(m[1]))
    assert found, f"no rank logs for attempt {attempt} in {run_dir}"
    return found


@pytest.mark.slow
def test_nan_replay_workers_see_torchelastic_restart_count_one(jobs, tmp_path):
    """Rank 1 injects a NaN only while TORCHELASTIC_RESTART_COUNT is 0, as a torchrun script would:
    the replay (no restart spent, --max-restarts 0) must see 1, so the NaN does not come back and
    training finishes; the restart event still speaks of the budget."""
    run_dir = tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "0", "--run-dir", run_dir, "--quiet",
               NAN_WORKER, "--flip-step", "10", "--steps", "30", "--first-attempt-var", "TORCHELASTIC_RESTART_COUNT")  # fmt: skip
    assert job.wait() == 0, job.output()
    assert _counts(run_dir, 0) == {0} and _counts(run_dir, 1) == {1}
    assert len(events(run_dir, "nan_transient")) == 1
    (restart,) = events(run_dir, "restart")
    assert "NaN replay, no restart used" in restart.message
    assert restart.evidence["restart_count"] == 0 and restart.evidence["torchelastic_restart_count"] == 1
    started = [e.evidence for e in events(run_dir, "job_started")]
    assert [(s["restart_count"], s["torchelastic_restart_count"]) for s in started] == [(0, 0), (0, 1)]


@pytest.mark.slow
def test_failure_restarts_count_up_in_torchelastic_restart_count(jobs, tmp_path):
    """Workers that fail their first two attempts, restarted with the budget (--restart-on-error:
    torchrun's restart on any failure): the attempts see 0, 1, 2, as under torchrun."""
    run_dir = tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "3", "--restart-on-error",
               "--run-dir", run_dir, "--quiet", COUNT_WORKER, "--fail-until", "2")  # fmt: skip
    assert job.wait() == 0, job.output()
    assert [_counts(run_dir, a) for a in range(3)] == [{0}, {1}, {2}]
    assert [e.evidence["restart_count"] for e in events(run_dir, "restart")] == [1, 2]
