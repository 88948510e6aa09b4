"""A stratified random sample of mutmut mutants, tested directly (docs/developing.md).

Run from the repository root, with the package built in place and mutmut 3 installed::

    nice -n 10 python tools/mutation_sample.py --seed 58 --per-module 25 --time-budget 3600 \
        --out mutation_sample.json                        # every mutated module but the skipped
    python tools/mutation_sample.py --names n1 n2 ... --tests <node ids> --out rerun.json
    python tools/mutation_sample.py --out mutation_sample.json --report judged.json   # the table

1. Generates ``mutants/`` with mutmut's own generator (no stats pass; an existing ``mutants/`` is
   reused, ``rm -rf mutants`` after changing the source).
2. Draws up to ``--per-module`` mutants per module (``random.Random(seed)``) and orders them
   round-robin across modules, so that a time budget that runs out leaves every module sampled.
3. In one worker process (``cwd=mutants/``): one coverage pass over the modules' mirror test
   files (quick tier) records which tests call which function, and each test's duration; then
   for each mutant: ``MUTANT_UNDER_TEST=<name>``, ``jax.clear_caches()`` and the test files'
   ``lru_cache``s cleared (nothing traced or computed under another mutant is reused), and
   ``pytest -x`` over the mirror tests that call the mutated function (those of any file in the
   pass where the mirror files never call it; "no tests" where none does). A mutant whose tests
   take longer than 10x their clean time + 20 s is killed by timeout, as mutmut counts it; a
   worker that dies (a hang in native code) is restarted and its mutant counted the same way.

4. The tests that killed something are run once unmutated in the mutated copy: one that fails
   there (e.g. a check of the caller's frame, which the trampolines change) is deselected and its
   kills are run again.

Verdicts go to ``--out`` (JSON: per mutant its module, verdict, seconds, test count, the killing
test) as they come; a second call with the same ``--out`` goes on where the first stopped. The
extension must lie in ``jax_nvfp4/`` when ``mutants/`` is made (it is copied from there).
"""

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = "jax_nvfp4"
SKIP = ("bench", "_extension")  # not mutated (pyproject.toml [tool.mutmut] do_not_mutate)
# Modules whose mirror file is not tests/test_<module>.py alone: the obvious neighbours.
MIRRORS = {
    "dispatch": ["test_dispatch.py", "test_fp8.py"],
    "formats": ["test_formats.py", "test_fp8.py"],
    "gemm_args": ["test_gemm_args.py", "test_gemm.py"],
    "varying": ["test_sharding.py", "test_gemm.py"],
    "nn": ["test_nn.py"],
    "moe_files": ["test_checkpoint.py"],
}
PYTEST_ARGS = ["-q", "-p", "no:cacheprovider", "-m", "not slow and not multidevice and not gpu",
               "--deselect", "tests/test_checkpoint.py::test_inverted_weight_scale_2_warns",
               "--deselect", "tests/test_options.py::test_fallback_warning_names_the_calling_line"]


def mirror_files(module):
    parts = module.split(".")  # maths.formats: formats; nn.eqx: nn
    key = parts[0] if parts[0] == "nn" else parts[-1]
    files = MIRRORS.get(key, [f"test_{key}.py"])
    return [f"tests/{f}" for f in files if (ROOT / "tests" / f).exists()]


def generate():
    """mutmut's generation step alone (mutmut 3.x internals: copy, then mutate); the tests are
    copied again on every run, so that new tests are used."""
    os.chdir(ROOT)
    from mutmut.__main__ import create_mutants  # noqa: PLC0415
    from mutmut.utils.file_utils import copy_also_copy_files, copy_src_dir  # noqa: PLC0415
    if not (ROOT / "mutants" / PKG).exists():
        Path("mutants").mkdir(exist_ok=True)
        copy_src_dir()
        create_mutants(1)
    copy_also_copy_files()


def all_mutants():
    """{module: [mutant names]} from the .meta files mutmut writes next to each mutated file."""
    out = {}
    for meta in sorted((ROOT / "mutants" / PKG).rglob("*.py.meta")):
        rel = meta.relative_to(ROOT / "mutants" / PKG).with_suffix("").with_suffix("")
        module = ".".join(rel.parts).removesuffix(".__init__")
        if module.split(".")[0] in SKIP:
            continue
        names = sorted(json.loads(meta.read_text())["exit_code_by_key"])
        if names:
            out[module] = names
    return out


