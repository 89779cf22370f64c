"""The private torch APIs trainguard relies on (trainguard/torch_compat.py), against the installed torch.

Each test names the API it guards: when a torch upgrade removes or changes one, the failure says
which, and the adapter is the one place to change."""

from __future__ import annotations

import importlib
import inspect
import signal
from datetime import timedelta
from itertools import count

import pytest
import torch
from tgtest import SCRIPTS, events, rank_log
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry

from trainguard import torch_compat as C

_ids = count()


def handler(max_nodes: int = 1):
    """A real c10d rendezvous handler, its store on a free loopback port."""
    params = RendezvousParameters(
        backend="c10d", endpoint="127.0.0.1:0", run_id=f"compat-{next(_ids)}", min_nodes=1, max_nodes=max_nodes,
        join_timeout=60, last_call_timeout=1,
    )  # fmt: skip
    return rdzv_registry.get_rendezvous_handler(params)


@pytest.fixture
def agent(tmp_path):
    h = handler()
    spec = WorkerSpec(role="t", local_world_size=1, entrypoint="python", args=(), rdzv_handler=h, max_restarts=3)
    a = LocalElasticAgent(spec, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)))
    yield a
    h.shutdown()


def test_restart_budget_is_SimpleElasticAgent__remaining_restarts(agent):
    assert hasattr(agent, "_remaining_restarts"), "torch removed SimpleElasticAgent._remaining_restarts"
    assert C.remaining_restarts(agent) == 3, "SimpleElasticAgent._remaining_restarts no longer starts at max_restarts"
    C.set_remaining_restarts(agent, 0)
    assert agent._remaining_restarts == 0 and C.remaining_restarts(agent) == 0
    C.set_remaining_restarts(agent, -4)
    assert C.remaining_restarts(agent) == 0


def test_process_context_is_LocalElasticAgent__pcontext(agent):
    closed = []

    class Procs:
        def close(self, death_sig, timeout):
            closed.append((death_sig, timeout))

    C.set_process_context(agent, Procs())
    agent._shutdown(timeout=7)  # torch's own shutdown must reach the context we put there
    assert closed == [(signal.SIGTERM, 7)], "LocalElasticAgent._shutdown no longer closes self._pcontext"


def test_local_rank_env_is_LocalElasticAgent__set_local_rank_env(agent):
    assert hasattr(LocalElasticAgent, "_set_local_rank_env"), "torch removed LocalElasticAgent._set_local_rank_env"
    env: dict[str, str] = {}
    C.set_local_rank_env(agent, env, 2, agent.get_worker_group().spec)
    assert env["LOCAL_RANK"] == "2"

    class Old:  # a torch without the method: LOCAL_RANK alone, as torch did then
        pass

    old: dict[str, str] = {}
    C.set_local_rank_env(Old(), old, 1, None)
    assert old == {"LOCAL_RANK": "1"}


def test_leave_rendezvous_uses_stop_heartbeats_op_executor_and_RendezvousExitOp():
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as D

    assert hasattr(D, "_RendezvousExitOp"), "torch removed dynamic_rendezvous._RendezvousExitOp"
    h = handler(max_nodes=2)
    try:
        assert callable(getattr(h, "_stop_heartbeats", None)), "torch removed DynamicRendezvousHandler._stop_heartbeats"
        assert callable(getattr(getattr(h, "_op_executor", None), "run", None)), (
            "torch removed DynamicRendezvousHandler._op_executor.run"
        )
        h.next_rendezvous()  # this node joins (min 1 node: the round completes after the last call)
        holder = h._state_holder
        holder.sync()
        assert len(holder.state.participants) == 1
        assert C.leave_rendezvous(h, timeout_s=30)
        holder.sync()
        assert holder.state.participants == {}, "the exit op no longer drops this node from the participants"
        assert not h.is_closed(), "leaving must not close the rendezvous for the others"
    finally:
        h.shutdown()
    assert not C.leave_rendezvous(object())  # a handler without them: the others time this node out


