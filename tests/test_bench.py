"""jax_nvfp4.bench's pieces on small shapes: every timed implementation computes the same GEMM
(a benchmark of different computations would compare nothing), and the helpers are right."""

import ast
import importlib
import importlib.util
import json
import math
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as jn
from jax_nvfp4.bench import gemm as bench, tokamax_peers as bench_tokamax, torch_peers as bench_torch
from oracles import dequant64, grouped_gemm64, rel_err
from conftest import QUANTIZE_STACK


@pytest.mark.slow
def test_every_implementation_computes_the_same_gemm():
    g, n, k, rows = 4, 128, 128, 40
    key = jax.random.key(0)
    rhs = QUANTIZE_STACK(jax.random.normal(key, (g, n, k), jnp.float32))
    x = jax.random.normal(jax.random.key(1), (rows, k), jnp.bfloat16)
    sizes = jnp.asarray(bench.skewed_group_sizes(rows, g, seed=2))
    fns, _, rhs_fp8 = bench.impl_fns(x, rhs, sizes)
    assert isinstance(rhs_fp8, jn.Fp8Weights)
    assert set(fns) == set(bench.IMPLS) - {"pallas_mgpu", *bench_torch.TORCH_IMPLS,
                                           *bench_tokamax.TOKAMAX_IMPLS}
    w64 = dequant64(rhs.data, rhs.scales, rhs.global_scale)
    ref16 = grouped_gemm64(np.asarray(x, np.float64), w64, np.ones(g), np.asarray(sizes))
    xq = jn.quantize(x.astype(jnp.float32))
    ref4 = grouped_gemm64(dequant64(xq.data, xq.scales, xq.global_scale), w64, np.ones(g),
                          np.asarray(sizes))
    for name, (f, args) in fns.items():
        out = np.asarray(f(*args), np.float64)
        if name in bench.UNIFORM_IMPLS:
            # a bound, not this GEMM: a batched GEMM of its own operands (the rows split evenly)
            a, w = (np.asarray(v, np.float64) for v in args)
            want = np.einsum("gmk,gnk->gmn" if name == "cublas_fp8_uniform" else "gmk,gkn->gmn",
                             a, w)
            assert out.shape == (g, 10, n), name
            assert rel_err(out, want) <= 1e-2, name                 # bf16 output
            continue
        assert out.shape == (rows, n), name
        ref = ref4 if name.startswith("w4a4") else ref16
        if name in bench.FP8_IMPLS:
            # the fp8 mode: e4m3 rounding of both operands (about 3%), and exactly the fp8
            # reference's GEMM up to float32 summation order and the bf16 output
            assert 1e-3 < rel_err(out, ref) <= 0.06, name
            fp8_ref = jn.grouped_gemm(args[0], args[1], args[2], backend="reference",
                                      precision="fp8", out_dtype=jnp.float32)
            assert rel_err(out, fp8_ref) <= 4e-3, name
        else:
            assert rel_err(out, ref) <= 1e-2, name          # bf16 outputs
    for prepared, base in bench.FP8_PREPARED.items():       # the same numbers, bit for bit here
        np.testing.assert_array_equal(np.asarray(fns[prepared][0](*fns[prepared][1])),
                                      np.asarray(fns[base][0](*fns[base][1])), prepared)


def test_uniform_rows_pads_the_last_group():
    x = jnp.arange(7 * 3, dtype=jnp.float32).reshape(7, 3)
    u = bench.uniform_rows(x, 3)                              # ceil(7 / 3) = 3 rows per group
    assert u.shape == (3, 3, 3)
    np.testing.assert_array_equal(np.asarray(u).reshape(9, 3)[:7], np.asarray(x))
    assert not np.asarray(u).reshape(9, 3)[7:].any()


