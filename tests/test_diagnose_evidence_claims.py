"""Verdicts that claim only what the evidence shows (offline vs live, ranked hypotheses,
calibrated confidence) and the weak spots found on logs the rules were never tuned on."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard import policy as P
from trainguard.cli import main as cli_main
from trainguard.diagnose import diagnose_paths
from trainguard.diagnose.lines import parse_line
from trainguard.evidence import Diagnosis, RankFailure
from trainguard.policy import Action


def diag(tmp_path: Path, text: str, name: str = "train.log", **kw) -> dict:
    p = tmp_path / name
    p.write_text(text.lstrip("\n"), encoding="utf-8")
    return diagnose_paths([p], **kw)


MEGATRON_DONE = "\n".join(
    f" [2026-01-12 10:{i:02d}:00] iteration        {i}/       9 | consumed samples: {i * 512} | "
    f"elapsed time per iteration (ms): 2{i}40.1 | learning rate: 3.0E-04 | lm loss: {9 - i * 0.4:.4E} | "
    "loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 |"
    for i in range(1, 10)
)


def test_a_log_that_ends_on_its_planned_last_iteration_is_no_failure_found(tmp_path, capsys):
    r = diag(tmp_path, MEGATRON_DONE)
    assert r["category"] == "healthy", r["summary"]
    assert r["hypotheses"][0]["category"] == "healthy"
    assert cli_main(["diagnose", str(tmp_path / "train.log")]) == 0
    out = capsys.readouterr().out
    assert "no failure found" in out and "hang" not in out.splitlines()[0]


def test_a_log_that_ends_mid_run_on_normal_progress_is_not_a_hang_offline(tmp_path):
    lines = [f"{{'loss': {2.0 - i * 0.01:.4f}, 'learning_rate': 2e-05, 'epoch': {i / 100:.2f}}}\n"
             f" {i}%|##        | {i * 10}/1000 [01:{i:02d}<10:00,  1.50it/s]" for i in range(1, 30)]  # fmt: skip
    r = diag(tmp_path, "\n".join(lines))
    assert r["category"] == "healthy"
    # the other reading is offered, with low confidence
    assert any(h["category"] == "hang_no_error" and h["confidence"] == "low" for h in r["hypotheses"][1:])


NCCL_INIT = """
[2026-02-03 11:00:01,100] torch.distributed.run: [WARNING] Setting OMP_NUM_THREADS environment variable for each process to be 1
node-a:2001:2001 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>
node-a:2001:2090 [0] NCCL INFO comm 0x55d1 rank 0 nranks 2 cudaDev 0 nvmlDev 0 busId 1b000 commId 0x7a - Init COMPLETE
node-a:2002:2091 [1] NCCL INFO comm 0x55d2 rank 1 nranks 2 cudaDev 1 nvmlDev 1 busId 3b000 commId 0x7a - Init COMPLETE
"""


def test_a_log_that_stops_right_after_nccl_init_is_a_hang_with_evidence(tmp_path):
    r = diag(tmp_path, NCCL_INIT)
    assert r["category"] == "hang_no_error"
    assert r["confidence"] in ("medium", "high")
    assert any("Init COMPLETE" in str(e.get("line")) for e in r["evidence"])


def test_a_log_that_stops_after_ddp_rebuilt_its_buckets_is_a_hang(tmp_path):
    r = diag(tmp_path, "[rank0]:[I reducer.cpp:1969] Reducer buckets have been rebuilt in this iteration.\n"
                       "[rank1]:[I reducer.cpp:1969] Reducer buckets have been rebuilt in this iteration.\n")  # fmt: skip
    assert r["category"] == "hang_no_error"
    assert "Reducer buckets" in r["evidence"][0]["line"]


SHARDS_KILLED = """
[2026-03-01 09:00:00,000] torch.distributed.run: [WARNING] *****************************************
Loading checkpoint shards:  40%|####      | 6/15 [01:12<01:48, 12.05s/it]
Loading checkpoint shards:  47%|####6     | 7/15 [01:24<01:36, 12.05s/it]
[2026-03-01 09:02:11,000] torch.distributed.elastic.multiprocessing.api: [WARNING] Sending process 4412 closing signal SIGTERM
[2026-03-01 09:02:12,000] torch.distributed.elastic.multiprocessing.api: [ERROR] failed (exitcode: -9) local_rank: 3 (pid: 4415) of binary: /usr/bin/python
"""


def test_sigkill_while_loading_shards_offline_stays_a_kill_with_host_oom_the_likely_sender(tmp_path):
    """Loading alone does not show that memory ran out: the kill is the verdict, host RAM OOM the
    lead (medium), to be confirmed with dmesg."""
    r = diag(tmp_path, SHARDS_KILLED)
    assert r["category"] == "killed_external"
    assert "likely" in r["summary"] and "dmesg" in r["summary"]
    assert r["confidence"] == "medium"
    assert r["first_failure"]["rank"] == 3
    alt = r["hypotheses"][1]
    assert alt["category"] == "host_oom" and alt["confidence"] == "medium" and "dmesg" in alt["summary"]


def test_deepspeed_cpu_memory_report_raises_the_confidence(tmp_path):
    text = ("[2026-03-01 09:00:00,000] [INFO] [utils.py:781:see_memory_usage] CPU Virtual Memory:  used = 1843.2 GB, "
            "percent = 97.6%\n" + SHARDS_KILLED)  # fmt: skip
    r = diag(tmp_path, text)
    assert r["category"] == "host_oom" and r["confidence"] == "high"
    assert any("CPU Virtual Memory" in str(e.get("line")) for e in r["evidence"])


def test_live_the_counters_decide_a_sigkill_while_loading(tmp_path):
    """The agent read the kernel's oom_kill counters and they did not move: not the OOM killer."""
    r = diag(tmp_path, SHARDS_KILLED, oom={"checked": True, "killed": 0, "source": "vmstat"},
             failures={3: {"exitcode": -9, "signal": "SIGKILL"}})  # fmt: skip
    assert r["category"] == "killed_external"


