"""Every private torch API trainguard relies on, in one place (tests/test_torch_compat.py fails,
naming the API, when a torch upgrade removes or changes one).

torch has no public way to do these things; each use says why it is needed and what happens
without it. The agent's overrides of SimpleElasticAgent's abstract methods (``_rendezvous``,
``_start_workers``, ``_stop_workers``, ``_monitor_workers``, ``_restart_workers``,
``_initialize_workers``, ``_shutdown``) and of PContext's (``_start``, ``_poll``, ``_close``) are
torch elastic's documented extension points and stay in those classes.

Replaced by public paths (no longer used): ``torch.distributed.launcher.api._get_addr_and_port``
(agent/launch.py reads the static endpoint with ``parse_rendezvous_endpoint``) and
``multiprocessing.api._terminate_process_handler`` (agent/launch.py raises the public
``SignalException`` itself); ``agent._worker_group`` (``get_worker_group()``).

Checked on torch 2.13 (CI's pin: tests/test_torch_compat.py) and 2.14 (2.14.1: ``bash
bench/compat.sh`` runs the same tests, the Flight Recorder, hang, rendezvous and restart tests in a
venv with that torch): every private name below, and those used outside this module (torch's
``_WorkerServer`` and its Flight Recorder dump format, worker/flight.py and
probes/flight_recorder.py; ``FileTimerServer._reap_worker``, agent/file_timer.py), is the same in
both, so no use needs a version branch. Each still falls back as its docstring says when a torch
lacks the name (False / None / torch's own behaviour, never a traceback). A torch release not in
``CHECKED_ON`` fails tests/test_torch_compat.py until bench/compat.sh has been run on it.

torch 2.14 adds public per-process-group collective hooks (``ProcessGroup.register_pre_hook`` /
``register_post_hook``, which also see DDP's C++ all-reduce): they could replace the wrapped
``torch.distributed`` collectives and DDP comm hook of worker/hooks.py once 2.13 is no longer
supported; they do not exist in 2.13.

Nothing is imported at module level: workers import this module too, and must not pay for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# torch releases (major.minor) every private use here was checked on (see above).
CHECKED_ON = ("2.13", "2.14")

# --------------------------------------------------------------------------- elastic agent

# SimpleElasticAgent keeps its restart budget in ``_remaining_restarts`` (set from
# spec.max_restarts, decremented by its run loop before each restart). The policy steers it: a
# stopped job has none left, a membership change does not use one.
_REMAINING = "_remaining_restarts"


def remaining_restarts(agent: Any) -> int:
    return int(getattr(agent, _REMAINING))


def set_remaining_restarts(agent: Any, value: int) -> None:
    if not hasattr(agent, _REMAINING):
        raise AttributeError(f"torch's SimpleElasticAgent has no {_REMAINING}: the restart budget cannot be steered")
    setattr(agent, _REMAINING, max(0, int(value)))


# LocalElasticAgent's ``_monitor_workers`` and ``_shutdown`` read the process context from
# ``_pcontext``; an agent that starts its own processes must put its context there.
_PCONTEXT = "_pcontext"


def set_process_context(agent: Any, pcontext: Any) -> None:
    setattr(agent, _PCONTEXT, pcontext)


def set_local_rank_env(agent: Any, env: dict[str, str], local_rank: int, spec: Any) -> None:
    """LOCAL_RANK (and, in torch's virtual-local-rank mode, CUDA_VISIBLE_DEVICES) for one worker.

    LocalElasticAgent._set_local_rank_env (torch >= 2.9) knows torch's current rules; older
    torch sets LOCAL_RANK alone, which is what this falls back to."""
    method = getattr(agent, "_set_local_rank_env", None)
    if method is None:
        env["LOCAL_RANK"] = str(local_rank)
        return
    method(env, local_rank, spec)


# LocalElasticAgent keeps the workers' file timer server in ``_worker_watchdog``: its
# ``_shutdown`` stops it, and its health check server (``_setup_healthcheck``, started when
# TORCHELASTIC_HEALTH_CHECK_PORT is set, as under torchrun) reports the timer's progress time.
_WATCHDOG = "_worker_watchdog"


def start_worker_watchdogs(agent: Any, timer_server: Any) -> None:
    setattr(agent, _WATCHDOG, timer_server)
    healthcheck = getattr(agent, "_setup_healthcheck", None)
    if healthcheck is not None:
        healthcheck()


# ------------------------------------------------------------------------------ rendezvous


def leave_rendezvous(handler: Any, timeout_s: float = 30.0) -> bool:
    """Leave the c10d rendezvous without closing it for the others: stop this node's heartbeat and
    drop it from the participants (what ``next_rendezvous`` does first), so the next round forms
    without waiting for it. torch has no public "leave" call; without it (False) the others drop
    this node once its heartbeat times out."""
    stop = getattr(handler, "_stop_heartbeats", None)
    run = getattr(getattr(handler, "_op_executor", None), "run", None)
    if stop is None or run is None:
        return False
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

    stop()
    run(_RendezvousExitOp(), time.monotonic() + timeout_s)
    return True


def forget_rendezvous_bootstrap(handler: Any) -> None:
    """Make the next round publish (rank 0) or read (the others) MASTER_ADDR afresh.

    With TCPStore sharing (torch's default), DynamicRendezvousHandler caches the first round's
    ``_bootstrap_store_info`` and rank 0 writes MASTER_ADDR only then. A node that joins in a later
    round (it started late, or the others re-formed after an exclusion) then waits 60 s for a key
    nobody writes and fails; a node whose rank changed keeps a stale address. Clearing the cache
    before each round makes every round build it again (rank 0 also starts a new shared store
    server; trainguard's workers use their own per-round store anyway)."""
    if hasattr(handler, "_bootstrap_store_info"):
        handler._bootstrap_store_info = None


def bind_rendezvous_shared_store(handler: Any, make_server: Any) -> bool:
    """Make a dynamic rendezvous create its per-round shared TCPStore server with ``make_server(addr,
    port)`` (trainguard binds it to one address) instead of ``TCPStore(addr, port, is_master=True)``,
    which listens on every interface. False when the handler has no such factory."""
    if not hasattr(handler, "_create_tcp_store_server"):
        return False
    handler._create_tcp_store_server = make_server
    return True


def rendezvous_base_store(handler: Any, round_store: Any) -> Any:
    """The rendezvous' store under every round's prefix (keys that must span rounds live there).

    A dynamic rendezvous keeps it in ``_store`` and hands out ``PrefixStore(round, _store)``. The
    public ``PrefixStore.underlying_store`` works for C++ stores (TCPStore) only: for a store
    written in Python (torch's ``EtcdStore``) it returns a bare ``Store`` whose every call fails
    with "pure virtual function". Falls back to ``underlying_store``, then to the round's store."""
    base = getattr(handler, "_store", None)
    if base is not None:
        return base
    return getattr(round_store, "underlying_store", None) or round_store


def cheap_rendezvous_records() -> bool:
    """Make the dynamic rendezvous name the method behind each of its records with one frame
    lookup instead of ``inspect.stack()``, which it calls twice per record (about ten records a
    round): each call reads the source of every frame on the stack and scans ``sys.modules``:
    3.5 ms a round in a process with trainguard loaded (0.3 ms without), much more on a restart's
    first round (source files not cached yet). Same name returned. False when torch has no
    ``get_method_name`` there (nothing to speed up)."""
    import sys

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    if not callable(getattr(dr, "get_method_name", None)):
        return False

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:  # the stack is shallower than depth
            return "no_method_name"

    dr.get_method_name = get_method_name
    return True


# A rendezvous waiting for the other nodes polls the store this often for its first
# POLL_FAST_FOR_S, then at torch's own 1 s: a restart's round forms within that time (the nodes
# come from a failure each agent saw within a second or two), a long wait (a node slow to come
# back, a standby on the redundancy list for hours) costs the store no more than torch's polling.
POLL_S = 0.1
POLL_FAST_FOR_S = 10.0


class rendezvous_delays:
    """Within it, a dynamic rendezvous polls the store for the other nodes' joins every
    ``POLL_S`` for its first ``POLL_FAST_FOR_S`` instead of torch's flat 1 s, and
    (``skip_first_round_delay``) does not wait its random 0-0.3 s before joining.

    torch sleeps 1 s between polls of the shared state while a round forms (``_delay(seconds=1)``
    in its op executor). A restart's round forms in steps, each seen only at a node's next poll:
    the last participant leaves round R, the nodes on the wait list add themselves to round R+1,
    the last one marks it complete, the others see it complete; at 1 s per poll (or a poll that
    grows, tried and measured: 2.5 s from the last participant leaving to every node joined, 3
    agents on loopback) every step costs up to a second. Polling every 0.1 s costs each waiting
    node ten small reads of the store per second for at most ``POLL_FAST_FOR_S``, and never
    spins: an earlier version replaced the delay by nothing and a waiting agent polled the store
    flat out, a core busy for the whole restart (3 agents on 2 cores: the other agents' own
    handling of the same failure took 1.3-1.8 s meanwhile).

    torch waits the random 0-0.3 s when the state's round is 0, meant to spread the *first* join
    of many nodes; but the state is still round 0 on the first restart of a job (round 0 is the
    one that completed), so the first recovery paid up to 0.3 s that every later one does not. The
    agent skips it for every rendezvous after its first. No-op when torch has no such ``_delay``.

    torch's state holder also serves the state from a 1 s cache between writes (``cache_duration``):
    a poll within it reads nothing new. ``handler``'s cache lasts ``POLL_S`` inside (restored after),
    else the polls above would mostly reread the cache (measured: nodes on the wait list saw the
    next round begin a second late)."""

    def __init__(self, handler: Any = None, skip_first_round_delay: bool = True,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> None:
        self._holder = getattr(handler, "_state_holder", None)
        self.skip_first_round_delay = skip_first_round_delay
        self._sleep = sleep
        self._clock = clock
        self._since: float | None = None

    def delay(self, seconds: float | tuple[float, float]) -> None:
        if isinstance(seconds, tuple):  # the first round's random skew
            if not self.skip_first_round_delay:
                self._saved(seconds)
            return
        now = self._clock()
        self._since = now if self._since is None else self._since
        wait = min(POLL_S, seconds) if now - self._since < POLL_FAST_FOR_S else seconds
        if wait >= 0.01:
            self._sleep(wait)

    def __enter__(self) -> rendezvous_delays:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

        self._saved = getattr(dr, "_delay", None)
        if self._saved is not None:
            dr._delay = self.delay
        self._cache = getattr(self._holder, "_cache_duration", None)
        if isinstance(self._cache, int | float) and self._cache > POLL_S:
            self._holder._cache_duration = POLL_S
        return self

    def __exit__(self, *exc: object) -> None:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

        if self._saved is not None:
            dr._delay = self._saved
        if isinstance(self._cache, int | float) and self._cache > POLL_S:
            self._holder._cache_duration = self._cache


def rendezvous_node(handler: Any) -> str | None:
    """This agent's identity in a dynamic rendezvous (torch's ``_NodeDesc``, as text): what the
    other agents name when they drop it after it vanished. None for other handlers."""
    node = getattr(handler, "_this_node", None)
    return None if node is None else repr(node)


def expire_rendezvous_node(handler: Any, node: str, attempts: int = 3) -> bool:
    """Drop a vanished node from a dynamic rendezvous now, instead of after torch's keep-alive
    timeout (keep_alive_interval x keep_alive_max_attempt, 15 s by default), during which the next
    round cannot form. It sets the node's last heartbeat far in the past and writes the state back;
    every agent's next sync then removes it the way torch removes any dead node. False when the
    handler has no such state (then torch's keep-alive timeout drops it)."""
    holder = getattr(handler, "_state_holder", None)
    lock = getattr(handler, "_heartbeat_lock", None)
    if holder is None or lock is None:
        return False
    from datetime import UTC, datetime

    with lock:
        for _ in range(attempts):
            holder.sync()
            state = holder.state
            target = next((n for n in state.last_heartbeats if repr(n) == node), None)
            if target is None:
                return True  # already gone
            state.last_heartbeats[target] = datetime.fromtimestamp(0, UTC)
            holder.mark_dirty()
            if holder.sync() is not False:  # False: another agent wrote first; read and try again
                return True
    return False


def _read_rendezvous_state(handler: Any, read: Callable[[Any], T]) -> T | None:
    """``read(state)`` of a dynamic rendezvous' state synced from the store, under the handler's
    lock (its keep-alive thread syncs it too); None for other handlers (etcd-v2, static)."""
    holder = getattr(handler, "_state_holder", None)
    lock = getattr(handler, "_heartbeat_lock", None)
    if holder is None or lock is None:
        return None
    with lock:
        holder.sync()
        return read(holder.state)


def rendezvous_round(handler: Any) -> tuple[bool, bool, int, int] | None:
    """(closed, complete, participants, max nodes) of a dynamic rendezvous' current round, read
    from the store: a standby agent joins only once the job's round has formed, so that it waits
    beside the job (torch puts a node beyond --nnodes MAX on its redundancy list) instead of
    taking an active node's place. None for other handlers (etcd-v2, static)."""
    settings = getattr(handler, "_settings", None)
    if settings is None:
        return None
    return _read_rendezvous_state(
        handler, lambda s: (bool(s.closed), bool(s.complete), len(s.participants), int(settings.max_nodes))
    )


def rendezvous_round_number(handler: Any) -> int | None:
    """The number of a dynamic rendezvous' current round (torch counts up each time a round empties);
    None for other handlers."""
    return _read_rendezvous_state(handler, lambda s: int(s.round))


def hold_on_redundancy_list(handler: Any, may_leave: Callable[[Any, int], bool]) -> Callable[[], None]:
    """Keep a node waiting on a dynamic rendezvous' redundancy list until ``may_leave(state,
    max_nodes)`` says a place is free for good; returns the undo.

    Why: torch moves a node off the redundancy list as soon as the round has fewer than --nnodes
    MAX participants. A participant that only steps out for a whole-job restart leaves such a gap
    too, and a standby waiting there then races it into the next round: it took a healthy, slower
    node's place and left that node waiting (bench/soak.py's standby row, 2026-11-29). The hook
    wraps the handler's op executor: while ``may_leave`` says no, a join op's "remove from the
    redundancy list" becomes what torch does while the round is full (keep alive, or poll).
    ``may_leave`` is asked at every look while the node is on the list (it learns the round's
    number while the round is full).
    Other handlers (etcd-v2, static) are left as they are: the undo does nothing."""
    executor = getattr(handler, "_op_executor", None)
    settings = getattr(handler, "_settings", None)
    if executor is None or settings is None or not callable(getattr(executor, "run", None)):
        return lambda: None
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    def held(join: Any) -> Callable[[Any, float], Any]:
        def decide(ctx: Any, deadline: float) -> Any:
            action = join(ctx, deadline)
            if ctx.node not in ctx.state.redundancy_list:
                return action
            # asked at every look while on the list, so that it sees the round it waits beside formed
            leave = may_leave(ctx.state, int(settings.max_nodes))
            if action == dr._Action.REMOVE_FROM_REDUNDANCY_LIST and not leave:
                return dr._Action.KEEP_ALIVE if dr._should_keep_alive(ctx) else dr._Action.SYNC
            return action

        return decide

    def run(state_handler: Any, deadline: float, update_deadline: Any = None) -> None:
        if isinstance(state_handler, dr._RendezvousJoinOp):
            state_handler = held(state_handler)
        return original(state_handler, deadline, update_deadline)

    original = executor.run
    executor.run = run

    def undo() -> None:
        if executor.__dict__.get("run") is run:
            del executor.run

    return undo


def rendezvous_standbys(handler: Any) -> int:
    """Nodes waiting beside a dynamic rendezvous' round (its redundancy list: they came while it
    had --nnodes MAX; and its wait list: they will join the next round): the standbys a lost node's
    place goes to. 0 for other handlers."""
    return _read_rendezvous_state(handler, lambda s: len(s.redundancy_list) + len(s.wait_list)) or 0


def no_restart_for_a_full_round(handler: Any) -> None:
    """Make a dynamic rendezvous' ``num_nodes_waiting()`` answer 0 while the round holds --nnodes
    MAX participants: no waiting node can be admitted then, and a restart for it only reshuffles
    which node is left out.

    Why: torch's agent restarts a healthy group whenever a node is on the wait list. A node lands
    there while a round has a free place (a participant leaving for a restart) and stays there
    when the next round fills without it; it never moves to the redundancy list. With more live
    nodes than MAX (a warm standby, a lost node that came back), every round then leaves one node
    on the wait list, and the job restarted every 2 s for good (bench/soak.py's standby row after
    a hang restart, 2026-11-28). A place that frees (a node lost, a participant leaving) makes
    the count visible again, and the waiting node joins the next round. Other handlers (etcd-v2,
    static) are left as they are."""
    holder = getattr(handler, "_state_holder", None)
    lock = getattr(handler, "_heartbeat_lock", None)
    settings = getattr(handler, "_settings", None)
    waiting = getattr(handler, "num_nodes_waiting", None)
    if holder is None or lock is None or settings is None or waiting is None:
        return

    def num_nodes_waiting() -> int:
        n = waiting()  # syncs the state from the store
        if n == 0:
            return 0
        with lock:
            state = holder.state
            full = bool(state.complete) and len(state.participants) >= int(settings.max_nodes)
        return 0 if full else n

    handler.num_nodes_waiting = num_nodes_waiting


def set_last_call(handler: Any, seconds: float | None) -> float | None:
    """Set a dynamic rendezvous' last-call wait (how long a round that reached --nnodes MIN waits
    for more nodes) for the rounds that follow; returns the previous value in seconds (None: the
    handler has no such setting). After a node was lost the survivors form the next round without
    waiting torch's 30 s for nodes that are not coming."""
    timeout = getattr(getattr(handler, "_settings", None), "timeout", None)
    if seconds is None or timeout is None or not hasattr(timeout, "_last_call"):
        return None
    from datetime import timedelta

    before = timeout._last_call.total_seconds()
    timeout._last_call = timedelta(seconds=seconds)
    return before


# ----------------------------------------------------------------------- worker processes

# Imported in pre-started workers before they are needed: torch._dynamo is imported lazily by
# DDP's constructor and alone costs ~1.8 s of a worker start. A module missing in another torch
# version is skipped (the worker then imports it when it needs it, as without pre-start).
PREIMPORT = ("torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel", "torch.optim", "torch.utils.data")


def preimport() -> None:
    import importlib

    for name in PREIMPORT:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def dataloader_iterator_base() -> Any:
    """The base class of every DataLoader iterator (single- and multi-process): wrapping its
    ``__next__`` times each batch fetch. Private in torch (``_BaseDataLoaderIter``)."""
    from torch.utils.data import dataloader

    return dataloader._BaseDataLoaderIter


def ddp_builtin_comm_hook_name(ddp_class: Any) -> str | None:
    """Name of DDP's method that registers a C++ built-in comm hook (private in torch 2.x,
    public in some versions); None when neither exists."""
    for name in ("_register_builtin_comm_hook", "register_builtin_comm_hook"):
        if hasattr(ddp_class, name):
            return name
    return None


def ddp_has_own_comm_path(ddp: Any) -> bool:
    """DDP runs its own reducer (compiled autograd) or has registered a comm hook itself (mixed
    precision): then no hook of ours may be added."""
    return bool(getattr(ddp, "_use_python_reducer", False) or getattr(ddp, "_comm_hooks", None))


def ddp_forget_comm_hook(ddp: Any, state: object) -> None:
    """Undo a half-registered comm hook whose state is ``state`` (DDP appended it before failing)."""
    hooks = getattr(ddp, "_comm_hooks", None)
    if hooks and hooks[-1][1] is state:
        hooks.pop()


def ddp_check_comm_hook(ddp: Any, hook: Any) -> None:
    """DDP's own validation of a user's comm hook (raises as ``register_comm_hook`` would)."""
    check = getattr(ddp, "_check_comm_hook", None)
    if check is not None:
        check(hook)


def ddp_log_comm_hook_name(ddp: Any, name: str) -> None:
    """Tell DDP's usage logger the user's hook name, as ``register_comm_hook`` does."""
    try:
        ddp.logger._set_comm_hook_name(name)
    except Exception:
        pass
