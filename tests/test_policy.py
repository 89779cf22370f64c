"""The policy module: the seed's four scenarios, failure classification, node exclusion."""

from __future__ import annotations

import itertools

import pytest

from trainguard import policy as P
from trainguard.evidence import CheckOutcome, Diagnosis, HardwareFault, HardwareReport, NodeLost, RankFailure
from trainguard.policy import Action

HEALTHY = HardwareReport(True, [], [])
FAULTY = HardwareReport(False, ["GPU 3: 2 uncorrectable ECC error(s) since driver load"], [])


def err_file(message: str, stack: str = "") -> dict:
    """The shape torch elastic's @record writes (and the agent passes on as error_file_data)."""
    return {"message": {"message": message, "extraInfo": {"py_callstack": stack, "timestamp": "1795250000"}}}


def info(exitcode=1, signal=None, error=None, tail=None, local_rank=0):
    return RankFailure(
        local_rank=local_rank, pid=1234, exitcode=exitcode, signal=signal, error_file_data=error, log_tail=tuple(tail or ())
    )


ZERODIV = info(
    error=err_file("ZeroDivisionError: division by zero", 'File "train.py", line 80\n    print(1 / 0)')
)
GLOO_PEER = info(
    error=err_file(
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4312"
    )
)
NCCL_ERR = info(
    error=err_file(
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error"
    )
)
SIGKILL = info(exitcode=-9, signal="SIGKILL")
SIGSEGV = info(exitcode=-11, signal="SIGSEGV")
BARE_EXIT = info(exitcode=3)
ECC_TAIL = info(error=err_file("RuntimeError: CUDA error: uncorrectable ECC error encountered"))
TRACEBACK_ONLY = info(
    tail=[
        "2026-11-21T09:30:01.1 [rank1]: Traceback (most recent call last):",
        '2026-11-21T09:30:01.1 [rank1]:   File "train.py", line 5, in <module>',
        "2026-11-21T09:30:01.1 [rank1]: KeyError: 'lr'",
    ]
)


# --------------------------------------------------------------------- scenario 4: user code


def test_zerodivision_on_healthy_hardware_stops_at_once_without_retry():
    d = P.decide_on_failure({1: ZERODIV}, remaining_restarts=3, diagnosis=None, hardware=HEALTHY)
    assert d.action == Action.STOP_JOB
    assert d.rank == 1
    assert "ZeroDivisionError" in d.reason
    assert d.evidence["scenario"] == 4
    assert d.evidence["cause"]["kind"] == P.USER


def test_restart_on_error_restarts_the_users_exception_as_torchrun_does_while_restarts_are_left():
    """--restart-on-error: torchrun's semantics (every failure restarts within --max-restarts)."""
    d = P.decide_on_failure({1: ZERODIV}, remaining_restarts=1, diagnosis=None, hardware=HEALTHY, restart_on_error=True)
    assert d.action == Action.RESTART and "--restart-on-error" in d.reason and "ZeroDivisionError" in d.reason
    d = P.decide_on_failure({1: ZERODIV}, remaining_restarts=0, diagnosis=None, hardware=HEALTHY, restart_on_error=True)
    assert d.action == Action.STOP_JOB and "no restarts are left" in d.reason


def test_user_error_wins_over_the_peer_connection_errors_it_caused():
    d = P.decide_on_failure({0: GLOO_PEER, 1: ZERODIV}, 2, None, HEALTHY)
    assert d.action == Action.STOP_JOB and d.rank == 1


def test_user_error_without_a_hardware_check_still_stops():
    assert P.decide_on_failure({0: ZERODIV}, 1, None, None).action == Action.STOP_JOB


def test_traceback_in_the_log_tail_counts_as_user_error_without_error_file():
    d = P.decide_on_failure({1: TRACEBACK_ONLY}, 2, None, HEALTHY)
    assert d.action == Action.STOP_JOB and "KeyError" in d.reason


def test_user_traceback_quoting_nccl_code_is_still_user_error():
    e = info(error=err_file("ValueError: bad shape", 'File "t.py"\n    dist.init_process_group("nccl")'))
    assert P.decide_on_failure({0: e}, 2, None, HEALTHY).action == Action.STOP_JOB


