"""Second rules pass: general shapes that hold across frameworks (a later look at a silent
log, a watcher that sees nothing change), each with the healthy twin that must stay healthy."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.diagnose import diagnose_paths


def diag(tmp_path: Path, files: dict[str, str]) -> dict:
    paths = []
    for name, text in files.items():
        p = tmp_path / name
        p.write_text(text.lstrip("\n"), encoding="utf-8")
        paths.append(p)
    return diagnose_paths(paths)


TIMED = "\n".join(f"2026-03-02 10:{i:02d}:10 | epoch 3 | iter {i * 100}/5000 | loss {2.5 - i * 0.01:.3f} | 0.61 s/it"
                  for i in range(1, 20))  # fmt: skip
UNTIMED_BAR = "\n".join(f" {i}%|##        | {i * 10}/1000 [01:{i:02d}<10:00,  1.50it/s]" for i in range(1, 30))


def test_a_date_printed_hours_after_the_last_logged_line_is_a_hang(tmp_path):
    r = diag(tmp_path, {"train.log": TIMED + "\n$ date\nMon Mar  2 16:40:00 UTC 2026\n"})
    assert r["category"] == "hang_no_error", r["summary"]
    assert "later look" in r["summary"] and "Mon Mar  2 16:40:00" in r["first_failure"]["line"]


def test_a_date_minutes_after_the_last_line_is_not_a_hang(tmp_path):
    r = diag(tmp_path, {"train.log": TIMED + "\nMon Mar  2 10:21:00 UTC 2026\n"})
    assert r["category"] == "healthy", r["summary"]


def test_a_date_after_many_untimed_progress_lines_proves_nothing(tmp_path):
    # `date` before and after a run whose progress bar has no timestamps: the run took hours, no stall
    text = "Mon Mar  2 10:00:00 UTC 2026\n" + UNTIMED_BAR + "\nMon Mar  2 14:00:00 UTC 2026\n"
    r = diag(tmp_path, {"train.log": text})
    assert r["category"] == "healthy", r["summary"]


def test_a_later_check_in_its_own_file_quoting_the_logs_last_line_is_a_hang(tmp_path):
    log = "[2026-03-02 09:00:00,100] [INFO] [train.py:10] [RANK:0] starting\n" + UNTIMED_BAR.splitlines()[0] + "\n"
    check = ("$ date; nvidia-smi --query-gpu=utilization.gpu --format=csv\nMon Mar  2 12:05:00 UTC 2026\n100 %\n"
             "$ tail -1 train.log\n" + UNTIMED_BAR.splitlines()[0] + "\n")  # fmt: skip
    r = diag(tmp_path, {"train.log": log, "check.txt": check})
    assert r["category"] == "hang_no_error", r["summary"]


def test_a_month_day_year_stamp_places_the_last_line_in_time(tmp_path):
    log = "[06/06/23 10:02:16] INFO     engine - INFO: Engine is built\n"
    r = diag(tmp_path, {"train.log": log, "ps.txt": "$ date\nTue Jun  6 13:40:52 CST 2023\n"})
    assert r["category"] == "hang_no_error", r["summary"]


def test_a_watcher_saying_the_log_is_unchanged_is_a_hang(tmp_path):
    last = UNTIMED_BAR.splitlines()[-1]
    watch = "".join(f"[watch 2026-03-02 1{h}:00:00] train.log unchanged for {h * 3600} s; last line: {last}\n"
                    for h in range(1, 4))  # fmt: skip
    r = diag(tmp_path, {"train.log": UNTIMED_BAR, "watch.txt": watch})
    assert r["category"] == "hang_no_error", r["summary"]
    alone = tmp_path / "alone"
    alone.mkdir()
    assert diag(alone, {"train.log": UNTIMED_BAR})["category"] == "healthy"


def _oom(rank: int) -> str:
    return (f"[rank{rank}]: Traceback (most recent call last):\n[rank{rank}]:   File \"train.py\", line 88, in step\n"
            f"[rank{rank}]:     loss.backward()\n[rank{rank}]: torch.OutOfMemoryError: CUDA out of memory. "
            f"Tried to allocate 3.91 GiB. GPU {rank} has a total capacity of 79.11 GiB of which 1.2 GiB is free.\n")  # fmt: skip


def test_untimed_same_failure_on_several_ranks_the_first_logged_rank_failed_first(tmp_path):
    r = diag(tmp_path, {"train.log": _oom(3) + _oom(6) + _oom(0)})
    assert r["category"] == "cuda_oom" and r["first_failure"]["rank"] == 3, r["summary"]


def test_ranks_the_launcher_killed_after_another_ranks_exit_are_not_the_first_failure(tmp_path):
    log = ("Epoch: [8]  [ 500/1251]  eta: 0:10:32  lr: 0.000146  loss: 5.0491 (5.0500)  time: 0.690\n"
           "srun: error: node-a: task 5: Exited with exit code 1\n"
           "srun: launch/slurm: _step_signal: Terminating StepId=111.0\n"
           "srun: error: node-a: tasks 0,2,3: Killed\nsrun: error: node-b: tasks 8-15: Killed\n")  # fmt: skip
    r = diag(tmp_path, {"train.log": log})
    assert r["first_failure"]["rank"] == 5 and r["category"] == "exit_nonzero", r["summary"]
    # a kill reported on its own stays a kill
    alone = tmp_path / "alone"
    alone.mkdir()
    assert diag(alone, {"train.log": "srun: error: node-a: tasks 0,2,3: Killed\n"})["category"] == "killed_external"


STEPS = "\n".join(f"[2024-04-19 21:{i:02d}:10] INFO  training | step {i * 100:5d}/20000 loss {2.5 - i * 0.01:.4f}"
                  for i in range(1, 22))  # fmt: skip
LIMIT = "slurmstepd: error: *** JOB 77 ON gpu-a-1 CANCELLED AT {} DUE TO TIME LIMIT ***\n"


def test_a_time_limit_cancel_long_after_the_last_progress_is_a_hang(tmp_path):
    r = diag(tmp_path, {"slurm-77.out": STEPS + "\n" + LIMIT.format("2024-04-20T09:09:37")})
    assert r["category"] == "hang_no_error", r["summary"]
    assert "11.8 h" in r["summary"]
    assert any(h["category"] == "killed_external" for h in r["hypotheses"][1:])


def test_a_time_limit_cancel_right_after_progress_is_a_stop_from_outside(tmp_path):
    r = diag(tmp_path, {"slurm-77.out": STEPS + "\n" + LIMIT.format("2024-04-19T21:22:00")})
    assert r["category"] == "killed_external", r["summary"]


def test_a_log_whose_last_line_comes_hours_after_silence_is_a_hang(tmp_path):
    r = diag(tmp_path, {"train.log": STEPS + "\n[2024-04-20 02:00:00] WARNING heartbeat: worker 3 alive\n"})
    assert r["category"] == "hang_no_error", r["summary"]


def test_hourly_epoch_lines_are_the_logs_cadence_not_a_silence(tmp_path):
    text = "".join(f"[2024-04-19 {h:02d}:00:00] INFO epoch {h} done, val loss {2.0 - h * 0.01:.3f}\n"
                   f"[2024-04-19 {h:02d}:00:05] INFO saved checkpoint epoch_{h}.pt\n" for h in range(1, 12))  # fmt: skip
    r = diag(tmp_path, {"train.log": text + "[2024-04-19 12:30:00] INFO saved final checkpoint\n"})
    assert r["category"] == "healthy", r["summary"]


WATCHDOG = ("[E ProcessGroupNCCL.cpp:458] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=96120, "
            "OpType=ALLREDUCE, Timeout(ms)=1800000) ran for 1800813 milliseconds before timing out.\n"
            "[E ProcessGroupNCCL.cpp:478] To avoid data inconsistency, we are taking the entire process down.\n"
            "terminate called after throwing an instance of 'std::runtime_error'\n"
            "  what():  [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=96120, OpType=ALLREDUCE, "
            "Timeout(ms)=1800000) ran for 1800813 milliseconds before timing out.\n")  # fmt: skip


def test_an_abort_names_its_reason_the_watchdog_timeout_not_a_native_crash(tmp_path):
    r = diag(tmp_path, {"slurm-1.out": WATCHDOG + "srun: error: dgx-014: tasks 0,3: Aborted (core dumped)\n"})
    assert r["category"] == "nccl_timeout", r["summary"]


def test_a_segfault_next_to_an_abort_reason_stays_a_native_crash(tmp_path):
    r = diag(tmp_path, {"slurm-1.out": WATCHDOG + "srun: error: dgx-014: task 0: Segmentation fault (core dumped)\n"})
    assert r["category"] == "segfault", r["summary"]


@pytest.mark.parametrize("line", [
    "mpirun noticed that process rank 1 with PID 0 on node tw-1 exited on signal 4 (Illegal instruction: 4).",
    "srun: error: node-1: task 1: Floating point exception",
    "srun: error: node-1: task 1: Illegal instruction (core dumped)",
    "ERROR: worker rank 1 exited with exit code 136",
])
def test_every_native_crash_signal_in_every_launchers_shape_is_a_native_crash(tmp_path, line):
    r = diag(tmp_path, {"job.log": "[1,0]<stdout>:step 1 loss 2.3\n" + line + "\n"})
    assert r["category"] == "segfault", r["summary"]


def test_open_mpis_exit_report_names_the_first_failing_rank(tmp_path):
    log = ("[1,0]<stdout>:Epoch 2 | train loss 0.0277\n[1,1]<stdout>:Epoch 2 | train loss 0.0276\n"
           "mpirun detected that one or more processes exited with non-zero status, thus causing\n"
           "the job to be terminated. The first process to do so was:\n\n  Process name: [[40213,1],1]\n"
           "  Exit code:    1\n")  # fmt: skip
    r = diag(tmp_path, {"horovodrun.log": log})
    assert r["category"] == "exit_nonzero" and r["first_failure"]["rank"] == 1, r["summary"]


def test_the_odd_op_type_wins_even_when_every_rank_moves_a_different_element_count(tmp_path):
    def line(r: int) -> str:
        op, n = ("ALLREDUCE", 32) if r == 5 else ("ALLTOALL_BASE", 1379328 + 4096 * r)
        return (f"[rank{r}]:[E218 04:54:22.86849{r} ProcessGroupNCCL.cpp:616] [Rank {r}] Watchdog caught collective "
                f"operation timeout: WorkNCCL(SeqNum=216, OpType={op}, NumelIn={n}, NumelOut=1572864, "
                "Timeout(ms)=600000) ran for 600040 milliseconds before timing out.\n")  # fmt: skip
    r = diag(tmp_path, {"job.log": "".join(line(i) for i in range(8))})
    assert r["category"] == "nccl_timeout" and r["first_failure"]["rank"] == 5, r["summary"]


def test_a_silent_rank_whose_last_line_comes_late_while_rank0_logs_steps_is_not_a_hang(tmp_path):
    # ranks other than 0 are often silent while rank 0 reports the steps: no silence in the job
    rank1 = "[2024-04-19 21:00:05] INFO rank 1 ready\n[2024-04-19 23:30:00] WARNING rank 1 destroying process group\n"
    steps = "\n".join(f"[2024-04-19 {21 + i // 60}:{i % 60:02d}:10] INFO  training | step {i * 10}/20000 loss 2.1"
                      for i in range(1, 150))  # fmt: skip
    r = diag(tmp_path, {"rank1.log": rank1, "rank0.log": steps + "\n"})
    assert r["category"] == "healthy", r["summary"]


def test_a_later_look_after_the_planned_last_step_is_not_a_hang(tmp_path):
    done = "\n".join(f" [2026-03-02 10:{i:02d}:10] iteration        {i}/      19 | lm loss: {2.5 - i * 0.01:.4E} |"
                     for i in range(1, 20))  # fmt: skip
    r = diag(tmp_path, {"train.log": done + "\n$ date\nMon Mar  2 16:40:00 UTC 2026\n"})
    assert r["category"] == "healthy", r["summary"]