@pytest.mark.parametrize(
    "line",
    [
        "Unable to determine the device handle for GPU0000:3B:00.0: Unknown Error",
        "Nov 21 09:30:01 node-a kernel: pcieport 0000:3a:00.0: AER: Uncorrected (Fatal) error received: 0000:3b:00.0",
        "Nov 21 09:30:01 node-a kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
        "[Fri Nov 20 10:30:41 2026] NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.",
        "2026-11-20 10:30:41 dcgm health: Detected XID error 79 on GPU 3",
    ],
)
def test_hardware_lines_outside_python_are_gpu_hardware(tmp_path, line):
    r = diag(tmp_path, "step 10 loss 2.1\n" + line + "\n")
    assert r["category"] == "gpu_hardware", r["summary"]


@pytest.mark.parametrize(
    "line",
    [
        "{'loss': 1.9321, 'grad_norm': nan, 'learning_rate': 1.9e-05, 'epoch': 0.41}",
        "{'loss': 0.0, 'grad_norm': nan, 'learning_rate': 1.9e-05, 'epoch': 0.41}",
        "[INFO|2026-01-01 10:00:00] {'loss': 2.1, 'grad_norm': 'nan', 'learning_rate': 1e-05}",
        "{'train/loss': nan, 'train/grad_norm': 3.2, 'train/global_step': 120}",
    ],
)
def test_nan_in_dict_style_metric_lines(tmp_path, line):
    ok = "{'loss': 1.95, 'grad_norm': 0.8, 'learning_rate': 1.9e-05, 'epoch': 0.40}\n"
    r = diag(tmp_path, ok * 3 + line + "\n")
    assert r["category"] == "nan_loss", r["summary"]


def test_one_nan_gradient_norm_followed_by_finite_records_is_a_skipped_step(tmp_path):
    ok = "{'loss': 1.95, 'grad_norm': 0.8, 'learning_rate': 1.9e-05, 'epoch': 0.40}\n"
    r = diag(tmp_path, ok * 3 + "{'loss': 1.94, 'grad_norm': nan, 'learning_rate': 1.9e-05, 'epoch': 0.41}\n" + ok * 3)
    assert r["category"] == "healthy", r["summary"]


def test_an_error_message_without_exception_type_before_the_launchers_exitcode_1(tmp_path):
    r = diag(tmp_path, """
[rank1]: Error: dataset path /data/train.jsonl does not exist, please check data_args
[2026-01-01 10:00:02,000] torch.distributed.elastic.multiprocessing.api: [ERROR] failed (exitcode: 1) local_rank: 1 (pid: 77) of binary: /usr/bin/python
""")
    assert r["category"] == "python_exception", r["summary"]
    assert r["first_failure"]["rank"] == 1
    assert "does not exist" in r["first_failure"]["line"]


