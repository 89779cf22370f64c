"""Write the hand-written cases of the diagnosis corpus (formats that need a GPU, several nodes or
the seed documents: NCCL/CUDA/Xid messages, Megatron and LLaMA-Factory logs). Real-run cases come
from make_corpus.py.   python tests/corpus/make_handwritten.py"""

import json
from pathlib import Path

C = Path(__file__).resolve().parent


def case(cat, name, files, expected, source):
    d = C / cat / name
    d.mkdir(parents=True, exist_ok=True)
    for fn, text in files.items():
        (d / fn).parent.mkdir(parents=True, exist_ok=True)
        (d / fn).write_text(text)
    (d / "expected.json").write_text(json.dumps({"source": source, **expected}, indent=1) + "\n")


def tg(rank, lines):  # trainguard per-rank format
    return "".join(f"{t} [rank{rank}]: {x}\n" for t, x in lines)


def steps(rank, start_s, n, first=1, dt=1.2, epoch=None):
    out = []
    for i in range(n):
        s = start_s + i * dt
        out.append(
            (
                f"2026-11-20T10:{int(s) // 60:02d}:{s % 60:09.6f}",
                f"iteration {first + i:>6}/ 100000 | consumed samples: {(first + i) * 256} | elapsed time per iteration (ms): {dt * 1000:.1f} | learning rate: 1.000E-04 | lm loss: 3.2{i % 10}E+00 |",
            )
        )
    return out


# 1. CUDA OOM on rank 2, NCCL watchdog timeouts on the others 10 minutes later (glog via torchrun prefixes)
files = {}
for r in range(4):
    lines = steps(r, 0, 20)
    if r == 2:
        lines += [
            ("2026-11-20T10:00:24.512331", "Traceback (most recent call last):"),
            (
                "2026-11-20T10:00:24.512400",
                '  File "/workspace/Megatron-LM/pretrain_gpt.py", line 243, in <module>',
            ),
            ("2026-11-20T10:00:24.512431", "    loss.backward()"),
            (
                "2026-11-20T10:00:24.513102",
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.50 GiB. GPU 2 has a total capacity of 79.10 GiB of which 1.21 GiB is free. Including non-PyTorch memory, this process has 77.88 GiB memory in use. Of the allocated memory 74.52 GiB is allocated by PyTorch, and 1.87 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
            ),
        ]
    else:
        lines += [
            (
                f"2026-11-20T10:10:25.001{r:03d}",
                f"[rank{r}]:E1120 10:10:25.001{r:03d} 4182 torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:632] [Rank {r}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=20481, OpType=ALLREDUCE, NumelIn=131072, NumelOut=131072, Timeout(ms)=600000) ran for 600088 milliseconds before timing out.",
            ),
            (
                f"2026-11-20T10:10:25.002{r:03d}",
                f"[rank{r}]:E1120 10:10:25.002{r:03d} 4182 torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1664] [PG 0 Rank {r}] Exception (either an error or timeout) detected by watchdog at work: 20481, last enqueued NCCL work: 20481, last completed NCCL work: 20480.",
            ),
            (
                f"2026-11-20T10:10:25.003{r:03d}",
                "terminate called after throwing an instance of 'c10::DistBackendError'",
            ),
        ]
    files[f"rank-{r}.log"] = tg(r, lines)
case(
    "cuda_oom",
    "oom_then_watchdog",
    files,
    {"category": "cuda_oom", "rank": 2, "line_contains": "CUDA out of memory"},
    "hand-written from torch 2.x OutOfMemoryError and ProcessGroupNCCL watchdog messages",
)

# 2. RoCE completion error (seed 000) on worker-1, two nodes' combined torchrun logs
w1 = [
    "[rank3]:modelarts-job-a7305e27-worker-1:1137:1197 [3] NCCL INFO Channel 00 : 11[5f000] -> 16[2d000] [send] via NET/IB/0/GDRDMA",
    "[rank3]:iteration     1200/  100000 | elapsed time per iteration (ms): 1201.3 | lm loss: 2.91E+00 |",
    "[rank3]:modelarts-job-a7305e27-worker-1:1137:1203 [3] transport/net_ib.cc:1295 NCCL WARN NET/IB : Got completion from peer 10.0.3.12<50313> with error 12, opcode 1, len 32478, vendor err 129 (Recv)",
    "[rank3]:modelarts-job-a7305e27-worker-1:1137:1203 [3] NCCL INFO transport/net.cc:1095 -> 6",
    "[rank3]:modelarts-job-a7305e27-worker-1:1137:1203 [3] NCCL INFO proxy.cc:859 -> 6",
    "[rank3]:RuntimeError: NCCL communicator was aborted on rank 3. Original reason for failure was: NCCL error: remote process exited or there was a network error, NCCL version 2.21.5",
    "[rank3]:ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.",
]
w2 = [
    "[rank12]:iteration     1200/  100000 | elapsed time per iteration (ms): 1199.8 | lm loss: 2.91E+00 |",
    "[rank12]:modelarts-job-a7305e27-worker-2:1141:1207 [4] NCCL INFO proxy.cc:859 -> 6",
    "[rank12]:modelarts-job-a7305e27-worker-2:1141:1207 [4] misc/socket.cc:47 NCCL WARN socketProgress: Connection closed by remote peer 10.0.3.11<44120>",
    "[rank12]:ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.",
]


