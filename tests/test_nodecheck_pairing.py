"""Pure parts of the node check: pairing rounds, verdict rules, bandwidth units, chaos parsing."""

from __future__ import annotations

import pytest

from trainguard.checks.bench import algbw_busbw, parse_chaos
from trainguard.detect import nodecheck as N

MS = 1e-3


def ok(node, group, t=1.0):
    """A passed test whose iteration takes t ms (split over the three operations)."""
    return N.TestResult(node, tuple(group), True, "", t * MS / 2, t * MS / 4, t * MS / 4)


def bad(node, group, error="exit 17"):
    return N.TestResult(node, tuple(group), False, error)


def run_rounds(n, broken=(), slow=None, k=3.0, ratio=2.0):
    """Simulate the two rounds the way NodeChecker drives them, with broken nodes failing their
    whole group and a slow node (node, factor) slowing its group's collectives."""
    nodes = list(range(n))

    def test(groups):
        out = []
        for g in groups:
            for node in g:
                if any(b in g for b in broken):
                    out.append(bad(node, g, "exit 17" if node in broken else "aborted: partner failed"))
                elif slow and slow[0] in g:
                    out.append(ok(node, g, slow[1] if node == slow[0] else slow[1] / 2))
                else:
                    out.append(ok(node, g))
        return out

    results = [r for wave in N.first_round_waves(nodes) for r in test(wave)]
    suspects = N.round_one_suspects(nodes, results, k, ratio)
    healthy = [x for x in nodes if x not in suspects]
    for wave in N.second_round_waves(suspects, healthy, N.tested_pairs(results)):
        results += test(wave)
    return N.verdict(nodes, results, k, ratio), results


def test_first_round_pairs_neighbours():
    assert N.first_round_waves([0, 1, 2, 3]) == [[(0, 1), (2, 3)]]
    assert N.first_round_waves([3, 2, 1, 0, 5, 4]) == [[(0, 1), (2, 3), (4, 5)]]


def test_first_round_odd_count_pairs_the_last_node_in_a_second_wave():
    assert N.first_round_waves([0, 1, 2]) == [[(0, 1)], [(2, 0)]]
    assert N.first_round_waves([0]) == [[(0,)]]
    assert N.first_round_waves([]) == []


def test_second_round_pairs_suspects_with_healthy_nodes_one_pair_each_per_wave():
    assert N.second_round_waves([2, 3], [0, 1]) == [[(2, 0), (3, 1)]]
    waves = N.second_round_waves([1, 2, 3], [0])
    assert waves == [[(1, 0)], [(2, 0)], [(3, 0)]]
    for wave in N.second_round_waves(list(range(5, 12)), [0, 1, 2]):
        used = [n for g in wave for n in g]
        assert len(used) == len(set(used))
    assert N.second_round_waves([], [0]) == [] and N.second_round_waves([1], []) == []


@pytest.mark.parametrize("n", [3, 4, 5, 6, 7, 8, 16])
def test_every_single_broken_node_is_found_and_nobody_else(n):
    for broken in range(n):
        v, _ = run_rounds(n, broken=(broken,))
        assert list(v.faulty) == [broken], (n, broken, v)
        assert not v.undetermined


def test_two_broken_nodes_in_eight():
    v, _ = run_rounds(8, broken=(2, 5))
    assert sorted(v.faulty) == [2, 5]


def test_two_broken_nodes_in_four_are_located_by_re_pairing_the_suspects():
    v, _ = run_rounds(4, broken=(0, 2))
    assert sorted(v.faulty) == [0, 2] and not v.undetermined


def test_suspects_re_pair_among_themselves_in_untested_pairs_when_none_is_healthy():
    tested = {frozenset((0, 1)), frozenset((2, 0))}
    assert N.second_round_waves([0, 1, 2], [], tested) == [[(1, 2)]]
    assert N.second_round_waves([0, 1], [], {frozenset((0, 1))}) == []


def test_a_broken_node_among_two_cannot_be_located():
    v, _ = run_rounds(2, broken=(1,))
    assert not v.faulty and "no healthy partner" in v.undetermined


def test_single_node_that_fails_is_faulty():
    v = N.verdict([0], [bad(0, (0,))])
    assert list(v.faulty) == [0]


def test_missing_result_counts_as_failure():
    missing = N.missing_results([(0, 1), (2, 3)], [ok(0, (0, 1)), ok(1, (0, 1)), ok(2, (2, 3))])
    assert [(r.node, r.ok) for r in missing] == [(3, False)]
    assert "no result" in missing[0].error