def draw(mutants, modules, per_module, seed, exclude):
    rng = random.Random(seed)
    queues = []
    for m in modules:
        pool = [n for n in mutants[m] if not any(e in n for e in exclude)]
        queues.append(rng.sample(pool, min(per_module, len(pool))))
    order = []
    for i in range(max(map(len, queues), default=0)):
        order += [q[i] for q in queues if i < len(q)]
    return order


def module_of(name):
    return name.split("__mutmut_")[0].rsplit(".", 1)[0][len(PKG) + 1:]


def function_of(name):
    """The key under which the trampoline reports a hit: module.x_function (or xǁClassǁmethod)."""
    return name.split("__mutmut_")[0]


# ---------------------------------------------------------------- the worker (cwd = mutants/)

def worker(args):
    import pytest  # noqa: PLC0415
    # the verdicts go to the driver on the original stdout; the tests' output nowhere
    report = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    os.environ["MUTANT_UNDER_TEST"] = ""
    # import the mutated copy, never the checkout (an in-place editable install's finder or
    # path entry points at the checkout)
    sys.meta_path[:] = [f for f in sys.meta_path if "Inplace" not in type(f).__name__]
    sys.path[:] = [os.getcwd()] + [p for p in sys.path if Path(p or ".").resolve() != ROOT]
    if args.clean:  # which of these tests fail unmutated (in the mutated copy, trampolines on)
        failed = FailedTests()
        pytest.main([*PYTEST_ARGS, *args.clean], plugins=[failed])
        print(json.dumps({"clean_failed": failed.all}), file=report, flush=True)
        return
    cov_path = Path(args.coverage)
    if args.tests:
        cov = {"hits": {}, "durations": {}}
    elif cov_path.exists():
        cov = json.loads(cov_path.read_text())
    else:
        cov = coverage_pass(pytest, args.files)
        cov_path.write_text(json.dumps(cov))
    import jax  # noqa: PLC0415  (after the pass: tests/conftest.py sets XLA_FLAGS first)
    from mutmut.mutation import trampoline  # noqa: PLC0415
    for name in args.names:
        tests = [t for t in cov["hits"].get(function_of(name), [])
                 if t.split("::")[0] in mirror_files(module_of(name))]
        if not tests:
            tests = cov["hits"].get(function_of(name), [])
        if args.tests:  # a re-run against named tests (new ones are not in the coverage pass)
            tests = list(args.tests)
        print(json.dumps({"start": name}), file=report, flush=True)
        if not tests:
            print(json.dumps({"name": name, "verdict": "no tests", "s": 0, "tests": 0}), file=report,
                  flush=True)
            continue
        tests.sort(key=lambda t: cov["durations"].get(t, 1.0))  # quick kills first
        limit = 10 * sum(cov["durations"].get(t, 1.0) for t in tests) + 20 if not args.tests else 600
        jax.clear_caches()
        clear_test_caches()
        os.environ["MUTANT_UNDER_TEST"] = name
        trampoline.set_mutant_under_test(name)
        t0 = time.time()
        failed = FailedTests()
        deselect = [a for t in [*(args.deselect or ()), *cov.get("failed", ())]
                    for a in ("--deselect", t)]
        rc = run_with_alarm(pytest, ["-x", *PYTEST_ARGS, *deselect, *tests], limit, failed)
        dt = time.time() - t0
        os.environ["MUTANT_UNDER_TEST"] = ""
        trampoline.set_mutant_under_test("")
        verdict = ("timeout" if rc == "timeout" else "survived" if rc == 0 else
                   "killed" if rc == 1 else f"killed (pytest exit {rc})")
        print(json.dumps({"name": name, "verdict": verdict, "s": round(dt, 1), "tests": len(tests),
                          "by": failed.first}), file=report, flush=True)


class FailedTests:
    """The tests that failed, first first (one that fails unmutated too is no kill)."""

    def __init__(self):
        self.all = []

    @property
    def first(self):
        return self.all[0] if self.all else None

    def pytest_runtest_logreport(self, report):
        if report.failed and report.nodeid not in self.all:
            self.all.append(report.nodeid)


class _Timeout(BaseException):
    pass


def run_with_alarm(pytest, argv, limit, plugin):
    import faulthandler  # noqa: PLC0415
    import signal  # noqa: PLC0415

    def on_alarm(*_):
        raise _Timeout
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(int(limit) + 1)
    # a hang in native code never returns to the handler: the process exits, the driver goes on
    faulthandler.dump_traceback_later(2 * limit + 60, exit=True)
    try:
        return int(pytest.main(argv, plugins=[plugin]))
    except _Timeout:
        return "timeout"
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def clear_test_caches():
    for mod in list(sys.modules.values()):
        if (getattr(mod, "__file__", None) or "").startswith(os.path.join(os.getcwd(), "tests")):
            for v in list(vars(mod).values()):
                if callable(getattr(v, "cache_clear", None)):
                    v.cache_clear()


