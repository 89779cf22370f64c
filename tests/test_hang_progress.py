"""Pure progress detector (detect.progress) and the verdict (detect.verdict) over synthetic
samples: what counts as progress, and the verdict on a stall (watch / suspected / detected) for
the healthy phases and the faults, before and at the window."""

from __future__ import annotations

import dataclasses

from trainguard.detect.culprit import RankView, find_culprit
from trainguard.detect.hang import HangConfig, phase_allowance
from trainguard.detect.progress import (
    BUSY,
    GONE,
    IDLE,
    PROGRESSING,
    STALLED,
    STOPPED,
    UNKNOWN,
    RankSamples,
    judge_progress,
)
from trainguard.detect.verdict import JobWindow, Limits, judge_stall, stopped_proof
from trainguard.probes.stacks import Frame

SP = "/venv/lib/python3.11/site-packages/torch"
C10D = f"{SP}/distributed/distributed_c10d.py"
MODULE = f"{SP}/nn/modules/module.py"
CFG = HangConfig(period=1.0, detect_time=600.0, window=5.0, phase_floor=60.0)


def barrier() -> tuple[Frame, ...]:
    return (
        Frame("barrier", C10D, 4100),
        Frame("train", "/job/train.py", 80),
        Frame("<module>", "/job/train.py", 200),
    )


def all_reduce() -> tuple[Frame, ...]:
    return (
        Frame("all_reduce", C10D, 2500),
        Frame("train", "/job/train.py", 70),
        Frame("<module>", "/job/train.py", 200),
    )


def forward(line: int) -> tuple[Frame, ...]:
    """An evaluation through model.module: inside nn.Module.__call__, on a moving line."""
    return (
        Frame("forward", f"{SP}/nn/modules/linear.py", 125),
        Frame("_call_impl", MODULE, 1750),
        Frame("_wrapped_call_impl", MODULE, 1739),
        Frame("run_generation", "/job/train.py", line),
        Frame("<module>", "/job/train.py", 200),
    )


def user(func: str = "train", line: int = 60) -> tuple[Frame, ...]:
    return (Frame(func, "/job/train.py", line), Frame("<module>", "/job/train.py", 200))


def samples(rank: int, stacks, cpu_per_s: float = 0.0, io_moves: bool = False, state: str = "S",
            spans=(), gpu=(), own_cpu_per_s: float | None = None) -> RankSamples:  # fmt: skip
    n = len(stacks)
    times = [100.0 + i for i in range(n)]
    own = cpu_per_s if own_cpu_per_s is None else own_cpu_per_s
    return RankSamples(
        rank,
        times=times,
        states=[state] * n,
        cpu=[cpu_per_s * i for i in range(n)],
        io=[(i if io_moves else 7, 0) for i in range(n)],
        stacks=list(stacks),
        spans=list(spans),
        gpu=list(gpu),
        own_cpu=[own * i for i in range(n)],
    )


# --- judge_progress -------------------------------------------------------------------------------


def test_progress_moving_stack_is_progress() -> None:
    p = judge_progress(
        samples(0, [forward(10), forward(11), forward(12), forward(10), forward(13), forward(11)]), CFG
    )
    assert p.kind == PROGRESSING and "stack" in p.moved


def test_progress_same_frame_on_cpu_is_busy_not_idle() -> None:
    p = judge_progress(samples(0, [user("spin", 5)] * 6, cpu_per_s=1.0), CFG)
    assert p.kind == BUSY and p.cpu_percent == 100.0 and p.progressing


def test_progress_same_frame_no_cpu_no_io_is_idle() -> None:
    p = judge_progress(samples(1, [user("sleepy", 41)] * 6), CFG)
    assert p.kind == IDLE and not p.progressing


def test_progress_new_collectives_are_progress_even_in_one_all_reduce_stack() -> None:
    """Gradient accumulation that all-reduces a flag per micro-batch (bench/hang.py's fsdp2_accum):
    under load every stack sample can land in the same all_reduce, while the rank's collective
    counter moves. A counter that stands still (or is unknown) is no progress."""
    base = samples(0, [all_reduce()] * 6, cpu_per_s=0.2)
    moving = dataclasses.replace(base, collectives=[40, 41, 41, 43, 44, 46])
    p = judge_progress(moving, CFG, waiting=True)
    assert p.kind == PROGRESSING and p.moved == ("collectives",) and "new collectives" in p.describe()
    for still in ([40] * 6, [None] * 6, []):
        assert judge_progress(dataclasses.replace(base, collectives=still), CFG, waiting=True).kind == IDLE