def test_torch_fp8_operands_are_the_prepared_weights_values():
    """The torch fp8 peer's operands (numpy, no torch needed): the weights times scale_b are the
    prepared fp8 weights' values exactly, the row-wise e4m3 tokens times scale_a are the tokens
    within e4m3 rounding, so its GEMM is the fp8 mode's within the activations' rounding."""
    g, n, k, rows = 3, 64, 128, 24
    rhs = QUANTIZE_STACK(jax.random.normal(jax.random.key(3), (g, n, k), jnp.float32))
    w8 = jn.prepare_weights(rhs, "fp8")
    x = jax.random.normal(jax.random.key(4), (rows, k), jnp.bfloat16)
    a, scale_a, b, scale_b = bench_torch.fp8_operands(x, w8.logical_codes(), w8.global_scale)
    assert a.dtype.name == b.dtype.name == "float8_e4m3fn"
    assert a.shape == (rows, k) and b.shape == (g, n, k)
    assert scale_a.shape == (rows,) and scale_b.shape == (g, n)
    assert scale_a.dtype == scale_b.dtype == np.float32
    w_value = b.astype(np.float64) * scale_b[..., None]
    want = (np.asarray(w8.logical_codes(), np.float64) * 8.0
            * np.asarray(w8.global_scale, np.float64)[:, None, None])
    np.testing.assert_array_equal(w_value, want)
    x64 = np.asarray(x, np.float64)
    assert rel_err(a.astype(np.float64) * scale_a[:, None], x64) <= 0.04
    assert np.abs(a.astype(np.float32)).max() <= 448


def test_torch_padded_rows():
    index, padded = bench_torch.padded_rows(np.array([3, 0, 17, 16], np.int32), 16)
    np.testing.assert_array_equal(padded, [16, 0, 32, 16])
    np.testing.assert_array_equal(index, [0, 1, 2, *range(16, 33), *range(48, 64)])


def test_skewed_group_sizes():
    s = bench.skewed_group_sizes(192, 48, seed=0)
    assert s.dtype == np.int32 and s.shape == (48,) and s.sum() == 192 and (s >= 0).all()
    assert np.array_equal(s, bench.skewed_group_sizes(192, 48, seed=0))


def test_a_cases_data_does_not_depend_on_the_selection(monkeypatch, tmp_path):
    """--cases picks cases; each keeps the seed (tokens, weights, group sizes) of the full run, so a
    selected case measures the same problem as the committed full-run JSON."""
    assert [bench.case_seed(lay, r) for lay in bench.LAYERS for r in bench.ROWS] == list(range(8))
    with pytest.raises(ValueError, match=r"\(layer, rows\): expected one of"):
        bench.case_seed("L3", 6144)
    seen = []

    class Stop(Exception):
        pass

    def make_case(rows, k, n, seed, experts):
        seen.append((rows, seed))
        raise Stop

    monkeypatch.setattr(bench, "make_case", make_case)
    with pytest.raises(Stop):
        bench.main(["--cases", "L2-6144", "--impls", "w4a16", "--out", str(tmp_path)])
    assert seen == [(6144, bench.case_seed("L2", 6144))] and seen[0][1] == 6


def test_floor_is_the_larger_of_bytes_and_flops():
    # L1 192 rows: weight-bound; L1 24576: FLOP-bound (numbers in docs/benchmarks.md)
    assert bench.floor_ms(192, 7168, 6144) == pytest.approx(
        48 * 6144 * 7168 * 0.5625 / 4.05e12 * 1e3)
    assert bench.floor_ms(24576, 7168, 6144) == pytest.approx(
        2 * 24576 * 7168 * 6144 / 711e12 * 1e3)


