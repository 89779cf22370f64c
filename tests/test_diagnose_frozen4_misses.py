"""The fifth rules pass (the misses of the burned frozen4 split, as general mechanisms): an epoch
bar at 100 % is not the run's end and a `tail -c` cut of the log's last line is a quote of it; a
capture of idle GPUs still holding memory, a store-based barrier's repeated waits and an inference
server's zero-work reports are stall evidence; NaN on a compound metric key ("triplet_loss=nan",
"nan loss detected"); /proc/vmstat's oom_kill counter as OOM evidence; "No rendezvous handler";
NCCL's missing-libibverbs warning is no failure; a time-limit cancel or the user's interrupt of a
job stalled at start is a hang. Each with the counter-case that must not change."""

from __future__ import annotations

from test_diagnose_stall_evidence import diag  # writes the files under tmp_path and diagnoses them


def _epoch(n: int, total: int) -> str:
    return (f"| epoch 001:  {n * 100 // total:3d}%|#         | {n}/{total} [1:00:00<00:00,  1.64it/s, loss=4.918, "
            f"nll_loss=3.818, ppl=14.10, wps=21831, num_updates={n}, lr=0.0005, gnorm=0.61, oom=0.000, wall={n * 3}]")  # fmt: skip


EPOCH = "".join(_epoch(n, 900) + "\n" for n in range(100, 901, 100))


def test_an_epoch_bar_at_100_percent_then_a_tail_cut_of_it_later_is_a_hang(tmp_path):
    cut = _epoch(900, 900)[-90:]
    check = f"$ date; tail -c 90 train.log\nFri Oct 18 09:12:40 IST 2019\n{cut}\n"
    r = diag(tmp_path, {"train.log": EPOCH, "check.txt": check})
    assert r["category"] == "hang_no_error", r["summary"]
    r = diag(tmp_path / "plain", {"train.log": EPOCH})  # no later look: an excerpt that ends
    assert r["category"] == "healthy", r["summary"]


def test_the_whole_runs_bar_at_its_total_is_the_end_even_with_a_later_look(tmp_path):
    bar = "".join(f"{i * 10:3d}%|#         | {i * 10}/100 [00:{i:02d}<00:10,  1.50it/s]\n" for i in range(1, 11))
    check = f"$ date; tail -1 train.log\nFri Oct 18 09:12:40 IST 2019\n{bar.splitlines()[-1]}\n"
    r = diag(tmp_path, {"train.log": bar, "check.txt": check})
    assert r["category"] == "healthy", r["summary"]


STEPS = "".join(f"(TaskRunner pid=201) step:{i} - actor/pg_loss:0.0019 - actor/grad_norm:0.13 - timing_s/step:240.1\n"
                for i in range(180, 196))  # fmt: skip


def test_a_capture_of_idle_gpus_still_holding_memory_is_a_hang(tmp_path):
    smi = "$ nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader\n" + "".join(
        f"{i}, 0 %, 61210 MiB\n" for i in range(8))
    r = diag(tmp_path, {"driver.log": STEPS, "check_later.txt": smi})
    assert r["category"] == "hang_no_error", r["summary"]
    one = "$ nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader\n0, 0 %, 512 MiB\n1, 97 %, 61210 MiB\n"
    r = diag(tmp_path / "busy", {"driver.log": STEPS, "smi.txt": one})  # one idle GPU among busy ones: no stall
    assert r["category"] == "healthy", r["summary"]


def test_repeated_store_based_barrier_waits_are_a_stall_and_one_is_not(tmp_path):
    wait = ("[2021-12-19 18:{m}:13,141][torch.distributed.distributed_c10d][INFO] - Waiting in store based barrier to "
            "initialize process group for rank: 0, key: store_based_barrier_key:1 (world_size=4, worker_count=1, timeout=0:30:00)\n")  # fmt: skip
    head = "initializing ddp: GLOBAL_RANK: 0, MEMBER: 1/4\n"
    r = diag(tmp_path, {"slurm.out": head + "".join(wait.format(m=m) for m in (10, 20, 30, 40))})
    assert r["category"] == "hang_no_error", r["summary"]
    after = "".join(f"Epoch 0: {i * 10:3d}%|#         | {i}/10 [00:{i:02d}<00:10, 1.1it/s, loss=0.{9 - i}, v_num=1]\n"
                    for i in range(1, 6))  # fmt: skip
    r = diag(tmp_path / "joined", {"slurm.out": head + wait.format(m=10) + after})
    assert r["category"] == "healthy", r["summary"]


def test_an_inference_server_reporting_no_work_again_and_again_is_a_stall(tmp_path):
    idle = ("INFO 12-08 2{h}:00:00 [metrics.py:406] Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: "
            "0.0 tokens/s, Running: 0 reqs, Swapped: 0 reqs, Pending: 0 reqs, GPU KV cache usage: 0.0%\n")  # fmt: skip
    train = "{'loss': 0.0213, 'grad_norm': 0.19, 'reward': 0.61, 'global_step/max_steps': '218/1400'}\n"
    r = diag(tmp_path, {"train.log": train, "rollout.log": "".join(idle.format(h=h) for h in range(4))})
    assert r["category"] == "hang_no_error", r["summary"]
    busy = idle.replace("generation throughput: 0.0", "generation throughput: 812.4").replace("Running: 0", "Running: 12")
    r = diag(tmp_path / "busy", {"train.log": train, "rollout.log": "".join(busy.format(h=h) for h in range(4))})
    assert r["category"] == "healthy", r["summary"]