def test_progress_io_counts_but_not_for_a_waiting_rank() -> None:
    assert judge_progress(samples(0, [user("save", 3)] * 6, io_moves=True), CFG).kind == PROGRESSING
    # a rank in a collective: a logging thread's writes or comm threads' CPU say nothing
    waiting = judge_progress(samples(1, [barrier()] * 6, cpu_per_s=0.5, io_moves=True), CFG, waiting=True)
    assert waiting.kind == IDLE


def test_progress_spans_and_gpu_count() -> None:
    assert judge_progress(samples(0, [user()] * 6, spans=[1, 1, 2, 2, 3, 3]), CFG).moved == ("spans",)
    flat = samples(0, [user()] * 6, gpu=[100.0] * 6)
    assert judge_progress(flat, CFG).kind == IDLE  # seed 000: flat variance and median is "no change"
    moving = samples(0, [user()] * 6, gpu=[10.0, 90.0, 10.0, 90.0, 10.0, 90.0])
    assert judge_progress(moving, CFG).moved == ("gpu",)


def test_progress_stopped_and_d_state_and_gone_are_never_progress() -> None:
    # SIGSTOP right after a save: the frames still show the checkpoint code, CPU was high before
    stopped = judge_progress(samples(1, [user("save_checkpoint", 9)] * 6, state="T"), CFG)
    assert stopped.kind == STOPPED and not stopped.progressing
    assert judge_progress(samples(1, [user()] * 6, state="D"), CFG).kind == STALLED
    assert (
        judge_progress(samples(1, [user()] * 6, state="D", io_moves=True), CFG).kind == PROGRESSING
    )  # slow disk, still writing
    assert judge_progress(samples(1, [user()] * 3, state=""), CFG).kind == GONE


def test_progress_too_few_samples_is_unknown() -> None:
    assert judge_progress(RankSamples(0), CFG).kind == UNKNOWN
    assert judge_progress(samples(0, [user()]), CFG).kind == UNKNOWN


def test_progress_children_computing_is_progress_of_the_waiting_rank() -> None:
    """DataLoader workers decoding: the rank's own frame stands still in the queue, its own CPU is
    nil, its children's CPU moves."""
    dl = (Frame("_next_data", f"{SP}/utils/data/dataloader.py", 1300), Frame("train", "/job/train.py", 50))
    p = judge_progress(samples(0, [dl] * 6, cpu_per_s=1.5, own_cpu_per_s=0.0), CFG)
    assert p.kind == PROGRESSING and p.moved == ("children",) and "child processes compute" in p.describe()
    spin = judge_progress(samples(0, [user("spin", 5)] * 6, cpu_per_s=1.0), CFG)
    assert spin.kind == BUSY  # its own CPU, on one frame: no child computes


# --- judge_stall ----------------------------------------------------------------------------------

QUIET = JobWindow(io_quiet=700.0, util_flat=True)  # the seed's condition holds job-wide
ALIVE_IO = JobWindow(io_quiet=1.0, util_flat=True, io_bytes=5 << 20)


def limits(threshold: float = 6.0, learned: dict[str, float] | None = None, cfg: HangConfig = CFG) -> Limits:
    learned = learned or {}
    return Limits(
        threshold=threshold,
        detect_time=cfg.detect_time,
        allowance=lambda r, ph: phase_allowance(learned.get(ph), threshold, cfg, recognised=bool(ph)),
        idle_cpu=cfg.idle_cpu,
    )


def judged(views: dict[int, RankView], stacks: dict[int, list], opts: dict[int, dict] | None = None):
    verdict = find_culprit(views)
    opts = opts or {}
    progress = {r: judge_progress(samples(r, stacks[r], **opts.get(r, {})), CFG, waiting=verdict.positions[r].waiting)
                for r in views}  # fmt: skip
    return verdict, progress