def test_an_error_word_in_a_healthy_log_is_not_a_failure(tmp_path):
    r = diag(tmp_path, "Error: could not import apex, using torch AMP\n" + MEGATRON_DONE)
    assert r["category"] == "healthy"


@pytest.mark.parametrize(
    "line, rank, msg",
    [("[1,3]<stderr>:RuntimeError: boom", 3, "RuntimeError: boom"), ("[1,0]<stdout>:Epoch 1 loss 2.0", 0, "Epoch 1 loss 2.0")],
)
def test_mpirun_rank_prefixes(line, rank, msg):
    info = parse_line(line)
    assert (info.rank, info.message) == (rank, msg)


def test_horovod_traceback_names_its_mpirun_rank(tmp_path):
    r = diag(tmp_path, """
[1,0]<stdout>:Train Epoch 1 loss=2.1
[1,2]<stderr>:Traceback (most recent call last):
[1,2]<stderr>:  File "train.py", line 80, in <module>
[1,2]<stderr>:ValueError: bad label 12 for 10 classes
""")
    assert r["category"] == "python_exception" and r["first_failure"]["rank"] == 2


def test_nccl_watchdog_odd_op_type_at_the_same_seqnum_is_the_first_failure(tmp_path):
    tmpl = ("[rank{r}]:[E ProcessGroupNCCL.cpp:616] [Rank {r}] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum=4711, OpType={op}, NumelIn=1024, NumelOut=1024, Timeout(ms)=600000) ran for 600{r}12 "
            "milliseconds before timing out.")  # fmt: skip
    ops = {0: "ALLREDUCE", 1: "ALLREDUCE", 2: "BROADCAST", 3: "ALLREDUCE"}
    r = diag(tmp_path, "\n".join(tmpl.format(r=k, op=v) for k, v in ops.items()) + "\n")
    assert r["category"] == "nccl_timeout"
    assert r["first_failure"]["rank"] == 2


GLOO_MISMATCH = """
[rank1]:terminate called after throwing an instance of 'gloo::EnforceNotMet'
[rank1]:  what():  [enforce fail at ../third_party/gloo/gloo/transport/tcp/pair.cc:446] op.preamble.length <= op.nbytes. 8 vs 4. Is there a distributed collective mismatch in your code?
[2026-01-01 10:00:02,000] torch.distributed.elastic.multiprocessing.api: [ERROR] failed (exitcode: -6) local_rank: 1 (pid: 78) of binary: /usr/bin/python
"""


def test_gloo_collective_mismatch_is_a_user_bug_not_a_native_crash(tmp_path):
    r = diag(tmp_path, GLOO_MISMATCH)
    assert r["category"] == "python_exception", r["summary"]
    d = P.decide_on_failure({1: RankFailure(1, 78, -6, "SIGABRT")}, 3, Diagnosis.from_dict(r))
    assert d.action == Action.STOP_JOB  # a retry runs into the same mismatch


KILLED_WORKER = ("RuntimeError: DataLoader worker (pid 4242) is killed by signal: Killed. ")


def test_live_a_dataloader_worker_killed_by_a_signal_restarts(tmp_path):
    """A signal (often the OOM killer) killed the worker: retrying can work, unlike a code bug."""
    err = {"message": {"message": KILLED_WORKER, "extraInfo": {"py_callstack": "", "timestamp": "1795250000"}}}
    failure = RankFailure(0, 1234, 1, None, err)
    log = tmp_path / "attempt-0"
    log.mkdir()
    (log / "rank0.log").write_text(
        "2026-11-21T09:30:01.000000 [rank0]: Traceback (most recent call last):\n"
        f"2026-11-21T09:30:01.000000 [rank0]: {KILLED_WORKER}\n", encoding="utf-8")  # fmt: skip
    offline = diagnose_paths([log])
    assert offline["category"] == "dataloader"
    assert [h["category"] for h in offline["hypotheses"]][:2] == ["dataloader", "host_oom"]
    r = diagnose_paths([log], failures={0: {"exitcode": 1, "error_file_data": err}})
    d = P.decide_on_failure({0: failure}, 2, Diagnosis.from_dict(r))
    assert d.action == Action.RESTART, d.reason
    assert P.decide_on_failure({0: failure}, 2, None).action == Action.RESTART
    assert P.decide_on_failure({0: failure}, 0, Diagnosis.from_dict(r)).action == Action.STOP_JOB  # budget gone


