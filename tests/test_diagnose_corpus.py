"""The diagnosis corpus: every case under tests/corpus/<category>/<case>/ gets its expected verdict."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from trainguard.diagnose import diagnose_paths
from trainguard.diagnose.prefilter import _hs

CORPUS = Path(__file__).resolve().parent / "corpus"
CASES = sorted(p.parent for p in CORPUS.glob("*/*/expected.json"))
ENGINES = ["re"] + (["hyperscan"] if _hs is not None else [])


def _failures(case: Path) -> dict[int, dict] | None:
    f = case / "failures.json"
    return {int(k): v for k, v in json.loads(f.read_text()).items()} if f.exists() else None


def check(result: dict, exp: dict, case: Path) -> None:
    assert result["category"] == exp["category"], (case, result["summary"], result["first_failure"])
    assert result["category"] == case.parent.name  # the folder names the category
    ff = result["first_failure"] or {}
    if "rank" in exp:
        assert ff.get("rank") == exp["rank"], ff
    if "host" in exp:
        assert ff.get("host") == exp["host"], ff
    if "line_contains" in exp:
        assert exp["line_contains"] in ff.get("line", ""), ff
    if "confidence" in exp:
        assert result["confidence"] == exp["confidence"]
    ids = [f["id"] for f in result["findings"]]
    for fid in exp.get("findings", []):
        assert fid in ids, (ids, result["findings"])
    for text in exp.get("fix_contains", []):
        assert text in result["fix"], result["fix"]
    if "suspects" in exp:
        assert next(f for f in result["findings"] if f["id"] == "suspect_ranks")["ranks"] == exp["suspects"]
    if "ranks_behind" in exp:
        lag = next(
            f for f in result["findings"] if f["id"] in ("data_misaligned", "ranks_at_different_steps")
        )
        assert lag["ranks_behind"] == exp["ranks_behind"]
    if "warnings" in exp:
        assert [w["message"] for w in result["slowdown"]["warnings"]] == exp["warnings"]
    if result["category"] not in ("healthy", "slowdown"):
        assert result["evidence"] and result["fix"]
    json.dumps(result)  # JSON-able as it is


def test_corpus_covers_every_category():
    cats = {c.parent.name for c in CASES}
    want = {"nccl_timeout", "nccl_network", "cuda_oom", "gpu_hardware", "cuda_error_other", "rendezvous_failure",
            "dataloader", "host_oom", "disk_full_or_io", "python_exception", "nan_loss", "segfault",
            "hang_no_error", "slowdown", "healthy", "killed_external", "environment"}  # fmt: skip
    assert want <= cats, want - cats


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", CASES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_corpus_case(case: Path, engine: str):
    exp = json.loads((case / "expected.json").read_text())
    result = diagnose_paths([case], failures=_failures(case), engine=engine)
    check(result, exp, case)


@pytest.mark.parametrize("case", [c for c in CASES if c.parent.name in ("cuda_oom", "python_exception")][:2],
                         ids=lambda p: p.name)  # fmt: skip
def test_corpus_case_gzipped_and_by_glob(case: Path, tmp_path: Path):
    """The same verdict from .gz copies found through a glob."""
    for f in case.iterdir():
        if f.name.endswith(".log"):
            with open(f, "rb") as src, gzip.open(tmp_path / (f.name + ".gz"), "wb") as dst:
                shutil.copyfileobj(src, dst)
    exp = json.loads((case / "expected.json").read_text())
    result = diagnose_paths([str(tmp_path / "*.log.gz")], failures=_failures(case))
    assert result["stats"]["files"] >= 1
    check(result, exp, case)


def test_capped_read_keeps_the_verdict(tmp_path: Path):
    """A long log read with a small cap (head + tail) still finds an error in its tail."""
    case = next(c for c in CASES if c.name == "oom_then_watchdog")
    for f in case.glob("rank-*.log"):
        lines = f.read_text().splitlines(keepends=True)
        filler = "".join(
            f"2026-11-20T09:{i // 600 % 60:02d}:{i % 60:02d}.000000 [rank{f.stem[-1]}]: iteration {i:>6}/ 100000 | ok\n"
            for i in range(60000)
        )
        (tmp_path / f.name).write_text(filler + "".join(lines))
    result = diagnose_paths([tmp_path], max_bytes_per_file=64 << 10)
    assert result["category"] == "cuda_oom" and result["first_failure"]["rank"] == 2
    assert result["stats"]["bytes"] < 4 * ((1 << 20) + (64 << 10))
