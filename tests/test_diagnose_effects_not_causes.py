"""Third rules pass: effects are not causes (Ray's dead-worker reports, a wrapper repeating a
child's exit status, Horovod's shutdown on the surviving ranks), the rank a stall inspector names,
and step records in any framework's key:value format."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.diagnose import diagnose_paths


def diag(tmp_path: Path, text: str) -> dict:
    p = tmp_path / "train.log"
    p.write_text(text.lstrip("\n"), encoding="utf-8")
    return diagnose_paths([p])


STEPS = "\n".join(f"INFO:root:[step {i}]  mlm_loss=1.41{i:03d}  throughput=16.2K tks/s" for i in range(90, 99))
WARN = ("[1,0]<stderr>:[2026-10-09 05:33:38.249493: W horovod/common/stall_inspector.cc:105] One or more tensors "
        "were submitted to be reduced, gathered or broadcasted by subset of ranks and are waiting for remainder of "
        "ranks for more than 60 seconds.\n")  # fmt: skip


@pytest.mark.parametrize(
    "tail",
    [
        "[1,0]<stderr>:Stalled ranks:\n[1,0]<stderr>:4: [horovod_allreduce.0, horovod_allreduce.1 ...]\n",
        "Missing ranks: 4\n",
        "".join(f"[1,0]<stderr>:Stalled ops: grad_{i} [ready ranks: {', '.join(str(r) for r in range(8) if r != 4)}]\n"
                for i in range(2)),  # fmt: skip
    ],
)
def test_the_rank_a_stall_inspector_names_is_the_hang_rank(tmp_path, tail):
    r = diag(tmp_path, STEPS + "\n" + WARN + tail)
    assert r["category"] == "hang_no_error", r["summary"]
    assert r["first_failure"]["rank"] == 4, r["first_failure"]


RAY_STEPS = "\n".join(f"(main_task pid=1882013) step:{i} - actor/pg_loss:-0.0{i:02d} - critic/score/mean:0.7{i:02d} - "
                      f"timing_s/step:63.2" for i in range(1, 6))  # fmt: skip
RAY_DIED = """
Traceback (most recent call last):
  File "/opt/verl/verl/trainer/main_ppo.py", line 76, in run_ppo
    ray.get(main_task.remote(config))
ray.exceptions.WorkerCrashedError: The worker died unexpectedly while executing this task. Check python-core-worker-*.log files for more information.
"""
RAYLET_OOM = ("(raylet) [2026-01-10 03:31:17,902 E 3907 3907] (raylet) node_manager.cc:3069: 1 Workers (tasks / actors) "
              "killed due to memory pressure (OOM), 0 Workers crashed due to other reasons at node (ID: 4f0e)\n")  # fmt: skip


def test_a_dead_ray_worker_is_a_kill_not_a_python_error(tmp_path):
    r = diag(tmp_path, RAY_STEPS + "\n" + RAY_DIED)
    assert r["category"] == "killed_external", r["summary"]


def test_a_dead_ray_worker_with_the_raylet_memory_pressure_line_is_host_oom(tmp_path):
    r = diag(tmp_path, RAY_STEPS + "\n" + RAYLET_OOM + RAY_DIED)
    assert r["category"] == "host_oom", r["summary"]


def test_an_unhandled_actor_death_the_run_goes_on_after_is_healthy(tmp_path):
    text = (RAY_STEPS + "\n(TaskRunner pid=91022) Unhandled error (suppress with 'RAY_IGNORE_UNHANDLED_ERRORS=1'): "
            "ray::RateLimiter.acquire()\n(TaskRunner pid=91022) ray.exceptions.ActorDiedError: The actor died unexpectedly "
            "before finishing this task.\n" + RAY_STEPS.replace("step:", "step:1"))  # fmt: skip
    r = diag(tmp_path, text)
    assert r["category"] == "healthy", r["summary"]


def test_a_wrapper_repeating_a_childs_exit_status_is_not_the_cause(tmp_path):
    text = """
[2026-06-29 19:33:51,877] [INFO] [launch.py:428:sigkill_handler] Killing subprocess 2210553
[2026-06-29 19:33:51,878] [ERROR] [launch.py:434:sigkill_handler] ['python', '-u', 'main.py', '--local_rank=0'] exits with return code = 249
Traceback (most recent call last):
  File "train.py", line 176, in launch_cmd
    raise RuntimeError(msg)
RuntimeError: Step 1 exited with non-zero status 249
"""
    r = diag(tmp_path, text)
    assert r["category"] == "exit_nonzero", r["summary"]


def test_horovod_shutdown_on_the_surviving_ranks_is_not_an_abort(tmp_path):
    text = """
INFO:tensorflow:loss = 0.2387119, step = 200 (8.904 sec)
2026-07-30 06:41:52.525932: W tensorflow/core/framework/op_kernel.cc:1318] OP_REQUIRES failed at mpi_ops.cc:422 : Aborted: Horovod has been shut down. This was caused by an exception on one of the ranks.
--------------------------------------------------------------------------
mpirun.real detected that one or more processes exited with non-zero status, thus causing
the job to be terminated. The first process to do so was:

  Process name: [[41873,1],2]
  Exit code:    1