def test_the_policy_never_stops_a_job_on_a_low_confidence_verdict():
    bare = RankFailure(0, 1234, 1)
    low = Diagnosis("python_exception", summary="maybe", confidence="low", first_failure={"rank": 0})
    d = P.decide_on_failure({0: bare}, 2, low)
    assert d.action == Action.RESTART, d.reason
    assert "low confidence" in d.reason
    sure = Diagnosis("python_exception", summary="KeyError", confidence="high", first_failure={"rank": 0})
    assert P.decide_on_failure({0: bare}, 2, sure).action == Action.STOP_JOB


def test_low_confidence_verdicts_say_so_in_one_line(tmp_path, capsys):
    """A bare exit code with nothing logged before it: a lead, not a verdict."""
    log = tmp_path / "a.log"
    log.write_text("[2026-01-01 10:00:02,000] torch.distributed.elastic.multiprocessing.api: [ERROR] failed "
                   "(exitcode: 1) local_rank: 0 (pid: 77) of binary: /usr/bin/python\n", encoding="utf-8")  # fmt: skip
    r = diagnose_paths([log])
    assert r["confidence"] == "low" and r["low_confidence"].startswith("low confidence:")
    assert cli_main(["diagnose", str(log)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("low confidence:") for line in out) == 1
    assert "hypotheses:" in out


def test_a_log_that_ends_on_a_horovod_stall_warning_is_a_hang_and_one_with_progress_after_is_not(tmp_path):
    stall = ("[1,0]<stderr>:[2026-08-14 10:02:11.530912: W /tmp/horovod/common/stall_inspector.cc:107] One or more "
             "tensors were submitted to be reduced, gathered or broadcasted by subset of ranks and are waiting for "
             "remainder of ranks for more than 60 seconds.")  # fmt: skip
    step = "[1,0]<stdout>:Train Epoch 1 [{}/60000 (5%)]\tLoss: 0.{}"
    progress = "\n".join(step.format(i * 640, 900 - i) for i in range(1, 6))
    assert diag(tmp_path, progress + "\n" + stall + "\n", "a.log")["category"] == "hang_no_error"
    assert diag(tmp_path, stall + "\n" + progress + "\n", "b.log")["category"] == "healthy"


def test_metric_lines_without_a_step_counter_are_progress_not_a_stall_at_start(tmp_path):
    """fairseq/torchtune/pytorch-examples metric lines: the run got past its start."""
    text = ("2026-01-01 10:00:00 | INFO | torch.distributed.distributed_c10d | Rank 0: Completed store-based barrier "
            "for key:store_based_barrier_key:1 with 8 nodes.\n"
            "2026-01-01 10:05:00 | INFO | train_inner | epoch 001:    100 / 1000 loss=9.1, nll_loss=9.0, ppl=512\n")  # fmt: skip
    assert diag(tmp_path, text)["category"] == "healthy"
    r = diag(tmp_path, text.splitlines()[0] + "\n", "init_only.log")
    assert r["category"] == "hang_no_error" and "store-based barrier" in r["evidence"][0]["line"]


def test_rays_list_of_potential_causes_is_not_a_segfault(tmp_path):
    r = diag(tmp_path, "(raylet) A worker died or was killed while executing a task by an unexpected system error. "
                       "There are some potential root causes. (1) The process is killed by SIGKILL by OOM killer due to "
                       "high memory usage. (3) The worker is crashed unexpectedly due to SIGSEGV or other unexpected errors.\n"
                       + MEGATRON_DONE)  # fmt: skip
    assert r["category"] != "segfault"


def test_two_launcher_reports_in_one_file_each_claim_the_lines_before_them(tmp_path):
    table = ("Root Cause (first observed failure):\n[0]:\n  time      : 2026-06-16_08:41:{s}\n  host      : {h}\n"
             "  rank      : {r} (local_rank: 0)\n  exitcode  : 1 (pid: {p})\n  error_file: <N/A>\n")  # fmt: skip
    text = ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.52 GiB\n"
            "ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: 1) local_rank: 0 (pid: 19401) of binary: python\n"
            + table.format(s=37, h="gpu188", r=4, p=19401)
            + "[E ProcessGroupNCCL.cpp:828] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=211, "
            "OpType=ALLREDUCE, Timeout(ms)=1800000) ran for 1800841 milliseconds before timing out.\n"
            "ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: 1) local_rank: 0 (pid: 19414) of binary: python\n"
            + table.format(s=59, h="gpu187", r=0, p=19414))  # fmt: skip
    r = diag(tmp_path, text, "slurm-node-7.out")
    assert r["category"] == "cuda_oom"
    assert (r["first_failure"]["rank"], r["first_failure"]["host"]) == (4, "gpu188")