def test_stall_rank0_evaluation_while_others_wait_is_watched_then_suspected_never_detected() -> None:
    """A once-false kill: rank 0 evaluates (through model.module) for 40 s, the others wait."""
    ev = [forward(10 + i % 3) for i in range(6)]
    views = {
        0: RankView(0, "R", ev[-1], busy=True),
        1: RankView(1, "S", barrier()),
        2: RankView(2, "S", barrier()),
    }
    verdict, progress = judged(
        views, {0: ev, 1: [barrier()] * 6, 2: [barrier()] * 6}, {0: {"cpu_per_s": 1.0}}
    )
    assert progress[0].kind == PROGRESSING and verdict.positions[0].phase == "forward"
    sv = judge_stall(verdict, progress, 40.0, limits())
    assert sv.state == "watch" and sv.culprit == 0 and sv.limit == 60.0  # the phase floor
    sv = judge_stall(verdict, progress, 90.0, limits())
    assert sv.state == "suspected" and sv.culprit == 0 and "progressing" in sv.why
    # the seed's window: no I/O and flat CPU job-wide, but rank 0's stack moves on CPU: alive
    sv = judge_stall(verdict, progress, 600.0, limits(), job=QUIET)
    assert (sv.state, sv.rule, sv.culprit) == ("suspected", "window", 0) and "rank 0 progresses" in sv.why
    assert judge_stall(verdict, progress, 5000.0, limits(), job=QUIET).state == "suspected"  # every window


def test_window_without_progress_or_io_is_a_hang_and_with_io_is_not() -> None:
    """At --hang-detect-time the seed's rule: no I/O anywhere, flat utilisation, nobody progressing.
    A rank that only polls (its stack moves with no CPU) is not progress at the window."""
    views = {0: RankView(0, "S", all_reduce()), 1: RankView(1, "S", user("poll_flag", 12))}
    polls = [user("poll_flag", 12 + i % 2) for i in range(6)]
    verdict, progress = judged(views, {0: [all_reduce()] * 6, 1: polls})
    assert progress[1].kind == PROGRESSING and progress[1].moved == ("stack",)
    sv = judge_stall(verdict, progress, 600.0, limits(), {}, job=QUIET)
    assert (sv.state, sv.rule, sv.culprit) == ("detected", "detect-time", 1) and "no I/O" in sv.why
    sv = judge_stall(verdict, progress, 600.0, limits(), {}, job=ALIVE_IO)
    assert sv.state == "suspected" and "did I/O" in sv.why and "5.0 MB since the last step" in sv.why
    moving_util = JobWindow(io_quiet=700.0, util_flat=False)
    assert judge_stall(verdict, progress, 600.0, limits(), {}, job=moving_util).state == "suspected"
    assert judge_stall(verdict, progress, 600.0, limits(), {}, job=None).state == "suspected"  # no window view


def test_stall_learned_allowance_grows_with_the_jobs_own_phases() -> None:
    ev = [forward(10 + i % 3) for i in range(6)]
    views = {0: RankView(0, "R", ev[-1], busy=True), 1: RankView(1, "S", barrier())}
    verdict, progress = judged(views, {0: ev, 1: [barrier()] * 6}, {0: {"cpu_per_s": 1.0}})
    assert (
        judge_stall(verdict, progress, 100.0, limits(learned={"forward": 45.0})).state == "watch"
    )  # 3 × 45 s


def test_stall_stopped_rank_after_a_save_is_detected_at_once() -> None:
    """HF Trainer case: a rank frozen just after a save is not 'saving a checkpoint'."""
    views = {0: RankView(0, "S", barrier()), 1: RankView(1, "T", user("_save_checkpoint", 9))}
    verdict, progress = judged(
        views, {0: [barrier()] * 6, 1: [user("_save_checkpoint", 9)] * 6}, {1: {"state": "T"}}
    )
    sv = judge_stall(verdict, progress, 8.0, limits(learned={"checkpoint": 600.0}))
    assert sv.state == "detected" and sv.culprit == 1 and "stopped" in sv.why


def test_stall_gone_rank_is_a_culprit_only_while_a_peer_waits_for_it() -> None:
    """A rank that finished and left while its peer uploads is not a culprit; the same rank gone
    while its peer waits in a collective for it is."""
    upload = [user("upload", 30 + i % 3) for i in range(6)]
    views = {0: RankView(0, "S", upload[-1]), 1: RankView(1, "", ())}
    verdict, progress = judged(views, {0: upload, 1: [()] * 3}, {0: {"io_moves": True}, 1: {"state": ""}})
    assert progress[1].kind == GONE
    assert judge_stall(verdict, progress, 30.0, limits()).state != "detected"
    views = {0: RankView(0, "S", all_reduce()), 1: RankView(1, "", ())}
    verdict, progress = judged(views, {0: [all_reduce()] * 6, 1: [()] * 3}, {1: {"state": ""}})
    sv = judge_stall(verdict, progress, 8.0, limits())
    assert (sv.state, sv.culprit) == ("detected", 1)


