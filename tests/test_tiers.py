"""The test tiers: every id in tests/slow_tests.txt names a collected test (a renamed test would
otherwise silently move back into the quick tier)."""

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import measured_slow_tests


@pytest.mark.slow     # collects every listed file in a subprocess (~20 s on 2 cores)
def test_every_listed_slow_test_exists():
    tests_dir = Path(__file__).resolve().parent
    files = sorted({i.split("::", 1)[0] for i in measured_slow_tests()})
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          *[str(tests_dir.parent / f) for f in files]],
                         capture_output=True, text=True, cwd=tests_dir.parent, check=False).stdout
    collected = {"tests/" + line.split("tests/", 1)[-1].strip() for line in out.splitlines() if "::" in line}
    missing = sorted(measured_slow_tests() - collected)
    assert not missing, f"tests/slow_tests.txt names tests that no longer exist: {missing[:10]}"
