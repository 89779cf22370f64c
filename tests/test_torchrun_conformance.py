"""bench/conformance.py's scenarios that cover distinct code paths of trainguard's torchrun
compatibility, run with both launchers: each must observe what torchrun observes (documented
differences aside). The whole suite: python bench/conformance.py."""

from __future__ import annotations

import pytest
from tgtest import bench_module

pytestmark = pytest.mark.slow

conformance = bench_module("conformance")
# parser abbreviations + --redirect/--tee + the prefix template; torch's files under --log-dir (tee
# with --local-ranks-filter); two agents of one job on one host; bad --nnodes (one line, exit 2); the
# workers' environment: its names, and the values of the rank and TORCHELASTIC_* ones across a
# restart; torchrun's restart on a Python exception (--restart-on-error)
CHOSEN = ("capture-logs", "tee-filter-files", "multiple-agents", "nnodes-bad", "worker-env", "worker-env-values",
          "raise-once-restart-on-error")
SCENARIOS = {s.name: s for s in conformance.scenarios()}


@pytest.mark.parametrize("name", CHOSEN)
def test_same_as_torchrun(name, tmp_path):
    sc = SCENARIOS[name]
    results, problems = conformance.run_scenario(sc, tmp_path)
    assert not problems, (problems, {k: (r.out[-3000:], r.err[-3000:]) for k, r in results.items()})
