"""Test setup: 8 CPU devices (set before JAX starts), the GPU skip/require switch, and the
quantizer jitted for the operand makers."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import jax
import numpy as np
import pytest

try:
    jax.config.update("jax_num_cpu_devices", 8)
except (AttributeError, RuntimeError):  # older jax, or backends already up: XLA_FLAGS covers it
    pass

REQUIRE_GPU = os.environ.get("JAX_NVFP4_REQUIRE_GPU", "") not in ("", "0")

import jax_nvfp4 as _jn  # noqa: E402

# The quantizer compiled once per shape for the tests' operand makers: called eagerly, its ~40
# operations are each dispatched and compiled on their own (seconds per new shape on the CPU).
QUANTIZE = jax.jit(_jn.quantize)
QUANTIZE_STACK = jax.jit(jax.vmap(_jn.quantize))


def gpu_devices():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def skip_or_fail(reason: str):
    """Skip, or fail when JAX_NVFP4_REQUIRE_GPU=1 (GPU machines must run every GPU test)."""
    if REQUIRE_GPU:
        pytest.fail(f"JAX_NVFP4_REQUIRE_GPU=1 but: {reason}")
    pytest.skip(reason)


def cpu_devices(n):
    """The first n CPU devices. Multi-device tests run on these on every machine (this file makes
    8, on GPU machines too), whatever the default backend is."""
    devs = jax.devices("cpu")
    if len(devs) < n:
        pytest.fail(f"needs {n} CPU devices (tests/conftest.py sets 8), have {len(devs)}")
    return devs[:n]


@pytest.fixture
def on_cpu():
    """Makes a CPU device the default one for the test (on a GPU machine the default is a GPU)."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture
def rng(request):
    """A numpy Generator seeded from the test's name: fresh, reproducible inputs per test."""
    return np.random.default_rng(sum(request.node.name.encode()))


def pytest_sessionstart(session):
    """Stop at once, naming the cause, when the tests import a source tree that holds no
    compiled extension (e.g. ``python -m pytest`` from the repository root, where the checkout
    shadows the installed package)."""
    from jax_nvfp4 import _extension  # noqa: PLC0415
    msg = _extension.source_tree_shadowing()
    if msg is not None:
        pytest.exit(f"jax_nvfp4 tests: {msg}", returncode=4)


SLOW_TESTS_FILE = os.path.join(os.path.dirname(__file__), "slow_tests.txt")


def measured_slow_tests() -> set:
    """Node ids (``tests/test_x.py::name[params]``) listed in tests/slow_tests.txt."""
    with open(SLOW_TESTS_FILE) as f:
        return {line.strip() for line in f if line.strip() and not line.startswith("#")}


COLLECTED: set = set()
"""Every node id this process collected, before ``-m`` deselects any (test_tiers.py)."""
QUICK: dict = {}
"""Node id -> whether it needs a GPU, for every collected test of the quick tier (neither ``slow``
nor ``multidevice``), before ``-m`` deselects any (test_docs.py checks the README's counts)."""

QUICK_BUDGET_ENV = "JAX_NVFP4_TEST_BUDGET_S"
QUICK_BUDGET_S = 60.0
"""A quick-tier test whose call uses more CPU time than this (seconds of the test process's CPU
time, all its threads, ``time.process_time``; the environment variable ``JAX_NVFP4_TEST_BUDGET_S``
overrides it, 0 turns the check off) fails, asking to be marked slow: the README's test command
must stay well under 10 minutes on 2 cores. CPU time, not wall time, so that a busy machine (other
jobs on the same cores) cannot fail a correct test: waiting for a core costs wall time only.
Generous on purpose (the slowest quick tests use ~10-20 s of CPU time)."""


def quick_budget_s(environ=os.environ) -> float:
    """The per-test budget of the quick tier in seconds (0: no check), from ``environ``."""
    raw = environ.get(QUICK_BUDGET_ENV, "").strip()
    if not raw:
        return QUICK_BUDGET_S
    try:
        value = float(raw)
    except ValueError:
        raise pytest.UsageError(f"{QUICK_BUDGET_ENV}={raw!r}: expected seconds (0 turns the "
                                "check off)") from None
    return max(value, 0.0)


