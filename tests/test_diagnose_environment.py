"""Environment failures (seed 003's runtime environment: conda not set up in the start shell, no
CUDA toolkit for DeepSpeed, no cuDNN): diagnosed as `environment` with the seed's fixes, and the
live policy stops the job with "fix the environment", neither "fix the code" nor a restart."""

from __future__ import annotations

from pathlib import Path

import pytest
from tgtest import events

from trainguard import policy as P
from trainguard.diagnose import diagnose_paths
from trainguard.evidence import Diagnosis, HardwareReport, RankFailure
from trainguard.policy import Action

CASES = sorted((Path(__file__).resolve().parent / "corpus" / "environment").iterdir())
HEALTHY = HardwareReport(True, [], [])


@pytest.mark.parametrize("case", CASES, ids=lambda p: p.name)
def test_the_live_policy_stops_on_an_environment_diagnosis_and_says_fix_the_environment(case):
    diagnosis = Diagnosis.from_dict(diagnose_paths([case]))
    assert diagnosis.category == "environment"
    failed = {0: RankFailure(local_rank=0, pid=7, exitcode=1)}
    for restarts_left in (0, 2):
        d = P.decide_on_failure(failed, restarts_left, diagnosis, HEALTHY)
        assert d.action == Action.STOP_JOB
        assert "fix the environment" in d.reason and "user code" not in d.reason, d.reason


def test_an_error_file_naming_a_missing_toolkit_is_environment_without_a_diagnosis():
    head = "deepspeed.ops.op_builder.builder.MissingCUDAException: CUDA_HOME does not exist, unable to compile CUDA op(s)"
    failed = RankFailure(local_rank=0, pid=7, exitcode=1, error_file_data={"message": {"message": head}})
    assert P.classify_rank_failure(0, failed).kind == P.ENVIRONMENT
    assert "fix the environment" in P.decide_on_failure({0: failed}, 2, None, HEALTHY).reason


CONDA_FAILS = '''import sys
sys.stderr.write("""
CommandNotFoundError: Your shell has not been properly configured to use 'conda activate'.
To initialize your shell, run

    $ conda init <SHELL_NAME>

See 'conda init --help' for more information and options.

IMPORTANT: You may need to close and restart your shell after running 'conda init'.
""")
sys.exit(1)
'''


@pytest.mark.slow
def test_a_job_whose_start_shell_lacks_conda_stops_at_once_with_the_seeds_fixes(jobs, tmp_path):
    script = tmp_path / "start.py"
    script.write_text(CONDA_FAILS)
    run = tmp_path / "run"
    job = jobs("run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "--run-dir", run, script)
    assert job.wait() != 0, job.output()
    diagnosis = events(run, "diagnosis")[0]
    assert diagnosis.evidence["category"] == "environment", diagnosis.message
    assert "conda init --system" in diagnosis.evidence["fix"] and "bash -i" in diagnosis.evidence["fix"]
    decision = events(run, "policy_decision")[0]
    assert decision.evidence["action"] == "stop_job" and "fix the environment" in decision.message, decision.message
    assert events(run, "restart") == []