# --------------------------------------------------------------------- scenario 3: hardware


def test_user_failure_with_faulty_hardware_isolates_the_node():
    d = P.decide_on_failure({1: ZERODIV}, 2, None, FAULTY)
    assert d.action == Action.EXCLUDE_NODE
    assert d.exit_message == P.NODE_DOWN_MESSAGE == "The node is down."
    assert d.evidence["scenario"] == 3
    assert "ECC" in d.reason
    assert d.source == "hardware_check"


def test_hardware_fault_isolates_even_with_no_restarts_left():
    assert P.decide_on_failure({0: SIGKILL}, 0, None, FAULTY).action == Action.EXCLUDE_NODE


def test_gpu_error_text_isolates_the_node_even_if_the_quick_check_saw_nothing():
    d = P.decide_on_failure({0: ECC_TAIL}, 2, None, HEALTHY)
    assert d.action == Action.EXCLUDE_NODE and d.exit_message == P.NODE_DOWN_MESSAGE


# ------------------------------------------------------------ infrastructure: restart in budget


@pytest.mark.parametrize("failure", [SIGKILL, SIGSEGV, BARE_EXIT, GLOO_PEER, NCCL_ERR, info(exitcode=-7)])
def test_infrastructure_failures_restart_within_the_budget(failure):
    d = P.decide_on_failure({0: failure}, 2, None, HEALTHY)
    assert d.action == Action.RESTART
    assert "2 restart(s) left" in d.reason


GLOO_CONNECT_REFUSED = info(
    error=err_file("RuntimeError: Gloo connectFullMesh failed with [../third_party/gloo/gloo/transport/tcp/pair.cc:152] "
                   "timed out connecting: SO_ERROR: Connection refused, remote=[10.210.129.1]:13200")
)


@pytest.mark.parametrize("failure", [GLOO_PEER, GLOO_CONNECT_REFUSED])
def test_losing_peers_while_a_new_round_is_pending_is_a_membership_change(failure):
    """The job formed on 2 of 2:3 nodes; the third arrived, node 0's agent left the round for a new
    one and node 1's fresh workers could not reach node 0's (fault matrix, 2026-11-25): not a
    failure of node 1, and no restart used, even with none left."""
    for left in (2, 0):
        d = P.decide_on_failure({1: failure}, left, None, HEALTHY, new_round_pending=True)
        assert d.action == Action.RERENDEZVOUS and "no restart used" in d.reason, d
        assert d.evidence["membership_change"] is True
    assert P.decide_on_failure({1: failure}, 2, None, HEALTHY).action == Action.RESTART


@pytest.mark.parametrize("failure", [ZERODIV, SIGKILL, ECC_TAIL])
def test_a_pending_round_does_not_excuse_a_failure_of_its_own(failure):
    d = P.decide_on_failure({0: failure}, 2, None, HEALTHY, new_round_pending=True)
    assert d.action != Action.RERENDEZVOUS, d


@pytest.mark.parametrize("failure", [SIGKILL, SIGSEGV, BARE_EXIT, NCCL_ERR])
def test_infrastructure_failures_stop_when_the_budget_is_spent(failure):
    d = P.decide_on_failure({0: failure}, 0, None, HEALTHY)
    assert d.action == Action.STOP_JOB and "no restarts" in d.reason


def test_negative_exitcode_is_read_as_a_signal():
    assert P.classify_rank_failure(0, info(exitcode=-9)).detail == "killed by SIGKILL"
    assert P.classify_rank_failure(0, info(exitcode=-7)).kind == P.SIGNAL


def test_signal_beats_communication_and_bare_exit():
    assert P.classify_failures({0: GLOO_PEER, 1: SIGKILL, 2: BARE_EXIT}).rank == 1


# ------------------------------------------------------------------------------ diagnosis