def in_quick_tier(item) -> bool:
    return item.get_closest_marker("slow") is None and item.get_closest_marker("multidevice") is None


def pairwise(axes: dict, seed=()) -> list:
    """A covering array of strength two: tuples, one value per axis, such that every pair of
    values of any two axes occurs in at least one tuple. Starts from the tuples in ``seed``
    (e.g. the quick tier's cases), then adds greedily the tuple of the full product that covers
    the most uncovered pairs (the first one on ties): deterministic, and for the matrices here a
    tenth of the full product. What it leaves out are interactions of three or more axes."""
    import itertools  # noqa: PLC0415
    values = list(axes.values())
    n = len(values)

    def pairs(t):
        return {(i, t[i], j, t[j]) for i in range(n) for j in range(i + 1, n)}

    todo = set().union(*(pairs(t) for t in itertools.product(*values)))
    chosen = []
    for t in seed:
        chosen.append(tuple(t))
        todo -= pairs(t)
    candidates = list(itertools.product(*values))
    while todo:
        best = max(candidates, key=lambda t: len(pairs(t) & todo))
        chosen.append(best)
        todo -= pairs(best)
    return chosen


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks (registered in pyproject.toml): ``gpu`` for tests that need a GPU (they skip
    without one), ``multidevice`` for tests on 8 CPU devices (``cpu_devices``) or several GPUs,
    ``slow`` for the tests measured slowest on a 2-core CPU (tests/slow_tests.txt)."""
    import inspect  # noqa: PLC0415
    slow = measured_slow_tests()
    COLLECTED.update("tests/" + item.nodeid.split("tests/", 1)[-1] for item in items)
    for item in items:
        if "tests/" + item.nodeid.split("tests/", 1)[-1] in slow:
            item.add_marker(pytest.mark.slow)
        params = getattr(getattr(item, "callspec", None), "params", {})
        name = item.nodeid.lower()
        on_gpu = any(isinstance(v, str) and v == "gpu" for v in params.values())  # (arrays too)
        if on_gpu or "cuda" in name or "gpus" in item.path.name:
            item.add_marker(pytest.mark.gpu)
        try:
            src = inspect.getsource(item.function)
        except (OSError, TypeError):
            src = ""
        if ("cpu_devices(" in src or item.path.name.startswith("test_sharding")
                or "bench_ep" in item.path.name):
            item.add_marker(pytest.mark.multidevice)
        if in_quick_tier(item):
            QUICK["tests/" + item.nodeid.split("tests/", 1)[-1]] = item.get_closest_marker("gpu") is not None


CPU_TIME_KEY = pytest.StashKey[float]()
"""The CPU time (seconds) of a test's call phase, stored on the item by pytest_runtest_call."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Measures the CPU time of the test's call: this process's, all threads (XLA compiles on
    threads of its own), so that time spent waiting for a busy machine's cores is not counted."""
    import time  # noqa: PLC0415
    start = time.process_time()
    try:
        yield
    finally:
        item.stash[CPU_TIME_KEY] = time.process_time() - start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """The quick tier's time budget: a passing call of a test that is neither ``slow`` nor
    ``multidevice`` (nor ``gpu``: GPU runs, e.g. under compute-sanitizer, have their own limits)
    fails when it used more CPU time than :func:`quick_budget_s`. Wall time is not checked (the
    README's ``--durations=10`` reports it): a loaded machine stretches wall time, not CPU time.
    Tests marked slow are never checked, so ``-m slow`` runs check nothing."""
    outcome = yield
    report = outcome.get_result()
    budget = quick_budget_s()
    if (report.when != "call" or not report.passed or budget <= 0 or not in_quick_tier(item)
            or item.get_closest_marker("gpu") is not None):
        return
    cpu = item.stash.get(CPU_TIME_KEY, 0.0)
    if cpu <= budget:
        return
    report.outcome = "failed"
    report.longrepr = (
        f"{item.nodeid} used {cpu:.1f} s of CPU time ({report.duration:.1f} s wall), over the "
        f"quick tier's budget of {budget:g} s of CPU time per test: mark it @pytest.mark.slow (or "
        f"list it in tests/slow_tests.txt) so that the README's test command stays short "
        f"({QUICK_BUDGET_ENV}=0 turns this check off)")
