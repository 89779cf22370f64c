"""Fourth rules pass: stall evidence that is not an error line (a later `date; tail` capture
showing the log's last progress unchanged, the user's ^C after minutes of silence, an interrupt
traceback waiting in a barrier), and the counter-cases that must stay healthy: a log that merely
ends, a ^C right after progress, one slow window. Also c10d's store client failing at start-up
(rendezvous, not NCCL's network) and the rank/host of an untimed failure."""

from __future__ import annotations

from pathlib import Path

from trainguard.diagnose import diagnose_paths
from trainguard.diagnose.sources import describe


def write(tmp_path: Path, files: dict[str, str]) -> list[Path]:
    out = []
    for name, text in files.items():
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text.lstrip("\n"), encoding="utf-8")
        out.append(p)
    return out


def diag(tmp_path: Path, files: dict[str, str]) -> dict:
    return diagnose_paths(write(tmp_path, files))


BAR = "".join(f" {i * 100 // 900:>2d}%|#         | {i}/900 [{i // 60:02d}:{i % 60:02d}<10:00,  1.50it/s]\n"
              for i in range(1, 41))  # fmt: skip
LAST = BAR.splitlines()[-1]


def test_a_later_capture_quoting_the_last_progress_unchanged_is_a_hang(tmp_path):
    # untimed tqdm log; the check hours later prints date and the log's last line (redrawn: same
    # count, a later elapsed time)
    later = LAST.replace("[00:40<", "[00:41<")
    check = f"$ date; tail -1 train.log\nWed Sep 20 05:02:17 UTC 2023\n{later}\n"
    r = diag(tmp_path, {"train.log": BAR, "check_later.txt": check})
    assert r["category"] == "hang_no_error", r["summary"]
    assert "unchanged" in r["summary"], r["summary"]


def test_a_capture_whose_tail_moved_on_is_no_stall(tmp_path):
    moved = LAST.replace(" 40/900", " 41/900")
    check = f"$ date; tail -1 train.log\nWed Sep 20 05:02:17 UTC 2023\n{moved}\n"
    r = diag(tmp_path, {"train.log": BAR, "check.txt": check})
    assert r["category"] == "healthy", r["summary"]


def test_the_same_log_ending_without_any_capture_stays_healthy(tmp_path):
    r = diag(tmp_path, {"train.log": BAR})  # silence alone is not a hang
    assert r["category"] == "healthy", r["summary"]


HF = "".join(f"[INFO|trainer.py:1836] 2024-05-26 14:{55 + i // 3:02d}:{(i % 3) * 17:02d},100 >> Epoch: [0],Step [{i}/30],"
             f" loss {1.0 - i / 100:.3f}\n" for i in range(1, 10))  # fmt: skip
INTERRUPT = """^C[2024-05-26 {t},046] [INFO] [launch.py:315:sigkill_handler] Killing subprocess 22523
Traceback (most recent call last):
  File "/opt/conda/bin/deepspeed", line 6, in <module>
    main()
  File "/opt/conda/lib/python3.10/subprocess.py", line 1917, in _try_wait
    (pid, sts) = os.waitpid(self.pid, wait_flags)
KeyboardInterrupt
"""


def test_the_users_interrupt_after_minutes_of_silence_is_a_hang(tmp_path):
    r = diag(tmp_path, {"train.log": HF + INTERRUPT.format(t="15:08:40")})
    assert r["category"] == "hang_no_error", r["summary"]
    assert "interrupted" in r["summary"], r["summary"]


def test_an_interrupt_right_after_progress_is_no_hang(tmp_path):
    # the user stopped a job that was moving (a minute after the last step): no failure shown
    r = diag(tmp_path, {"train.log": HF + INTERRUPT.format(t="14:58:30")})
    assert r["category"] == "healthy", r["summary"]


LIGHTNING = "".join(f"Epoch 0:  {i * 10}%|#         | {i * 181}/1812 [01:14<11:07,  2.40it/s, loss=0.5{i}]\n"
                    for i in range(1, 10))  # fmt: skip