@pytest.mark.parametrize(
    "category,action",
    [
        ("python_exception", Action.STOP_JOB),
        ("cuda_oom", Action.STOP_JOB),
        ("cuda_error_other", Action.STOP_JOB),
        ("nan_loss", Action.STOP_JOB),
        ("disk_full_or_io", Action.STOP_JOB),
        ("nccl_network", Action.RESTART),
        ("nccl_timeout", Action.RESTART),
        ("rendezvous_failure", Action.RESTART),
        ("hang_no_error", Action.RESTART),
        ("segfault", Action.RESTART),
        ("host_oom", Action.RESTART),
        ("killed_external", Action.RESTART),  # SIGKILL from outside, no OOM-killer event
        ("exit_nonzero", Action.RESTART),  # a non-zero exit with no error logged
        ("gpu_hardware", Action.EXCLUDE_NODE),
    ],
)
def test_diagnosis_category_decides_when_known(category, action):
    d = P.decide_on_failure({0: BARE_EXIT}, 2, Diagnosis(category, summary="x", first_failure={"rank": 0}), HEALTHY)
    assert d.action == action
    assert d.evidence["diagnosis"]["category"] == category


def test_a_tcpstore_timeout_in_the_error_file_is_communication_not_user_code():
    """c10d store client timeouts surface as Python exceptions: a rendezvous failure, retried."""
    store_timeout = RankFailure(local_rank=0, pid=7, exitcode=1, error_file_data={"message": {
        "message": "torch.distributed.DistStoreError: Socket Timeout", "extraInfo": {"py_callstack": ""}}})
    assert P.decide_on_failure({0: store_timeout}, 2, None, HEALTHY).action == Action.RESTART


def test_rank_comes_from_the_diagnosis_first_failure():
    diag = Diagnosis("python_exception", summary="ZeroDivisionError", first_failure={"rank": 1})
    assert P.decide_on_failure({0: GLOO_PEER, 1: ZERODIV}, 2, diag, HEALTHY).rank == 1


@pytest.mark.parametrize("category", ["unknown", "healthy", "dataloader", "slowdown"])
def test_vague_diagnosis_categories_defer_to_the_failure_info(category):
    assert P.decide_on_failure({1: ZERODIV}, 2, Diagnosis(category), HEALTHY).action == Action.STOP_JOB
    assert P.decide_on_failure({1: SIGKILL}, 2, Diagnosis(category), HEALTHY).action == Action.RESTART


def test_unknown_diagnosis_category_falls_back_to_the_failure_info():
    assert P.decide_on_failure({0: ZERODIV}, 2, Diagnosis("mystery"), HEALTHY).action == Action.STOP_JOB
    assert P.decide_on_failure({0: SIGKILL}, 2, Diagnosis("mystery"), HEALTHY).action == Action.RESTART


def test_every_combination_yields_a_decision_with_evidence():
    failures = [ZERODIV, GLOO_PEER, NCCL_ERR, SIGKILL, SIGSEGV, BARE_EXIT, ECC_TAIL, TRACEBACK_ONLY, info()]
    diagnoses = [None, Diagnosis("python_exception"), Diagnosis("nccl_network"), Diagnosis("??")]
    for f, diag, hw, budget in itertools.product(failures, diagnoses, [None, HEALTHY, FAULTY], [0, 1, 3]):
        d = P.decide_on_failure({0: f}, budget, diag, hw)
        assert d.action in (Action.RESTART, Action.STOP_JOB, Action.EXCLUDE_NODE)
        assert d.reason and d.evidence["failed_ranks"] == [0]
        if hw is FAULTY:
            assert d.action == Action.EXCLUDE_NODE
        if d.action == Action.RESTART:
            assert budget > 0


def test_without_diagnosis_or_hardware_check():
    assert P.decide_on_failure({0: SIGKILL}, 1).action == Action.RESTART
    assert P.decide_on_failure({0: SIGKILL}, 0).action == Action.STOP_JOB
    assert P.decide_on_failure({}, 1).action == Action.RESTART


def test_error_file_with_plain_string_message():
    assert P.classify_rank_failure(0, info(error={"message": "AssertionError: x"})).kind == P.USER


# ------------------------------------------------------------------ before start (1-2)


def precheck(faulty, **kw):
    return CheckOutcome("precheck", faulty, **kw)


def nodecheck(faulty=None, stragglers=None, undetermined=""):
    return CheckOutcome("node_check", faulty or {}, stragglers or {}, undetermined)


