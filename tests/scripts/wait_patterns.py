"""Long waits from real usage, healthy and dead: a tiny DDP job (gloo, CPU) that runs
--steps-before steps, one wait pattern, --steps-after steps, and ends.

Healthy patterns wait on the outside world and come back (downloads at 40 KB/s from a local slow
server, uploads, children that idle, sleeps, files, locks held by others, recompiles, long
accumulation, DataLoader workers at an epoch boundary, a slow sync): none is a hang. Fault
patterns are the same waits made dead (the server frozen, the child stopped, a recv nobody
sends, a pipe nobody else can write, a lock the rank holds itself ...): each is a hang with a
known culprit. A fault rank prints ``fault=<name> rank=<r> t=<unix time>`` just before its wait
becomes dead; every rank prints ``step=<n> rank=<r> t=<t>`` after each step and ``done rank=<r>``.

PATTERNS holds each pattern's kind, culprit and whether it is FROZEN: the frozen third is kept
out of sight while the detector is tuned and reported on its own line (bench/hang.py). Faults
happen on the first attempt only (TRAINGUARD_RESTART_COUNT 0). Loopback only; every wait bounded
(--wait-s, helpers end after 300 s).

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=... python wait_patterns.py --pattern http_download
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from http.client import HTTPConnection

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "wait_helper.py")


@dataclass(frozen=True)
class Pattern:
    healthy: bool
    culprit: int | None  # the rank a fault's verdict must name (None: healthy)
    frozen: bool  # the held-out split: not looked at while the detector is tuned
    what: str
    before: int | None = None  # DDP steps before the wait (None: --steps-before)
    after: int | None = None  # ... and after it (None: --steps-after)
    at_window: bool = False  # a fault only the window can judge (a spin): detected at --hang-detect-time


PATTERNS: dict[str, Pattern] = {
    # --- healthy: waits on the outside world that end -------------------------------------------
    "http_download": Pattern(True, None, False, "rank 0 downloads over HTTP at 40 KB/s, rank 1 in a barrier"),
    "socket_stream": Pattern(True, None, True, "rank 0 reads a raw socket stream at 4 KB/s, rank 1 in a barrier"),
    "http_upload": Pattern(True, None, False, "rank 0 uploads over HTTP to a sink reading 40 KB/s, rank 1 in a barrier"),
    "child_idle": Pattern(True, None, False, "rank 0 waits in subprocess.run for an uploader child that idles"),
    "child_download": Pattern(True, None, True, "rank 0 waits for a child that downloads at 40 KB/s"),
    "all_sleep": Pattern(True, None, False, "every rank sleeps (rate-limited API), no collective in flight"),
    "rank0_sleep": Pattern(True, None, True, "rank 0 sleeps in one call (rate limit), rank 1 in a barrier"),
    "file_wait": Pattern(True, None, False, "rank 0 polls for a file another process writes late"),
    "flock_wait": Pattern(True, None, False, "rank 0 waits on a flock another process holds"),
    "select_pipe": Pattern(True, None, True, "rank 0 select()s on a FIFO another process trickles into"),
    "thread_lock": Pattern(True, None, False, "rank 0's main thread waits on a lock its worker thread holds"),
    "compile": Pattern(True, None, True, "every rank torch.compiles, then recompiles on new shapes"),
    "fsdp2_accum": Pattern(True, None, False, "FSDP2 with a long gradient accumulation window"),
    "loader_persistent": Pattern(True, None, True, "persistent DataLoader workers block on a slow source at an epoch"),
    "slow_sync": Pattern(True, None, False, "rank 0 writes and os.sync()s repeatedly, rank 1 in a barrier"),
    "event_wait": Pattern(True, None, False, "every rank waits on an Event a background thread sets late"),
    "hf_eval": Pattern(True, None, False, "HF Trainer evaluation: rank 0's metric calls a slow scoring service, "
                       "rank 1 waits in the next step's collective"),
    "lightning_val": Pattern(True, None, True, "Lightning validation: rank 0 runs an evaluator child that idles, "
                             "rank 1 waits in the next collective"),
    # Async collectives (FSDP's prefetch, comm hooks, overlapped metrics): rank 0 waits in
    # Work.wait() on a C++ condition its backend's thread releases, while rank 1 is late to join.
    "async_peer_pause": Pattern(True, None, False, "rank 0 in Work.wait() of an async all_reduce while rank 1 "
                                "pauses in its own code (sleeps) before joining it"),
    "async_peer_busy": Pattern(True, None, True, "rank 0 in Work.wait() of an async all_reduce while rank 1 "
                               "computes (busy) before joining it"),
    "server_stall": Pattern(True, None, False, "rank 0's HTTP request: the server accepts and sends nothing for "
                            "the whole wait, then answers"),
    # --- faults: the same waits made dead ---------------------------------------------------------
    "http_server_stopped": Pattern(False, 0, False, "the HTTP server freezes mid-download (SIGSTOP)"),
    "stream_peer_stopped": Pattern(False, 0, True, "the raw stream's server freezes (SIGSTOP)"),
    "child_stopped": Pattern(False, 0, False, "rank 0's child stops (SIGSTOP) while rank 0 waits for it"),
    "p2p_recv": Pattern(False, 1, False, "rank 1 in dist.recv(src=0) that is never sent, rank 0 in all_reduce"),
    "rank_stopped": Pattern(False, 1, True, "rank 1 stops (SIGSTOP) while rank 0 waits in a barrier"),
    "async_peer_stopped": Pattern(False, 1, False, "rank 1 stops (SIGSTOP) while rank 0 waits in Work.wait() of "
                                  "an async all_reduce"),
    "pipe_no_writer": Pattern(False, 0, False, "rank 0 reads a pipe whose only writer is itself"),
    "own_lock": Pattern(False, 0, False, "rank 0 re-acquires a threading.Lock it holds"),
    "flock_holder_stopped": Pattern(False, 0, True, "the flock holder freezes (SIGSTOP)"),
    "writer_stopped": Pattern(False, 0, False, "the FIFO's writer freezes (SIGSTOP) while rank 0 select()s"),
    "flock_self": Pattern(False, 0, False, "rank 0 flocks one file through two open files"),
    "loader_worker_stopped": Pattern(False, 0, True, "rank 0's persistent DataLoader worker stops (SIGSTOP)"),
    "hf_eval_server_stopped": Pattern(False, 0, False, "HF Trainer evaluation: the scoring service freezes mid-answer"),
    "lightning_val_child_stopped": Pattern(False, 0, True, "Lightning validation: the evaluator child stops (SIGSTOP)"),
    "stall_server_stopped": Pattern(False, 0, False, "the stalling server freezes (SIGSTOP), its connection open"),
}


def attempt() -> int:
    return int(os.environ.get("TRAINGUARD_RESTART_COUNT") or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def fault(name: str, rank: int) -> None:
    print(f"fault={name} rank={rank} t={time.time():.6f}", flush=True)


def helper(*args: str) -> tuple[int, int]:
    """Start a detached wait_helper.py; (its pid, its port)."""
    p = subprocess.Popen([sys.executable, HELPER, *args, "--detach"], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    p.wait(timeout=60)
    fields = dict(kv.split("=") for kv in line.split()[1:])
    HELPERS.append(int(fields["pid"]))
    return int(fields["pid"]), int(fields["port"])


HELPERS: list[int] = []  # detached helpers started here: killed when the pattern ends


def kill_helpers() -> None:
    for pid in HELPERS:
        try:
            os.kill(pid, signal.SIGKILL)  # a stopped one too
        except ProcessLookupError:
            pass


@dataclass
class Ctx:
    rank: int
    wait: float
    tmp: str  # a directory shared by the ranks (same MASTER_PORT)
    live: bool  # a fault pattern on its faulty attempt
    step: int = 0  # steps done so far: a framework's steps go on from here (and print step= lines)


# --------------------------------------------------------------------------------------------
# the waits (rank 0 waits, rank 1 meets it in a barrier afterwards, unless said otherwise)


def download(url: str, name: str = "", rank: int = 0) -> int:
    n = 0
    with urllib.request.urlopen(url, timeout=600) as resp:
        if name:
            fault(name, rank)
        while chunk := resp.read(8192):
            n += len(chunk)
    return n


def http_download(c: Ctx, stop: bool = False) -> None:
    if c.rank == 0:
        extra = ["--stop-after", "100000"] if stop else []
        _, port = helper("http", "--rate", "40000", "--seconds", str(c.wait), *extra)
        download(f"http://127.0.0.1:{port}/shard", "http_server_stopped" if stop else "")


def socket_stream(c: Ctx, stop: bool = False) -> None:
    if c.rank == 0:
        extra = ["--stop-after", "8000"] if stop else []
        _, port = helper("stream", "--rate", "4000", "--seconds", str(c.wait), *extra)
        with socket.create_connection(("127.0.0.1", port)) as s:
            if stop:
                fault("stream_peer_stopped", 0)
            buf = bytearray(4096)
            while s.recv_into(buf):
                pass


def http_upload(c: Ctx) -> None:
    if c.rank == 0:
        _, port = helper("sink", "--rate", "40000", "--seconds", str(c.wait))
        body = b"y" * int(40000 * c.wait)
        conn = HTTPConnection("127.0.0.1", port, timeout=600)
        conn.request("POST", "/upload", body=body)
        conn.getresponse().read()
        conn.close()


def child(c: Ctx, code: str, name: str = "") -> None:
    if c.rank == 0:
        if name:
            fault(name, 0)
        subprocess.run([sys.executable, "-c", code], check=True, timeout=600)


def child_idle(c: Ctx) -> None:
    child(c, f"import time; time.sleep({c.wait})")  # an uploader waiting on a remote service


def child_download(c: Ctx) -> None:
    if c.rank == 0:
        _, port = helper("http", "--rate", "40000", "--seconds", str(c.wait))
        child(c, f"import urllib.request as u; u.urlopen('http://127.0.0.1:{port}/x', timeout=600).read()")


def child_stopped(c: Ctx) -> None:
    child(c, "import os, signal, time; time.sleep(1); os.kill(os.getpid(), signal.SIGSTOP)", "child_stopped")


def all_sleep(c: Ctx) -> None:
    time.sleep(c.wait)


def rank0_sleep(c: Ctx) -> None:
    if c.rank == 0:
        time.sleep(c.wait)


def file_wait(c: Ctx) -> None:
    if c.rank == 0:
        path = os.path.join(c.tmp, "ready.flag")
        helper("touch", "--path", path, "--seconds", str(c.wait))
        deadline = time.monotonic() + 600
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.5)


def flock_wait(c: Ctx, stop: bool = False) -> None:
    if c.rank == 0:
        path = os.path.join(c.tmp, "shared.lock")
        extra = ["--stop-after", "1"] if stop else []
        helper("flock", "--path", path, "--seconds", str(c.wait), *extra)
        with open(path, "a+") as f:
            if stop:
                fault("flock_holder_stopped", 0)
            fcntl.flock(f, fcntl.LOCK_EX)


def flock_self(c: Ctx) -> None:
    if c.rank == 0:
        path = os.path.join(c.tmp, "self.lock")
        with open(path, "a+") as a, open(path, "a+") as b:
            fcntl.flock(a, fcntl.LOCK_EX)
            fault("flock_self", 0)
            fcntl.flock(b, fcntl.LOCK_EX)  # another open file description: blocks on our own lock


def select_pipe(c: Ctx, stop: bool = False) -> None:
    if c.rank == 0:
        path = os.path.join(c.tmp, "events.fifo")
        os.mkfifo(path)
        extra = ["--stop-after", "0"] if stop else []
        helper("writer", "--path", path, "--seconds", str(c.wait), *extra)
        fd = os.open(path, os.O_RDONLY)
        if stop:
            fault("writer_stopped", 0)
        got = b""
        while got.count(b"\n") < 4:
            ready, _, _ = select.select([fd], [], [])
            data = os.read(fd, 4096) if ready else b""
            if not data:
                break
            got += data
        os.close(fd)


def pipe_no_writer(c: Ctx) -> None:
    if c.rank == 0:
        r, w = os.pipe()  # the write end stays open here: read() never sees EOF and nobody writes
        fault("pipe_no_writer", 0)
        os.read(r, 1)


def thread_lock(c: Ctx) -> None:
    if c.rank == 0:
        lock, held = threading.Lock(), threading.Event()

        def worker() -> None:
            with lock:
                held.set()
                time.sleep(c.wait)  # e.g. a background uploader holding the checkpoint lock

        t = threading.Thread(target=worker, daemon=True)
        t.start()
        held.wait(60)
        with lock:
            pass
        t.join()


def own_lock(c: Ctx) -> None:
    if c.rank == 0:
        lock = threading.Lock()
        lock.acquire()
        fault("own_lock", 0)
        lock.acquire()  # not reentrant, and no other thread could release it


def event_wait(c: Ctx) -> None:
    done = threading.Event()
    threading.Thread(target=lambda: (time.sleep(c.wait), done.set()), daemon=True).start()
    done.wait(c.wait + 600)


def slow_sync(c: Ctx) -> None:
    if c.rank == 0:
        path = os.path.join(tempfile.gettempdir(), f"tg-sync-{os.getpid()}.bin")
        deadline = time.monotonic() + c.wait
        try:
            with open(path, "wb") as f:
                while time.monotonic() < deadline:
                    f.write(os.urandom(1 << 20))
                    f.flush()
                    os.sync()
                    time.sleep(0.2)
        finally:
            os.unlink(path)


def compile_(c: Ctx) -> None:
    fn = torch.compile(lambda x: (x.sin() @ x.cos().T).relu().sum(), dynamic=False)
    deadline = time.monotonic() + c.wait
    n = 8
    while time.monotonic() < deadline and n < 11:  # at most 3 compiles: each takes long on a busy CPU
        fn(torch.randn(n, 16))  # a new shape every call: a recompile each time (until the cache limit)
        n += 1
        if n % 8 == 0:
            torch._dynamo.reset()  # past dynamo's recompile limit it would fall back to eager


def fsdp2_accum(c: Ctx) -> None:
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    deadline = time.monotonic() + c.wait
    model.set_requires_gradient_sync(False)  # accumulate locally: no reduce-scatter until the last micro-batch
    more = torch.ones(1)
    while more.item():  # as many micro-batches on every rank (rank 0's clock decides)
        model(torch.randn(32, 64)).square().mean().backward()
        more.fill_(float(c.rank == 0 and time.monotonic() < deadline))
        dist.all_reduce(more)
    model.set_requires_gradient_sync(True)
    model(torch.randn(32, 64)).square().mean().backward()
    opt.step()


class SlowSource(torch.utils.data.Dataset):
    """The first item of epoch 1 blocks (a slow remote source); a stop flag freezes the worker."""

    def __init__(self, wait: float, stop: bool) -> None:
        self.wait, self.stop, self.epoch = wait, stop, torch.zeros(1, dtype=torch.int64).share_memory_()

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 0 and int(self.epoch) == 1:
            if self.stop:
                os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(self.wait)
        return torch.randn(8)


def loader(c: Ctx, stop: bool = False) -> None:
    data = SlowSource(c.wait, stop and c.rank == 0)
    dl = torch.utils.data.DataLoader(data, batch_size=4, num_workers=1, persistent_workers=True)
    for epoch in range(2):
        data.epoch.fill_(epoch)
        if epoch == 1 and stop and c.rank == 0:
            fault("loader_worker_stopped", 0)
        for _ in dl:
            pass


def server_stall(c: Ctx, stop: bool = False) -> None:
    if c.rank == 0:
        extra = ["--stop-after", "0"] if stop else []  # freezes right after reading the request
        _, port = helper("stall", "--seconds", str(c.wait), *extra)
        if stop:
            fault("stall_server_stopped", 0)
        download(f"http://127.0.0.1:{port}/answer")


def step_line(c: Ctx) -> None:
    c.step += 1
    print(f"step={c.step} rank={c.rank} t={time.time():.6f}", flush=True)


def hf_eval(c: Ctx, stop: bool = False) -> None:
    """A Hugging Face Trainer (tiny GPT-2 from a config, no downloads) that evaluates every 3
    steps; rank 0's compute_metrics scores the gathered predictions with a slow remote service the
    first time, while rank 1 goes on to the next step and waits there in its collective."""
    port = 0
    if c.rank == 0:
        extra = ["--stop-after", "100000"] if stop else []
        _, port = helper("http", "--rate", "40000", "--seconds", str(c.wait), *extra)
    hf_trainer(c, lambda: download(f"http://127.0.0.1:{port}/score", "hf_eval_server_stopped" if stop else ""))


def hf_trainer(c: Ctx, first_metrics: Callable[[], object]) -> None:
    """A Hugging Face Trainer (tiny GPT-2 from a config) evaluating every 3 steps; rank 0's
    compute_metrics runs ``first_metrics`` the first time."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from token_data import Tokens
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    scored: list[object] = []

    def metrics(pred) -> dict:
        if c.rank == 0 and not scored:
            scored.append(first_metrics())
        return {"n": float(len(pred.label_ids))}

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_line(c)

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=128, n_positions=16,
                                       bos_token_id=0, eos_token_id=0))  # fmt: skip
    targs = TrainingArguments(
        output_dir=os.path.join(c.tmp, f"hf-{c.rank}"), max_steps=6, eval_strategy="steps", eval_steps=3,
        save_strategy="no", per_device_train_batch_size=4, per_device_eval_batch_size=8, report_to=[],
        use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0, disable_tqdm=True, logging_steps=100,
    )  # fmt: skip
    Trainer(model=model, args=targs, train_dataset=Tokens(64), eval_dataset=Tokens(16), compute_metrics=metrics,
            callbacks=[Steps()]).train()  # fmt: skip