def stamped(lines, base):
    return "".join(f"2026-11-20 10:20:{base + i:02d},{100 + i:03d} {x}\n" for i, x in enumerate(lines))


case(
    "nccl_network",
    "roce_completion_error",
    {"worker-1.log": stamped(w1, 10), "worker-2.log": stamped(w2, 12)},
    {
        "category": "nccl_network",
        "rank": 3,
        "host": "modelarts-job-a7305e27-worker-1",
        "line_contains": "Got completion",
        "fix_contains": ["NCCL_IB_GID_INDEX=3", "NCCL_IB_TC=128", "NCCL_IB_TIMEOUT=22"],
    },
    "hand-written from the seed 000 RoCE case and NCCL 2.21 net_ib warnings",
)

# 3. Xid 79 in syslog before the CUDA error in the rank log
case(
    "gpu_hardware",
    "xid79_fallen_off_bus",
    {
        "node-b/dmesg.log": "[Fri Nov 20 10:30:00 2026] systemd[1]: Started Session 12 of user root.\n"
        "[Fri Nov 20 10:30:41 2026] NVRM: GPU at PCI:0000:3b:00: GPU-4a1b2c3d-0000-1111-2222-333344445555\n"
        "[Fri Nov 20 10:30:41 2026] NVRM: Xid (PCI:0000:3b:00): 79, pid=48213, name=python, GPU has fallen off the bus.\n"
        "[Fri Nov 20 10:30:41 2026] NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.\n",
        "node-b/rank-5.log": tg(
            5,
            steps(5, 30 * 60, 10)
            + [
                ("2026-11-20T10:30:42.100001", "RuntimeError: CUDA error: unspecified launch failure"),
                (
                    "2026-11-20T10:30:42.100002",
                    "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.",
                ),
            ],
        ),
        "node-b/rank-4.log": tg(4, steps(4, 30 * 60, 10)),
    },
    {"category": "gpu_hardware", "host": "node-b", "line_contains": "Xid"},
    "hand-written from NVRM Xid 79 kernel messages (dmesg -T)",
)

# 4. device-side assert on rank 3
case(
    "cuda_error_other",
    "device_assert",
    {
        "rank-3.log": tg(
            3,
            steps(3, 0, 5)
            + [
                (
                    "2026-11-20T10:00:06.000100",
                    "../aten/src/ATen/native/cuda/Loss.cu:250: nll_loss_forward_reduce_cuda_kernel_2d: block: [0,0,0], thread: [5,0,0] Assertion `t >= 0 && t < n_classes` failed.",
                ),
                ("2026-11-20T10:00:06.000200", "Traceback (most recent call last):"),
                ("2026-11-20T10:00:06.000300", "RuntimeError: CUDA error: device-side assert triggered"),
                (
                    "2026-11-20T10:00:06.000400",
                    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
                ),
            ],
        ),
        "rank-0.log": tg(0, steps(0, 0, 5)),
    },
    {
        "category": "cuda_error_other",
        "rank": 3,
        "line_contains": "Assertion `t >= 0 && t < n_classes` failed",
    },
    "hand-written from torch CUDA device-side assert output",
)

# 5. NCCL watchdog on ranks 0,1,3; rank 2 silent (stuck)
files = {}
for r in range(4):
    lines = steps(r, 0, 12)
    if r != 2:
        lines.append(
            (
                f"2026-11-20T10:10:15.2000{r:02d}",
                f"[rank{r}]:[E1120 10:10:15.2000{r:02d} ProcessGroupNCCL.cpp:607] [Rank {r}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3011, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600021 milliseconds before timing out.",
            )
        )
    files[f"rank-{r}.log"] = tg(r, lines)
