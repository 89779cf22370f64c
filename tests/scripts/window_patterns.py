"""Healthy work that outlasts --hang-detect-time, and the same shapes made dead: a tiny DDP job
(gloo, CPU) that runs DDP steps, one pattern, more steps, and ends (wait_patterns.main).

The healthy patterns are busy for ``--wait-s`` seconds (longer than the hang window under test)
without finishing a step: an evaluation with I/O, a CPU-only evaluation, a checkpoint written in
fsynced chunks, tokenising before the first step, pickling inside ``broadcast_object_list`` /
``all_gather_object``, an upload while the peer waits in the exit barrier or has left,
gradient accumulation, DataLoader workers decoding, an evaluator child computing, HF Trainer and
Lightning evaluation loops, torch.compile before the first step. None is a hang: the seed's rule
(no I/O anywhere in the job and flat utilisation) does not hold, or a rank progresses.

The faults are the same shapes made dead: a spin on one frame with no I/O (judged at the window,
as the seed says), a rank stopped mid-evaluation or mid-pickling, two threads each holding the
lock the other wants, a wait-for cycle through a FIFO and a pipe, DataLoader workers blocked on a
lock inherited locked at fork. A fault rank prints ``fault=<name> rank=<r> t=<unix time>`` just
before its wait becomes dead. FROZEN patterns are the held-out third (bench/hang.py reports them
on their own line). Loopback only; every loop bounded (--wait-s, 600 s for the faults).

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=... python window_patterns.py --pattern eval_io
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from wait_patterns import Ctx, Pattern, fault, finish, hf_trainer, http_upload, lightning_fit, main

FAULT_BOUND_S = 600.0  # a fault's dead wait ends by itself after this (the job is killed long before)

PATTERNS: dict[str, Pattern] = {
    # --- healthy: busy past the window ---------------------------------------------------------
    "eval_io": Pattern(True, None, False, "rank 0 evaluates (matmuls), a metric line fsynced per batch; rank 1 in a barrier"),
    "eval_cpu": Pattern(True, None, False, "every rank evaluates on CPU, no I/O, no collective: only the stack moves"),
    "slow_save": Pattern(True, None, False, "rank 0 writes a checkpoint in 1 MB fsynced chunks; rank 1 in a barrier"),
    "tokenise_first": Pattern(True, None, False, "every rank tokenises before its first step", before=0),
    "broadcast_pickle": Pattern(True, None, False, "rank 0 pickles a large object inside broadcast_object_list "
                                "(its __getstate__ computes) while rank 1 waits in the same call"),
    "exit_upload": Pattern(True, None, False, "after training rank 0 uploads at 40 KB/s; rank 1 waits in the exit "
                           "barrier", after=0),
    "grad_accum": Pattern(True, None, False, "every rank accumulates gradients (DDP no_sync) before one step"),
    "loader_decode": Pattern(True, None, False, "DataLoader workers decode (CPU) while rank 0 waits for batches"),
    "hf_eval_long": Pattern(True, None, False, "HF Trainer: rank 0's compute_metrics computes long; rank 1 waits in "
                            "the next step's collective"),
    "gather_pickle": Pattern(True, None, True, "rank 1's object pickles long inside all_gather_object; rank 0 "
                             "waits in the call"),
    "exit_upload_left": Pattern(True, None, True, "rank 1 finished and left; rank 0 uploads at 40 KB/s", after=0),
    "lightning_val_long": Pattern(True, None, True, "Lightning validation computes long on every rank"),
    "compile_first": Pattern(True, None, True, "every rank torch.compiles (recompiling) before its first step", before=0),
    "eval_child": Pattern(True, None, True, "rank 0 waits for an evaluator child that computes; rank 1 in a barrier"),
    # --- faults: the same shapes made dead -------------------------------------------------------
    "spin": Pattern(False, 0, False, "rank 0 spins on one line, no I/O; rank 1 in a barrier", at_window=True),
    "eval_stopped": Pattern(False, 0, False, "rank 0 stops (SIGSTOP) mid-evaluation; rank 1 in a barrier"),
    "thread_deadlock": Pattern(False, 0, False, "two threads of rank 0 each hold the lock the other waits for"),
    "pipe_cycle": Pattern(False, 1, False, "rank 1 reads a FIFO whose only writer (its child) is blocked writing to "
                          "a pipe only rank 1 reads"),
    "loader_fork_lock": Pattern(False, 0, False, "rank 0's DataLoader workers block on a lock inherited locked at fork"),
    "pickle_stopped": Pattern(False, 0, True, "rank 0 stops (SIGSTOP) inside __getstate__ of broadcast_object_list"),
    "spin_gather": Pattern(False, 1, True, "rank 1 spins on one line inside __getstate__ of all_gather_object",
                           at_window=True),
}


# --------------------------------------------------------------------------------------------
# work that moves


def _scores(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ x.T).mean(dim=1)


def _normalise(x: torch.Tensor) -> torch.Tensor:
    return (x - x.mean()) / (x.std() + 1e-6)


def evaluate(seconds: float, log: str | None = None) -> float:
    """Batches of real work (several functions: the stack moves) for ``seconds``; a metric line
    appended and fsynced per batch when ``log`` is given."""
    end = time.monotonic() + seconds
    total, batch = 0.0, 0
    f = open(log, "a") if log else None  # noqa: SIM115 (closed below)
    try:
        while time.monotonic() < end:
            x = _normalise(torch.randn(96, 96))
            total += float(_scores(x).sum())
            batch += 1
            if f is not None:
                f.write(f"batch={batch} score={total:.4f}\n")
                f.flush()
                os.fsync(f.fileno())
    finally:
        if f is not None:
            f.close()
    return total


def tokenise(seconds: float) -> int:
    """A pure-Python tokeniser over synthetic text (no I/O)."""
    words = [f"w{i % 977}x{i % 13}" for i in range(2000)]
    end = time.monotonic() + seconds
    vocab: dict[str, int] = {}
    n = 0
    while time.monotonic() < end:
        for w in words:
            ids = [vocab.setdefault(p, len(vocab)) for p in w.split("x")]
            n += len(ids)
    return n


class MergeIndex:
    """A large index whose pickling takes ``seconds`` of real work (or stops / spins, for faults)."""

    def __init__(self, seconds: float, how: str = "work", rank: int = 0) -> None:
        self.seconds, self.how, self.rank = seconds, how, rank

    def __getstate__(self) -> dict:
        if self.how == "stop":
            fault("pickle_stopped", self.rank)
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.how == "spin":
            fault("spin_gather", self.rank)
            end = time.monotonic() + FAULT_BOUND_S
            while time.monotonic() < end: pass  # noqa: E701 (one line: the stack never moves)
        else:
            tokenise(self.seconds)
        return {"seconds": self.seconds, "how": "done", "rank": self.rank}


# --------------------------------------------------------------------------------------------
# the patterns


def eval_io(c: Ctx) -> None:
    if c.rank == 0:
        evaluate(c.wait, os.path.join(c.tmp, "metrics.log"))


def eval_cpu(c: Ctx) -> None:
    evaluate(c.wait)


def slow_save(c: Ctx) -> None:
    if c.rank == 0:
        path = os.path.join(c.tmp, "model.ckpt")
        chunk = os.urandom(1 << 20)
        end = time.monotonic() + c.wait
        with open(path, "wb") as f:
            while time.monotonic() < end:
                f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
                time.sleep(0.05)  # slow storage
        os.unlink(path)


def tokenise_first(c: Ctx) -> None:
    tokenise(c.wait)


def broadcast_pickle(c: Ctx, how: str = "work") -> None:
    obj = [MergeIndex(c.wait, how, 0) if c.rank == 0 else None]
    dist.broadcast_object_list(obj, src=0)


def gather_pickle(c: Ctx, how: str = "work") -> None:
    out: list = [None] * dist.get_world_size()
    mine = MergeIndex(c.wait, how, 1) if c.rank == 1 else MergeIndex(0.0)
    dist.all_gather_object(out, mine)


def exit_upload(c: Ctx) -> None:
    http_upload(c)  # rank 0; rank 1 goes on to the exit barrier


def exit_upload_left(c: Ctx) -> None:
    if c.rank == 1:
        finish(c, barrier=False)  # finished: it leaves the job
    http_upload(c)
    finish(c, barrier=False)


def grad_accum(c: Ctx) -> None:
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                                                          torch.nn.Linear(128, 1)))  # fmt: skip
    end = time.monotonic() + c.wait
    with model.no_sync():  # accumulate locally: no all-reduce until the last micro-batch
        while time.monotonic() < end:
            model(torch.randn(32, 64)).square().mean().backward()
    model(torch.randn(32, 64)).square().mean().backward()


class Decoded(torch.utils.data.Dataset):
    """Each item takes real decoding work in the worker (``seconds``), or blocks on a lock that
    was held when the worker was forked (``forklock``)."""

    def __init__(self, seconds: float, forklock: threading.Lock | None = None) -> None:
        self.seconds, self.forklock = seconds, forklock

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.forklock is not None:
            self.forklock.acquire()  # held by a parent thread that does not exist in this child
        end = time.monotonic() + self.seconds
        x = torch.randn(64, 64)
        while time.monotonic() < end:
            x = torch.tanh(x @ x) + torch.randn(64, 64) * 0.01
        return x.sum(dim=0)


def loader_decode(c: Ctx) -> None:
    if c.rank == 0:
        dl = torch.utils.data.DataLoader(Decoded(c.wait / 2), batch_size=1, num_workers=2)
        for _ in dl:
            pass


def loader_fork_lock(c: Ctx) -> None:
    if c.rank != 0 or not c.live:
        return
    lock, taken, release = threading.Lock(), threading.Event(), threading.Event()

    def holder() -> None:  # e.g. a logging or metrics thread inside its critical section at fork time
        with lock:
            taken.set()
            release.wait(FAULT_BOUND_S)

    threading.Thread(target=holder, daemon=True).start()
    taken.wait(60)
    dl = torch.utils.data.DataLoader(Decoded(0.0, forklock=lock), batch_size=1, num_workers=2,
                                     multiprocessing_context="fork")  # fmt: skip
    it = iter(dl)
    fault("loader_fork_lock", 0)
    release.set()  # the parent's copy is released; the workers' copies never are
    next(it)


def _busy_child_code(seconds: float) -> str:
    return ("import time, math\n"
            f"end = time.monotonic() + {seconds}\n"
            "x = 0.0\n"
            "while time.monotonic() < end:\n"
            "    for i in range(10000): x += math.sin(i)\n")  # fmt: skip


def eval_child(c: Ctx) -> None:
    if c.rank == 0:
        subprocess.run([sys.executable, "-c", _busy_child_code(c.wait)], check=True, timeout=FAULT_BOUND_S)


def hf_eval_long(c: Ctx) -> None:
    """HF Trainer: rank 0's compute_metrics computes for ``--wait-s`` the first time, rank 1 goes
    on to the next step and waits there."""
    hf_trainer(c, lambda: evaluate(c.wait))


def lightning_val_long(c: Ctx) -> None:
    """A Lightning fit whose first validation computes for about ``--wait-s`` on every rank."""
    batches = 4
    lightning_fit(c, first_validation_step=lambda: evaluate(c.wait / batches), val_batches=batches)


def compile_first(c: Ctx) -> None:
    end = time.monotonic() + c.wait
    n = 8
    while time.monotonic() < end:
        fn = torch.compile(lambda x: (x.sin() @ x.cos().T).relu().sum(), dynamic=False)
        fn(torch.randn(n, 16))  # a new shape and a fresh cache each time: a full compile
        torch._dynamo.reset()
        n += 1


# --- faults ------------------------------------------------------------------------------------


def spin(c: Ctx) -> None:
    if c.rank == 0:
        fault("spin", 0)
        end = time.monotonic() + FAULT_BOUND_S
        while time.monotonic() < end: pass  # noqa: E701 (one line: the stack never moves)


def eval_stopped(c: Ctx) -> None:
    if c.rank == 0:
        evaluate(3.0)
        fault("eval_stopped", 0)
        os.kill(os.getpid(), signal.SIGSTOP)


def thread_deadlock(c: Ctx) -> None:
    if c.rank != 0:
        return
    a, b = threading.Lock(), threading.Lock()
    both = threading.Barrier(2)

    def other() -> None:
        with b:
            both.wait()
            a.acquire()  # the main thread holds a and waits for b

    threading.Thread(target=other, daemon=True).start()
    with a:
        both.wait()
        fault("thread_deadlock", 0)
        b.acquire()  # the other thread holds b and waits for a


def pipe_cycle(c: Ctx) -> None:
    """Rank 1 reads a FIFO whose only writer is its decoder child; the child first writes its
    diagnostics to a stderr pipe that only rank 1 reads, fills it and blocks: each waits for the
    other."""
    if c.rank != 1:
        return
    path = os.path.join(c.tmp, "frames.fifo")
    os.mkfifo(path, 0o600)
    code = ("import os, sys\n"
            f"fd = os.open({path!r}, os.O_WRONLY)\n"
            "sys.stderr.buffer.write(b'warning: slow frame\\n' * 100000)\n"  # 2 MB: the pipe holds 64 KB
            "sys.stderr.flush()\n"
            "os.write(fd, b'frame\\n')\n")  # fmt: skip
    child = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
    fd = os.open(path, os.O_RDONLY)  # the child opens the write end
    fault("pipe_cycle", 1)
    os.read(fd, 64)  # never: the child is blocked on its stderr, which only we read (after this)
    child.communicate(timeout=FAULT_BOUND_S)


WAITS: dict[str, Callable[[Ctx], None]] = {
    "eval_io": eval_io,
    "eval_cpu": eval_cpu,
    "slow_save": slow_save,
    "tokenise_first": tokenise_first,
    "broadcast_pickle": broadcast_pickle,
    "exit_upload": exit_upload,
    "grad_accum": grad_accum,
    "loader_decode": loader_decode,
    "hf_eval_long": hf_eval_long,
    "gather_pickle": gather_pickle,
    "exit_upload_left": exit_upload_left,
    "lightning_val_long": lightning_val_long,
    "compile_first": compile_first,
    "eval_child": eval_child,
    "spin": lambda c: spin(c) if c.live else None,
    "eval_stopped": lambda c: eval_stopped(c) if c.live else None,
    "thread_deadlock": lambda c: thread_deadlock(c) if c.live else None,
    "pipe_cycle": lambda c: pipe_cycle(c) if c.live else None,
    "loader_fork_lock": loader_fork_lock,
    "pickle_stopped": lambda c: broadcast_pickle(c, "stop") if c.live else None,
    "spin_gather": lambda c: gather_pickle(c, "spin") if c.live else None,
}
assert set(WAITS) == set(PATTERNS)


if __name__ == "__main__":
    sys.exit(main(PATTERNS, WAITS))