def coverage_pass(pytest, files):
    """Runs the files once, unmutated, recording {function: [tests calling it]} and durations."""
    from mutmut.mutation import trampoline  # noqa: PLC0415
    hits, durations, current = {}, {}, [None]

    def record(name, caller=None):
        if current[0] is not None:
            hits.setdefault(name, {})[current[0]] = None

    class Plugin:
        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_protocol(self, item, nextitem):
            current[0] = item.nodeid
            t0 = time.time()
            yield
            durations[item.nodeid] = time.time() - t0
            current[0] = None

    trampoline.record_trampoline_hit = record
    os.environ["MUTANT_UNDER_TEST"] = "stats"
    trampoline.set_mutant_under_test("stats")
    t0 = time.time()
    failed = FailedTests()
    rc = pytest.main([*PYTEST_ARGS, *files], plugins=[Plugin(), failed])
    os.environ["MUTANT_UNDER_TEST"] = ""
    trampoline.set_mutant_under_test("")
    print(json.dumps({"coverage_pass_s": round(time.time() - t0), "rc": int(rc)}),
          file=sys.stderr, flush=True)
    return {"hits": {k: list(v) for k, v in hits.items()}, "durations": durations,
            "failed": failed.all}


# ---------------------------------------------------------------- the report

def wilson(k, n, z=1.96):
    if n <= 0:
        return (0.0, 1.0)
    p = k / n
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5 / (1 + z * z / n)
    return (max(0.0, c - h), min(1.0, c + h))


def report(results, population, equivalent, known):
    """Per module: sampled / killed / survived / equivalent, and the score of the meaningful
    mutants. ``equivalent``: {name: reason}; a re-run's verdict may replace the first.
    ``known``: {module: (caught, meaningful)} for modules run in full, weighted as exact.
    Package-wide: the stratified estimate (each module weighted by its mutant count), with a
    Wilson interval on the effective sample size p(1-p)/var (Kish)."""
    rows, est_c, est_m, var = [], 0.0, 0.0, 0.0
    by_mod = {}
    for name, r in results.items():
        by_mod.setdefault(r["module"], []).append((name, r["verdict"]))
    for mod in sorted(by_mod):
        v = by_mod[mod]
        n = len(v)
        eq = sum(name in equivalent for name, _ in v)
        killed = sum(verdict.startswith(("killed", "timeout")) for _, verdict in v)
        surv = n - killed - eq
        meaningful = killed + surv
        lo, hi = wilson(killed, meaningful)
        rows.append((mod, population[mod], n, killed, surv, eq, killed / max(meaningful, 1), lo, hi))
        big = population[mod]
        est_m += big * meaningful / n
        est_c += big * killed / n
        var += (big * meaningful / n) ** 2 * (killed / max(meaningful, 1)) * (
            1 - killed / max(meaningful, 1)) / max(meaningful, 1)
    for mod, (c, m) in known.items():
        est_c += c
        est_m += m
    p = est_c / est_m
    var /= est_m ** 2
    n_eff = p * (1 - p) / var if var > 0 else float("inf")
    return rows, p, wilson(p * n_eff, n_eff) if var > 0 else (p, p), n_eff