def test_nan_on_a_compound_metric_key_and_nan_loss_detected(tmp_path):
    rows = "".join(f"[2023-05-02 09:1{i}:40] [INFO]: Iteration {i:05d}00, Cost 41.1s, triplet_loss={v}, softmax_loss={v}\n"
                   for i, v in enumerate(["0.69", "0.63", "nan", "nan", "nan"], 1))  # fmt: skip
    r = diag(tmp_path, {"train.log": rows})
    assert r["category"] == "nan_loss", r["summary"]
    r = diag(tmp_path / "fine", {"train.log": rows.replace("nan", "0.55")})
    assert r["category"] == "healthy", r["summary"]
    crash = ("  0%|          | 0/29316 [00:00<?, ?it/s]WARNING: nan loss detected, ending training\n"
             "Exception ignored in: <bound method tqdm.__del__ of   0%|          | 0/29316>\nTraceback (most recent call last):\n"
             "  File \"tqdm/_tqdm.py\", line 931, in __del__\nAttributeError: 'tqdm' object has no attribute 'last_vals'\n")  # fmt: skip
    r = diag(tmp_path / "yolo", {"train.log": crash})
    assert r["category"] == "nan_loss", r["summary"]
    r = diag(tmp_path / "scale", {"train.log": "step 10 loss_scale: nan skipped\n{'loss': 1.2, 'epoch': 0.1}\n"})
    assert r["category"] != "nan_loss", r["summary"]  # a loss scale is not the loss


KILLED = ("2024-08-07 19:13:40,331 [INFO] Quantising transformer. Using int8-quanto.\n"
          "subprocess.CalledProcessError: Command '['python3', 'train.py']' died with <Signals.SIGKILL: 9>.\n")  # fmt: skip


def test_the_vmstat_oom_kill_counter_turns_a_sigkill_into_host_oom(tmp_path):
    r = diag(tmp_path, {"train.log": KILLED, "memcheck.txt": "$ grep oom /proc/vmstat\noom_kill 3\n"})
    assert r["category"] == "host_oom", r["summary"]
    r = diag(tmp_path / "zero", {"train.log": KILLED, "memcheck.txt": "$ grep oom /proc/vmstat\noom_kill 0\n"})
    assert r["category"] == "killed_external", r["summary"]


def test_no_rendezvous_handler_and_the_libibverbs_warning(tmp_path):
    r = diag(tmp_path, {"train.log": "Traceback (most recent call last):\n  File \"main_moco.py\", line 118, in main_worker\n"
                        "RuntimeError: No rendezvous handler for ://\n"})  # fmt: skip
    assert r["category"] == "rendezvous_failure", r["summary"]
    log = ("ws-189:41822:41822 [0] misc/ibvwrap.cc:63 NCCL WARN Failed to open libibverbs.so[.1]\n"
           "ws-189:41822:41822 [0] NCCL INFO NET/Socket : Using [0]enp65s0f1:10.31.7.189<0>\n"
           + "".join(f"[01/01 14:{20 + i}:49 d2.utils.events]:  eta: 1 day, 18:16:19  iter: {i * 20 + 19}  total_loss: "
                     f"{1.9 - i * 0.04:.3f}  time: 1.9941  lr: 0.0051\n" for i in range(8)))  # fmt: skip
    r = diag(tmp_path / "ib", {"train.log": log})
    assert r["category"] == "healthy", r["summary"]
    # any other NCCL warning, as the log's last word after the progress, still counts
    r = diag(tmp_path / "ib2", {"train.log": log + "ws-189:41822:42033 [0] NCCL WARN NET/IB : Got async event : port error\n"})
    assert r["category"] == "nccl_network", r["summary"]


START = ("Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2\nAll distributed processes registered. Starting with 2 processes\n"
         "LOCAL_RANK: 0 - CUDA_VISIBLE_DEVICES: [0,1]\n")  # fmt: skip
LIMIT = "slurmstepd: error: *** JOB 8810442 ON gpu-c-031 CANCELLED AT 2024-05-20T23:59:12 DUE TO TIME LIMIT ***\n"


def test_a_time_limit_ending_a_job_that_never_stepped_is_a_hang(tmp_path):
    r = diag(tmp_path, {"slurm.out": START + LIMIT})
    assert r["category"] == "hang_no_error", r["summary"]
    steps = "".join(f"Epoch 0: {i * 10:3d}%|#         | {i}/10 [00:{i:02d}<00:10, 1.1it/s, loss=0.{9 - i}, v_num=1]\n"
                    for i in range(1, 6))  # fmt: skip
    r = diag(tmp_path / "working", {"slurm.out": START + steps + LIMIT})  # it was working when the limit came
    assert r["category"] == "killed_external", r["summary"]