def test_stopped_rank_is_proof_before_the_step_threshold() -> None:
    """A rank stopped for a whole window while its peers wait is detected without waiting
    for the step threshold (which grows with slow steps under load); a short stop, or a peer still
    working outside a collective, is left to the usual rules."""
    views = {0: RankView(0, "S", all_reduce()), 1: RankView(1, "T", user("train", 66))}
    verdict, progress = judged(views, {0: [all_reduce()] * 6, 1: [user("train", 66)] * 6}, {1: {"state": "T"}})
    sv = stopped_proof(verdict, progress, {1: 5.0}, hold_s=5.0)
    assert sv is not None and (sv.state, sv.culprit, sv.rule, sv.limit) == ("detected", 1, "steps", 5.0)
    assert "stopped" in sv.why and "peers wait" in sv.why
    assert stopped_proof(verdict, progress, {1: 4.0}, hold_s=5.0) is None  # not a whole window yet
    healthy, _ = judged(views, {0: [all_reduce()] * 6, 1: [user("train", 66)] * 6})
    assert stopped_proof(healthy, _, {}, hold_s=5.0) is None  # nobody stopped
    ev = [forward(10 + i % 3) for i in range(6)]
    busy = {0: RankView(0, "R", ev[-1], busy=True), 1: RankView(1, "T", user("train", 66))}
    verdict, progress = judged(busy, {0: ev, 1: [user("train", 66)] * 6}, {0: {"cpu_per_s": 1.0}, 1: {"state": "T"}})
    assert stopped_proof(verdict, progress, {1: 9.0}, hold_s=5.0) is None  # rank 0 works outside a collective


def test_stall_idle_rank_before_the_collective_is_detected() -> None:
    views = {0: RankView(0, "S", all_reduce()), 1: RankView(1, "S", user("train", 66))}
    verdict, progress = judged(views, {0: [all_reduce()] * 6, 1: [user("train", 66)] * 6})
    sv = judge_stall(verdict, progress, 8.0, limits())
    assert sv.state == "detected" and sv.culprit == 1 and sv.rule == "steps"


def test_stall_mismatched_collectives_detected() -> None:
    bc = (
        Frame("broadcast", C10D, 2600),
        Frame("sync", "/job/train.py", 120),
        Frame("<module>", "/job/train.py", 200),
    )
    views = {0: RankView(0, "S", all_reduce()), 1: RankView(1, "S", bc), 2: RankView(2, "S", all_reduce())}
    verdict, progress = judged(views, {0: [all_reduce()] * 6, 1: [bc] * 6, 2: [all_reduce()] * 6})
    sv = judge_stall(verdict, progress, 8.0, limits())
    assert sv.state == "detected" and sv.culprit == 1


def test_stall_rank_serialising_inside_an_object_collective_is_no_mismatch() -> None:
    """broadcast_object_list: rank 0 still pickles its payload (its __getstate__ runs) while
    rank 1 waits in the same call: rank 0 is not waiting, and working is no hang."""
    bol = f"{SP}/distributed/distributed_c10d.py"

    def pickling(line: int) -> tuple[Frame, ...]:
        return (Frame("__getstate__", "/job/index.py", line), Frame("_object_to_tensor", bol, 3000),
                Frame("broadcast_object_list", bol, 3300), Frame("sync_index", "/job/train.py", 40))  # fmt: skip

    waiting = (Frame("broadcast", bol, 2600), Frame("broadcast_object_list", bol, 3320),
               Frame("sync_index", "/job/train.py", 40))  # fmt: skip
    views = {0: RankView(0, "R", pickling(10), busy=True), 1: RankView(1, "S", waiting)}
    verdict, progress = judged(views, {0: [pickling(10)] * 6, 1: [waiting] * 6}, {0: {"cpu_per_s": 1.0}})
    assert verdict.positions[0].kind == "serialising" and not verdict.positions[0].waiting
    assert verdict.rank == 0 and "serialising its side of broadcast_object_list" in verdict.reason
    assert progress[0].kind == BUSY
    assert judge_stall(verdict, progress, 30.0, limits()).state == "suspected"  # never a mismatch
    # ... and one spinning there on one frame with no I/O is judged at the window
    sv = judge_stall(verdict, progress, 600.0, limits(), job=QUIET)
    assert (sv.state, sv.culprit) == ("detected", 0)


