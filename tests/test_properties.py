"""Property-based tests (hypothesis) of quantize/dequantize and grouped_gemm against float64 oracles.

Random shapes, scales over the whole float32 range, NaN/Inf entries, group sizes that are 0,
negative or past M, both lhs kinds and both weight layouts. The oracles are tests/oracles.py
(ml_dtypes casts, float64 numpy) and an elementwise float64 product-sum for the GEMM, so that
Inf and NaN follow IEEE rules exactly (x * 0 with x = Inf is NaN, Inf + -Inf is NaN). Example
counts are bounded, and shapes are drawn from small sets and run through jitted functions (each
new shape compiles once), so the file stays well under a minute on two cores.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_nvfp4 as jn
from jax_nvfp4 import _extension
from oracles import dequant64
from test_quantization import codes_of, oracle_quantize

FLT_MIN = 2.0**-126
SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(autouse=True)
def _cpu(on_cpu):
    yield


_quantize = jax.jit(jn.quantize)
_quantize_stack = jax.jit(jax.vmap(jn.quantize))
_dequantize = jax.jit(jn.dequantize)
_prepare = jax.jit(jn.prepare_weights)


@functools.partial(jax.jit, static_argnames="backend")
def _gemm(lhs, rhs, sizes, backend):
    return jn.grouped_gemm(lhs, rhs, sizes, out_dtype=jnp.float32, backend=backend)


def special_values(draw, shape, kinds=("nan", "inf", "-inf")):
    """A float32 array of `shape` with a few NaN/Inf entries at drawn positions (maybe none)."""
    seed = draw(st.integers(0, 2**32 - 1))
    exp = draw(st.integers(-37, 33))
    r = np.random.default_rng(seed)
    x = (r.standard_normal(shape) * 10.0**exp).astype(np.float32)
    if draw(st.booleans()):                                       # some blocks far smaller
        small = r.random(shape[:-1] + (shape[-1] // 16,)) < 0.3
        x *= np.where(small, 1e-6, 1.0).repeat(16, -1).astype(np.float32)
    x[np.abs(x) < FLT_MIN] = 0      # XLA flushes float32 subnormal inputs to 0 (numpy does not)
    for _ in range(draw(st.integers(0, 2))):
        idx = tuple(int(r.integers(0, s)) for s in shape)
        x[idx] = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}[draw(st.sampled_from(kinds))]
    return x


@st.composite
def quantize_inputs(draw):
    shape = (draw(st.sampled_from([1, 3])), draw(st.sampled_from([32, 64, 96])))
    x = special_values(draw, shape)
    static = draw(st.booleans())
    gs = None
    if static:
        finite = np.abs(x[np.isfinite(x)])
        amax = float(finite.max()) if finite.size else 1.0
        gs = np.float32(max(amax / 2688 * draw(st.sampled_from([0.25, 1.0, 4.0])), FLT_MIN))
    return x, gs


@settings(max_examples=40, **SETTINGS)
@given(quantize_inputs())
def test_quantize_dequantize_property(args):
    x, gs = args
    t = _quantize(jnp.asarray(x), None if gs is None else jnp.float32(gs))
    finite = np.abs(x[np.isfinite(x)])
    amax = np.float32(finite.max()) if finite.size else np.float32(0)
    if gs is None:                       # amax / 2688 of the finite values, floored at 2^-126
        want = np.float32(1.0) if amax == 0 else max(np.float32(amax / np.float32(2688)),
                                                     np.float32(FLT_MIN))
        # (under jit XLA may divide as amax * (1/2688): the last bit can differ)
        assert abs(np.float32(t.global_scale) - want) <= np.spacing(want)
    gsv = float(np.float32(t.global_scale))
    assert gsv >= FLT_MIN and np.isfinite(gsv)
    # codes and block scales: the ml_dtypes oracle, bit for bit, given the global scale
    codes, scales = oracle_quantize(x, np.float32(t.global_scale))
    np.testing.assert_array_equal(codes_of(t), codes)
    np.testing.assert_array_equal(np.asarray(t.scales).view(np.uint8), scales)
    # dequantize: the float64 oracle (float32 rounding; XLA on CPU flushes subnormals to 0)
    dq = np.asarray(_dequantize(t), np.float64)
    ref = dequant64(t.data, t.scales, t.global_scale)
    np.testing.assert_allclose(dq, ref, rtol=2e-7, atol=FLT_MIN)
    # the quantization error of each block with no NaN: <= 1/5 of its amax plus the absolute
    # floor of e4m3's smallest scale step (2^-9, times at most 6 in a code)
    blocks = x.reshape(x.shape[:-1] + (-1, 16)).astype(np.float64)
    dqb = dq.reshape(blocks.shape)
    nan_block = np.isnan(blocks).any(-1)
    assert np.isnan(dqb[nan_block]).all() and not np.isnan(dqb[~nan_block]).any()
    sat = 2688 * gsv
    clipped = np.clip(np.where(np.isnan(blocks), 0, blocks), -sat, sat)   # Inf saturates
    bamax = np.abs(clipped).max(-1, keepdims=True)
    err = np.abs(dqb - clipped)
    bound = bamax / 5 + 6 * 2.0**-9 * gsv + 2 * FLT_MIN
    assert np.all(err[~nan_block] <= np.broadcast_to(bound, err.shape)[~nan_block])


@st.composite
def gemm_problems(draw):
    m, n, k, g = draw(st.sampled_from([(1, 16, 32, 1), (0, 16, 64, 2), (7, 128, 64, 2),
                                       (24, 128, 128, 3)]))
    layout = "sm90" if n % 128 == 0 and k % 64 == 0 and draw(st.booleans()) else "checkpoint"
    sizes = draw(st.lists(st.one_of(st.integers(-5, 30), st.sampled_from([0, 2**31 - 1])),
                          min_size=g, max_size=g))
    lhs_kind = draw(st.sampled_from(["bf16", "nvfp4"]))
    seed = draw(st.integers(0, 2**32 - 1))
    r = np.random.default_rng(seed)
    w = r.standard_normal((g, n, k)).astype(np.float32) * 10.0 ** r.integers(-3, 4, (g, 1, 1))
    x = (r.standard_normal((m, k)) * 10.0 ** draw(st.integers(-3, 30))).astype(np.float32)
    for _ in range(draw(st.integers(0, 2)) if m else 0):        # a non-finite entry in a row
        x[r.integers(0, m), r.integers(0, k)] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    return x, w, sizes, lhs_kind, layout


def ieee_grouped_gemm64(a, w, alpha, sizes):
    """float64 grouped GEMM as explicit product sums (IEEE Inf/NaN rules in any order)."""
    m, n = a.shape[0], w.shape[1]
    out = np.zeros((m, n))
    start = 0
    with np.errstate(invalid="ignore", over="ignore"):
        for gi, size in enumerate(sizes):
            end = min(start + max(int(size), 0), m)
            prod = a[start:end, None, :] * w[gi][None]
            out[start:end] = alpha[gi] * prod.sum(-1)
            start = end
    return out


@settings(max_examples=30, **SETTINGS)
@given(gemm_problems())
def test_grouped_gemm_property(problem):
    x, w, sizes, lhs_kind, layout = problem
    rhs = _quantize_stack(jnp.asarray(w))
    w64 = dequant64(rhs.data, rhs.scales)
    alpha = np.asarray(rhs.global_scale, np.float64)
    if lhs_kind == "nvfp4":
        lhs = _quantize(jnp.asarray(x))
        a64 = dequant64(lhs.data, lhs.scales)
        alpha = alpha * np.float64(np.float32(lhs.global_scale))
    else:
        lhs = jnp.asarray(x, jnp.bfloat16)
        a64 = np.asarray(lhs, np.float64)
    ref = ieee_grouped_gemm64(a64, w64, alpha, sizes)
    with np.errstate(invalid="ignore"):
        mag = ieee_grouped_gemm64(np.abs(a64), np.abs(w64), np.abs(alpha), sizes)
    if layout == "sm90":
        rhs = _prepare(rhs)
    backends = ["reference"] + (["ffi"] if _extension.available() else [])
    outs = {}
    for backend in backends:
        out = np.asarray(_gemm(lhs, rhs, jnp.asarray(sizes, jnp.int32), backend), np.float64)
        assert out.shape == ref.shape
        # Inf and NaN exactly where IEEE float64 puts them; rows past the groups exactly 0
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref), err_msg=backend)
        np.testing.assert_array_equal(np.isposinf(out), np.isposinf(ref), err_msg=backend)
        np.testing.assert_array_equal(np.isneginf(out), np.isneginf(ref), err_msg=backend)
        fin = np.isfinite(ref)
        # float32 accumulation: error <= ~K ulp of the sum of magnitudes (plus FTZ near 0)
        tol = 1e-5 * np.where(np.isfinite(mag), mag, 0) + 1e-30
        assert np.all(np.abs(out[fin] - ref[fin]) <= tol[fin]), backend
        outs[backend] = out
    if len(outs) == 2:   # the backends agree with each other as with the oracle
        a, b = outs["reference"], outs["ffi"]
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
        np.testing.assert_allclose(a[~np.isnan(a)], b[~np.isnan(b)], rtol=1e-5, atol=1e-30)


# ------------------------------------------------------------------ issue 68: the newest modules


@functools.partial(jax.jit, static_argnames=("transposed", "out", "quant"))
def _ragged(x, w, gs, transposed, out, quant):
    from jax_nvfp4.ops.ragged import TRANSPOSED_RHS_DIMENSION_NUMBERS  # noqa: PLC0415
    lhs = jn.quantize(x) if quant else x
    rhs = w if transposed else jn.ragged_rhs(w)
    return jn.ragged_dot(lhs, rhs, gs, preferred_element_type=out,
                         ragged_dot_dimension_numbers=(TRANSPOSED_RHS_DIMENSION_NUMBERS
                                                       if transposed else None))


@st.composite
def ragged_problems(draw):
    g = draw(st.sampled_from([1, 3]))
    k = draw(st.sampled_from([32, 64]))
    n = draw(st.sampled_from([16, 48]))
    m = draw(st.sampled_from([0, 1, 9]))
    sizes = [draw(st.integers(0, m)) for _ in range(g)]
    while sum(sizes) > m:                      # rows past the groups allowed, not missing ones
        sizes[sizes.index(max(sizes))] -= 1
    seed = draw(st.integers(0, 2**32 - 1))
    return (g, k, n, m, sizes, seed, draw(st.booleans()), draw(st.sampled_from([None, "f32", "bf16"])),
            draw(st.booleans()))


@settings(max_examples=10, **SETTINGS)
@given(ragged_problems())
def test_ragged_dot_is_lax_ragged_dot_on_dequantized_weights(problem):
    """jn.ragged_dot (either dimension numbers, bf16 or NVFP4 lhs, each output dtype, group sizes
    0 and rows past the groups) against jax.lax.ragged_dot in float32 (HIGHEST) of the
    dequantized operands; the output dtype is lhs's (bf16) unless preferred."""
    g, k, n, m, sizes, seed, transposed, out, quant = problem
    r = np.random.default_rng(seed)
    w = _quantize_stack(jnp.asarray(r.standard_normal((g, n, k)), jnp.float32))        # [G, N, K]
    x = jnp.asarray(r.standard_normal((m, k)), jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    out_t = {None: None, "f32": jnp.float32, "bf16": jnp.bfloat16}[out]
    got = _ragged(x, w, gs, transposed, out_t, quant)
    assert got.shape == (m, n) and got.dtype == (out_t or jnp.bfloat16)
    xd = _dequantize(_quantize(x)) if quant and m else x.astype(jnp.float32)
    wd = jnp.swapaxes(_dequantize(w), 1, 2)                                           # [G, K, N]
    want = jax.lax.ragged_dot(xd, wd, gs, precision=jax.lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32)
    bound = jax.lax.ragged_dot(jnp.abs(xd), jnp.abs(wd), gs, precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)
    tol = 2e-6 if got.dtype == jnp.float32 else 2.0 ** -8
    err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    assert np.all(err <= tol * np.asarray(bound, np.float64) + 1e-30)
    assert np.all(np.asarray(got, np.float32)[sum(sizes):] == 0)


@st.composite
def qwix_problems(draw):
    shape, axis = draw(st.sampled_from([((2, 64, 16), 1), ((2, 16, 32), 2), ((32, 8), 0),
                                        ((8, 64), 1)]))
    return (shape, axis, draw(st.sampled_from(["float32", "bfloat16"])),
            draw(st.integers(-30, 30)), draw(st.integers(0, 2**32 - 1)), draw(st.booleans()))


@pytest.mark.slow
@settings(max_examples=12, **SETTINGS)
@given(qwix_problems())
def test_qwix_round_trip_is_qwix_dequantization(problem):
    """from_qwix of qwix.quantize (per-channel or shared scales, any tiled axis, float32 and
    bfloat16, magnitudes 2^-30..2^30) dequantizes to qwix.dequantize bit for bit, and to_qwix
    back gives a QArray that qwix dequantizes to the same bits."""
    qwix = pytest.importorskip("qwix")
    from jax_nvfp4.maths import qwix_interop as qi  # noqa: PLC0415
    shape, axis, dtype, exp, seed, channelwise = problem
    r = np.random.default_rng(seed)
    w = (r.standard_normal(shape) * np.exp2(exp + r.integers(-6, 6, shape))).astype(np.float32)
    others = tuple(a for a in range(len(shape)) if a != axis) if channelwise else ()
    q = qwix.quantize(jnp.asarray(w, dtype), "nvfp4", channelwise_axes=others,
                      tiled_axes={axis: 16})
    oracle = np.asarray(qwix.dequantize(q))
    t = jax.jit(qi.from_qwix)(q)
    got = np.asarray(jn.dequantize(t, jnp.dtype(dtype)))
    np.testing.assert_array_equal(got.view(np.uint8),
                                  np.ascontiguousarray(np.moveaxis(oracle, axis, -1)).view(np.uint8))
    back = jax.jit(functools.partial(qi.to_qwix, axis=axis, dtype=jnp.dtype(dtype)))(t)
    assert back.qvalue.shape == q.qvalue.shape
    np.testing.assert_array_equal(np.asarray(qwix.dequantize(back)).view(np.uint8),
                                  oracle.view(np.uint8))


@st.composite
def dispatch_problems(draw):
    return (draw(st.sampled_from([0, 1, 5])), draw(st.sampled_from([128, 256])),
            draw(st.sampled_from(["copy", "given", "dynamic"])),
            draw(st.sampled_from(["bfloat16", "float32"])), draw(st.integers(-40, 40)),
            draw(st.integers(0, 2**32 - 1)), draw(st.sampled_from(["ffi", "reference"])))


@functools.partial(jax.jit, static_argnames=("mode", "backend"))
def _dispatch_fp8(x, gather, gs, mode, backend):
    from jax_nvfp4.ops.dispatch import dispatch_rows, dispatch_rows_dynamic  # noqa: PLC0415
    if mode == "dynamic":
        return dispatch_rows_dynamic(x, gather, fp8=True, backend=backend)
    return dispatch_rows(x, gather, row_scale=gs if mode == "given" else None, fp8=True,
                         backend=backend), None


@settings(max_examples=20, **SETTINGS)
@given(dispatch_problems())
def test_fp8_dispatch_is_the_ml_dtypes_oracle(problem):
    """dispatch_rows / dispatch_rows_dynamic with fp8=True (each mode, bf16 and float32 rows of
    magnitudes 2^-40..2^40 with Inf/NaN entries, gathers with repeats and none, 0 rows) against
    the ml_dtypes oracle of tests/test_dispatch.py and tests/test_fp8.py, byte for byte."""
    from jax_nvfp4.maths.formats import from_kernel_k_order  # noqa: PLC0415
    from test_dispatch import oracle_scales, oracle_values  # noqa: PLC0415
    from test_fp8 import oracle_quantize as oracle_fp8  # noqa: PLC0415
    t, k, mode, dtype, exp, seed, backend = problem
    if backend == "ffi" and not _extension.available():
        backend = "reference"
    r = np.random.default_rng(seed)
    x = (r.standard_normal((t, k)) * np.exp2(exp + r.integers(-4, 4, (t, 1)))).astype(np.float32)
    if t and r.integers(2):
        x[r.integers(t), r.integers(k)] = [np.inf, -np.inf, np.nan][r.integers(3)]
    x = jnp.asarray(x, dtype)
    gather = jnp.asarray(r.integers(0, max(t, 1), 2 * t), jnp.int32)
    gs = jnp.asarray(np.abs(r.standard_normal(t)) + 0.05, jnp.float32)
    got, row_scale = _dispatch_fp8(x, gather, gs, mode, backend)
    if mode == "copy":
        rows = np.asarray(x.astype(jnp.bfloat16), np.float32)
    else:
        scales = oracle_scales(x) if mode == "dynamic" else np.asarray(gs)
        rows = oracle_values(x, scales) if t else np.zeros((0, k), np.float32)
        if mode == "dynamic":
            np.testing.assert_array_equal(np.asarray(row_scale), scales[np.asarray(gather)])
    want_c, want_s = oracle_fp8(rows[np.asarray(gather)])
    np.testing.assert_array_equal(np.asarray(from_kernel_k_order(got.codes)).view(np.uint8),
                                  want_c.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(got.scales), want_s.astype(np.float32))