case(
    "nccl_timeout",
    "watchdog_rank2_silent",
    files,
    {"category": "nccl_timeout", "findings": ["suspect_ranks"], "suspects": [2]},
    "hand-written from ProcessGroupNCCL watchdog messages",
)

# 6. GDR on one node only (seed 000), no errors: hang before training
a = """modelarts-job-a7305e27-d1cf-4c71-ae6e-a12da6761d5a-worker-1:1136:1191 [2] NCCL INFO Channel 00 : 3[5f000] -> 10[5b000] [receive] via NET/IB/0/GDRDMA
modelarts-job-a7305e27-d1cf-4c71-ae6e-a12da6761d5a-worker-1:1140:1196 [6] NCCL INFO Channel 00 : 14[e1000] -> 15[e9000] via P2P/IPC
modelarts-job-a7305e27-d1cf-4c71-ae6e-a12da6761d5a-worker-1:1141:1187 [7] NCCL INFO Channel 00 : 15[e9000] -> 11[5f000] via P2P/IPC
modelarts-job-a7305e27-d1cf-4c71-ae6e-a12da6761d5a-worker-1:1138:1189 [4] NCCL INFO Channel 00 : 12[b5000] -> 14[e1000] via P2P/IPC
modelarts-job-a7305e27-d1cf-4c71-ae6e-a12da6761d5a-worker-1:1137:1197 [3] NCCL INFO Channel 00 : 11[5f000] -> 16[2d000] [send] via NET/IB/0/GDRDMA
"""
b = """modelarts-job-a7305e27-d1cf-4c71-ae6e-a12da6761d5a-worker-2:1139:1198 [2] NCCL INFO Channel 00 : 18[5b000] -> 19[5f000] via P2P/IPC
modelarts-job-a7305e27-d1cf-4c71-ae6e-a12da6761d5a-worker-2:1144:1200 [7] NCCL INFO Channel 00 : 23[e9000] -> 20[b5000] via P2P/IPC
modelarts-job-a7305e27-d1cf-4c71-ae6e-a12da6761d5a-worker-2:1142:1196 [5] NCCL INFO Channel 00 : 21[be000] -> 17[32000] via P2P/IPC
modelarts-job-a7305e27-d1cf-4c71-ae6e-a12da6761d5a-worker-2:1143:1194 [6] NCCL INFO Channel 00 : 22[e1000] -> 21[be000] via P2P/IPC
modelarts-job-a7305e27-d1cf-4c71-ae6e-a12da6761d5a-worker-2:1141:1191 [4] NCCL INFO Channel 00 : 20[b5000] -> 22[e1000] via P2P/IPC
"""
case(
    "hang_no_error",
    "gdr_on_one_node",
    {"node-a.log": a, "node-b.log": b},
    {"category": "hang_no_error", "findings": ["gdr_mismatch"], "fix_contains": ["NCCL_NET_GDR_LEVEL"]},
    "seed 000 (GDR on some nodes only), verbatim",
)

# 7. last epoch: ranks at epochs 48 and 49 (seed 000)
seed = """loss exit lane:0.12314446270465851
step loss is 0.29470521211624146
[2022-04-26 13:57:20,757][INFO][train_epoch]:Rank:2 Epoch:[48][20384/all] Data Time 0.000(0.000) Net Time 0.705(0.890) Loss 0.3403(0.3792)LR 0.00021887
[2022-04-26 13:57:20,757][INFO][train_epoch]:Rank:1 Epoch:[48][20384/all] Data Time 0.000(0.000) Net Time 0.705(0.891) Loss 0.3028(0.3466) LR 0.00021887
[2022-04-26 13:57:20,757][INFO][train_epoch]:Rank:4 Epoch:[49][20384/all] Data Time 0.000(0.147) Net Time 0.705(0.709) Loss 0.3364(0.3414)LR 0.00021887
[2022-04-26 13:57:20,758][INFO][train_epoch]:Rank:3 Epoch:[49][20384/all] Data Time 0.000 (0.115) Net Time 0.706(0.814) Loss 0.3345(0.3418) LR 0.00021887
[2022-04-26 13:57:20,758][INFO][train_epoch]:Rank:0 Epoch:[49][20384/all] Data Time 0.000(0.006) Net Time 0.704(0.885) Loss 0.2947(0.3566) LR 0.00021887
[2022-04-26 13:57:20,758][INFO][train_epoch]:Rank:7 Epoch:[49][20384/all] Data Time 0.001 (0.000) Net Time 0.706 (0.891) Loss 0.3782(0.3614) LR 0.00021887
[2022-04-26 13:57:20,759][INFO][train_epoch]:Rank:5 Epoch:[48][20384/all] Data Time 0.000(0.000) Net Time 0.706(0.891) Loss 0.5471(0.3642) LR 0.00021887
[2022-04-26 13:57:20,763][INFO][train_epoch]:Rank:6 Epoch:[49][20384/all] Data Time 0.000(0.000) Net Time 0.704(0.891) Loss 0.2643(0.3390)LR 0.00021887
stage 1 loss 0.4600560665130615 mul_cls_loss loss:0.01245919056236744 mul_offset_loss 0.44759687781333923 origin stage2_loss 0.048592399805784225
stage 1 loss:0.4600560665130615 stage 2 loss:0.048592399805784225 loss exit lane:0.10233864188194275
"""
case(
    "hang_no_error",
    "last_epoch_misaligned",
    {"train.log": seed},
    {"category": "hang_no_error", "findings": ["data_misaligned"], "ranks_behind": [1, 2, 5]},
    "seed 000 (last epoch), verbatim",
)