# ---------------------------------------------------------------- the driver

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seed", type=int, default=58)
    p.add_argument("--per-module", type=int, default=25)
    p.add_argument("--time-budget", type=float, default=3600, help="seconds for the mutants")
    p.add_argument("--modules", nargs="*", help="default: every mutated module")
    p.add_argument("--skip-modules", nargs="*", default=[], help="e.g. modules already fully run")
    p.add_argument("--exclude", nargs="*", default=[], help="substrings of names not to draw")
    p.add_argument("--names", nargs="*", help="run these mutants (no draw)")
    p.add_argument("--tests", nargs="*", help="with --names: run these tests (node ids or "
                   "files) against each mutant instead of those the coverage pass found")
    p.add_argument("--out", default="mutation_sample.json")
    p.add_argument("--report", metavar="JUDGED", help="print the table of --out; JUDGED: a JSON "
                   "file {\"equivalent\": {name: reason}, \"rerun\": {name: verdict}, "
                   "\"known\": {module: [caught, meaningful]}, \"untestable\": [name]}")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--files", nargs="*", help=argparse.SUPPRESS)
    p.add_argument("--coverage", help=argparse.SUPPRESS)
    p.add_argument("--clean", nargs="*", help=argparse.SUPPRESS)
    p.add_argument("--deselect", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.report:
        data = json.loads(Path(args.out).read_text())
        judged = json.loads(Path(args.report).read_text())
        results = {n: r for n, r in data["mutants"].items()
                   if n not in judged.get("untestable", ())}      # e.g. code run at import
        for name, verdict in judged.get("rerun", {}).items():
            results[name] = dict(results[name], verdict=verdict)
        rows, p, (lo, hi), n_eff = report(results, data["meta"]["population"],
                                          judged.get("equivalent", {}), judged.get("known", {}))
        print("| module | mutants | sampled | killed | survived | equivalent | score (95% Wilson) |")
        print("|---|---|---|---|---|---|---|")
        for mod, big, n, k, sv, eq, sc, a, b in rows:
            print(f"| {mod} | {big} | {n} | {k} | {sv} | {eq} | {sc:.0%} ({a:.0%}-{b:.0%}) |")
        print(f"package-wide estimate: {p:.1%} (95% {lo:.1%}-{hi:.1%}, effective n {n_eff:.0f})")
        return None

    generate()
    mutants = all_mutants()
    if args.names:
        order = args.names
    else:
        modules = [m for m in (args.modules or mutants) if m not in args.skip_modules]
        order = draw(mutants, modules, args.per_module, args.seed, args.exclude)
    files = sorted({f for n in order for f in mirror_files(module_of(n))})
    out = Path(args.out).resolve()
    coverage = out.with_suffix(".coverage.json")
    results = json.loads(out.read_text())["mutants"] if out.exists() else {}
    meta = dict(seed=args.seed, per_module=args.per_module, pytest_args=PYTEST_ARGS,
                population={m: len(v) for m, v in mutants.items()})
    saved = json.loads(out.read_text())["meta"] if out.exists() else {}
    meta["fail_unmutated"] = bad = saved.get("fail_unmutated", [])
    meta["checked_killers"] = checked = saved.get("checked_killers", [])
    deadline = time.time() + args.time_budget
    todo = [n for n in order if n not in results]
    while todo and time.time() < deadline:
        run_batch(args, todo, files, coverage, bad, results, meta, out, deadline)
        # a kill by a test that fails unmutated (in the mutated copy) is none: deselect, re-run
        killers = sorted({r["by"] for r in results.values() if r.get("by")} - set(checked))
        if killers:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--clean", *killers]
            lines = subprocess.run(cmd, cwd=ROOT / "mutants", stdout=subprocess.PIPE, text=True,
                                   check=False).stdout.splitlines()
            failing = json.loads(lines[-1])["clean_failed"] if lines else []
            checked += killers
            bad += failing
            for name in [n for n, r in results.items() if r.get("by") in failing]:
                del results[name]
            out.write_text(json.dumps(dict(meta=meta, mutants=results), indent=1))
        todo = [n for n in order if n not in results]
    summary = {}
    for r in results.values():
        s = summary.setdefault(r["module"], {})
        v = r["verdict"].split(" ")[0]
        s[v] = s.get(v, 0) + 1
    print(json.dumps(summary, indent=1))


def run_batch(args, todo, files, coverage, bad, results, meta, out, deadline):
    """One worker over the mutants to do, until it ends, dies or the budget runs out."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--coverage",
           str(coverage), "--files", *files, "--names", *todo]
    cmd += ["--tests", *args.tests] if args.tests else []
    cmd += ["--deselect", *bad] if bad else []
    proc = subprocess.Popen(cmd, cwd=ROOT / "mutants", stdout=subprocess.PIPE, text=True)
    started = None
    for line in proc.stdout:
        rec = json.loads(line)
        if "start" in rec:
            started = rec["start"]
        else:
            rec["module"] = module_of(rec["name"])
            results[rec.pop("name")] = rec
            started = None
            out.write_text(json.dumps(dict(meta=meta, mutants=results), indent=1))
            print(rec["module"], rec["verdict"], rec["s"], flush=True)
        if time.time() > deadline:
            proc.kill()
            started = None  # cut by the budget, not a verdict
            break
    proc.wait()
    if started is not None:  # the worker died inside this mutant's tests
        results[started] = dict(module=module_of(started), verdict="timeout (worker died)",
                                s=None, tests=None)
        out.write_text(json.dumps(dict(meta=meta, mutants=results), indent=1))


if __name__ == "__main__":
    main()
