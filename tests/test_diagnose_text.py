"""classify_text: the one source of failure-text knowledge for the agent and the policy.

Every alternative of the three regexes it replaces is here as a realistic line, so nothing they
recognised is lost: the agent's PEER_LOSS (agent/elastic.py) -> peer_loss, the policy's
_HARDWARE_TEXT -> family "hardware", its _COMMUNICATION_TEXT -> family "communication"."""

from __future__ import annotations

import time

import pytest

from trainguard.diagnose import TextVerdict, classify_text
from trainguard.diagnose.rules import FAMILIES, builtin_rules

# PEER_LOSS = Connection closed by peer|Connection reset by peer|Broken pipe|remote process exited
#   |communicator was aborted|NCCL communicator.*abort|Socket Timeout|failed to recv, got 0 bytes  (IGNORECASE)
PEER_LOSS = [
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4312",
    "RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:48828: Connection reset by peer. This is typically caused by a remote worker hanging",
    "ConnectionResetError: [Errno 104] connection reset by peer",
    "BrokenPipeError: [Errno 32] Broken pipe",
    "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error, NCCL version 2.21.5",
    "[rank1]:[E1121 10:00:01.000000 ProcessGroupNCCL.cpp:1234] [PG 0 Rank 1] NCCL communicator was aborted on rank 1.",
    "RuntimeError: NCCL communicator encountered error; aborting",
    "RuntimeError: Socket Timeout",
    "torch.distributed.DistNetworkError: Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown or crash?",
    "2026-11-21T09:30:01.000000 [rank0]: RuntimeError: recvValue failed to recv, got 0 bytes",
]

# _HARDWARE_TEXT = uncorrectable ECC|ECC error|\bXid\b|fallen off the bus|GPU is lost|NVLink
#   |cudaErrorDevicesUnavailable|CUDA-capable device\(s\) is/are busy or unavailable
#   |CUDA error: unspecified launch failure  (IGNORECASE)
HARDWARE = [
    "RuntimeError: CUDA error: uncorrectable ECC error encountered",
    "RuntimeError: cuda runtime error (39) : uncorrectable ECC error encountered at /pytorch/aten/src/THC/THCCachingHostAllocator.cpp:265",
    "GPU 3: 2 ECC error(s) since driver load",
    "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.",
    "Xid 79 (GPU has fallen off the bus)",
    "NVRM: GPU at PCI:0000:02:00: GPU-8a1d has fallen off the bus.",
    "RuntimeError: CUDA error: GPU is lost",
    "NCCL WARN NVLink error detected on GPU 2",
    "RuntimeError: CUDA error: cudaErrorDevicesUnavailable",
    "RuntimeError: CUDA-capable device(s) is/are busy or unavailable",
    "RuntimeError: CUDA error: unspecified launch failure",
]

# _COMMUNICATION_TEXT = DistBackendError|DistNetworkError|DistStoreError|ProcessGroupNCCL|ProcessGroupGloo
#   |\bNCCL\b|\bnccl\w*Error|\bgloo\b|Connection (?:reset|closed|refused)|Broken pipe|ECONNRESET
#   |No route to host|Socket Timeout|Watchdog caught collective|collective operation timeout|timed out
#   |TCPStore|RendezvousError  (IGNORECASE), applied to the error message's head
COMMUNICATION = [
    "torch.distributed.DistBackendError: something went wrong in the backend",
    "torch.distributed.DistNetworkError: The client socket has timed out after 600000ms while trying to connect to (10.0.0.1, 29500).",
    "torch.distributed.DistStoreError: Timed out after 901 seconds waiting for clients. 1/3 clients joined.",
    "RuntimeError: ProcessGroupNCCL is only supported with GPUs, no GPUs found!",
    "RuntimeError: ProcessGroupGloo::allreduce: invalid tensor type",
    "RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error, NCCL version 2.18.1",
    "torch.distributed.DistBackendError: NCCL error: ncclInternalError: Internal check failed",
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv operation to complete",
    "RuntimeError: [enforce fail at ../third_party/gloo/gloo/transport/tcp/device.cc:83] ifa != nullptr. Unable to find address for: eth7",
    "RuntimeError: Connection refused",
    "RuntimeError: [1] TCPStore client failed: Connection refused",
    "OSError: [Errno 104] ECONNRESET while talking to the store",
    "node5:240:240 [6] misc/socket.cc:533 NCCL WARN socketPollConnect: Connect to 10.0.0.4<56849> returned 113(No route to host)",
    "RuntimeError: [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE) ran for 1800000 milliseconds",
    "RuntimeError: NCCL collective operation timeout after 30 minutes",
    "RuntimeError: Timed out waiting for the other ranks",
    "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError",
    "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d store has failed.",
]

