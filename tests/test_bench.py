"""jax_nvfp4.bench's pieces on small shapes: every timed implementation computes the same GEMM
(a benchmark of different computations would compare nothing), and the helpers are right."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as jn
from jax_nvfp4 import bench
from oracles import dequant64, grouped_gemm64, rel_err
from conftest import QUANTIZE_STACK


@pytest.mark.slow
def test_every_implementation_computes_the_same_gemm():
    g, n, k, rows = 4, 128, 128, 40
    key = jax.random.key(0)
    rhs = QUANTIZE_STACK(jax.random.normal(key, (g, n, k), jnp.float32))
    x = jax.random.normal(jax.random.key(1), (rows, k), jnp.bfloat16)
    sizes = jnp.asarray(bench.skewed_group_sizes(rows, g, seed=2))
    fns, _ = bench.impl_fns(x, rhs, sizes)
    assert set(fns) == set(bench.IMPLS) - {"pallas_mgpu"}
    w64 = dequant64(rhs.data, rhs.scales, rhs.global_scale)
    ref16 = grouped_gemm64(np.asarray(x, np.float64), w64, np.ones(g), np.asarray(sizes))
    xq = jn.quantize(x.astype(jnp.float32))
    ref4 = grouped_gemm64(dequant64(xq.data, xq.scales, xq.global_scale), w64, np.ones(g),
                          np.asarray(sizes))
    for name, (f, args) in fns.items():
        out = np.asarray(f(*args), np.float64)
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


def test_skewed_group_sizes():
    s = bench.skewed_group_sizes(192, 48, seed=0)
    assert s.dtype == np.int32 and s.shape == (48,) and s.sum() == 192 and (s >= 0).all()
    assert np.array_equal(s, bench.skewed_group_sizes(192, 48, seed=0))


def test_floor_is_the_larger_of_bytes_and_flops():
    # L1 192 rows: weight-bound; L1 24576: FLOP-bound (numbers in docs/benchmarks.md)
    assert bench.floor_ms(192, 7168, 6144) == pytest.approx(
        48 * 6144 * 7168 * 0.5625 / 4.05e12 * 1e3)
    assert bench.floor_ms(24576, 7168, 6144) == pytest.approx(
        2 * 24576 * 7168 * 6144 / 711e12 * 1e3)


def test_small_run_writes_the_json(tmp_path):
    """The CLI end to end at CPU size: one row per implementation (the Pallas one is GPU-only),
    finite positive numbers, the derived columns computed from the measured ms."""
    impls = [i for i in bench.IMPLS if i != "pallas_mgpu"]
    bench.main(["--small", "--check", "--impls", ",".join(impls), "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench.json").read_text())
    for key in ("gpu", "platform", "driver", "jax", "experts", "results"):
        assert key in saved, key
    assert saved["jax"] == jax.__version__ and saved["experts"] == bench.SMALL["experts"]
    assert [r["impl"] for r in saved["results"]] == impls
    (k, n), = bench.SMALL["layers"].values()
    for r in saved["results"]:
        assert r["case"] == "S1 rows 40"
        assert r["ms"] > 0
        for key in ("tflops", "weight_gbs", "floor_ms", "pct_of_floor"):  # CPU size: may round to 0
            assert math.isfinite(r[key]) and r[key] >= 0, key
        assert r["tflops"] == pytest.approx(2.0 * 40 * k * n / r["ms"] / 1e9, abs=0.06)
        assert r["floor_ms"] == pytest.approx(bench.floor_ms(40, k, n, 4), abs=1e-4)


def test_unknown_impl_is_an_error():
    with pytest.raises(SystemExit):
        bench.main(["--impls", "w4a16,nope"])
