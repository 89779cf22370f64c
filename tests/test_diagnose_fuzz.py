"""Fuzz: diagnosis never crashes on arbitrary bytes, lines and failure info."""

from __future__ import annotations

import json

import pytest

from trainguard.diagnose import diagnose_paths
from trainguard.diagnose.lines import iso, parse_line
from trainguard.diagnose.prefilter import Prefilter, _hs

hypothesis = pytest.importorskip("hypothesis")  # in the test extras; skip rather than break without it
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

ENGINES = ["re"] + (["hyperscan"] if _hs is not None else [])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=4096), lines=st.lists(st.text(max_size=200), max_size=20))
def test_fuzz_diagnose_never_crashes(tmp_path_factory, data: bytes, lines: list[str]):
    d = tmp_path_factory.mktemp("fuzz")
    (d / "rank-0.log").write_bytes(data)
    (d / "rank-1.log").write_text(
        "\n".join(f"2026-11-21T09:30:01.000000 [rank1]: {x}" for x in lines), errors="replace"
    )
    for engine in ENGINES:
        r = diagnose_paths(
            [d],
            engine=engine,
            failures={1: {"exitcode": -9, "signal": None, "error_file_data": {"message": data[:50].hex()}}},
        )
        json.dumps(r)


@given(st.text(max_size=300))
@settings(max_examples=300, deadline=None)
def test_fuzz_parse_line(line: str):
    info = parse_line(line, 2026)
    assert isinstance(info.message, str)
    iso(info.time)


_KWS = ["Error", "NaN", "nan", "Timed out", "CUDA error", "a\\b", "xx(", "Signal 9 ("]


@given(
    st.lists(
        st.lists(
            st.sampled_from(_KWS + ["rror", "Err", "Timed", " out", "x", "\n", "É", "[rank1]: "]), max_size=12
        ),
        max_size=30,
    )
)
@settings(max_examples=200, deadline=None)
def test_fuzz_prefilter_engines_agree_with_a_plain_search(parts):
    buf = "\n".join("".join(p) for p in parts).encode()
    want = [ln for ln in buf.split(b"\n") if any(k.encode() in ln for k in _KWS)]
    for engine in ENGINES:
        got = [buf[s:e] for s, e in Prefilter(_KWS, engine).lines(buf)]
        assert got == want, engine
