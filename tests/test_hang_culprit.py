"""Culprit from stacks: the rank that is not where the others are, and the seed's named causes."""

from __future__ import annotations

from pathlib import Path

from trainguard.detect.culprit import RankView, classify, find_culprit
from trainguard.probes.stacks import Frame

SP = "/venv/lib/python3.11/site-packages/torch"
C10D = f"{SP}/distributed/distributed_c10d.py"


def coll(op: str, line: int = 96, user_func: str = "train_step") -> list[Frame]:
    return [
        Frame(op, C10D, 3252),
        Frame("_exception_logger.<locals>.wrapper", f"{SP}/distributed/c10d_logger.py", 83),
        Frame(user_func, "/job/train.py", line),
        Frame("<module>", "/job/train.py", 200),
    ]


def user(func: str = "train_step", line: int = 91) -> list[Frame]:
    return [Frame(func, "/job/train.py", line), Frame("<module>", "/job/train.py", 200)]


def v(rank: int, frames, state: str = "S", busy: bool = False, **kw) -> RankView:
    return RankView(rank=rank, state=state, frames=frames, busy=busy, **kw)


def test_hang_culprit_stopped_rank() -> None:
    verdict = find_culprit(
        {0: v(0, coll("all_reduce")), 1: v(1, user(), state="T"), 2: v(2, coll("all_reduce"))}
    )
    assert verdict.rank == 1
    assert "stopped" in verdict.reason and "ranks 0,2 wait in all_reduce" in verdict.reason
    assert [c["cause"] for c in verdict.causes][0] == "process_stopped"


def test_hang_culprit_sleeping_rank_outside_the_collective() -> None:
    verdict = find_culprit({0: v(0, user(line=91)), 1: v(1, coll("all_reduce"))})
    assert verdict.rank == 0 and verdict.positions[0].kind == "user" and not verdict.positions[0].busy
    assert "train.py:91" in verdict.reason


def test_hang_culprit_busy_loop_holding_gil() -> None:
    verdict = find_culprit({0: v(0, coll("all_reduce")), 1: v(1, user("spin"), busy=True)})
    assert verdict.rank == 1 and "busy in own code (on CPU)" in verdict.reason
    assert "busy_loop" in [c["cause"] for c in verdict.causes]


def test_hang_culprit_mismatched_collective_minority() -> None:
    views = {
        0: v(0, coll("all_reduce")),
        1: v(1, coll("broadcast", 120, "sync")),
        2: v(2, coll("all_reduce")),
    }
    verdict = find_culprit(views)
    assert verdict.rank == 1 and "mismatched collectives" in verdict.reason
    assert "collective_mismatch" in [c["cause"] for c in verdict.causes]


def test_hang_culprit_two_way_tie_is_not_guessed() -> None:
    verdict = find_culprit({0: v(0, coll("all_reduce")), 1: v(1, coll("barrier", 150, "finish"))})
    assert verdict.rank is None and verdict.candidates == [0, 1]
    assert "no majority" in verdict.reason
    assert "collective_mismatch" in [c["cause"] for c in verdict.causes]


def test_hang_culprit_all_in_the_same_collective() -> None:
    views = {0: v(0, coll("all_reduce")), 1: v(1, coll("all_reduce"))}
    assert find_culprit(views, nnodes=2).rank is None
    assert "another node" in find_culprit(views, nnodes=2).reason
    assert "no local rank is behind" in find_culprit(views, nnodes=1).reason


def test_hang_culprit_exited_rank_and_step_misalignment() -> None:
    views = {
        0: v(0, coll("all_reduce"), last_step=49),
        1: v(1, [], state=""),
        2: v(2, coll("all_reduce"), last_step=49),
    }
    verdict = find_culprit(views)
    assert verdict.rank == 1 and verdict.positions[1].kind == "gone"
    assert "collective_mismatch" in [c["cause"] for c in verdict.causes]


def test_hang_culprit_dataloader() -> None:
    dl = [
        Frame("_try_get_data", f"{SP}/utils/data/dataloader.py", 1100),
        Frame("__next__", f"{SP}/utils/data/dataloader.py", 700),
        Frame("train", "/job/train.py", 50),
    ]
    verdict = find_culprit({0: v(0, coll("all_reduce")), 1: v(1, dl)})
    assert verdict.rank == 1 and verdict.positions[1].kind == "dataloader"
    assert "dataloader" in [c["cause"] for c in verdict.causes]


def test_hang_culprit_init_without_master() -> None:
    init = [
        Frame("_create_c10d_store", f"{SP}/distributed/rendezvous.py", 180),
        Frame("_env_rendezvous_handler", f"{SP}/distributed/rendezvous.py", 260),
        Frame("init_process_group", C10D, 1700),
        Frame("main", "/job/train.py", 10),
    ]
    pos = classify(v(0, init))
    assert pos.kind == "init" and pos.op == "init_process_group"
    verdict = find_culprit({0: v(0, init), 1: v(1, init)})
    assert "init_hang" in [c["cause"] for c in verdict.causes]


