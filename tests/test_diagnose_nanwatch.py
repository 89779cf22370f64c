"""NaN read from the training numbers (nanwatch.py) and where a log without errors stopped (progress.py)."""

from __future__ import annotations

import json
from pathlib import Path

from trainguard.diagnose import diagnose_paths
from trainguard.diagnose.nanwatch import NanWatch
from trainguard.diagnose.progress import step_of


def _feed(lines: list[str]) -> tuple[str | None, str | None]:
    nan = NanWatch()
    for line in lines:
        verdict = nan.feed(0, line)
        if verdict:
            return verdict, nan.anchor
    return None, None


def _jsonl(losses: list[float], total: int = 1000) -> list[str]:
    return [
        json.dumps({"current_steps": 10 * (i + 1), "total_steps": total, "loss": v, "lr": 1e-5})
        for i, v in enumerate(losses)
    ]


def test_a_loss_that_jumps_to_exactly_zero_and_stays_is_nan():
    lines = _jsonl([1.52, 1.48, 1.41, 1.39, 0.0, 0.0, 0.0, 0.0])
    verdict, anchor = _feed(lines)
    assert verdict is not None and "collapsed to exactly 0.0" in verdict
    assert anchor == lines[4]  # the record where it began, not the one where the watch was sure


def test_hf_dict_logs_collapse_too():
    lines = [
        f"{{'loss': {v}, 'learning_rate': 2e-05, 'epoch': 0.{i}}}"
        for i, v in enumerate([0.9, 0.8, 0.85, 0.0, 0.0, 0.0])
    ]
    verdict, _ = _feed(lines)
    assert verdict is not None


def test_a_loss_that_decays_to_zero_is_over_fitting_not_nan():
    # a tiny data set learnt by heart: 4-digit loss reaches 0.0 gradually
    verdict, _ = _feed(_jsonl([1.2, 0.6, 0.2, 0.04, 0.003, 0.0001, 0.0, 0.0, 0.0, 0.0]))
    assert verdict is None


def test_rl_losses_that_start_at_zero_or_touch_it_once_are_not_nan():
    # TRL GRPO: loss is 0.0 at the start (policy == reference) and small after
    assert _feed(_jsonl([0.0, 0.0, 0.0, 0.0001, 0.02, 0.0, 0.03]))[0] is None
    # one exact zero between normal values
    assert _feed(_jsonl([1.0, 0.9, 0.8, 0.0, 0.7, 0.0, 0.6]))[0] is None


def test_persistent_nan_grad_norm_is_nan_and_a_single_one_is_not():
    lines = [f"{{'loss': 1.2, 'grad_norm': {g}, 'epoch': 0.1}}" for g in ("1.3", "nan", "nan", "nan")]
    verdict, _ = _feed(lines)
    assert verdict is not None and "gradient norm" in verdict
    # one NaN followed by finite values is a skipped fp16 step
    assert _feed([f"{{'loss': 1.2, 'grad_norm': {g}}}" for g in ("1.3", "nan", "1.1", "0.9")])[0] is None


def test_llamafactory_trainer_log_steps_count_as_progress():
    st = step_of('{"current_steps": 610, "total_steps": 3120, "loss": 1.2, "lr": 4e-06}')
    assert st is not None and (st.n, st.total) == (610, 3120) and st.unfinished
    assert not step_of('{"current_steps": 3120, "total_steps": 3120, "loss": 1.2}').unfinished


def test_trainer_log_that_stops_short_is_a_hang_live_only_and_a_finished_one_is_healthy(tmp_path: Path):
    short = tmp_path / "short" / "trainer_log.jsonl"
    short.parent.mkdir()
    short.write_text("\n".join(_jsonl([1.5 - i / 100 for i in range(40)], total=3000)) + "\n")
    # offline a log that ends on normal progress is no failure; a hang is only offered
    res = diagnose_paths([str(short)])
    assert res["category"] == "healthy", res["summary"]
    assert any(h["category"] == "hang_no_error" for h in res["hypotheses"])
    # live, the agent knows the job stopped: short of its total, with no error, it hung or was stopped
    res = diagnose_paths([str(short)], failures={0: {"exitcode": -15, "signal": "SIGTERM"}})
    assert res["category"] == "hang_no_error", res["summary"]
    done = tmp_path / "done" / "trainer_log.jsonl"
    done.parent.mkdir()
    done.write_text("\n".join(_jsonl([1.5 - i / 100 for i in range(40)], total=400)) + "\n")
    assert diagnose_paths([str(done)])["category"] == "healthy"


def test_deepspeed_skipping_nearly_every_step_is_nan_a_few_skips_are_not():
    line = "[Rank 0] step={}, skipped={}, lr=[0.001, 0.001], mom=[0.0, 0.0]"
    verdict, _ = _feed([line.format(500, 496)])
    assert verdict is not None and "skipped 496 of 500" in verdict
    assert _feed([line.format(500, 7), line.format(1000, 9)]) == (None, None)
    assert _feed([line.format(20, 20)]) == (None, None)  # too early to tell: the loss scale is settling