def lightning_val(c: Ctx, stop: bool = False) -> None:
    """A Lightning fit (DDP on the job's gloo group) that validates every 3 steps with a synced
    metric; at the end of the first validation rank 0 runs an evaluator CLI (a child that waits on
    a remote service) while rank 1 waits in the next collective."""

    def after_first_validation() -> None:
        if c.rank == 0:
            child_stopped(c) if stop else child_idle(c)

    lightning_fit(c, after_first_validation)


def lightning_fit(c: Ctx, after_first_validation: Callable[[], None] = lambda: None,
                  first_validation_step: Callable[[], None] = lambda: None, val_batches: int = 2) -> None:  # fmt: skip
    """A Lightning fit (DDP on the job's gloo group), validating every 3 steps with a synced
    metric; the hooks run during (each batch) and after the first validation."""
    import lightning.pytorch as pl

    evaluated: list[bool] = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            if not evaluated:
                first_validation_step()
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]), sync_dist=True)

        def on_validation_epoch_end(self) -> None:
            if not evaluated:
                evaluated.append(True)
                after_first_validation()

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            step_line(c)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    trainer = pl.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy="ddp", max_steps=6,
                         val_check_interval=3, limit_val_batches=val_batches, num_sanity_val_steps=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=os.path.join(c.tmp, f"pl-{c.rank}"))  # fmt: skip
    loader = functools.partial(torch.utils.data.DataLoader, data, batch_size=8)
    trainer.fit(Module(), loader(), loader())


