"""The test tiers: every id in tests/slow_tests.txt names a collected test (a renamed test would
otherwise silently move back into the quick tier), a quick test over the time budget fails
(conftest.py; by CPU time, so a busy machine fails none), and ``pairwise`` covers every pair."""

import itertools
import os
import subprocess
import sys
import textwrap

import pytest

import jax_nvfp4 as jn
from conftest import (COLLECTED, QUICK_BUDGET_ENV, QUICK_BUDGET_S, measured_slow_tests, pairwise,
                      quick_budget_s)


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


def test_a_quick_test_over_the_budget_fails_asking_to_mark_it_slow(tmp_path):
    """conftest.py's budget, in a pytest run of its own with a budget of 0.5 s of CPU time: a
    quick test computing for 1 s of CPU time fails with the message; the same test marked slow,
    a fast one, and one that waits 1.5 s of wall time without computing (as a test does on a
    machine whose cores are busy with other jobs) pass."""
    (tmp_path / "test_budget.py").write_text(textwrap.dedent("""
        import time
        import pytest

        def spin(seconds):
            start = time.process_time()
            while time.process_time() - start < seconds:
                pass

        def test_fast():
            pass

        def test_long():
            spin(1.0)

        def test_waits_for_a_busy_machine():
            time.sleep(1.5)

        @pytest.mark.slow
        def test_long_marked_slow():
            spin(1.0)
    """))
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(os.path.abspath(jn.__file__)))
    path = os.pathsep.join([here, root, *filter(None, os.environ.get("PYTHONPATH", "").split(
        os.pathsep))])

    def run(budget):
        env = dict(os.environ, PYTHONPATH=path, JAX_PLATFORMS="cpu", **{QUICK_BUDGET_ENV: budget})
        return subprocess.run([sys.executable, "-P", "-m", "pytest", "-p", "conftest", "-p",
                               "no:cacheprovider", "-q", "-rf", "test_budget.py"], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=300)

    r = run("0.5")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 failed, 3 passed" in r.stdout, r.stdout
    assert "test_budget.py::test_long used 1." in r.stdout and "of CPU time" in r.stdout
    assert "mark it @pytest.mark.slow" in r.stdout
    assert "test_waits_for_a_busy_machine" not in r.stdout.split("short test summary")[-1]


@pytest.mark.parametrize("raw,budget", [(None, QUICK_BUDGET_S), ("", QUICK_BUDGET_S), ("90", 90.0),
                                        ("0", 0.0), ("-1", 0.0)])
def test_the_budget_setting(raw, budget):
    """The environment variable sets the budget in seconds; 0 (or less) turns the check off."""
    assert quick_budget_s({} if raw is None else {QUICK_BUDGET_ENV: raw}) == budget


def test_a_bad_budget_setting_is_a_usage_error():
    with pytest.raises(pytest.UsageError, match="JAX_NVFP4_TEST_BUDGET_S='a minute': expected seconds"):
        quick_budget_s({QUICK_BUDGET_ENV: "a minute"})
