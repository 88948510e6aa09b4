"""The pure-jnp reference grouped GEMM against float64 numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as jn
from oracles import dequant64, grouped_gemm64, rel_err


def make_rhs(rng, g, n, k):
    w = rng.standard_normal((g, n, k)).astype(np.float32) * rng.uniform(0.1, 10, (g, 1, 1))
    return jax.vmap(jn.quantize)(jnp.asarray(w))


@pytest.mark.parametrize("m,n,k,sizes", [
    (10, 24, 64, [3, 0, 4]),          # empty group, rows past the sum
    (17, 8, 32, [17]),                # one group holds every row
    (40, 40, 96, [0, 0, 40, 0]),
    (50, 16, 160, [7, -3, 20, 100]),  # negative size counts as 0, sum clamped to M
    (0, 16, 32, [0, 0]),
])
@pytest.mark.parametrize("w4a4", [False, True])
def test_against_float64(rng, m, n, k, sizes, w4a4):
    rhs = make_rhs(rng, len(sizes), n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    if w4a4:
        lhs = jn.quantize(jnp.asarray(x))
        a64 = dequant64(lhs.data, lhs.scales, lhs.global_scale)
    else:
        lhs = jnp.asarray(x)
        a64 = x.astype(np.float64)
    w64 = dequant64(rhs.data, rhs.scales)
    alpha = np.asarray(rhs.global_scale, np.float64)
    ref = grouped_gemm64(a64, w64, alpha, sizes)
    out = jax.jit(lambda a, b, c: jn.reference.grouped_gemm(a, b, c, out_dtype=jnp.float32))(
        lhs, rhs, gs)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    assert rel_err(out, ref) <= 1e-6
    total = min(sum(max(s, 0) for s in sizes), m)
    assert np.all(np.asarray(out)[total:] == 0)
    out16 = jn.reference.grouped_gemm(lhs, rhs, gs)
    assert out16.dtype == jnp.bfloat16 and rel_err(out16, ref) <= 1e-2


@pytest.mark.parametrize("w4a4", [False, True])
def test_sm90_layout_rhs(rng, w4a4):
    """Prepared (sm90) weights: the same float64 answer, and bitwise the checkpoint-layout one."""
    sizes = [9, 0, 30, -2, 25]
    rhs = make_rhs(rng, len(sizes), 256, 192)
    prepared = jn.prepare_weights(rhs)
    x = rng.standard_normal((70, 192)).astype(np.float32)
    lhs = jn.quantize(jnp.asarray(x)) if w4a4 else jnp.asarray(x)
    a64 = dequant64(lhs.data, lhs.scales, lhs.global_scale) if w4a4 else x.astype(np.float64)
    ref = grouped_gemm64(a64, dequant64(rhs.data, rhs.scales),
                         np.asarray(rhs.global_scale, np.float64), sizes)
    gs = jnp.asarray(sizes, jnp.int32)
    f = jax.jit(lambda a, b, c: jn.reference.grouped_gemm(a, b, c, out_dtype=jnp.float32))
    out = f(lhs, prepared, gs)
    assert rel_err(out, ref) <= 1e-6
    np.testing.assert_array_equal(np.asarray(out), np.asarray(f(lhs, rhs, gs)))


def test_sm90_layout_is_for_rhs_only(rng):
    rhs = make_rhs(rng, 2, 128, 64)
    lhs = jn.quantize(jnp.asarray(rng.standard_normal((128, 64)).astype(np.float32)))
    bad = jn.NVFP4Tensor(lhs.data, lhs.scales, lhs.global_scale, "sm90")
    with pytest.raises(ValueError, match="lhs.layout: expected 'checkpoint'"):
        jn.reference.grouped_gemm(bad, rhs, jnp.asarray([64, 64], jnp.int32))
    odd = jn.NVFP4Tensor(rhs.data, rhs.scales, rhs.global_scale, "sm100")
    with pytest.raises(ValueError, match=r"rhs.layout: expected one of"):
        jn.reference.grouped_gemm(lhs, odd, jnp.asarray([64, 64], jnp.int32))