def test_hang_culprit_unknown_stack_among_waiters() -> None:
    verdict = find_culprit({0: v(0, coll("all_reduce")), 1: v(1, [], error="py-spy timed out")})
    assert verdict.rank == 1 and verdict.positions[1].kind == "unknown"


def test_hang_phases_from_stacks() -> None:
    save = [Frame("save", f"{SP}/serialization.py", 900), Frame("save_checkpoint", "/job/train.py", 70)]
    assert classify(v(0, save)).phase == "checkpoint"
    barrier_in_save = [Frame("barrier", C10D, 4000), Frame("save_checkpoint", "/job/train.py", 72)]
    pos = classify(v(1, barrier_in_save))
    assert pos.kind == "collective" and pos.phase == "checkpoint"
    assert classify(v(0, user("evaluate"))).phase == "eval"
    assert classify(v(0, user("run_validation"))).phase == "eval"
    assert classify(v(0, user("main.<locals>.eval0.<locals>.<lambda>"))).phase == "eval"  # py-spy's qualified names
    assert classify(v(0, user("medieval_map"))).phase == ""
    # forward passes through any module (model.module or the unwrapped model), under any name
    fwd = [Frame("forward", f"{SP}/nn/modules/linear.py", 125), Frame("_call_impl", f"{SP}/nn/modules/module.py", 1750),
           Frame("generate_samples", "/job/train.py", 40)]  # fmt: skip
    assert classify(v(0, fwd)).phase == "forward" and classify(v(0, fwd)).kind == "forward"
    # activation checkpointing inside every step is not a checkpoint save
    act = [Frame("checkpoint", f"{SP}/utils/checkpoint.py", 480), Frame("forward", "/job/model.py", 30)]
    assert classify(v(0, act)).phase == ""
    assert classify(v(0, user("interval_step"))).phase == ""
    verdict = find_culprit({0: v(0, save), 1: v(1, barrier_in_save)})
    assert verdict.phase == "checkpoint"


def test_hang_named_seed_causes_from_frames() -> None:
    sbn = [
        Frame("forward", f"{SP}/nn/modules/_functions.py", 40),
        Frame("sync_batch_norm_step", "/job/train.py", 5),
    ]
    tb = [
        Frame(
            "flush", "/venv/lib/python3.11/site-packages/tensorboard/summary/writer/event_file_writer.py", 10
        )
    ]
    verdict = find_culprit(
        {0: v(0, coll("all_reduce")), 1: v(1, sbn), 2: v(2, coll("all_reduce"), other_frames=[tb])}
    )
    causes = [c["cause"] for c in verdict.causes]
    assert "sync_batchnorm" in causes and "tensorboard" in causes


def test_hang_culprit_exiting_processes_are_a_phase_not_a_culprit() -> None:
    finalised = "Error: Failed to find a python interpreter in the .data section"
    verdict = find_culprit({0: v(0, [], error=finalised), 1: v(1, [], state="")})
    assert verdict.phase == "exit" and verdict.positions[0].kind == "exiting"
    assert "stuck_at_exit" in [c["cause"] for c in verdict.causes]
    # one rank left while the other still waits in a collective: that one is the culprit
    verdict = find_culprit({0: v(0, [], error=finalised), 1: v(1, coll("all_reduce"))})
    assert verdict.rank == 0 and verdict.phase == ""
    assert "collective_mismatch" in [c["cause"] for c in verdict.causes]


def test_hang_culprit_site_skips_trainguard_wrappers() -> None:
    import trainguard.worker as tw

    wrapper = str(Path(tw.__file__).with_name("hooks.py"))
    frames = [
        Frame("all_reduce", C10D, 3252),
        Frame("collective", wrapper, 229),
        Frame("train_step", "/job/train.py", 96),
    ]
    assert classify(v(0, frames)).site == "train.py:96 in train_step"


def test_hang_culprit_single_local_rank() -> None:
    waiting = {0: v(0, coll("all_reduce"))}
    assert find_culprit(waiting, nnodes=2).rank is None  # its peer is elsewhere
    assert find_culprit(waiting, nnodes=1).rank == 0
    assert find_culprit({5: v(5, user(), state="T")}, nnodes=2).rank == 5


def test_hang_culprit_all_gone_is_the_exit_phase() -> None:
    verdict = find_culprit({1: v(1, [], state="")}, nnodes=2)
    assert verdict.phase == "exit"
    assert find_culprit({0: v(0, [], state=""), 1: v(1, [], state="Z")}).phase == "exit"


def test_hang_culprit_gpu_ranks_wait_in_device_sync() -> None:
    sync = [Frame("synchronize", f"{SP}/cuda/__init__.py", 985), Frame("train_step", "/job/train.py", 60)]
    dl = [Frame("__next__", f"{SP}/utils/data/dataloader.py", 700), Frame("train", "/job/train.py", 50)]
    verdict = find_culprit({0: v(0, sync, busy=True), 1: v(1, dl), 2: v(2, sync, busy=True)})
    assert verdict.positions[0].kind == "device" and verdict.rank == 1
