"""The worker side in real processes: bootstrap through trainguard's worker entry, every span kind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tgtest import SCRIPTS, free_port

from trainguard.monitors.profiling.monitor import sweep_rings
from trainguard.worker import ring as R


def run_worker(script: str, env_extra: dict[str, str], tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), TRAINGUARD_RESTART_COUNT="0", OMP_NUM_THREADS="1")
    env.update(env_extra)
    spec = {"env": env, "cwd": str(tmp_path), "script": script, "args": []}
    return subprocess.run([sys.executable, "-m", "trainguard.spawn.worker_main", json.dumps(spec)],
                          capture_output=True, text=True, timeout=180)


def test_bootstrap_without_profiling_env_does_nothing():
    code = ("import sys; n = len(sys.meta_path); from trainguard.worker import bootstrap, spans; bootstrap.install();"
            "print('torch' in sys.modules, len(sys.meta_path) - n, spans.recorder())")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.stdout.split() == ["False", "0", "None"], out.stderr


@pytest.mark.slow
def test_every_span_kind_from_an_unchanged_script(tmp_path):
    prefix = os.path.join(R.shm_dir(), f"trainguard-{os.getpid()}-0badc0de")
    try:
        out = run_worker(str(SCRIPTS / "profiling_worker.py"),
                         {"TRAINGUARD_RING_PREFIX": prefix, "TRAINGUARD_PROFILING_FLAGS": "3"}, tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "trainguard:" not in out.stderr, "every hook installed"
        got = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        sweep_rings(prefix)
    assert got["steps"] == 8, "2 epochs x 4 batches; the second optimizer does not count"
    per_step = got["per_step"]
    for step in range(1, 9):
        kinds = per_step[str(step)]
        # One batch wait, one top-level forward (DDP, not its inner module nor the loss module),
        # one named span, one step; DDP's bucket all-reduce through the user's own comm hook, plus
        # the previous step's all_gather_object counted once (not its inner all_gather).
        assert kinds == {"DataLoader": 1, "FP": 1, "User": 1, "Step": 1,
                         "Communication": 1 if step == 1 else 2}, (step, kinds)
    assert per_step["9"]["SaveCheckpoint"] == 2, "torch.save and dcp.save, dcp's inner writes not again"
    assert got["names"] == ["fwd+bwd"]
    assert got["hook_calls"] == 8, "the user's comm hook replaced the default and ran"
    assert got["ordered"]
    assert not [n for n in os.listdir(R.shm_dir()) if n.startswith(os.path.basename(prefix))], \
        "the worker removes its ring name at exit"


@pytest.mark.slow
def test_a_broken_ring_never_stops_training(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import torch\nimport trainguard\nwith trainguard.span('x'):\n    pass\nprint('trained')\n")
    out = run_worker(str(script), {"TRAINGUARD_RING_PREFIX": str(tmp_path / "no" / "such" / "dir" / "ring")}, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "trained"
    assert "trainguard: profiling disabled:" in out.stderr