@pytest.mark.parametrize("n,slow", [(4, 1), (4, 2), (5, 4), (8, 6)])
def test_slow_node_is_named_straggler_and_its_partner_cleared(n, slow):
    v, results = run_rounds(n, slow=(slow, 10.0))
    assert list(v.stragglers) == [slow], v
    assert not v.faulty
    assert "x the median" in v.stragglers[slow]
    assert any(
        r.node == slow and len(set(r.group)) == 2
        for r in results
        if r.group not in N.first_round_waves(list(range(n)))[0]
    )


def test_no_straggler_for_ordinary_spread():
    times = {0: 1.0, 1: 1.3, 2: 0.9, 3: 1.6, 4: 1.1}
    assert N.outliers(times) == {}


def test_outlier_needs_both_mad_and_ratio():
    assert N.outliers({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.5}) == {}  # MAD 0, but only 1.5x
    assert list(N.outliers({0: 1.0, 1: 1.0, 2: 1.0, 3: 2.5})) == [3]
    wide = {0: 1.0, 1: 3.0, 2: 5.0, 3: 7.0, 4: 11.0}  # 2.2x the median but within k*MAD
    assert N.outliers(wide) == {}
    assert N.outliers({0: 1.0}) == {}


def test_slow_suspects_use_the_fast_half_as_baseline():
    # A slow node drags its partner: half the nodes look slow in round 1.
    assert N.slow_suspects({0: 1.0, 1: 1.1, 2: 10.0, 3: 5.0}) == {2, 3}
    assert N.slow_suspects({0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3}) == set()


def test_verdict_round_trips_through_dicts():
    r = ok(1, (0, 1))
    assert N.TestResult.from_dict(r.to_dict()) == r
    v, _ = run_rounds(4, broken=(3,))
    d = v.to_dict()
    assert d["faulty"].keys() == {"3"} and len(d["results"]) == len(v.results)


# ----------------------------------------------------------------------------- units


def test_bandwidth_units_follow_nccl_tests():
    # 100 MB all-reduce in 10 ms across 2 ranks: algbw 10 GB/s, busbw 10 * 2(2-1)/2 = 10 GB/s
    assert algbw_busbw("all_reduce", 100_000_000, 0.010, 2) == pytest.approx((10.0, 10.0))
    # 8 ranks: busbw = algbw * 2*7/8
    assert algbw_busbw("all_reduce", 100_000_000, 0.010, 8) == pytest.approx((10.0, 17.5))
    # all-gather of 100 MB output in 10 ms across 4 ranks: busbw = algbw * 3/4
    assert algbw_busbw("all_gather", 100_000_000, 0.010, 4) == pytest.approx((10.0, 7.5))
    assert algbw_busbw("all_reduce", 1, 0.0, 2) == (0.0, 0.0)


def test_dlrover_unit_bug_is_not_repeated():
    # DLRover summed ms-per-matmul with seconds-of-20-all-reduces. Ours: one op, one unit.
    nbytes, seconds_per_op = 4_000_000, 0.004
    alg, _ = algbw_busbw("all_reduce", nbytes, seconds_per_op, 2)
    assert alg == pytest.approx(1.0)  # 4 MB in 4 ms is 1 GB/s, not 51


@pytest.mark.parametrize(
    "value,want", [("", ("", 1.0)), (None, ("", 1.0)), ("fail", ("fail", 1.0)), ("slow:4", ("slow", 4.0))]
)
def test_parse_chaos(value, want):
    assert parse_chaos(value) == want


@pytest.mark.parametrize("value", ["boom", "slow:", "slow:0.5", "slow:x"])
def test_parse_chaos_rejects_bad_values(value):
    with pytest.raises(ValueError):
        parse_chaos(value)


def test_slow_compute_is_found_even_when_shared_collectives_are_noisy():
    # Seen on a loaded 2-core box: collectives 16-25 ms by noise, node 1's GEMM 14x the others'.
    def r(node, group, gemm, ar, ag):
        return N.TestResult(node, group, True, "", gemm * MS, ar * MS, ag * MS)

    results = [
        r(0, (0, 1), 0.41, 24.9, 13.9),
        r(1, (0, 1), 5.95, 20.1, 14.0),
        r(2, (2, 3), 0.42, 17.9, 2.5),
        r(3, (2, 3), 0.44, 16.1, 3.3),
    ]
    v = N.verdict([0, 1, 2, 3], results)
    assert list(v.stragglers) == [1] and v.stragglers[1].startswith("GEMM 5.95 ms per op")
    assert N.outliers(N._best(results, "iteration_s")) == {}  # the sum alone would miss it
