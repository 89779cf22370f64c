"""The sixth rules pass (the misses of the burned frozen5 split, as general mechanisms): ranks stated
in a log's own words (ParlAI's ``rank:  3 |``, fairseq's ``distributed init (rank 4)`` /
``initialized host H as rank 4``, spawn's ``-- Process 3 terminated`` after an earlier OOM line);
torchrun's ``[default0]:[rank12]:`` is global rank 12, not local 0 (so an earlier error on another
node beats a later timeout); a `tail -n 1` of a log that never stepped quotes its last line, and a
`tail` typed with no `date` is a look of unknown time (a stall only for an untimed log); Open
MPI's ``ompi_rte_init failed`` is a rendezvous failure; a Slurm cancel at the moment the user's ssh
session closed is an external stop; ``srun -l``'s ``3: `` is task 3; ``slurmstepd-NODE:`` and Open MPI's ``[host:pid]`` name the host. Each with the counter-case that must not change."""

from __future__ import annotations

from test_diagnose_stall_evidence import diag  # writes the files under tmp_path and diagnoses them

from trainguard.diagnose.lines import parse_line

OOM = "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 3; 79.35 GiB total capacity)\n"


def test_launcher_rank_prefixes_are_read():
    assert parse_line("[default0]:[rank12]:[E817 17:40:34.227531918 ProcessGroupNCCL.cpp:1515] x").rank == 12
    assert parse_line("[default3]:hello").rank == 3  # the local rank alone: all there is
    assert parse_line("[1,3]<stderr>:boom").rank == 3  # mpirun
    assert parse_line("8: [rank8]: RuntimeError: x").rank == 8  # srun -l
    assert parse_line("12:30:01 a clock, not a task").rank is None
    assert parse_line("rank:  3 | 2022-04-03 18:44:26,615 CRITICAL | Traceback (most recent call last):").rank == 3
    assert parse_line("rank: high | nothing").rank is None


def test_a_parlai_traceback_opened_on_a_rank_line_is_that_ranks(tmp_path):
    log = ("rank:  0 | 2022-04-03 18:44:02,110 INFO     | training...\n"
           "rank:  3 | 2022-04-03 18:44:26,615 CRITICAL | Traceback (most recent call last):\n"
           '  File "parlai/core/torch_generator_agent.py", line 720, in train_step\n'
           "    self.backward(loss)\n" + OOM)  # fmt: skip
    r = diag(tmp_path, {"train.log": log})
    assert r["category"] == "cuda_oom" and r["first_failure"]["rank"] == 3, r["summary"]
    plain = log.replace("rank:  3 | 2022-04-03 18:44:26,615 CRITICAL | ", "")  # no rank line opens it
    r = diag(tmp_path / "plain", {"train.log": plain})
    assert r["category"] == "cuda_oom" and r["first_failure"]["rank"] != 3, r["first_failure"]


def test_a_fairseq_log_that_names_its_own_rank_is_that_ranks(tmp_path):
    own = "| distributed init (rank 4): tcp://10.0.0.1:18811\n| initialized host worker-1 as rank 4\n"
    r = diag(tmp_path, {"node.log": own + OOM})
    assert r["first_failure"]["rank"] == 4 and r["first_failure"]["host"] == "worker-1", r["first_failure"]
    every = "".join(f"| distributed init (rank {i}): tcp://10.0.0.1:18811\n" for i in range(4))
    r = diag(tmp_path / "combined", {"node.log": every + OOM})  # one file for every rank: no rank
    assert r["first_failure"]["rank"] is None, r["first_failure"]


def test_spawns_failed_process_owns_the_error_logged_before_its_report(tmp_path):
    log = ("| WARNING: ran out of memory with exception: " + OOM +
           "Exception:\n\n-- Process 3 terminated with the following error:\nTraceback (most recent call last):\n"
           "_pickle.UnpicklingError: invalid load key, '\\xad'.\n")  # fmt: skip
    r = diag(tmp_path, {"train.log": log})
    assert r["category"] == "cuda_oom" and r["first_failure"]["rank"] == 3, r["first_failure"]
    two = log + "\n-- Process 1 terminated with the following error:\nValueError: x\n"
    r = diag(tmp_path / "two", {"train.log": two})  # two reports: the earlier OOM is nobody's in particular
    assert r["first_failure"]["rank"] is None, r["first_failure"]


def test_the_earlier_ecc_error_on_another_node_beats_a_later_rank0_timeout(tmp_path):
    ecc = ("[default0]:[rank12]:[E817 17:40:34.227531918 ProcessGroupNCCL.cpp:1515] [PG 0 (default_pg) Rank 12] "
           "Process group watchdog thread terminated with exception: CUDA error: uncorrectable ECC error encountered\n")
    timeout = ("[default0]:[rank0]:[E817 17:50:35.118203114 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught "
               "collective operation timeout: WorkNCCL(SeqNum=41215, OpType=ALLREDUCE, NumelIn=2101760, "
               "NumelOut=2101760, Timeout(ms)=600000) ran for 600089 milliseconds before timing out.\n")  # fmt: skip
    r = diag(tmp_path, {"node-0/train.log": timeout, "node-1/train.log": ecc})
    assert r["category"] == "gpu_hardware" and r["first_failure"]["rank"] == 12, r["first_failure"]
    r = diag(tmp_path / "alone", {"node-0/train.log": timeout})
    assert r["category"] == "nccl_timeout" and r["first_failure"]["rank"] == 0, r["first_failure"]


CONFIG = "".join(f"(TaskRunner pid=357663)   'key_{i}': {i},\n" for i in range(6))
LAST = "(WorkerDict pid=358112) NCCL version 2.21.5+cuda12.4 loaded for the actor workers"


