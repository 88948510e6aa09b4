"""The test tiers: every id in tests/slow_tests.txt names a collected test (a renamed test would
otherwise silently move back into the quick tier), and ``pairwise`` covers every pair."""

import itertools

import pytest

from conftest import COLLECTED, measured_slow_tests, pairwise


def test_every_listed_slow_test_exists():
    listed = measured_slow_tests()
    files = {i.split("::", 1)[0] for i in listed}
    seen = {i.split("::", 1)[0] for i in COLLECTED}
    if not files <= seen:
        pytest.skip("this run did not collect every file that tests/slow_tests.txt names")
    missing = sorted(listed - COLLECTED)
    assert not missing, f"tests/slow_tests.txt names tests that no longer exist: {missing[:10]}"


@pytest.mark.parametrize("axes,seed", [
    (dict(a=(0, 1), b=(0, 1), c=(0, 1), d=(0, 1), e=(0, 1), f=(0, 1)), [(0,) * 6, (1,) * 6]),
    (dict(f=("x", "y", "z"), l=range(3), p=(0, 1), r=(0, 1), s=(0, 1), y=(0, 1)), []),
])
def test_pairwise_covers_every_pair(axes, seed):
    got = pairwise(axes, seed)
    assert got[:len(seed)] == [tuple(s) for s in seed]
    values = list(axes.values())
    for i, j in itertools.combinations(range(len(values)), 2):
        for vi, vj in itertools.product(values[i], values[j]):
            assert any(t[i] == vi and t[j] == vj for t in got), (i, vi, j, vj)
    full = 1
    for v in values:
        full *= len(v)
    assert len(got) <= full // 4, len(got)
    assert got == pairwise(axes, seed)            # deterministic: test ids must not move