def p2p_recv(c: Ctx) -> None:
    t = torch.zeros(4)
    if c.rank == 1:
        fault("p2p_recv", 1)
        dist.recv(t, src=0)  # rank 0 never sends: it went on to the all-reduce
    else:
        dist.all_reduce(t)


def rank_stopped(c: Ctx, name: str = "rank_stopped") -> None:
    if c.rank == 1:
        fault(name, 1)
        os.kill(os.getpid(), signal.SIGSTOP)


def async_all_reduce(c: Ctx, late: Callable[[], None]) -> None:
    """Both ranks all-reduce asynchronously; rank 1 does ``late`` first, rank 0 waits in Work.wait()."""
    t = torch.ones(1024)
    if c.rank == 1:
        late()
    work = dist.all_reduce(t, async_op=True)
    work.wait()


def busy_for(seconds: float) -> None:
    end = time.monotonic() + seconds
    x = torch.randn(64, 64)
    while time.monotonic() < end:
        x = torch.tanh(x @ x)


WAITS: dict[str, Callable[[Ctx], None]] = {
    "http_download": http_download,
    "socket_stream": socket_stream,
    "http_upload": http_upload,
    "child_idle": child_idle,
    "child_download": child_download,
    "all_sleep": all_sleep,
    "rank0_sleep": rank0_sleep,
    "file_wait": file_wait,
    "flock_wait": flock_wait,
    "select_pipe": select_pipe,
    "thread_lock": thread_lock,
    "compile": compile_,
    "fsdp2_accum": fsdp2_accum,
    "loader_persistent": loader,
    "slow_sync": slow_sync,
    "event_wait": event_wait,
    "hf_eval": hf_eval,
    "lightning_val": lightning_val,
    "server_stall": server_stall,
    "async_peer_pause": lambda c: async_all_reduce(c, lambda: time.sleep(c.wait)),
    "async_peer_busy": lambda c: async_all_reduce(c, lambda: busy_for(c.wait)),
    "http_server_stopped": lambda c: http_download(c, stop=c.live),
    "stream_peer_stopped": lambda c: socket_stream(c, stop=c.live),
    "child_stopped": lambda c: child_stopped(c) if c.live else child_idle(c),
    "p2p_recv": lambda c: p2p_recv(c) if c.live else None,
    "rank_stopped": lambda c: rank_stopped(c) if c.live else None,
    "async_peer_stopped": lambda c: async_all_reduce(c, lambda: rank_stopped(c, "async_peer_stopped") if c.live else None),
    "pipe_no_writer": lambda c: pipe_no_writer(c) if c.live else None,
    "own_lock": lambda c: own_lock(c) if c.live else None,
    "flock_holder_stopped": lambda c: flock_wait(c, stop=c.live),
    "writer_stopped": lambda c: select_pipe(c, stop=c.live),
    "flock_self": lambda c: flock_self(c) if c.live else None,
    "loader_worker_stopped": lambda c: loader(c, stop=c.live),
    "hf_eval_server_stopped": lambda c: hf_eval(c, stop=c.live),
    "lightning_val_child_stopped": lambda c: lightning_val(c, stop=c.live),
    "stall_server_stopped": lambda c: server_stall(c, stop=c.live),
}
assert set(WAITS) == set(PATTERNS)