--------------------------------------------------------------------------
"""
    r = diag(tmp_path, text)
    assert r["category"] == "exit_nonzero", r["summary"]
    assert r["first_failure"]["rank"] == 2


def test_nccl_2_19_init_lines_give_the_process_its_rank(tmp_path):
    text = """
node1:2304:2343 [4] NCCL INFO ncclCommInitRank comm 0x98247f0 rank 12 nranks 16 cudaDev 4 nvmlDev 4 busId 96000 commId 0xa1 - Init COMPLETE
node1:2305:2344 [5] NCCL INFO ncclCommInitRank comm 0x98247f1 rank 13 nranks 16 cudaDev 5 nvmlDev 5 busId 97000 commId 0xa1 - Init COMPLETE
2026-04-01 09:14:31 | step 1 | loss 10.9162 | 1.91 s/it
node1:2304:2351 [4] transport/net_ib.cc:1696 NCCL WARN NET/IB : Got completion from peer 7.6.13.83<36315> with status=12 opcode=32698 len=32696 vendor err 129 (Send)
"""
    r = diag(tmp_path, text)
    assert r["category"] == "nccl_network", r["summary"]
    assert r["first_failure"]["rank"] == 12


def test_untimed_the_host_logged_first_failed_first_not_the_lowest_rank(tmp_path):
    text = """
gpu4:35902:35977 [0] NCCL INFO comm 0x7f1de8001af0 rank 0 nranks 8 cudaDev 0 nvmlDev 0 - Init COMPLETE
gpu5:35917:35994 [0] transport/net_ib.cu:788 NCCL WARN NET/IB : Got completion with error 12, opcode 1, len 0, vendor err 129
gpu4:35902:35977 [0] transport/net_ib.cu:788 NCCL WARN NET/IB : Got completion with error 12, opcode 1, len 0, vendor err 129
"""
    r = diag(tmp_path, text)
    assert r["category"] == "nccl_network", r["summary"]
    assert r["first_failure"]["host"] == "gpu5", r["first_failure"]


FIT = """
BEGIN fit on node-0412 at Wed Nov  1 06:12:02 CDT 2023
 Iteration 1:  alpha=0.1521  beta=3.0411
 Done with fit
done
"""


@pytest.mark.parametrize(("cancel_at", "want"), [("2023-11-02T06:12:11", "hang_no_error"),
                                                 ("2023-11-01T06:13:30", "killed_external")])  # fmt: skip
def test_a_printed_date_places_the_log_in_time_before_a_slurm_cancel(tmp_path, cancel_at, want):
    r = diag(tmp_path, FIT + f"slurmstepd: error: *** JOB 99 ON node-0412 CANCELLED AT {cancel_at} DUE TO TIME LIMIT ***\n")
    assert r["category"] == want, r["summary"]


def test_a_watcher_saying_the_log_is_unchanged_since_a_time_is_a_stall(tmp_path):
    bar = "\n".join(f"Epoch 0: :  18%|▏| {i}/100000 [03:{i % 60:02d}<29:10:00, reduced_train_loss=4.1, global_step={i}.000]"
                    for i in range(180, 192))  # fmt: skip
    r = diag(tmp_path, bar + "\n$ tail -c 300 train.log   # unchanged since 08:17\n")
    assert r["category"] == "hang_no_error", r["summary"]
    r = diag(tmp_path, bar + "\n")
    assert r["category"] == "healthy", r["summary"]


def test_an_exception_class_of_an_exc_module_is_the_error_whatever_its_name(tmp_path):
    text = """
[rank0]:[rank0]: Traceback (most recent call last):
[rank0]:[rank0]:   File "train.py", line 10, in <module>
[rank0]:[rank0]: torch._dynamo.exc.Unsupported: Attempted to call function marked as skipped
E0430 07:13:10.804000 55102 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: 1) local_rank: 0 (pid: 55179) of binary: /usr/bin/python
"""
    r = diag(tmp_path, text)
    assert r["category"] == "python_exception", r["summary"]
    assert "Unsupported" in r["first_failure"]["line"]


def test_slurmstepds_oom_kill_names_the_node_and_sruns_task_report_the_rank(tmp_path):
    text = """
2022-05-17 17:58:06,882 - mmdet - INFO - Saving checkpoint at 7 epochs
slurmstepd-gpu20-15: error: Detected 1 oom-kill event(s) in StepId=9411285.0. Some of your processes may have been killed by the cgroup out-of-memory handler.
srun: error: gpu20-15: task 0: Out Of Memory
slurmstepd-gpu20-15: error: *** STEP 9411285.0 ON gpu20-15 CANCELLED AT 2022-05-17T17:58:10 ***
"""
    r = diag(tmp_path, text)
    assert r["category"] == "host_oom", r["summary"]
    assert (r["first_failure"]["rank"], r["first_failure"]["host"]) == (0, "gpu20-15")


@pytest.mark.parametrize("sig", ["15", "Signals.SIGTERM"])
def test_the_launchers_death_signal_in_both_python_spellings_is_a_kill(tmp_path, sig):
    text = f"""
[2026-03-02 10:00:00] INFO step 10 loss 2.1
[2026-03-02 10:00:10] INFO step 20 loss 2.0
W0302 10:00:15.000 123 torch/distributed/elastic/agent/server/api.py:704] Received {sig} death signal, shutting down workers
"""
    r = diag(tmp_path, text)
    assert r["category"] == "killed_external", r["summary"]