def test_an_error_the_run_went_on_training_after_is_not_the_failure(tmp_path):
    """e.g. a library catching a CUDA OOM and retrying with a smaller batch: the same process logs
    more steps after it, and no launcher reports an exit."""
    lines = MEGATRON_DONE.splitlines()
    lines.insert(2, "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB")
    r = diag(tmp_path, "\n".join(lines) + "\n")
    assert r["category"] == "healthy", r["summary"]
    assert any(h["category"] == "cuda_oom" and "went on" in h["summary"] for h in r["hypotheses"])
    # the same error as the last thing logged is the failure
    lines = MEGATRON_DONE.splitlines()[:3] + ["torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB"]
    assert diag(tmp_path, "\n".join(lines) + "\n", "b.log")["category"] == "cuda_oom"


def test_a_kernel_gpu_line_takes_the_rank_that_failed_the_same_way_right_after(tmp_path):
    (tmp_path / "node-x7").mkdir()
    (tmp_path / "node-x7" / "kern.log").write_text(
        "Feb 14 05:03:43 node-x7 kernel: NVRM: GPU 0000:4c:00.0: GPU has fallen off the bus.\n", encoding="utf-8")
    (tmp_path / "slurm-77.out").write_text(
        "[rank5]:[E214 05:03:44.190244513 ProcessGroupNCCL.cpp:1595] [Rank 5] Process group watchdog thread "
        "terminated with exception: CUDA error: unknown error\n", encoding="utf-8")  # fmt: skip
    r = diagnose_paths([tmp_path])
    assert r["category"] == "gpu_hardware"
    assert (r["first_failure"]["rank"], r["first_failure"]["host"]) == (5, "node-x7")


@pytest.mark.parametrize(
    "line",
    ["2026-01-01 10:00:01 - root - ERROR - could not find the tokenizer at /models/x, abort",
     "2026-01-01 10:00:01.123 | ERROR    | __main__:main:42 - the dataset is empty after filtering"],
)
def test_logging_format_errors_before_the_launchers_exit_report(tmp_path, line):
    r = diag(tmp_path, f"[rank0]: {line}\n[2026-01-01 10:00:02,000] torch.distributed.elastic.multiprocessing.api: "
                       "[ERROR] failed (exitcode: 1) local_rank: 0 (pid: 77) of binary: /usr/bin/python\n")  # fmt: skip
    assert r["category"] == "python_exception" and r["first_failure"]["rank"] == 0


def test_a_slurm_time_limit_is_a_stop_from_outside(tmp_path):
    # the cancel comes a minute after the last iteration (the log's cadence); after a long silence
    # it would be a hang the stop ended (test_diagnose_silent_logs.py)
    r = diag(tmp_path, MEGATRON_DONE.replace("/       9 |", "/     500 |") +
             "\nslurmstepd: error: *** JOB 1234 ON node-1 CANCELLED AT 2026-01-12T10:10:00 DUE TO TIME LIMIT ***\n")  # fmt: skip
    assert r["category"] == "killed_external" and "time limit" in r["summary"]


def test_the_rank_whose_last_enqueued_collective_is_behind_the_others_is_the_first_failure(tmp_path):
    tmpl = ("[rank{r}]:[E1206 18:44:1{r}.715298 ProcessGroupNCCL.cpp:1834] [PG ID 0 PG GUID 0(default_pg) Rank {r}] "
            "Timeout at NCCL work: {n}, last enqueued NCCL work: {n}, last completed NCCL work: {c}.")  # fmt: skip
    text = "\n".join(tmpl.format(r=r, n=100 if r == 2 else 101, c=99 if r == 2 else 100) for r in range(4))
    r = diag(tmp_path, text + "\n")
    assert r["category"] == "nccl_timeout" and r["first_failure"]["rank"] == 2, r["summary"]


def test_live_sigkill_without_the_kernel_counters_is_low_and_says_so(tmp_path):
    r = diag(tmp_path, "[2026-03-01 09:02:12,000] torch.distributed.elastic.multiprocessing.api: [ERROR] failed "
                       "(exitcode: -9) local_rank: 1 (pid: 4415) of binary: /usr/bin/python\n",
             failures={1: {"exitcode": -9, "signal": "SIGKILL"}})  # fmt: skip
    assert r["category"] == "killed_external" and r["confidence"] == "low"
    assert r["hypotheses"][0]["confidence"] == "low" and r["low_confidence"].startswith("low confidence:")