def main(patterns: dict[str, Pattern] = PATTERNS, waits: dict[str, Callable[[Ctx], None]] = WAITS) -> int:
    """Run one pattern of ``patterns`` (``waits``: its code) between two runs of DDP steps."""
    p = argparse.ArgumentParser()
    p.add_argument("--pattern", required=True, choices=sorted(patterns))
    p.add_argument("--wait-s", type=float, default=40.0)
    p.add_argument("--steps-before", type=int, default=15)
    p.add_argument("--steps-after", type=int, default=5)
    p.add_argument("--step-time-ms", type=float, default=50.0)
    args = p.parse_args()
    pattern = patterns[args.pattern]
    before = args.steps_before if pattern.before is None else pattern.before
    after = args.steps_after if pattern.after is None else pattern.after
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctx = None  # set below (the frameworks' steps go on from the loop's)
    step = 0

    def train(n: int) -> None:
        nonlocal step
        step = max(step, ctx.step if ctx else 0)
        for _ in range(n):
            t0 = time.perf_counter()
            opt.zero_grad()
            model(torch.randn(8, 16)).square().mean().backward()  # DDP's all-reduce
            opt.step()
            step += 1
            time.sleep(max(0.0, args.step_time_ms / 1000 - (time.perf_counter() - t0)))
            print(f"step={step} rank={rank} t={time.time():.6f}", flush=True)

    # A directory both ranks know (one per job: the rendezvous port is the job's), in the run dir
    # when there is one: a fault's job is killed before it could remove the directory itself.
    base = os.environ.get("TRAINGUARD_RUN_DIR") or tempfile.gettempdir()
    tmp = os.path.join(base, f"tg-waits-{os.environ['MASTER_PORT']}")
    os.makedirs(tmp, exist_ok=True)
    ctx = Ctx(rank, args.wait_s, tmp, live=not pattern.healthy and attempt() == 0)
    train(before)
    ctx.step = step
    t0 = time.monotonic()
    try:
        waits[args.pattern](ctx)
    finally:
        kill_helpers()
    print(f"phase={args.pattern} rank={rank} seconds={time.monotonic() - t0:.1f}", flush=True)
    train(after)
    finish(ctx)
    return 0


def finish(c: Ctx, barrier: bool = True) -> None:
    """The job's end: an exit barrier, the process group destroyed, ``done``; never returns."""
    if barrier:
        dist.barrier()
    if c.rank == 0:
        shutil.rmtree(c.tmp, ignore_errors=True)
    dist.destroy_process_group()
    print(f"done rank={c.rank}", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip gloo's teardown race under load (see hang_worker.py)


if __name__ == "__main__":
    sys.exit(main())