BARRIER = """Epoch 0, global step 1629: val_loss reached 0.48311, saving model to "ckpt/epoch=0.ckpt" as top 1
^CTraceback (most recent call last):
  File "train.py", line 188, in <module>
    trainer.fit(model, dm)
  File "/venv/lib/python3.8/site-packages/pytorch_lightning/plugins/training_type/ddp.py", line 298, in barrier
    torch.distributed.barrier()
  File "/venv/lib/python3.8/site-packages/torch/distributed/distributed_c10d.py", line 2420, in barrier
    work.wait()
KeyboardInterrupt
"""
ELSEWHERE = """^CTraceback (most recent call last):
  File "train.py", line 188, in <module>
    trainer.fit(model, dm)
  File "/venv/lib/python3.8/site-packages/torch/utils/data/dataloader.py", line 1207, in _next_data
    idx, data = self._get_data()
KeyboardInterrupt
"""


def test_an_interrupt_traceback_waiting_in_a_barrier_is_a_hang(tmp_path):
    r = diag(tmp_path, {"train.log": LIGHTNING + BARRIER})
    assert r["category"] == "hang_no_error", r["summary"]
    assert "collective or a barrier" in r["summary"] and "wait" in r["first_failure"]["line"], r


def test_an_interrupt_traceback_outside_a_collective_says_nothing(tmp_path):
    r = diag(tmp_path, {"train.log": LIGHTNING + ELSEWHERE})
    assert r["category"] == "healthy", r["summary"]


def test_a_validation_bar_at_100_percent_is_not_the_runs_end(tmp_path):
    log = "".join(f"[NeMo I 2025-05-27 08:{10 + i:02d}:00 train:1] Epoch 0: : {i * 100}it, train_loss={4.5 - i / 10:.3f}, "
                  f"global_step={i * 100}\n" for i in range(1, 20))  # fmt: skip
    log += "Validation DataLoader 0: 100%|##########| 96/96 [00:22<00:00,  4.31it/s]\n"
    log += "[NeMo I 2025-05-27 08:36:44 ckpt:572] Checkpoint save for step 1900 started\n"
    look = "$ date; tail -1 train.log\nTue May 27 10:51:30 UTC 2025\n[NeMo I 2025-05-27 08:36:44 ckpt:572] Checkpoint save\n"
    r = diag(tmp_path, {"train.log": log, "status_later.txt": look})
    assert r["category"] == "hang_no_error", r["summary"]


def _ds(step: int, t: int) -> str:
    return (f"[2023-04-28 {7 + t // 3600:02d}:{t // 60 % 60:02d}:{t % 60:02d},100] [INFO] [logging.py:96:log_dist] "
            f"[Rank 0] step={step}, skipped=6, lr=[9.6e-06], mom=[(0.9, 0.95)]\n")  # fmt: skip


def test_one_slow_window_between_normal_ones_is_a_pause_not_a_slowdown(tmp_path):
    t, lines = 0, []
    for i in range(1, 60):
        t += 70 if i in (20, 40) else 10  # two isolated long intervals (an eval, overflow steps skipped)
        lines.append(_ds(i * 10, t))
    r = diag(tmp_path, {"training.log": "".join(lines)})
    assert r["category"] == "healthy", r["summary"]


def test_a_slowdown_that_lasts_is_still_one(tmp_path):
    t, lines = 0, []
    for i in range(1, 60):
        t += 40 if i >= 30 else 10
        lines.append(_ds(i * 10, t))
    r = diag(tmp_path, {"training.log": "".join(lines)})
    assert r["category"] == "slowdown", r["summary"]


def test_c10d_store_client_failing_at_startup_is_a_rendezvous_failure(tmp_path):
    text = ("[W socket.cpp:601] [c10d] The client socket has failed to connect to [gpu03]:29500 "
            "(errno: 113 - No route to host).\n") * 3  # fmt: skip
    r = diag(tmp_path, {"train.log": text})
    assert r["category"] == "rendezvous_failure", r["summary"]
    nccl = "node5:240:240 [6] misc/socket.cc:533 NCCL WARN socketPollConnect: Connect to 10.0.0.4<56849> returned 113(No route to host)\n"
    r = diag(tmp_path / "nccl", {"train.log": nccl})
    assert r["category"] == "nccl_network", r["summary"]