def test_stall_busy_loop_is_a_suspicion_until_the_window_then_detected() -> None:
    """A rank busy on the very same frame: long work or a loop, never told apart before the
    window; at the window, with no I/O and flat utilisation job-wide, a spin."""
    views = {0: RankView(0, "S", all_reduce()), 1: RankView(1, "R", user("spin", 5), busy=True)}
    verdict, progress = judged(
        views, {0: [all_reduce()] * 6, 1: [user("spin", 5)] * 6}, {1: {"cpu_per_s": 1.0}}
    )
    assert progress[1].kind == BUSY
    for stall in (8.0, 300.0, 599.0):
        sv = judge_stall(verdict, progress, stall, limits(learned={"": 2.0}))
        assert sv.state == "suspected" and sv.culprit == 1, stall
    sv = judge_stall(verdict, progress, 700.0, limits(), job=QUIET)
    assert sv.state == "detected" and sv.culprit == 1 and "no rank progressing" in sv.why
    assert judge_stall(verdict, progress, 700.0, limits(), job=ALIVE_IO).state == "suspected"


def test_stall_all_ranks_evaluating_without_collective_is_watched() -> None:
    evs = {r: [forward(20 + (i + r) % 4) for i in range(6)] for r in (0, 1)}
    views = {r: RankView(r, "R", evs[r][-1], busy=True) for r in (0, 1)}
    verdict, progress = judged(views, evs, {0: {"cpu_per_s": 1.0}, 1: {"cpu_per_s": 1.0}})
    assert judge_stall(verdict, progress, 30.0, limits()).state == "watch"


def test_stall_dataloader_blocking_while_workers_compute_is_watched() -> None:
    dl = (Frame("_next_data", f"{SP}/utils/data/dataloader.py", 1300), Frame("train", "/job/train.py", 50),
          Frame("<module>", "/job/train.py", 200))  # fmt: skip
    views = {0: RankView(0, "S", dl), 1: RankView(1, "S", dl)}
    # the main threads block on the queue; their worker processes (the tree's CPU) compute
    verdict, progress = judged(
        views, {0: [dl] * 6, 1: [dl] * 6}, {0: {"cpu_per_s": 1.5}, 1: {"cpu_per_s": 1.5}}
    )
    assert {p.kind for p in progress.values()} == {BUSY}
    sv = judge_stall(verdict, progress, 20.0, limits())
    assert sv.state == "watch" and sv.phase == "dataloader"


def test_stall_waiting_for_more_samples() -> None:
    views = {0: RankView(0, "S", all_reduce()), 1: RankView(1, "S", user())}
    verdict = find_culprit(views)
    progress = {r: judge_progress(samples(r, [views[r].frames]), CFG) for r in views}
    assert judge_stall(verdict, progress, 8.0, limits()).state == "watch"
    assert judge_stall(verdict, progress, 600.0, limits(), job=QUIET).state == "watch"  # the window waits too


def test_window_needs_several_stack_samples_before_calling_a_rank_still() -> None:
    """A job without steps is first looked at when the seed's rule opens the watch, at the window
    itself: /proc samples for the whole window but one stack sample of a busy rank (tokenising)
    say nothing about its stack moving."""
    views = {r: RankView(r, "R", user("tokenise", 112), busy=True) for r in (0, 1)}
    verdict = find_culprit(views)
    full = {r: samples(r, [user("tokenise", 112)] * 6, cpu_per_s=1.0) for r in views}
    one = {r: judge_progress(dataclasses.replace(full[r], stacks=full[r].stacks[-1:]), CFG) for r in views}
    assert one[0].kind == BUSY and one[0].samples == 1
    assert judge_stall(verdict, one, 600.0, limits(), {}, job=QUIET).state == "watch"
    four = {r: judge_progress(dataclasses.replace(full[r], stacks=full[r].stacks[-4:]), CFG) for r in views}
    assert judge_stall(verdict, four, 600.0, limits(), {}, job=QUIET).state == "detected"  # then a spin
