"""The documents' figures against what they describe: the README's benchmark numbers against the
committed JSON (docs/bench-*.json), its test counts against the collected quick tier. (The
benchmarks page is generated: test_benchmarks_md.py.)"""

import json
import pathlib
import re

import pytest

from conftest import COLLECTED, QUICK, QUICK_BUDGET_S

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _section(text, heading):
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def _gemm_ms(name):
    """{(case, impl): ms} of a committed grouped GEMM benchmark JSON."""
    d = json.loads((ROOT / "docs" / name).read_text())
    return {(r["case"], r["impl"]): r["ms"] for r in d["results"]}


def _printed(value, text):
    """Whether ``text`` (a number as the document prints it) is ``value`` at that precision."""
    decimals = len(text.split(".")[1]) if "." in text else 0
    return f"{value:.{decimals}f}" == text


def _numbers(text):
    return re.findall(r"\d+(?:\.\d+)?", text)


README_COLUMNS = {"exact W4A16": "w4a16_sm90", "exact W4A4": "w4a4_sm90",
                  "fp8 W4A16": "w4a16_fp8", "fp8 W4A4": "w4a4_fp8"}
"""The README's performance table: column heading -> the benchmark's implementation."""


def test_readme_gemm_table_is_the_committed_json():
    perf = _section(README, "Performance")
    assert "`docs/bench-h200-fp8-api.json`" in perf
    ms = _gemm_ms("bench-h200-fp8-api.json")
    lines = [ln for ln in perf.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[0] == "case" and set(header[1:]) <= set(README_COLUMNS), header
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    assert {r[0] for r in rows} == {case for case, _ in ms}, "the table has every case"
    for case, *cells in rows:
        for col, cell in zip(header[1:], cells):
            want = ms[(case, README_COLUMNS[col])]
            assert _printed(want, cell), f"README {case} {col}: {cell}, the JSON has {want}"


def test_readme_layer_sentence_is_the_committed_json():
    """The layer's time and its overhead beyond its two GEMMs (layer / (gemm1 + gemm2) - 1),
    W4A4, per token count, as docs/bench-layer-h200.json has them."""
    m = re.search(r"The layer \(`python -m jax_nvfp4\.bench\.layer`, W4A4, weights prepared\) "
                  r"takes ([\d./ ]+) ms at ([\d/ ]+) tokens per GPU, ([\d./ ]+)% beyond its two "
                  r"GEMMs\s+\(`docs/bench-layer-h200\.json`", " ".join(README.split()))
    assert m, "README: the layer's sentence is not in the form this test reads"
    layer_ms, tokens, overhead = (_numbers(g) for g in m.groups())
    d = json.loads((ROOT / "docs/bench-layer-h200.json").read_text())
    rows = {r["tokens"]: r for r in d["results"] if r["activation"] == "w4a4"}
    assert [int(t) for t in tokens] == sorted(rows) and len(layer_ms) == len(overhead) == len(rows)
    for t, printed_ms, printed_pct in zip(tokens, layer_ms, overhead):
        r = rows[int(t)]
        assert _printed(r["layer_ms"], printed_ms), (t, printed_ms, r["layer_ms"])
        beyond = 100 * (r["layer_ms"] / (r["gemm1_ms"] + r["gemm2_ms"]) - 1)
        assert _printed(beyond, printed_pct), (t, printed_pct, beyond)


def test_readme_fp8_prepared_figures_are_the_committed_json():
    text = " ".join(_section(README, "Performance").split())
    ms = _gemm_ms("bench-h200-fp8-prepared.json")
    m = re.search(r"\(`docs/bench-h200-fp8-prepared\.json`, W4A16 / W4A4\): (.+?): level with",
                  text)
    assert m, "README: the fp8-prepared figures are not in the form this test reads"
    pairs = re.findall(r"(L[12]) (\d+)(?: rows)? ([\d.]+) / ([\d.]+)", m.group(1))
    assert len(pairs) == 4
    for layer, rows, a16, a4 in pairs:
        case = f"{layer} rows {rows}"
        assert _printed(ms[(case, "w4a16_fp8_prepared")], a16), (case, a16)
        assert _printed(ms[(case, "w4a4_fp8_prepared")], a4), (case, a4)
    m = re.search(r"\(L1 192: ([\d.]+) against ([\d.]+)\)", text)
    assert _printed(ms[("L1 rows 192", "w4a16_fp8_prepared")], m.group(1))
    assert _printed(ms[("L1 rows 192", "w4a16_fp8")], m.group(2))
    cases = ["L1 rows 6144", "L1 rows 24576", "L2 rows 6144"]
    m = re.search(r"took ([\d./ ]+) ms at L1 6144 / L1 24576 / L2 6144, and cuBLAS's batched e4m3 "
                  r"GEMM on an even split of the rows \(a bound: no raggedness\) ([\d./ ]+)\.", text)
    for impl, printed in (("torch_fp8_grouped", m.group(1)), ("cublas_fp8_uniform", m.group(2))):
        for case, value in zip(cases, _numbers(printed), strict=True):
            assert _printed(ms[(case, impl)], value), (impl, case, value)
    # 48 V4-Pro experts' w13 [2I, H] and w2 [H, I]: 1 byte per weight, NVFP4 0.5625
    weights = 48 * (2 * 3072 * 7168 + 7168 * 3072)
    assert f"i.e. {weights / 1e9:.2f} GB against {weights * 0.5625 / 1e9:.2f} for 48" in text


def test_readme_quick_tier_counts():
    """The README's "about N tests, M of them without a GPU" against this run's collection of
    the quick tier (neither slow nor multidevice), within 10%; skipped unless this run collected
    every test file."""
    files = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")}
    if not files <= {i.split("::", 1)[0] for i in COLLECTED}:
        pytest.skip("this run did not collect every test file")
    m = re.search(r"runs the quick tier \(about ([\d,]+) tests, ([\d,]+) of them without a GPU",
                  " ".join(README.split()))
    assert m, "README: the quick tier's counts are not in the form this test reads"
    said_all, said_cpu = (int(g.replace(",", "")) for g in m.groups())
    have_all, have_cpu = len(QUICK), sum(not gpu for gpu in QUICK.values())
    for said, have, what in ((said_all, have_all, "tests"), (said_cpu, have_cpu, "CPU tests")):
        assert abs(said - have) <= 0.1 * have, (
            f"README says about {said} quick-tier {what}; {have} are collected: update README.md")


def test_readme_states_the_quick_tier_budget():
    assert f"a quick test taking more than {QUICK_BUDGET_S:g} s fails" in " ".join(README.split())