def test_failed_node_is_excluded_and_the_rest_rerendezvous_when_elastic():
    faulty = {2: "pre-check failed: item disk-size root ... failed"}
    mine = P.decide_before_start(precheck(faulty), 2, 4, 3)
    assert mine.action == Action.EXCLUDE_NODE and mine.exit_message == "The node is down."
    assert mine.source == "precheck"
    for other in (0, 1, 3):
        d = P.decide_before_start(nodecheck(faulty), other, 4, 3)
        assert d.action == Action.RERENDEZVOUS and "continuing on 3" in d.reason
    named = P.decide_before_start(precheck(faulty, names={2: "gpu-07"}), 0, 4, 3)
    assert named.reason.startswith("node 2 (gpu-07) excluded")


def test_precheck_scenario_says_whether_the_hardware_failed():
    faulty = {1: "pre-check failed: item gpu-check ... failed", 2: "pre-check failed: item disk-size root ... failed"}
    outcome = precheck(faulty, hardware_faulty=frozenset({1}))
    assert P.decide_before_start(outcome, 1, 4, 2).evidence["scenario"] == 1
    assert P.decide_before_start(outcome, 2, 4, 2).evidence["scenario"] == 2
    assert P.decide_before_start(outcome, 0, 4, 2).evidence["scenario"] is None
    assert "scenario" not in P.decide_before_start(nodecheck(faulty), 1, 4, 2).evidence


def test_the_rest_stop_with_the_reason_when_not_elastic():
    d = P.decide_before_start(nodecheck({2: "bad"}), 0, 4, 4)
    assert d.action == Action.STOP_JOB and "needs at least 4" in d.reason


def test_nothing_to_do_when_all_nodes_pass():
    assert P.decide_before_start(nodecheck(), 0, 4, 4) is None
    assert P.decide_before_start(nodecheck({}, {3: "slow"}), 0, 4, 4) is None  # stragglers only reported


def test_straggler_leaves_only_when_asked():
    d = P.decide_before_start(nodecheck({}, {3: "2.5x"}), 3, 4, 2, exclude_stragglers=True)
    assert d.action == Action.EXCLUDE_NODE and d.exit_message == P.STRAGGLER_EXIT_MESSAGE
    assert (
        P.decide_before_start(nodecheck({}, {3: "2.5x"}), 0, 4, 2, exclude_stragglers=True).action
        == Action.RERENDEZVOUS
    )


def test_undetermined_node_check_stops_everyone():
    for n in range(2):
        assert P.decide_before_start(nodecheck(undetermined="cannot tell"), n, 2, 1).action == Action.STOP_JOB


def test_single_failed_node_stops_its_own_job():
    d = P.decide_before_start(precheck({0: "bad disk"}), 0, 1, 1)
    assert d.action == Action.EXCLUDE_NODE


@pytest.mark.parametrize(
    "spec,current,want", [("3:4", 4, 3), ("4", 4, 4), (None, 2, 2), ("", 3, 3), ("x", 2, 2), (2, 5, 2)]
)
def test_min_nodes_of(spec, current, want):
    assert P.min_nodes_of(spec, current) == want


def test_periodic_hardware_fault_isolates_the_node():
    fault = HardwareFault(["Xid 79 (GPU has fallen off the bus)"], node="a", node_rank=1)
    d = P.decide_on_hardware_fault(fault, nnodes=3, min_nodes=2)
    assert d.action == Action.EXCLUDE_NODE and d.exit_message == P.NODE_DOWN_MESSAGE
    assert d.evidence["faults"] and d.evidence["node"] == "a" and d.source == "health_check"


def test_periodic_hardware_fault_stops_a_job_that_cannot_go_on_without_the_node():
    fault = HardwareFault(["Xid 79 (GPU has fallen off the bus)"], node="a", node_rank=0)
    for nnodes, min_nodes in ((1, 1), (2, 2)):
        d = P.decide_on_hardware_fault(fault, nnodes, min_nodes)
        assert d.action == Action.STOP_JOB and "below the minimum" in d.reason and "Xid 79" in d.reason


def test_action_values_are_plain_strings():
    assert f"{Action.EXCLUDE_NODE}" == "exclude_node" and Action("restart") is Action.RESTART