def test_small_run_writes_the_json(tmp_path, capsys):
    """The CLI end to end at CPU size: one row per implementation (the Pallas one is GPU-only;
    the torch ones skipped, saying why, where torch does not import or has no GPU), finite
    positive numbers, the derived columns computed from the measured ms, weight GB/s from each
    implementation's bytes per weight (1 for the prepared fp8 weights)."""
    impls = [i for i in bench.IMPLS if i != "pallas_mgpu"]
    bench.main(["--small", "--check", "--impls", ",".join(impls), "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    saved = json.loads((tmp_path / "bench.json").read_text())
    for key in ("gpu", "platform", "driver", "jax", "experts", "results"):
        assert key in saved, key
    assert saved["jax"] == jax.__version__ and saved["experts"] == bench.SMALL["experts"]
    assert saved["complete"] is True
    torch, reason = bench_torch.torch_or_reason()
    tokamax, tokamax_reason = bench_tokamax.tokamax_or_reason()
    ran = [i for i in impls if (torch is not None or i not in bench_torch.TORCH_IMPLS)
           and (tokamax is not None or i not in bench_tokamax.TOKAMAX_IMPLS)]
    assert [r["impl"] for r in saved["results"]] == ran
    if torch is None:
        for impl in bench_torch.TORCH_IMPLS:
            assert f"{impl} skipped: {reason}" in printed
    if tokamax is None:
        for impl in bench_tokamax.TOKAMAX_IMPLS:
            assert f"{impl} skipped: {tokamax_reason}" in printed
    else:                                     # the bf16 peer is ragged_dot's numbers
        m = re.search(r"rel diff tokamax_bf16 vs ragged_dot ([\d.e+-]+)", printed)
        assert m and float(m.group(1)) <= 1e-2, printed[-2000:]
        assert "rel diff tokamax_int4 vs ragged_dot" in printed
    for prepared in bench.FP8_PREPARED:
        assert f"rel diff {prepared} vs " in printed
    (k, n), = bench.SMALL["layers"].values()
    experts = bench.SMALL["experts"]
    for r in saved["results"]:
        assert r["case"] == "S1 rows 40"
        assert r["ms"] > 0
        for key in ("tflops", "weight_gbs", "floor_ms", "pct_of_floor"):  # CPU size: may round to 0
            assert math.isfinite(r[key]) and r[key] >= 0, key
        assert r["tflops"] == pytest.approx(2.0 * 40 * k * n / r["ms"] / 1e9, abs=0.06)
        assert r["floor_ms"] == pytest.approx(bench.floor_ms(40, k, n, 4), abs=1e-4)
        assert r["weight_gbs"] == pytest.approx(
            experts * n * k * bench.WEIGHT_BYTES[r["impl"]] / r["ms"] / 1e6, abs=0.06)
    assert {i: bench.WEIGHT_BYTES[i] for i in ("w4a16_fp8", *bench.FP8_PREPARED)} == {
        "w4a16_fp8": 0.5625, "w4a16_fp8_prepared": 1.0, "w4a4_fp8_prepared": 1.0}
    assert "uniform split, 4 x 10 rows" in next(r["config"] for r in saved["results"]
                                                if r["impl"] == "cublas_fp8_uniform")


def test_a_torch_error_skips_that_row_only(monkeypatch):
    """A torch peer that raises is skipped with the error printed; the benchmark goes on."""
    class FakeTorch:
        class cuda:  # noqa: N801 - torch.cuda's shape
            @staticmethod
            def empty_cache():
                pass

        @staticmethod
        def from_numpy(a):
            raise RuntimeError("no such device")

    monkeypatch.setattr(bench_torch, "torch_or_reason", lambda: (FakeTorch, None))
    logged = []
    x = jnp.ones((8, 128), jnp.bfloat16)
    w8 = jn.prepare_weights(QUANTIZE_STACK(jnp.ones((2, 32, 128), jnp.float32)), "fp8")
    got = bench_torch.torch_peers(x, w8, jnp.ones((2, 128, 32), jnp.bfloat16),
                                  jnp.array([3, 5], jnp.int32), bench.IMPLS, log=logged.append)
    assert got == {}
    assert logged == [f"  {impl} skipped: RuntimeError: no such device"
                      for impl in bench_torch.TORCH_IMPLS]
    assert bench_torch.torch_peers(x, w8, None, None, ["w4a16"], log=logged.append) == {}


def test_prepared_fp8_rows_count_one_byte_per_weight(tmp_path, monkeypatch):
    """With the timer replaced (1 us per call), weight GB/s shows the bytes per weight: 1 for the
    weights prepared as e4m3, 0.5625 for NVFP4."""
    monkeypatch.setattr(bench, "time_ms", lambda f, *a, **kw: 1e-3)
    impls = ["w4a16_fp8", "w4a16_fp8_prepared", "w4a4_fp8_prepared"]
    results = bench.main(["--small", "--impls", ",".join(impls), "--out", str(tmp_path)])
    (k, n), = bench.SMALL["layers"].values()
    elements = bench.SMALL["experts"] * n * k
    gbs = {r["impl"]: r["weight_gbs"] for r in results}
    assert gbs == {"w4a16_fp8": round(elements * 0.5625 / 1e3, 1),
                   "w4a16_fp8_prepared": round(elements / 1e3, 1),
                   "w4a4_fp8_prepared": round(elements / 1e3, 1)}


def test_unknown_impl_is_an_error():
    with pytest.raises(SystemExit):
        bench.main(["--impls", "w4a16,nope"])


def test_a_cut_run_keeps_the_cases_it_measured(tmp_path, monkeypatch):
    """bench.json is written after every case, ``"complete": false`` until the last one is done:
    a run stopped in its second case (here: its case maker raises) leaves the first case's rows
    in a valid JSON."""
    monkeypatch.setattr(bench, "SMALL", dict(bench.SMALL, rows=(40, 48)))
    monkeypatch.setattr(bench, "time_ms", lambda f, *a, **kw: 1e-3)
    make_case = bench.make_case

    def cut(rows, *a, **kw):
        if rows == 48:
            raise KeyboardInterrupt("time limit")                 # what a kill looks like
        return make_case(rows, *a, **kw)

    monkeypatch.setattr(bench, "make_case", cut)
    impls = ["w4a16", "w4a16_fp8_prepared"]
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--small", "--impls", ",".join(impls), "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["complete"] is False
    assert saved["experts"] == bench.SMALL["experts"] and saved["jax"] == jax.__version__
    assert [(r["case"], r["impl"]) for r in saved["results"]] == [("S1 rows 40", i) for i in impls]
    assert not list(tmp_path.glob("*.tmp*"))                        # no temporary file left
    monkeypatch.setattr(bench, "make_case", make_case)              # the whole run: complete
    bench.main(["--small", "--impls", ",".join(impls), "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["complete"] is True
    assert [r["case"] for r in saved["results"]] == ["S1 rows 40"] * 2 + ["S1 rows 48"] * 2


def _log_to_json():
    path = pathlib.Path(__file__).resolve().parents[1] / "tools/bench/bench_log_to_json.py"
    spec = importlib.util.spec_from_file_location("bench_log_to_json", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


LOG = """device: NVIDIA H200 (gpu), jax 0.11.2
/x/bench_torch.py:76: UserWarning: The given NumPy array is not writable
  return torch.from_numpy(a.view(np.uint8)).to(device).view(torch.float8_e4m3fn)
  check L1 rows 6144: rel err w4a16 vs ragged_dot 2.57e-03
  L1 rows 6144     w4a16_fp8_prepared       1.096 ms   493.9 TFLOP/s   1929.3 GB/s   69.5% of floor
  L1 rows 6144     cublas_fp8_uniform       0.644 ms   839.9 TFLOP/s   3280.9 GB/s  118.1% of floor
  torch_fp8_grouped skipped: torch does not import (ModuleNotFoundError: no torch)
  L2 rows 192      w4a16_sm90               0.168 ms    50.3 TFLOP/s   3534.7 GB/s   87.3% of floor
"""
FINAL = """
case             w4a16_fp8_prepared cublas_fp8_uniform w4a16_sm90
L1 rows 6144                1.096 ms           0.644 ms          nan ms
"""


def test_log_to_json_parses_the_printed_rows():
    tool = _log_to_json()
    d = tool.parse(LOG, "580.159.04", notes="a note", source="x.log")
    assert list(d) == ["gpu", "platform", "driver", "jax", "experts", "complete", "parsed_from",
                       "notes", "results"]
    assert (d["gpu"], d["platform"], d["driver"], d["jax"]) == (
        "NVIDIA H200", "gpu", "580.159.04", "0.11.2")
    assert d["experts"] == 48 and d["complete"] is False and d["notes"] == "a note"
    assert d["results"][0] == {"case": "L1 rows 6144", "impl": "w4a16_fp8_prepared", "ms": 1.096,
                               "tflops": 493.9, "weight_gbs": 1929.3,
                               "floor_ms": round(bench.floor_ms(6144, 7168, 6144), 4),
                               "pct_of_floor": 69.5}
    assert [(r["case"], r["impl"], r["ms"]) for r in d["results"]] == [
        ("L1 rows 6144", "w4a16_fp8_prepared", 1.096), ("L1 rows 6144", "cublas_fp8_uniform", 0.644),
        ("L2 rows 192", "w4a16_sm90", 0.168)]
    assert d["results"][2]["floor_ms"] == round(bench.floor_ms(192, 3072, 7168), 4)
    assert tool.parse(LOG + FINAL, "d")["complete"] is True      # the final table: all cases done
    assert "notes" not in tool.parse(LOG, "d")
    with pytest.raises(ValueError, match="floor"):                # the floor of 4 experts
        tool.parse(LOG, "d", experts=4)
    with pytest.raises(ValueError, match="L3"):
        tool.parse(LOG.replace("L2 rows", "L3 rows"), "d")
    assert tool.parse(LOG.replace("L2 rows", "L3 rows"), "d", layers={"L3": (3072, 7168)})
    with pytest.raises(ValueError, match="device"):
        tool.parse(LOG.split("\n", 1)[1], "d")


def test_log_to_json_constants_are_the_benchmarks():
    tool = _log_to_json()
    assert tool.LAYERS == bench.LAYERS and tool.EXPERTS == bench.EXPERTS
    assert tool.SMALL_LAYERS == bench.SMALL["layers"]
    assert tool.SMALL_EXPERTS == bench.SMALL["experts"]
    for rows, k, n, g in [(192, 7168, 6144, 48), (24576, 3072, 7168, 48), (40, 128, 256, 4)]:
        assert tool.floor_ms(rows, k, n, g) == bench.floor_ms(rows, k, n, g)


def test_log_to_json_gives_what_the_run_wrote(tmp_path, capsys):
    """A --small run's printed log, parsed, gives its bench.json: the header but the driver, the
    same rows (ms to the 3 printed decimals)."""
    impls = ["w4a16", "w4a4_fp8_prepared", "cublas_bf16_uniform"]
    bench.main(["--small", "--impls", ",".join(impls), "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    saved = json.loads((tmp_path / "bench.json").read_text())
    (tmp_path / "bench.log").write_text(printed)
    out = tmp_path / "parsed.json"
    assert _log_to_json().main([str(tmp_path / "bench.log"), "--driver", "D", "--out",
                                str(out)]) == 0
    parsed = json.loads(out.read_text())
    for key in ("gpu", "platform", "jax", "experts", "complete"):
        assert parsed[key] == saved[key], key
    assert parsed["driver"] == "D" and parsed["parsed_from"] == "bench.log"
    assert len(parsed["results"]) == len(saved["results"]) == len(impls)
    for got, want in zip(parsed["results"], saved["results"]):
        # printed to 3 decimals, saved to 4, both from the same ms: up to 5e-4 + 5e-5 apart
        # (2.10549 prints 2.105 and saves 2.1055)
        assert got["ms"] == pytest.approx(want["ms"], abs=5.5e-4)
        want = {k: v for k, v in want.items() if k not in ("ms", "config")}
        assert {k: v for k, v in got.items() if k != "ms"} == want


def _imported_modules(path, package):
    """The modules a source file names: its imports (relative ones resolved against ``package``)
    and string constants that look like a module path (``importlib.import_module("...")``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.startswith("jax_nvfp4."):
                names.add(node.value)
    return names


def _is_bench(module):
    return module == "jax_nvfp4.bench" or module.startswith("jax_nvfp4.bench.")


def test_nothing_in_the_package_imports_the_benchmarks():
    """The package ends at the layer: jax_nvfp4.bench uses the public API, and no core module
    (anything under jax_nvfp4/ outside bench/) imports it, directly, relatively or by name."""
    root = pathlib.Path(jn.__file__).resolve().parent
    core = [p for p in root.rglob("*.py") if "bench" not in p.relative_to(root).parts]
    assert len(core) > 20 and root / "layer" / "moe.py" in core and root / "nn" / "__init__.py" in core
    for path in core:
        rel = path.relative_to(root.parent).with_suffix("")
        bad = sorted(filter(_is_bench, _imported_modules(path, ".".join(rel.parts[:-1]))))
        assert not bad, f"{path.relative_to(root.parent)} imports {bad}"


def test_the_import_check_sees_each_form(tmp_path):
    """The check above fails on each way a core module could reach the benchmarks."""
    for src in ("import jax_nvfp4.bench.gemm", "from jax_nvfp4 import bench",
                "from .bench import common", "from . import bench",
                "importlib.import_module('jax_nvfp4.bench.layer')"):
        f = tmp_path / "m.py"
        f.write_text(src + "\n")
        names = _imported_modules(f, "jax_nvfp4")
        assert any(map(_is_bench, names)), src
    f.write_text("from jax_nvfp4 import benchmarks_md, gemm\nimport jax_nvfp4.moe\n")
    assert not any(map(_is_bench, _imported_modules(f, "jax_nvfp4")))


def test_a_tokamax_error_skips_that_row_only(monkeypatch):
    """A tokamax peer that raises is skipped with the error printed; the others still run."""
    class FakeTokamax:
        @staticmethod
        def ragged_dot(a, w, s):
            if w.dtype != jnp.bfloat16:
                raise RuntimeError("no kernel for this")
            return jax.lax.ragged_dot(a, w, s)

    class FakeQwix:
        @staticmethod
        def quantize(w, qtype, **kw):
            return w.astype(jnp.float32)

    monkeypatch.setattr(bench_tokamax, "tokamax_or_reason", lambda: ((FakeTokamax, FakeQwix), None))
    logged = []
    x, wb = jnp.ones((8, 128), jnp.bfloat16), jnp.ones((2, 128, 32), jnp.bfloat16)
    sizes = jnp.array([3, 5], jnp.int32)
    got = bench_tokamax.tokamax_peers(x, wb, sizes, list(bench_tokamax.TOKAMAX_IMPLS),
                                      log=logged.append, target_s=0.001, repeats=1)
    assert list(got) == ["tokamax_bf16"] and got["tokamax_bf16"][0] > 0
    assert logged == ["  tokamax_int4 skipped: RuntimeError: no kernel for this"]
    assert bench_tokamax.tokamax_peers(x, wb, sizes, ["w4a16"], log=logged.append) == {}


def test_tools_and_examples_import_what_exists():
    """Every ``jax_nvfp4`` import of the scripts in tools/ and examples/ names a module, or a name
    of one, that exists (they are not tested otherwise: a moved module would break them silently)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    checked = 0
    for path in [*(root / "tools").rglob("*.py"), *(root / "examples").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                pairs = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                pairs = [(node.module, a.name) for a in node.names]
            else:
                continue
            for module, name in pairs:
                if module != "jax_nvfp4" and not module.startswith("jax_nvfp4."):
                    continue
                mod = importlib.import_module(module)
                assert name is None or hasattr(mod, name) or importlib.util.find_spec(
                    f"{module}.{name}") is not None, f"{path.relative_to(root)}: {module}.{name}"
                checked += 1
    assert checked > 20
