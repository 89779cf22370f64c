"""Helpers that replaced copies: signal names, CUDA_VISIBLE_DEVICES, the robust outlier test, option types,
and settings built once from `trainguard run`'s flags with their defaults in one place."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from trainguard.detect.robust import median_and_spread, slower
from trainguard.exitcodes import signal_name, signal_number
from trainguard.options import SettingsError, given, number
from trainguard.probes.nvml import GpuId, visible_indices

# --------------------------------------------------------------------------- signal names


@pytest.mark.parametrize(
    "exitcode,given_name,want",
    [
        (-9, None, "SIGKILL"),
        (-11, None, "SIGSEGV"),
        (-15, None, "SIGTERM"),
        (-77, None, "signal 77"),  # a number Python does not name
        (1, None, None),
        (0, None, None),
        (None, None, None),
        (True, None, None),  # not an exit code
        (1, "SIGKILL", "SIGKILL"),  # a name already written down wins
        (-9, "KILL", "SIGKILL"),  # as some tools print it
        (1, "", None),
    ],
)
def test_signal_name(exitcode, given_name, want):
    assert signal_name(exitcode, given_name) == want


def test_signal_number():
    assert signal_number("SIGKILL") == 9 and signal_number("SIGTERM") == 15
    assert signal_number("signal 77") is None and signal_number(None) is None


# --------------------------------------------------------------------- CUDA_VISIBLE_DEVICES

GPUS = [
    GpuId(0, "GPU-1f0e8a3c-0000-0000-0000-00000000aaaa"),
    GpuId(1, "GPU-2b7d1e94-0000-0000-0000-00000000bbbb", mig=("MIG-7a1c0000-1111-2222-3333-444455556666",)),
    GpuId(2, "GPU-2b7d9999-0000-0000-0000-00000000cccc"),
    GpuId(3, "GPU-3c00aa11-0000-0000-0000-00000000dddd"),
]


@pytest.mark.parametrize(
    "spec,want",
    [
        (None, [0, 1, 2, 3]),  # unset: every GPU
        ("", []),  # set and empty: none
        ("2,0", [2, 0]),  # CUDA's order
        (" 3 , 1 ", [3, 1]),
        ("1,7,2", [1]),  # CUDA stops at the first entry that names no device
        ("GPU-3c00aa11-0000-0000-0000-00000000dddd", [3]),  # a full UUID
        ("GPU-1f0e", [0]),  # a unique prefix
        ("GPU-2b7d", []),  # an ambiguous prefix names no device
        ("GPU-2b7d9,0", [2, 0]),  # UUIDs and indices mixed
        ("MIG-7a1c0000-1111-2222-3333-444455556666", [1]),  # a MIG instance counts as its GPU
        ("MIG-GPU-3c00aa11-0000-0000-0000-00000000dddd/1/0", [3]),  # the older MIG form
        ("GPU-ffff", []),
        ("0,,1", [0]),
    ],
)
def test_visible_indices_accept_indices_uuids_and_mig(spec, want):
    assert visible_indices(spec, GPUS) == want


def test_visible_indices_without_nvml_devices():
    assert visible_indices("0,1", []) == [] and visible_indices(None, []) == []


def test_checks_and_hang_monitor_use_the_same_mapping(monkeypatch):
    from trainguard.checks import items
    from trainguard.monitors.hang import monitor as hang
    from trainguard.probes import nvml

    health = [nvml.GpuHealth(g.index, uuid=g.uuid, mig=g.mig) for g in GPUS]
    env = {"CUDA_VISIBLE_DEVICES": "GPU-3c00aa11,MIG-7a1c"}
    assert items.visible_gpu_indices(health, env) == [3, 1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env["CUDA_VISIBLE_DEVICES"])
    monkeypatch.setattr(nvml, "gpu_ids", lambda: GPUS)
    monkeypatch.setattr(nvml, "utilization", lambda indices: [10.0 * i for i in indices])
    gpu = hang._Gpu()
    assert gpu.indices == [3, 1] and gpu.read() == [30.0, 10.0]
    monkeypatch.setattr(nvml, "gpu_ids", lambda: None)  # no NVML: no GPU series (each rank's CPU is used)
    assert hang._Gpu().read() is None


# ------------------------------------------------------------------ robust outlier test


def test_median_and_spread():
    med, spread = median_and_spread([1.0, 1.0, 1.0, 5.0])
    assert med == 1.0 and spread == 0.0
    med, spread = median_and_spread([1.0, 2.0, 3.0])
    assert med == 2.0 and spread == pytest.approx(1.4826)


def test_slower_needs_the_ratio_and_the_robust_margin():
    assert slower(13.0, 10.0, 0.5, k=4.0, ratio=1.25)  # 1.3x and 6 spreads above
    assert not slower(12.0, 10.0, 0.1, k=4.0, ratio=1.25)  # 1.2x: not enough
    assert not slower(13.0, 10.0, 1.0, k=4.0, ratio=1.25)  # within 4 spreads
    assert not slower(10.5, 10.0, 0.0, k=4.0, ratio=1.05, min_delta=1.0)  # under the absolute floor
    assert slower(12.5, 10.0, 0.0, k=4.0, ratio=1.25)  # reaching the bounds is enough...
    assert not slower(12.5, 10.0, 0.0, k=4.0, ratio=1.25, strict=True)  # ...unless strict


# ------------------------------------------------------------------------- option types


def test_number_types_refuse_bad_values_with_one_line():
    minutes = number("minutes")
    assert minutes("2.5") == 2.5
    for bad in ("0", "-1", "nan", "inf", "soon"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected minutes"):
            minutes(bad)
    count = number("a count", integer=True, minimum=0, inclusive=True)
    assert count("0") == 0
    with pytest.raises(argparse.ArgumentTypeError):
        count("1.5")


def test_given_passes_only_what_the_user_set():
    ns = argparse.Namespace(a=None, b=3, c=0)
    assert given(ns, {"x": "a", "y": "b", "z": "c", "w": "missing"}) == {"y": 3, "z": 0}


# ---------------------------------------------- settings: built once, defaults in one place


def run_options(*argv: str) -> argparse.Namespace:
    from trainguard.agent.cli import make_parser

    return make_parser().parse_args([*argv, "train.py"])


def test_settings_without_flags_are_the_dataclass_defaults():
    from trainguard.detect.straggler import StragglerConfig
    from trainguard.monitors import checkpoint as checkpoint_monitor
    from trainguard.monitors import checks as checks_monitor
    from trainguard.monitors import diagnosis as diagnosis_monitor
    from trainguard.monitors import straggler
    from trainguard.monitors.hang import monitor as hang
    from trainguard.monitors.profiling import monitor as profiling

    ns = run_options()
    assert hang.HangSettings.from_options(ns) == hang.HangSettings()
    assert profiling.ProfilingSettings.from_options(ns) == profiling.ProfilingSettings()
    assert straggler.config_from(ns) == StragglerConfig()
    assert diagnosis_monitor.DiagnosisSettings.from_options(ns) == diagnosis_monitor.DiagnosisSettings()
    assert checkpoint_monitor.CheckpointSettings.from_options(ns) == checkpoint_monitor.CheckpointSettings()
    checks = checks_monitor.ChecksSettings.from_options(ns)
    d = checks_monitor.ChecksSettings()
    assert (checks.precheck, checks.node_check, checks.health_interval_s, checks.wait_s) == (
        d.precheck, d.node_check, d.health_interval_s, d.wait_s
    )  # fmt: skip
    plain = dataclasses.replace(checks.check, endpoints=[], nproc_per_node=None)
    assert plain == dataclasses.replace(d.check)
    assert dataclasses.replace(checks.node, peer_host=None, advertise_addr=None) == d.node


def test_settings_follow_the_flags():
    from trainguard.monitors import checkpoint as checkpoint_monitor
    from trainguard.monitors import checks as checks_monitor
    from trainguard.monitors import straggler
    from trainguard.monitors.hang import monitor as hang
    from trainguard.monitors.profiling import monitor as profiling

    ns = run_options(
        "--hang-period", "0.5", "--profiling", "off", "--profiling-comm", "on", "--straggler-window", "7",
        "--ckpt-keep", "5", "--check-disk-root-gb", "8", "--health-check-interval", "0", "--precheck", "off",
        "--node-check-iters", "4", "--rdzv-endpoint", "10.1.2.3:29400",
    )  # fmt: skip
    assert hang.HangSettings.from_options(ns).config.period == 0.5
    p = profiling.ProfilingSettings.from_options(ns)
    assert (p.basic, p.comm, p.flags) == (False, False, 0)  # Communication needs profiling on (seed)
    assert straggler.config_from(ns).window_steps == 7
    assert checkpoint_monitor.CheckpointSettings.from_options(ns).keep == 5
    c = checks_monitor.ChecksSettings.from_options(ns)
    assert (c.check.root_min_gb, c.health_interval_s, c.precheck, c.node.iters) == (8.0, 0.0, False, 4)
    assert c.node.peer_host == "10.1.2.3" and c.check.endpoints == ["10.1.2.3:29400", "127.0.0.1"]  # + --master-addr
    assert not c.node_check and not c.enabled


def test_bad_environment_is_a_settings_error(monkeypatch):
    from trainguard.monitors.hang import monitor as hang

    monkeypatch.setenv("TRAINGUARD_HANG_DETECT_TIME", "-3")
    with pytest.raises(SettingsError, match="TRAINGUARD_HANG_DETECT_TIME='-3'.*--no-hang-detect"):
        hang.HangSettings.from_options(run_options())
    assert hang.HangSettings.from_options(run_options("--no-hang-detect")).enabled is False