# ------------------------------------------------------------------ while running: evidence


def straggler(rank=1, node="node0"):
    from trainguard.evidence import StragglerEvidence

    return StragglerEvidence(rank, node, "compute", 2.98, 150.6, 50.6, [0, 1, 2], (1, 15))


def test_hang_restarts_with_the_culprit():
    from trainguard.evidence import HangEvidence

    causes = [{"cause": "process_stopped", "advice": "..."}]
    d = P.decide_on_hang(
        HangEvidence(1, "steps", "rank 1 is not in the collective", causes, "/run/hang.txt", 0, progress="stopped")
    )
    assert (d.action, d.rank, d.source) == (Action.RESTART, 1, "hang")
    assert d.reason == "hang: culprit rank 1: rank 1 is not in the collective"
    assert d.evidence == {"rule": "steps", "causes": causes, "report": "/run/hang.txt", "progress": "stopped",
                          "recorded_by": ""}  # fmt: skip
    nobody = P.decide_on_hang(HangEvidence(None, "io+utilisation", "stacks are symmetric"))
    assert nobody.action == Action.RESTART and nobody.rank is None and "no single rank" in nobody.reason


def test_hang_suspicion_or_progressing_culprit_never_restarts():
    """Only a detected hang with no-progress evidence restarts; a progressing culprit never does,
    at the seed's window neither."""
    from trainguard.evidence import HangEvidence

    assert P.decide_on_hang(HangEvidence(0, "steps", "rank 0 evaluates", level="suspected", progress="progressing")) is None
    for rule in ("steps", "detect-time", "io+utilisation"):
        assert P.decide_on_hang(HangEvidence(0, rule, "rank 0 evaluates", progress="progressing")) is None, rule
    for rule in ("detect-time", "io+utilisation"):  # a spin on one frame at the window
        d = P.decide_on_hang(HangEvidence(0, rule, "rank 0 loops", progress="busy"))
        assert d is not None and d.action == Action.RESTART, rule
    for kind in ("busy", "idle", "stopped", "stalled", "gone"):
        d = P.decide_on_hang(HangEvidence(1, "steps", "no progress", progress=kind))
        assert d is not None and d.action == Action.RESTART, kind
    s = P.decide_while_running(HangEvidence(0, "steps", "x", level="suspected", progress="busy"), P.PolicySettings(), 1)
    assert s is None


def test_workers_failing_under_the_jobs_hang_verdict_act_on_the_verdict():
    """On several nodes, a node restarting on the job's hang verdict makes the others' ranks lose
    their peers: those failures follow the one verdict (same culprit, same action), not a diagnosis
    of their own; without restarts left the job stops. A suspicion is no verdict."""
    from trainguard.evidence import HangEvidence

    hang = HangEvidence(1, "steps", "rank 1 is idle in own code", progress="idle", recorded_by="node1")
    d = P.decide_on_failure({0: GLOO_PEER}, 2, None, HEALTHY, hang)
    assert (d.action, d.source, d.rank) == (Action.RESTART, "hang", 1)
    assert d.evidence["recorded_by"] == "node1" and d.evidence["failed_ranks"] == [0]
    last = P.decide_on_failure({0: GLOO_PEER}, 0, None, HEALTHY, hang)
    assert (last.action, last.source) == (Action.STOP_JOB, "hang") and "no restarts are left" in last.reason
    user_error = P.decide_on_failure({1: ZERODIV}, 2, None, HEALTHY, HangEvidence(1, "steps", "x", level="suspected"))
    assert user_error.action == Action.STOP_JOB and user_error.source == "worker_exit"


def test_straggler_is_only_reported_without_exclude_straggler():
    assert P.decide_on_straggler(straggler(), exclude=False, nnodes=4, min_nodes=1) is None


def test_straggler_node_leaves_an_elastic_job_with_exclude_straggler():
    d = P.decide_on_straggler(straggler(), exclude=True, nnodes=2, min_nodes=1)
    assert (d.action, d.rank, d.source, d.exit_message) == (
        Action.EXCLUDE_NODE, 1, "straggler", P.STRAGGLER_EXIT_MESSAGE
    )  # fmt: skip
    assert d.reason.startswith("rank 1 on node node0 is a straggler: compute 2.98x slower")
    assert d.evidence["steps"] == [1, 15] and d.evidence["kind"] == "compute"


