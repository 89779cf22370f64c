"""Zero-code instrumentation of PyTorch: the seed's five span kinds from hooks and wrappers.

- Step: the global optimizer step post-hook (``register_optimizer_step_post_hook``). Only one
  optimizer counts (the first that steps, while it lives), so two optimizers do not double steps;
  once the script calls ``trainguard.step()`` itself, the hook stops counting.
- FP: forward of the top-level model. Global module forward hooks run only until the first step
  ends (they slow every module call), to find the outermost modules that own parameters (DDP, or
  the bare model); then per-module hooks on just those modules time each forward.
- DataLoader: ``_BaseDataLoaderIter.__next__`` (the iterator every ``DataLoader.__iter__`` returns),
  i.e. the time the loop waits for the next batch.
- Communication: the ``torch.distributed`` collectives (outermost call only: ``all_gather_object``
  does not count its inner ``all_gather`` twice) and DDP's gradient all-reduce. DDP's reducer calls
  the process group from C++, so ``DistributedDataParallel.__init__`` is wrapped to register a comm
  hook that times each bucket from "ready" to "all-reduce complete" and delegates to the default
  ``allreduce_hook`` — or to the user's hook: a later ``register_comm_hook`` /
  ``_register_builtin_comm_hook`` swaps the inner hook instead of failing. A rank that waits for a
  straggler therefore shows long Communication; the straggler itself shows short. Async
  collectives (``async_op=True``) are timed to their launch only.
- ``trainguard chaos hang``: the collective wrappers and the DDP comm hook read the ring's flag
  word once per call anyway; while the agent sets FLAG_HOLD there, the rank blocks at that call
  (``chaos_hang_before_collective``) before the collective starts.
- SaveCheckpoint: ``torch.save`` and ``torch.distributed.checkpoint.save`` (and ``async_save``,
  to its launch), outermost call only.

On CUDA tensors, FP and synchronous collectives are timed with CUDA events (resolved later by the
recorder); everything else with ``perf_counter_ns``. Every piece installs independently: one that
fails (an older torch without a private class) leaves the others working.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any

from trainguard import torch_compat
from trainguard.worker import ring as R
from trainguard.worker.spans import Recorder

COLLECTIVES = R.COLL_OPS[:-1]  # every torch.distributed collective wrapped (the last: DDP's buckets)
DDP_OP_ID = len(R.COLL_OPS)
FORWARD_CALIBRATION_CALLS = 256
HOLD_POLL_S = 0.05  # how often a held rank looks whether `trainguard chaos hang` released it  # without an optimizer step, settle the top-level modules after this

_tls = threading.local()  # .comm / .ckpt: nesting depth, so only the outermost call is a span
# The NaN replay's gradient check (worker/nancheck.py): sees each DDP bucket before its all-reduce.
# None outside a replay, so the hot path pays one global read.
bucket_check: Callable[[Any], None] | None = None


def install(rec: Recorder) -> list[str]:
    """Install every hook; returns the errors of the pieces that could not be installed."""
    errors = []
    for fn in (_install_step, _install_forward, _install_dataloader, _install_collectives, _install_ddp, _install_save):
        try:
            fn(rec)
        except Exception as exc:  # one missing piece must not cost the others
            errors.append(f"{fn.__name__[9:]}: {exc}")
    return errors


# ---- Step --------------------------------------------------------------------------------------
def _install_step(rec: Recorder) -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    lead: list[weakref.ref | None] = [None]

    def hook(opt: Any, args: Any, kwargs: Any) -> None:
        if rec.explicit_steps:
            return
        ref = lead[0]
        current = ref() if ref is not None else None
        if current is None:
            lead[0] = weakref.ref(opt)
            current = opt
        if current is opt:
            rec.step()

    register_optimizer_step_post_hook(hook)


# ---- FP ----------------------------------------------------------------------------------------
class _ForwardTimer:
    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.depth = 0
        self.calls = 0
        self.top: weakref.WeakSet = weakref.WeakSet()
        self.handles: list[Any] = []
        self.starts: dict[int, Any] = {}
        self.cal_start = 0

    # Calibration: global hooks on every module call.
    def global_pre(self, module: Any, args: Any) -> None:
        if self.depth == 0:
            if self.rec.steps >= 1 or self.calls >= FORWARD_CALIBRATION_CALLS:
                self.settle()
                if module in self.top:
                    self.pre(module, args)  # its own pre-hook was registered too late for this call
                return
            if self.calls == 0 and self.rec.steps == 0:
                self.rec._step_start = perf_counter_ns()  # step 1 starts at the first forward
            self.calls += 1
            if _has_params(module):
                self.top.add(module)
            self.cal_start = perf_counter_ns()
        self.depth += 1

    def global_post(self, module: Any, args: Any, output: Any) -> None:
        self.depth = max(0, self.depth - 1)
        if self.depth == 0 and self.cal_start and module in self.top and self.rec.enabled(R.FP):
            self.rec.record(R.FP, self.cal_start, perf_counter_ns())
        if self.depth == 0:
            self.cal_start = 0

    def settle(self) -> None:
        """Swap the global hooks for hooks on the top-level modules only."""
        for h in self.handles:
            h.remove()
        self.handles = []
        for module in list(self.top):
            module.register_forward_pre_hook(self.pre)
            module.register_forward_hook(self.post, always_call=True)
        self.depth = 0

    # Steady state: per top-level module.
    def pre(self, module: Any, args: Any) -> None:
        rec = self.rec
        if not rec.flags() & R.FLAG_BASIC:
            return
        if _is_cuda(module):
            self.starts[id(module)] = rec.cuda_begin()
        else:
            self.starts[id(module)] = perf_counter_ns()

    def post(self, module: Any, args: Any, output: Any) -> None:
        begun = self.starts.pop(id(module), None)
        if begun is None:
            return
        if isinstance(begun, tuple):
            self.rec.cuda_end(R.FP, begun)
        else:
            self.rec.record(R.FP, begun, perf_counter_ns())


def _has_params(module: Any) -> bool:
    try:
        return next(module.parameters(), None) is not None
    except Exception:
        return False


def _is_cuda(module: Any) -> bool:
    cached = getattr(module, "_trainguard_cuda", None)
    if cached is None:
        try:
            p = next(module.parameters(), None)
            cached = bool(p is not None and p.is_cuda)
        except Exception:
            cached = False
        try:
            object.__setattr__(module, "_trainguard_cuda", cached)
        except Exception:
            return cached
    return cached


def _install_forward(rec: Recorder) -> None:
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    timer = _ForwardTimer(rec)
    timer.handles = [
        register_module_forward_pre_hook(timer.global_pre),
        register_module_forward_hook(timer.global_post, always_call=True),
    ]


# ---- DataLoader --------------------------------------------------------------------------------
def _install_dataloader(rec: Recorder) -> None:
    base = torch_compat.dataloader_iterator_base()
    orig = base.__next__
    if getattr(orig, "_trainguard", False):
        return

    @functools.wraps(orig)
    def __next__(self: Any) -> Any:
        if not rec.flags() & R.FLAG_BASIC:
            return orig(self)
        start = perf_counter_ns()
        batch = orig(self)  # StopIteration passes through, unrecorded
        rec.record(R.DATALOADER, start, perf_counter_ns())
        return batch

    __next__._trainguard = True  # type: ignore[attr-defined]
    base.__next__ = __next__


# ---- Communication -----------------------------------------------------------------------------
def _first_tensor(args: tuple, kwargs: dict) -> Any:
    t = args[0] if args else kwargs.get("tensor")
    if isinstance(t, list | tuple):
        t = t[0] if t else None
    return t


def chaos_hang_before_collective(rec: Recorder) -> None:
    """`trainguard chaos hang`: block here, at the collective's call site, while the agent holds
    this rank (the flag word's FLAG_HOLD). The name is what py-spy shows on top of the stack."""
    while rec.flags() & R.FLAG_HOLD:
        time.sleep(HOLD_POLL_S)


def _comm_span(rec: Recorder, flags: int, orig: Callable, args: tuple, kwargs: dict) -> Any:
    """Run the collective, inside a Communication span when comm profiling is on (outermost only)."""
    if not flags & R.FLAG_COMM or getattr(_tls, "comm", 0):
        return orig(*args, **kwargs)
    t = _first_tensor(args, kwargs)
    cuda = not kwargs.get("async_op", False) and getattr(t, "is_cuda", False)
    begun = rec.cuda_begin() if cuda else perf_counter_ns()
    _tls.comm = 1
    try:
        return orig(*args, **kwargs)
    finally:
        _tls.comm = 0
        if cuda:
            rec.cuda_end(R.COMMUNICATION, begun)
        else:
            rec.record(R.COMMUNICATION, begun, perf_counter_ns())


def _wrap_collective(rec: Recorder, orig: Callable, name: str = "") -> Callable:
    op_id = R.COLL_OPS.index(name or orig.__name__) + 1

    @functools.wraps(orig)
    def collective(*args: Any, **kwargs: Any) -> Any:
        flags = rec.flags()  # one read of the shared flag word per call
        if flags & R.FLAG_HOLD:
            chaos_hang_before_collective(rec)
        if getattr(_tls, "seq", 0):  # inside a counted collective (all_gather_object's all_gather): counted once
            return _comm_span(rec, flags, orig, args, kwargs)
        _tls.seq = 1
        rec.collective(op_id)  # the counters are always on (the sequence of collectives)
        try:
            return _comm_span(rec, flags, orig, args, kwargs)
        finally:
            _tls.seq = 0

    collective._trainguard = True  # type: ignore[attr-defined]
    return collective


def _install_collectives(rec: Recorder) -> None:
    import torch.distributed as dist

    if not dist.is_available():
        return
    from torch.distributed import distributed_c10d as c10d

    for name in COLLECTIVES:
        orig = getattr(c10d, name, None)
        if orig is None or getattr(orig, "_trainguard", False):
            continue
        wrapped = _wrap_collective(rec, orig, name)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is orig:
            setattr(dist, name, wrapped)


class _CommHookState:
    """What our DDP comm hook delegates to: the default all-reduce, or the user's hook."""

    __slots__ = ("inner", "inner_state", "rec")

    def __init__(self, rec: Recorder, inner: Callable, inner_state: Any) -> None:
        self.rec, self.inner, self.inner_state = rec, inner, inner_state


def _trainguard_comm_hook(state, bucket):  # type: ignore[no-untyped-def]
    # No annotations: DDP checks them against dist.GradBucket / Future[Tensor] (strings here would fail).
    rec = state.rec
    if bucket_check is not None:
        bucket_check(bucket.buffer())
    flags = rec.flags()
    if flags & R.FLAG_HOLD:
        chaos_hang_before_collective(rec)
    rec.collective(DDP_OP_ID)
    if not flags & R.FLAG_COMM:
        _tls.seq = 1  # the default hook's dist.all_reduce is this bucket's, counted once
        try:
            return state.inner(state.inner_state, bucket)
        finally:
            _tls.seq = 0
    cuda = bucket.buffer().is_cuda
    begun = rec.cuda_begin() if cuda else perf_counter_ns()
    _tls.comm = _tls.seq = 1  # the inner hook's dist.all_reduce is part of this span (and counted)
    try:
        fut = state.inner(state.inner_state, bucket)
    finally:
        _tls.comm = _tls.seq = 0

    def done(f: Any) -> Any:
        # Runs when the all-reduce completed (possibly on another thread: the recorder queues it).
        if cuda:
            rec.cuda_end(R.COMMUNICATION, begun)
        else:
            rec.record(R.COMMUNICATION, begun, perf_counter_ns())
        return f.value()

    return fut.then(done)


def _install_ddp(rec: Recorder) -> None:
    import torch.distributed as dist

    if not dist.is_available():
        return
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    if getattr(DDP.__init__, "_trainguard", False):
        return
    orig_init = DDP.__init__
    orig_register = DDP.register_comm_hook
    builtin_name = torch_compat.ddp_builtin_comm_hook_name(DDP)
    orig_builtin = getattr(DDP, builtin_name) if builtin_name else None

    @functools.wraps(orig_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        if torch_compat.ddp_has_own_comm_path(self):
            return  # compiled-autograd reducer or a hook DDP registered itself (mixed precision)
        state = _CommHookState(rec, default_hooks.allreduce_hook, self.process_group)
        try:
            orig_register(self, state, _trainguard_comm_hook)
        except Exception:
            torch_compat.ddp_forget_comm_hook(self, state)
            return
        self._trainguard_comm = state

    @functools.wraps(orig_register)
    def register_comm_hook(self: Any, state: object, hook: Callable) -> None:
        ours = getattr(self, "_trainguard_comm", None)
        if ours is None:
            return orig_register(self, state, hook)
        torch_compat.ddp_check_comm_hook(self, hook)
        ours.inner, ours.inner_state = hook, state
        torch_compat.ddp_log_comm_hook_name(self, hook.__qualname__)

    def register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
        ours = getattr(self, "_trainguard_comm", None)
        python_twin = {
            dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
            dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook,
        }.get(comm_hook_type)
        if ours is None or python_twin is None:
            return orig_builtin(self, comm_hook_type)
        ours.inner, ours.inner_state = python_twin, self.process_group

    __init__._trainguard = True  # type: ignore[attr-defined]
    DDP.__init__ = __init__
    DDP.register_comm_hook = register_comm_hook
    if builtin_name and orig_builtin is not None:
        setattr(DDP, builtin_name, functools.wraps(orig_builtin)(register_builtin_comm_hook))


# ---- SaveCheckpoint ----------------------------------------------------------------------------
def suppress_saves(on: bool) -> None:
    """While on, ``torch.save`` / DCP saves on this thread record no span of their own: they are
    part of a framework's whole checkpoint save, recorded as one SaveCheckpoint span by its
    callback (``trainguard.integrations``)."""
    _tls.ckpt = 1 if on else 0


def wrap_save(rec: Recorder, orig: Callable) -> Callable:
    """``orig`` timed as one SaveCheckpoint span; saves nested in it are part of it."""
    @functools.wraps(orig)
    def save(*args: Any, **kwargs: Any) -> Any:
        if not rec.flags() & R.FLAG_BASIC or getattr(_tls, "ckpt", 0):
            return orig(*args, **kwargs)
        start = perf_counter_ns()
        _tls.ckpt = 1
        try:
            return orig(*args, **kwargs)
        finally:
            _tls.ckpt = 0
            rec.record(R.SAVE_CHECKPOINT, start, perf_counter_ns())

    save._trainguard = True  # type: ignore[attr-defined]
    return save


def _install_save(rec: Recorder) -> None:
    import torch

    if not getattr(torch.save, "_trainguard", False):
        torch.save = wrap_save(rec, torch.save)


def install_dcp(rec: Recorder, dcp: Any) -> None:
    """Wrap ``torch.distributed.checkpoint`` saves (called once that module is imported)."""
    for name in ("save", "async_save", "save_state_dict"):
        orig = getattr(dcp, name, None)
        if orig is not None and not getattr(orig, "_trainguard", False):
            setattr(dcp, name, wrap_save(rec, orig))