def test_preimported_modules_exist():
    for name in C.PREIMPORT:
        assert importlib.import_module(name), f"torch no longer has {name} (pre-started workers import it)"


def test_dataloader_iterators_share_BaseDataLoaderIter():
    base = C.dataloader_iterator_base()
    data = torch.utils.data.DataLoader(list(range(4)), batch_size=2)
    assert isinstance(iter(data), base), "DataLoader iterators no longer derive from _BaseDataLoaderIter"
    assert "__next__" in vars(base), "_BaseDataLoaderIter no longer defines __next__ (the DataLoader span wraps it)"


def test_ddp_comm_hook_internals(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    name = C.ddp_builtin_comm_hook_name(DDP)
    assert name is not None, "DDP has neither _register_builtin_comm_hook nor register_builtin_comm_hook"
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ddp = DDP(torch.nn.Linear(2, 2))
        assert hasattr(ddp, "_comm_hooks"), "DDP no longer keeps its comm hooks in _comm_hooks"
        assert hasattr(ddp, "_use_python_reducer"), "DDP no longer has _use_python_reducer"
        assert not C.ddp_has_own_comm_path(ddp)
        assert callable(getattr(ddp, "_check_comm_hook", None)), "DDP no longer has _check_comm_hook"
        assert callable(getattr(ddp.logger, "_set_comm_hook_name", None)), "DDP's logger lost _set_comm_hook_name"
        with pytest.raises(TypeError):
            C.ddp_check_comm_hook(ddp, "not a hook")  # DDP's own validation ran
        state = object()

        def hook(state, bucket):
            return bucket.buffer()

        C.ddp_check_comm_hook(ddp, hook)
        ddp.register_comm_hook(state, hook)
        assert ddp._comm_hooks[-1] == (hook, state), "DDP no longer appends (hook, state) to _comm_hooks"
        assert C.ddp_has_own_comm_path(ddp)
        C.ddp_forget_comm_hook(ddp, state)
        assert ddp._comm_hooks == []
    finally:
        dist.destroy_process_group()
        del store


def test_rendezvous_bootstrap_cache_is_DynamicRendezvousHandler__bootstrap_store_info():
    h = handler()
    try:
        assert hasattr(h, "_bootstrap_store_info"), "torch removed DynamicRendezvousHandler._bootstrap_store_info"
        first = h.next_rendezvous()
        assert h._bootstrap_store_info is not None, "torch no longer caches the bootstrap store info"
        C.forget_rendezvous_bootstrap(h)
        assert h._bootstrap_store_info is None
        second = h.next_rendezvous()  # the next round builds (and publishes) it again
        assert h._bootstrap_store_info is not None
        assert second.bootstrap_store_info.master_addr == first.bootstrap_store_info.master_addr
    finally:
        h.shutdown()
    C.forget_rendezvous_bootstrap(object())  # other handlers: nothing to forget


def test_rendezvous_records_use_dynamic_rendezvous_get_method_name_and_delay(monkeypatch):
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    assert callable(getattr(dr, "get_method_name", None)), "torch removed dynamic_rendezvous.get_method_name"
    original = dr.get_method_name
    monkeypatch.setattr(dr, "get_method_name", original)  # restored after the test

    def caller_of_record():
        def record():
            return dr.get_method_name()
        return record()

    expected = caller_of_record()
    assert expected == "caller_of_record"
    assert C.cheap_rendezvous_records()
    assert dr.get_method_name is not original and caller_of_record() == expected  # same answer, no inspect.stack()

    assert callable(getattr(dr, "_delay", None)), "torch removed dynamic_rendezvous._delay"
    delay = dr._delay
    with C.rendezvous_delays():
        assert dr._delay is not delay and dr._delay(seconds=(5, 5)) is None  # returns at once
    assert dr._delay is delay
    h = handler()
    try:
        h.next_rendezvous()
        assert h._state_holder.state.round == 0, "torch's state is still round 0 before the first restart"
        cache = getattr(h._state_holder, "_cache_duration", None)
        assert cache == 1, "torch's state holder no longer caches the state for 1 s"
        with C.rendezvous_delays(h):  # polls every POLL_S would otherwise mostly reread the cache
            assert h._state_holder._cache_duration == C.POLL_S
        assert h._state_holder._cache_duration == cache
    finally:
        h.shutdown()


def test_rendezvous_base_store_is_DynamicRendezvousHandler__store():
    h = handler()
    try:
        info = h.next_rendezvous()
        assert hasattr(h, "_store"), "torch removed DynamicRendezvousHandler._store"
        base = C.rendezvous_base_store(h, info.store)
        assert base is h._store
        base.set("across-rounds", "x")  # what the round's PrefixStore sees under its prefix is elsewhere
        assert info.store.check(["across-rounds"]) is False and base.get("across-rounds") == b"x"
    finally:
        h.shutdown()
    round_store = torch.distributed.PrefixStore("r", torch.distributed.HashStore())
    assert C.rendezvous_base_store(object(), round_store) is not round_store  # other handlers: underlying_store


def test_shared_store_server_is_DynamicRendezvousHandler__create_tcp_store_server():
    from trainguard.cluster.stores import bound_store

    h = handler()
    made = []
    try:
        assert callable(getattr(h, "_create_tcp_store_server", None)), "torch removed _create_tcp_store_server"
        assert C.bind_rendezvous_shared_store(h, lambda addr, port: made.append(bound_store("127.0.0.3", port)) or made[-1])
        h.next_rendezvous()
        assert made and h._shared_tcp_store_server is made[0], "torch no longer creates its shared store there"
    finally:
        h.shutdown()
    assert not C.bind_rendezvous_shared_store(object(), None)


def test_rendezvous_node_expiry_and_last_call_are_DynamicRendezvousHandler_internals():
    a = handler(max_nodes=2)
    try:
        a.next_rendezvous()
        assert C.rendezvous_node(a) is not None and C.rendezvous_node(object()) is None
        me = C.rendezvous_node(a)
        holder = a._state_holder
        holder.sync()
        assert [repr(n) for n in holder.state.last_heartbeats] == [me], "heartbeats are no longer keyed by _NodeDesc"
        assert C.expire_rendezvous_node(a, me)
        holder.sync()
        assert me not in [repr(n) for n in holder.state.last_heartbeats], "torch no longer drops an expired node"
        assert C.expire_rendezvous_node(a, "gone") and not C.expire_rendezvous_node(object(), me)
        before = C.set_last_call(a, 0.5)
        assert before == 1.0 and a._settings.timeout.last_call == timedelta(seconds=0.5)
        assert C.set_last_call(object(), 1.0) is None
    finally:
        a.shutdown()


def test_file_timer_works_as_under_torchrun(jobs, tmp_path):
    """TORCHELASTIC_ENABLE_FILE_TIMER=1: the workers get TORCHELASTIC_TIMER_FILE (a drop-in keeps
    torchrun's contract), and a worker that overruns its timer is killed by torch's timer server."""
    env = {"TORCHELASTIC_ENABLE_FILE_TIMER": "1"}
    common = ["--standalone", "--nproc-per-node", "2", "--precheck", "off", "--quiet", "--max-restarts", "0"]
    ok = jobs("run", *common, "--run-dir", tmp_path / "ok", SCRIPTS / "file_timer_worker.py", env=env)
    assert ok.wait() == 0, ok.output()[-3000:]
    assert "timer armed" in rank_log(tmp_path / "ok", 0, 1).read_text()
    assert "done" in rank_log(tmp_path / "ok", 0, 0).read_text()
    over = jobs("run", *common, "--run-dir", tmp_path / "over", SCRIPTS / "file_timer_worker.py", "--overrun", env=env)
    assert over.wait() != 0, over.output()[-3000:]
    [expired] = events(tmp_path / "over", "worker_timer_expired")  # torch's server killed rank 0, not the agent
    assert expired.rank == 0 and expired.evidence["signal"] == signal.SIGKILL, expired
    assert events(tmp_path / "over", "job_failed")


def test_file_timer_server_internals():
    """agent/file_timer.py relies on FileTimerServer._reap_worker(pid, signal) -> bool (it refuses
    pids that are not the agent's workers, and torch's self-kill) and on the ``log_event`` name
    "kill worker process"; LocalElasticAgent._shutdown stops ``_worker_watchdog``."""
    from torch.distributed.elastic.timer import FileTimerServer

    assert "kill worker process" in inspect.getsource(FileTimerServer._run_watchdog)
    assert list(inspect.signature(FileTimerServer._reap_worker).parameters) == ["self", "worker_pid", "signal"]
    assert "_worker_watchdog" in inspect.getsource(LocalElasticAgent._shutdown)


def test_rendezvous_round_reads_DynamicRendezvousHandler__state_holder_and__settings():
    """A standby agent joins once the job's round formed (agent/standby.py): it reads the round's
    state (closed, complete, participants) and --nnodes MAX from the handler."""
    a = handler(max_nodes=1)
    try:
        assert C.rendezvous_round(a) == (False, False, 0, 1)
        a.next_rendezvous()
        assert C.rendezvous_round(a) == (False, True, 1, 1), "torch no longer marks a full round complete"
        assert C.rendezvous_round(object()) is None
    finally:
        a.shutdown()
    assert C.rendezvous_round(a)[0], "a shut-down rendezvous no longer reads closed"


def test_a_node_beyond_max_waits_on_DynamicRendezvousHandler_redundancy_list():
    """What --standby builds on (agent/standby.py): a node that joins a full round waits in torch's
    redundancy list (``rendezvous_standbys`` counts it), and leaves quietly
    (RendezvousGracefulExitError, which torch's agent ends its run on) when the job closes."""
    import threading

    from tgtest import wait_for
    from torch.distributed.elastic.rendezvous import RendezvousGracefulExitError

    from trainguard.cluster.stores import bound_store

    server = bound_store("127.0.0.1", multi_tenant=True)
    params = dict(backend="c10d", endpoint=f"127.0.0.1:{server.port}", run_id=f"standby-{next(_ids)}", min_nodes=1,
                  max_nodes=1, join_timeout=60, last_call_timeout=1, is_host=False)  # fmt: skip
    job, spare = (rdzv_registry.get_rendezvous_handler(RendezvousParameters(**params)) for _ in range(2))
    ended: list[BaseException] = []

    def wait_as_standby() -> None:
        try:
            spare.next_rendezvous()
        except BaseException as exc:
            ended.append(exc)

    try:
        job.next_rendezvous()
        assert C.rendezvous_standbys(job) == 0 and C.rendezvous_standbys(object()) == 0
        waiter = threading.Thread(target=wait_as_standby, daemon=True)
        waiter.start()
        wait_for(lambda: C.rendezvous_standbys(job) == 1, what="the standby in the redundancy list")
        assert C.rendezvous_round(job) == (False, True, 1, 1) and not ended  # it waits, the round stays full
        job.shutdown()
        waiter.join(timeout=30)
        assert ended and isinstance(ended[0], RendezvousGracefulExitError), ended
    finally:
        job.shutdown()


def test_a_full_round_with_a_node_left_on_the_wait_list_restarts_nothing():
    """torch's agent restarts a healthy group whenever ``num_nodes_waiting() > 0``. A node that came
    while a round had a free place is on the wait list and stays there when the next round fills
    without it; with more live nodes than --nnodes MAX (a standby, a lost node come back) the job
    then restarted every 2 s for good (bench/soak.py, 2026-11-28). no_restart_for_a_full_round
    answers 0 while the round is full, and the count again once a place is free."""
    import threading
    from datetime import UTC, datetime

    from tgtest import wait_for

    from trainguard.cluster.stores import bound_store

    server = bound_store("127.0.0.1", multi_tenant=True)
    params = dict(backend="c10d", endpoint=f"127.0.0.1:{server.port}", run_id=f"full-{next(_ids)}", min_nodes=2,
                  max_nodes=2, join_timeout=60, last_call_timeout=1, is_host=False)  # fmt: skip
    a, b, c = (rdzv_registry.get_rendezvous_handler(RendezvousParameters(**params)) for _ in range(3))
    try:
        joiner = threading.Thread(target=b.next_rendezvous, daemon=True)
        joiner.start()
        a.next_rendezvous()
        joiner.join(timeout=60)
        assert C.rendezvous_round(a) == (False, True, 2, 2)
        torch_waiting = a.num_nodes_waiting
        # The state the race leaves: the round full, c still on the wait list from when it had a place.
        with a._heartbeat_lock:
            holder = a._state_holder
            holder.sync()
            holder.state.wait_list.add(c._this_node)
            holder.state.last_heartbeats[c._this_node] = datetime.now(UTC)
            holder.mark_dirty()
            holder.sync()
        assert torch_waiting() == 1, "torch no longer counts the wait list of a full round (the shim may go)"
        C.no_restart_for_a_full_round(a)
        assert a.num_nodes_waiting() == 0  # nobody can be admitted: no restart
        assert C.leave_rendezvous(b)  # b leaves (a restart's first step): a place is free
        # (a's view of the store is cached for up to a second)
        wait_for(lambda: C.rendezvous_round(a) == (False, True, 1, 2), what="a to see b gone")
        assert a.num_nodes_waiting() == 1  # now the waiting node is worth a new round
        C.no_restart_for_a_full_round(object())  # other handlers: left alone, no error
    finally:
        for h in (a, b, c):
            h.shutdown()
        del server


def test_rendezvous_polls_often_while_a_round_forms_then_at_torchs_pace_never_spinning():
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s + 0.002  # a poll of the store

    d = C.rendezvous_delays(sleep=sleep, clock=lambda: now[0])
    while now[0] < C.POLL_FAST_FOR_S + 5:
        d.delay(1)  # torch's op executor between two polls of the state
    fast = [s for s in slept if s == C.POLL_S]
    assert len(fast) >= 0.9 * C.POLL_FAST_FOR_S / C.POLL_S  # every step of a forming round seen within 0.1 s
    assert slept[len(fast):] and all(s == 1 for s in slept[len(fast):])  # then torch's 1 s, a long wait
    assert all(s >= C.POLL_S for s in slept)  # never a spin


def test_the_first_rendezvous_keeps_torchs_skew_between_nodes_joining_at_once():
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    slept: list[float] = []
    with C.rendezvous_delays(skip_first_round_delay=False, sleep=slept.append) as d:
        skew: list[object] = []
        d._saved = skew.append  # torch's own _delay, recorded instead of slept
        dr._delay(seconds=(0, 0.3))
        assert skew == [(0, 0.3)] and slept == []


def test_the_installed_torch_is_one_the_private_uses_were_checked_on():
    """A torch release nobody ran bench/compat.sh on fails here, naming what to do, instead of
    in a private path at a user's restart."""
    version = torch.__version__.split("+")[0]
    release = ".".join(version.split(".")[:2])
    assert release in C.CHECKED_ON, (
        f"torch {torch.__version__} is not among torch_compat.CHECKED_ON {C.CHECKED_ON}: run "
        f"`TORCH_VERSION={version} bash bench/compat.sh`, fix what fails, then add {release}"
    )