def test_straggler_is_kept_when_it_is_the_last_node_above_the_minimum():
    for nnodes, min_nodes in ((2, 2), (1, 1), (3, 3)):
        d = P.decide_on_straggler(straggler(), exclude=True, nnodes=nnodes, min_nodes=min_nodes)
        assert d.action == Action.CONTINUE and "kept" in d.reason and d.rank == 1
        assert (d.evidence["nnodes"], d.evidence["min_nodes"], d.evidence["wanted"]) == (nnodes, min_nodes, "exclude_node")


def test_running_evidence_goes_to_its_policy():
    from trainguard.evidence import HangEvidence

    elastic = P.PolicySettings(nnodes="1:4", exclude_straggler=True)
    assert P.decide_while_running(HangEvidence(0, "steps", "x"), elastic, 3).action == Action.RESTART
    assert P.decide_while_running(straggler(), elastic, 3).action == Action.EXCLUDE_NODE
    assert P.decide_while_running(straggler(), P.PolicySettings(nnodes="1:4"), 3) is None
    assert P.decide_while_running(straggler(), P.PolicySettings(nnodes="3", exclude_straggler=True), 3).action == (
        Action.CONTINUE
    )
    fault = HardwareFault(["GPU 0: row remapping failed"], "a", 0)
    assert P.decide_while_running(fault, elastic, 3).action == Action.EXCLUDE_NODE
    assert P.decide_while_running(fault, P.PolicySettings(nnodes="3"), 3).action == Action.STOP_JOB
    with pytest.raises(TypeError):
        P.decide_while_running("a rumour", elastic, 3)  # type: ignore[arg-type]


def test_policy_settings_from_the_run_command_line():
    from trainguard.agent.cli import make_parser

    ns = make_parser().parse_args(["--nnodes", "2:4", "--exclude-straggler", "train.py"])
    s = P.PolicySettings.from_options(ns)
    # --exclude-straggler (DLRover's) also drops a straggler the node check finds
    assert (s.nnodes, s.exclude_straggler, s.node_check_exclude_straggler) == ("2:4", True, True)
    assert s.min_nodes(3) == 2
    assert P.PolicySettings.from_options(make_parser().parse_args(["train.py"])).min_nodes(3) == 1


def test_news_from_other_nodes():
    from trainguard.evidence import PeerLeft, PeerStop

    stop = P.decide_on_peer_news(PeerStop("user code failed (decided on node1)"))
    assert (stop.action, stop.source, stop.reason) == (Action.STOP_JOB, "peer", "user code failed (decided on node1)")
    left = P.decide_on_peer_news(PeerLeft("node2"))
    assert (left.action, left.reason) == (Action.RERENDEZVOUS, "node node2 left the job")


def test_a_lost_node_with_a_standby_waiting_keeps_the_world_size():
    """A standby waiting in the rendezvous (agent/standby.py) takes the lost node's place: a job
    that may not shrink (--nnodes 3:3) goes on in a new round instead of spending a restart to wait
    for a replacement, and the decision says the standby keeps the node count."""
    lost = NodeLost({"n3": "no heartbeat for 4.0 s"}, ["n3-desc"], 4.0)
    fixed = P.decide_on_node_lost(lost, 3, 3, standbys=1)
    assert fixed.action == Action.RERENDEZVOUS and "1 standby node(s) take the place: going on with 3 node(s)" in fixed.reason
    assert fixed.evidence["standbys"] == 1 and fixed.evidence["rdzv_nodes"] == ["n3-desc"]
    assert P.decide_on_node_lost(lost, 3, 3).action == Action.RESTART  # no standby: wait for a replacement
    elastic = P.decide_on_node_lost(lost, 3, 2, standbys=2)  # one lost, one of the two standbys replaces it
    assert elastic.action == Action.RERENDEZVOUS and "going on with 3 node(s)" in elastic.reason
    assert "going on with 2 node(s)" in P.decide_on_node_lost(lost, 3, 2).reason