def test_an_untimed_failure_takes_the_rank_of_the_one_process_whose_end_follows(tmp_path):
    text = """
Epoch 0, batch 3000, batch avg loss 0.6800
terminate called after throwing an instance of 'c10::Error'
  what():  CUDA error: an illegal memory access was encountered
Traceback (most recent call last):
  File "/venv/lib/python3.8/site-packages/torch/multiprocessing/spawn.py", line 130, in join
    raise ProcessExitedException(
torch.multiprocessing.spawn.ProcessExitedException: process 1 terminated with signal SIGABRT
"""
    r = diag(tmp_path, {"exp/log-train.log": text})
    assert r["category"] == "cuda_error_other", r["summary"]
    assert r["first_failure"]["rank"] == 1, r["first_failure"]


def test_srun_names_the_host_and_task_of_a_cgroup_oom(tmp_path):
    text = """
RuntimeError: DataLoader worker (pid 121877) is killed by signal: Killed.
slurmstepd: error: Detected 1 oom-kill event(s) in StepId=4420371.0. Some of your processes may have been killed by the cgroup out-of-memory handler.
srun: error: gpu001: task 0: Out Of Memory
"""
    r = diag(tmp_path, {"kraken-4420371.out": text})
    assert r["category"] == "host_oom", r["summary"]
    assert (r["first_failure"]["rank"], r["first_failure"]["host"]) == (0, "gpu001"), r["first_failure"]


def test_a_generic_log_name_in_a_host_folder_takes_the_folder_as_host(tmp_path):
    assert describe(tmp_path / "GPU01" / "train_sft_node1.log").host == "GPU01"
    assert describe(tmp_path / "logs" / "worker-node1.log").host == "worker-node1"


AGENT_WAIT = """^CTraceback (most recent call last):
  File "/venv/bin/torchrun", line 8, in <module>
    sys.exit(main())
  File "/venv/lib/python3.10/site-packages/torch/distributed/elastic/agent/server/api.py", line 867, in _invoke_run
    time.sleep(monitor_interval)
  File "/venv/lib/python3.10/site-packages/torch/distributed/elastic/multiprocessing/api.py", line 288, in wait
    return self._poll()
KeyboardInterrupt
"""


def test_torchruns_agent_waiting_for_its_workers_is_no_collective(tmp_path):
    r = diag(tmp_path, {"train.log": LIGHTNING + AGENT_WAIT})
    assert r["category"] == "healthy", r["summary"]


def test_a_rank_waiting_in_a_barrier_counts_even_when_the_launchers_traceback_follows(tmp_path):
    launcher = INTERRUPT.format(t="15:08:40").split("\n", 1)[1]  # the launcher's own traceback, untimed
    r = diag(tmp_path, {"train.log": LIGHTNING + BARRIER + launcher + AGENT_WAIT})
    assert r["category"] == "hang_no_error", r["summary"]


WAIT = "[watchdog] rank 0: still waiting for rank 3 in all_reduce (SeqNum=1882) for {n} s\n"


def test_a_repeated_still_waiting_line_after_the_last_step_is_a_hang(tmp_path):
    r = diag(tmp_path, {"train.log": LIGHTNING + WAIT.format(n=300) + WAIT.format(n=600) + WAIT.format(n=900)})
    assert r["category"] == "hang_no_error", r["summary"]
    assert "repeated 3 times" in r["summary"], r["summary"]


def test_one_wait_line_or_waits_the_run_got_past_are_no_hang(tmp_path):
    r = diag(tmp_path, {"train.log": LIGHTNING + WAIT.format(n=300)})  # a slow rank that may catch up
    assert r["category"] == "healthy", r["summary"]
    r = diag(tmp_path / "past", {"train.log": WAIT.format(n=300) + WAIT.format(n=600) + LIGHTNING})
    assert r["category"] == "healthy", r["summary"]


SIGINT = "[2024-05-26 {t},000] torch.distributed.elastic.agent.server.api: [WARNING] Received Signals.SIGINT death signal, shutting down workers\n"


def test_the_launchers_sigint_after_minutes_of_silence_is_a_hang_the_user_ended(tmp_path):
    r = diag(tmp_path, {"train.log": HF + SIGINT.format(t="15:08:40")})
    assert r["category"] == "hang_no_error", r["summary"]
    r = diag(tmp_path / "soon", {"train.log": HF + SIGINT.format(t="14:58:30")})
    assert r["category"] == "killed_external", r["summary"]  # a minute after a step: a stop, no stall shown