USER = [
    "ZeroDivisionError: division by zero",
    "RuntimeError: injected failure at step 4 on rank 1",
    "AssertionError: x",
    "KeyError: 'backend'",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
    "RuntimeError: CUDA error: an illegal memory access was encountered",
]


@pytest.mark.parametrize("line", PEER_LOSS)
def test_every_peer_loss_text_is_a_peer_loss(line: str):
    v = classify_text([line])
    assert v.peer_loss, v
    assert v.family == "communication", v


@pytest.mark.parametrize("line", HARDWARE)
def test_every_hardware_text_is_hardware(line: str):
    v = classify_text([line])
    assert v.family == "hardware" and v.category == "gpu_hardware", v


@pytest.mark.parametrize("line", COMMUNICATION + PEER_LOSS)
def test_every_communication_text_is_communication(line: str):
    v = classify_text([line])
    assert v.family == "communication", v


@pytest.mark.parametrize("line", USER)
def test_user_errors_are_user_code_and_not_peer_loss(line: str):
    v = classify_text([line])
    assert v.family == "user_code" and not v.peer_loss, v


def test_application_xids_are_the_programs_fault_not_the_gpus():
    """A refinement over the old regex (any Xid = hardware): Xid 13/31/43 are the application's own
    faults in NVIDIA's Xid catalogue, hardware Xids (48, 79, 94 ...) stay hardware."""
    assert classify_text(["NVRM: Xid (PCI:0000:3b:00): 13, Graphics Exception"]).family == "user_code"
    assert classify_text(["NVRM: Xid (PCI:0000:3b:00): 48, DBE (double bit error)"]).family == "hardware"


def test_the_most_specific_line_of_a_tail_decides_and_prefixes_are_stripped():
    tail = [
        "2026-11-21T09:30:01.000000 [rank1]: step=3 rank=1",
        "2026-11-21T09:30:02.000000 [rank1]: Traceback (most recent call last):",
        '2026-11-21T09:30:02.000100 [rank1]:   File "train.py", line 9, in <module>',
        "2026-11-21T09:30:02.000200 [rank1]: RuntimeError: CUDA error: uncorrectable ECC error encountered",
        "2026-11-21T09:30:02.100000 [rank1]: RuntimeError: Connection reset by peer",
    ]
    v = classify_text(tail)
    assert v.family == "hardware" and v.peer_loss and "ECC" in (v.line or "")
    assert classify_text("\n".join(tail)) == v  # a string works the same as lines


def test_nothing_known_gives_an_empty_verdict():
    for text in ([], "", ["step=3 rank=0 loss=0.1"], ["hello"]):
        v = classify_text(text)
        assert v == TextVerdict(None, None, False, None, None, None)


# Categories that on purpose say nothing about the cause: the failure info decides (policy).
NO_FAMILY = {"dataloader"}


def test_every_category_has_a_family():
    rs = builtin_rules()
    failing = {r.category for r in rs.rules if r.role != "fact"} - NO_FAMILY
    assert all(rs.family_for(c) in FAMILIES for c in failing), {c: rs.family_for(c) for c in failing}
    assert all(rs.family_for(c) is None for c in NO_FAMILY)


def test_classify_text_is_fast_on_a_log_tail():
    tail = [
        f"2026-11-21T09:30:{i % 60:02d}.000000 [rank0]: step={i} rank=0 loss=0.1{i % 10}" for i in range(50)
    ]
    tail.append(
        "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4312"
    )
    classify_text(tail)  # warm: rules compiled once per process
    t0 = time.perf_counter()
    for _ in range(20):
        assert classify_text(tail).peer_loss
    per_call = (time.perf_counter() - t0) / 20
    print(f"classify_text on a 51-line tail: {per_call * 1e3:.2f} ms")  # measured, not asserted