# 8. an error on rank 1 that did not end the job
lines1 = steps(1, 0, 8) + [
    ("2026-11-20T10:00:10.000100", "ERROR:train:batch failed, skipping"),
    ("2026-11-20T10:00:10.000200", "Traceback (most recent call last):"),
    ("2026-11-20T10:00:10.000300", '  File "train.py", line 88, in train_step'),
    ("2026-11-20T10:00:10.000400", "KeyError: 'input_ids'"),
]
lines1 += [
    (f"2026-11-20T10:{1 + i // 2:02d}:{(i % 2) * 30:02d}.000000", "waiting for next batch ...")
    for i in range(8)
]
case(
    "python_exception",
    "error_without_exit",
    {"rank-1.log": tg(1, lines1), "rank-0.log": tg(0, steps(0, 0, 8))},
    {
        "category": "python_exception",
        "rank": 1,
        "findings": ["error_without_exit"],
        "line_contains": "KeyError",
    },
    "hand-written (seed 000: one node errors but the job does not exit)",
)

# 9. Megatron slowdown with the seed's numbers
lines = []
for it in range(3, 93):
    ms = 3101.0 if it < 83 else (9465.0 if it < 88 else 16704.0)
    lines.append(
        f" iteration {it:>8}/  500000 | consumed samples: {it * 512:>10} | elapsed time per iteration (ms): {ms:.1f} | learning rate: 2.999E-04 | global batch size:   512 | lm loss: 2.4{it % 10}E+00 | loss scale: 1.0 | grad norm: 0.41 |\n"
    )
case(
    "slowdown",
    "megatron_seed_numbers",
    {"megatron.log": "".join(lines)},
    {
        "category": "slowdown",
        "warnings": [
            "Smoothed mean (iters 83-87: 9465.00 ms, baseline: 3101.00 ms), threshold ratio:2.05. Warning",
            "Smoothed mean (iters 88-92: 16704.00 ms, baseline: 3101.00 ms), threshold ratio:4.39. Warning",
        ],
    },
    "hand-written Megatron-LM iteration lines carrying the seed 003 step times",
)

# 10. LLaMA-Factory trainer_log.jsonl slowdown
rows, el = [], 0
for s in range(5, 205, 5):
    el += 5 * (2 if s <= 150 else 5)
    rows.append(
        json.dumps(
            {
                "current_steps": s,
                "total_steps": 1000,
                "loss": 1.2,
                "lr": 1e-5,
                "epoch": s / 1000,
                "percentage": s / 10,
                "elapsed_time": f"{el // 3600}:{el % 3600 // 60:02d}:{el % 60:02d}",
                "remaining_time": "1:00:00",
            }
        )
    )
case(
    "slowdown",
    "llamafactory_jsonl",
    {"trainer_log.jsonl": "\n".join(rows) + "\n"},
    {"category": "slowdown"},
    "hand-written LLaMA-Factory trainer_log.jsonl rows",
)

# 11. env:// without MASTER_ADDR
case(
    "rendezvous_failure",
    "master_addr_missing",
    {
        "rank-0.log": tg(
            0,
            [
                ("2026-11-20T09:00:00.000001", "Traceback (most recent call last):"),
                ("2026-11-20T09:00:00.000002", '  File "train.py", line 12, in <module>'),
                (
                    "2026-11-20T09:00:00.000003",
                    "ValueError: Error initializing torch.distributed using env:// rendezvous: environment variable MASTER_ADDR expected, but not set",
                ),
            ],
        )
    },
    {"category": "rendezvous_failure", "rank": 0},
    "hand-written from torch's env:// rendezvous error (seed 000: master_ip/rank not passed)",
)
print("ok")
