"""The pure-jnp reference grouped GEMM against float64 numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as jn
from oracles import dequant64, grouped_gemm64, rel_err
from conftest import QUANTIZE_STACK


def make_rhs(rng, g, n, k):
    w = rng.standard_normal((g, n, k)).astype(np.float32) * rng.uniform(0.1, 10, (g, 1, 1))
    return QUANTIZE_STACK(jnp.asarray(w))


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


# ------------------------------------------------------------------ grouped_gemm_swiglu
from oracles import gate_up64, grouped_gemm_swiglu64  # noqa: E402


def make_glu_problem(rng, m, i, k, sizes, *, w4a4, per_half, layout="checkpoint", row_scale=False,
                     limit_quantile=None, lhs_dtype=jnp.bfloat16):
    """Paired gate/up weights [G, 2I, K] and an lhs; returns (lhs, rhs, group_sizes, row_scale,
    limit, float64 reference from the stored (unpaired) weights)."""
    g = len(sizes)
    w = rng.standard_normal((g, 2 * i, k)).astype(np.float32) * rng.uniform(0.1, 10, (g, 1, 1))
    stored = QUANTIZE_STACK(jnp.asarray(w))
    gs = np.asarray(stored.global_scale)
    alpha = np.stack([gs, gs * (3.0 if per_half else 1.0)], 1).astype(np.float32)   # (gate, up)
    rhs = jn.layout.pair_gate_up(jn.NVFP4Tensor(stored.data, stored.scales,
                                                jnp.asarray(alpha if per_half else gs)))
    if layout == "sm90":
        rhs = jn.prepare_weights(rhs)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.5, 2, (m, 1))).astype(np.float32)
    if w4a4:
        lhs = jn.quantize(jnp.asarray(x))
        a64 = dequant64(lhs.data, lhs.scales, lhs.global_scale)
    else:
        lhs = jnp.asarray(x, lhs_dtype)
        a64 = np.asarray(lhs, np.float64)
    rs = rng.uniform(0.5, 2, m).astype(np.float32) if row_scale else None
    w64 = dequant64(stored.data, stored.scales)
    limit = None
    if limit_quantile is not None:    # a limit that clamps part of the gate and up values
        h = np.abs(gate_up64(a64, w64, alpha.astype(np.float64), sizes, rs))
        limit = float(np.float32(np.quantile(h[h > 0], limit_quantile)))
    ref = grouped_gemm_swiglu64(a64, w64, alpha.astype(np.float64), sizes,
                                None if rs is None else rs.astype(np.float64), limit)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32), None if rs is None else jnp.asarray(rs), limit, ref


GLU_VARIANTS = [  # (limit quantile, row_scale, per-half global scales)
    (None, False, False), (0.5, True, True), (None, True, False), (0.8, False, True)]


@pytest.mark.parametrize("lim_q,row_scale,per_half", GLU_VARIANTS)
@pytest.mark.parametrize("w4a4", [False, True], ids=["w4a16", "w4a4"])
def test_swiglu_against_float64(rng, lim_q, row_scale, per_half, w4a4):
    """reference.grouped_gemm_swiglu of paired weights against the float64 GEMM + SwiGLU of the
    stored rows: limit or none, row scale or none, alpha [G] or [G, 2]; an empty group and rows
    past the groups (0)."""
    sizes = [9, 0, 14, 3]
    lhs, rhs, gs, rs, limit, ref = make_glu_problem(rng, 30, 16, 64, sizes, w4a4=w4a4,
                                                    per_half=per_half, row_scale=row_scale,
                                                    limit_quantile=lim_q)
    f = jax.jit(lambda a, b, c, r: jn.reference.grouped_gemm_swiglu(a, b, c, row_scale=r,
                                                                    limit=limit))
    out = f(lhs, rhs, gs, rs)
    assert out.shape == (30, 16) and out.dtype == jnp.float32
    assert rel_err(out, ref) <= 1e-5
    assert np.all(np.asarray(out)[26:] == 0)
    if limit is not None:    # the clamp binds somewhere
        assert not np.allclose(out, jn.reference.grouped_gemm_swiglu(lhs, rhs, gs, row_scale=rs))
    out16 = jn.reference.grouped_gemm_swiglu(lhs, rhs, gs, row_scale=rs, limit=limit,
                                            out_dtype=jnp.bfloat16)
    assert out16.dtype == jnp.bfloat16 and rel_err(out16, ref) <= 1e-2


def test_swiglu_nan_rows_stay_contained(rng):
    """A NaN lhs row, and a NaN row scale, give NaN in that row only (the clamps propagate NaN);
    rows past the groups stay 0 whatever their row scale; a limit does not hide a NaN."""
    lhs, rhs, gs, rs, limit, ref = make_glu_problem(rng, 20, 16, 64, [6, 10], w4a4=False,
                                                    per_half=True, row_scale=True,
                                                    limit_quantile=0.5, lhs_dtype=jnp.float32)
    lhs = lhs.at[3].set(jnp.nan)
    rs = rs.at[12].set(jnp.nan).at[18].set(jnp.nan)            # row 18 lies past the groups
    out = np.asarray(jn.reference.grouped_gemm_swiglu(lhs, rhs, gs, row_scale=rs, limit=limit))
    assert np.isnan(out[3]).all() and np.isnan(out[12]).all()
    assert np.all(out[16:] == 0)
    keep = np.ones(20, bool)
    keep[[3, 12]] = False
    assert rel_err(out[keep], ref[keep]) <= 1e-5


def test_swiglu_bad_input_names_the_argument(rng):
    lhs, rhs, gs, _, _, _ = make_glu_problem(rng, 8, 16, 64, [4, 4], w4a4=False, per_half=False)
    f = jn.reference.grouped_gemm_swiglu
    odd = jn.NVFP4Tensor(rhs.data[:, :24], rhs.scales[:, :24], rhs.global_scale)
    with pytest.raises(ValueError, match=r"rhs: N = 2I must be a multiple of 16 .*got N = 24"):
        f(lhs, odd, gs)
    for bad in (jnp.ones((7,), jnp.float32), jnp.ones((8,), jnp.bfloat16), jnp.ones((8, 1))):
        with pytest.raises(ValueError, match=r"row_scale: expected float32 \[8\]"):
            f(lhs, rhs, gs, row_scale=bad)
    for bad in (0.0, -1.0, float("nan"), "10", True, 1e-50):
        with pytest.raises(ValueError, match="limit: expected"):
            f(lhs, rhs, gs, limit=bad)
    with pytest.raises(ValueError, match="limit: expected a static number"):
        jax.jit(lambda l: f(lhs, rhs, gs, limit=l))(1.0)
    bad_gs = jn.NVFP4Tensor(rhs.data, rhs.scales, jnp.ones((2, 3), jnp.float32))
    with pytest.raises(ValueError, match=r"rhs.global_scale: expected shape \[\], \[2\] or \[2, 2\]"):
        f(lhs, bad_gs, gs)
    # an infinite limit is no limit
    np.testing.assert_array_equal(np.asarray(f(lhs, rhs, gs, limit=float("inf"))),
                                  np.asarray(f(lhs, rhs, gs)))


def test_swiglu_clamps_the_gate_from_above_only(rng):
    """silu(min(gate, L)): a gate below -L is not clamped (only up is clipped on both sides).
    With L at the 20% quantile of |h| most gates lie beyond +-L, so a clip of the gate from below
    (silu(-L) for silu(gate)) would move most outputs of negative gates; element for element
    against the float64 oracle."""
    lhs, rhs, gs, rs, limit, ref = make_glu_problem(rng, 24, 16, 64, [10, 14], w4a4=False,
                                                    per_half=False, limit_quantile=0.2)
    out = np.asarray(jax.jit(lambda a, b, c: jn.reference.grouped_gemm_swiglu(
        a, b, c, limit=limit))(lhs, rhs, gs), np.float64)
    assert np.sum(ref < 0) > 50                     # negative gates (times positive up) abound
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-6 * np.abs(ref).max())