def _hang_only_when_quoted(tmp_path, name: str, log: str, check: str, moved: str) -> None:
    """A later look quoting the log's end unchanged is a hang; the same look quoting a line the log
    moved on to, or no look at all, is not."""
    r = diag(tmp_path, {name: log, "check.txt": check})
    assert r["category"] == "hang_no_error", r["summary"]
    # the evidence named is where the log stopped (the quoted line, in the log), not the look itself
    assert r["first_failure"]["line"].strip() == log.splitlines()[-1].strip(), r["first_failure"]
    assert r["first_failure"]["file"].endswith(name), r["first_failure"]
    for sub, files in (("moved", {name: log, "check.txt": moved}), ("plain", {name: log})):
        r = diag(tmp_path / sub, files)
        assert r["category"] == "healthy", (sub, r["summary"])


def test_a_later_tail_quoting_the_last_line_of_a_log_that_never_stepped_is_a_hang(tmp_path):
    check = f"$ date; tail -n 1 ppo.log\nThu Aug 21 16:02:19 UTC 2025\n{LAST}\n"
    moved = check.replace(LAST, "(WorkerDict pid=358112) some other line the log printed after this copy")
    _hang_only_when_quoted(tmp_path, "ppo.log", CONFIG + LAST + "\n", check, moved)


MPI = ("It looks like orte_init failed for some reason; your parallel process is\nlikely to abort.\n"
       "  ompi_mpi_init: ompi_rte_init failed\n  --> Returned \"(null)\" (-43) instead of \"Success\" (0)\n"
       "mpirun detected that one or more processes exited with non-zero status, thus causing\n"
       "the job to be terminated.\n")  # fmt: skip


def test_open_mpis_runtime_init_failure_is_a_rendezvous_failure(tmp_path):
    r = diag(tmp_path, {"launch.log": MPI})
    assert r["category"] == "rendezvous_failure", r["summary"]
    bare = "mpirun detected that one or more processes exited with non-zero status, thus causing\n"
    r = diag(tmp_path / "bare", {"launch.log": "step 1 loss 2.0\n" + bare})
    assert r["category"] != "rendezvous_failure", r["summary"]


TICKS = "".join(f"2021-02-13 16:35:{s:02d}.055811\n" for s in range(50, 60))
CANCEL = "slurmstepd-localhost: error: *** STEP 204.0 ON localhost CANCELLED AT 2021-02-13T16:38:01 ***\n"


def test_a_slurm_cancel_when_the_users_ssh_session_closed_is_an_external_stop(tmp_path):
    auth = "Feb 13 16:38:01 eureka sshd[3478847]: pam_unix(sshd:session): session closed for user qiqig\n"
    r = diag(tmp_path, {"out.log": TICKS + CANCEL, "auth_log.txt": auth})
    assert r["category"] == "killed_external", r["summary"]
    hours = auth.replace("16:38:01", "19:02:44")  # the session closed hours later: not what stopped it
    r = diag(tmp_path / "later", {"out.log": TICKS + CANCEL, "auth_log.txt": hours})
    assert r["category"] != "killed_external", r["summary"]


BAR = "".join(f"Epoch {e}: 100%|##########| 63/63 [00:04<00:00, 12.01it/s, loss=0.{90 - e}, v_num=3]\n" for e in range(13))
STUCK = "Epoch 13:  41%|####      | 26/63 [00:02<00:03, 11.92it/s, loss=0.345, v_num=3]"


def test_a_tail_without_date_quoting_an_untimed_logs_last_progress_is_a_hang(tmp_path):
    check = f"$ tail -n 1 train.log\n{STUCK}\n$ nvidia-smi --query-gpu=index,utilization.gpu --format=csv,noheader\n0, 100 %\n"
    moved = check.replace("26/63 [00:02<00:03", "40/63 [00:03<00:02")  # the log went on after the copy
    _hang_only_when_quoted(tmp_path, "train.log", BAR + STUCK + "\n", check, moved)
    timed = "".join(f"2024-05-01 10:00:{i:02d} step {i} loss 0.5\n" for i in range(10))
    last = timed.splitlines()[-1]
    r = diag(tmp_path / "timed", {"train.log": timed, "check.txt": f"$ tail -n 1 train.log\n{last}\n"})
    assert r["category"] == "healthy", r["summary"]  # a timed log and a look of unknown time: no measure


def test_slurm_and_open_mpi_prefixes_name_the_host():
    assert parse_line("slurmstepd-localhost: error: *** STEP 204.0 ON localhost CANCELLED AT x ***").host == "localhost"
    assert parse_line("[hostA:71142] Local abort before MPI_INIT completed").host == "hostA"
    assert parse_line("[trainer.py:120] loss 0.3").host is None  # python logging's file:line
    assert parse_line("[INFO:12] w").host is None


def test_a_horovod_stall_list_entry_still_names_the_stalled_rank(tmp_path):
    # "3: [tensor]" under "Stalled ranks:" reads like srun -l's prefix; it is the rank the others wait for
    warn = ("[2020-07-13 21:{m}:48.104171: W horovod/common/operations.cc:588] One or more tensors were submitted "
            "to be reduced by subset of ranks and are waiting for remainder of ranks for more than 60 seconds.\n"
            "Stalled ranks:\n3: [HorovodAllreduce_globals_train_step_0]\n")  # fmt: skip
    r = diag(tmp_path, {"run.log": "train epoch 1, step 10, loss 2.5\n" + "".join(warn.format(m=m) for m in (12, 13, 14))})
    assert r["category"] == "hang_no_error" and r["first_failure"]["rank"] == 3, r["first_failure"]
