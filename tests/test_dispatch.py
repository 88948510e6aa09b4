"""The one-pass dispatch custom call (jax_nvfp4.ops.dispatch): bit for bit against an NVFP4 oracle
built from ml_dtypes casts and float32 numpy (true divisions, RNE), and against the gather it
fuses; on the CPU handler and (GPU machines) the CUDA kernel."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_nvfp4 import _extension
from jax_nvfp4.ops.dispatch import DISPATCH_TARGET, dispatch_rows, dispatch_rows_dynamic, dispatch_rows_reference
from jax_nvfp4.maths.formats import Fp8Rows, from_kernel_k_order
from jax_nvfp4.maths.quantization import dynamic_global_scale
from jax_nvfp4.layer.moe import _row_global_scale, sort_rows
from conftest import gpu_devices, skip_or_fail
from test_fp8 import oracle_quantize as oracle_quantize_fp8

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def oracle_values(x, gs):
    """e2m1 * block scale of each row's NVFP4 quantization with global scale gs[t], as float32:
    numpy float32 divisions and ml_dtypes casts (round to nearest even) only."""
    x = np.asarray(x, np.float32)
    t, k = x.shape
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        y = (x.reshape(t, k // 16, 16) / np.asarray(gs, np.float32)[:, None, None]).astype(np.float32)
        amax = np.abs(y).max(-1, keepdims=True)
        s = np.clip(amax / np.float32(6), 0, 448).astype(ml_dtypes.float8_e4m3fn)
        sf = s.astype(np.float32)
        q = np.where((sf > 0) & ~np.isnan(y), np.clip(y / np.where(sf > 0, sf, 1), -6, 6), 0)
        codes = q.astype(np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
        return (E2M1[codes] * sf).reshape(t, k)


def oracle_scales(x):
    """Each row's dynamic global scale: the amax of its finite |values|, divided by 2688 in
    float64 and cast to float32 (innocuous double rounding: 53 >= 2 * 24 + 2 bits), clipped to
    [2^-126, FLT_MAX]; 1 for a row without a finite non-zero value."""
    with np.errstate(invalid="ignore"):
        a = np.abs(np.asarray(x, np.float64))
    amax = np.where(np.isfinite(a), a, 0).max(-1)
    gs = np.maximum((amax / 2688).astype(np.float32), np.float32(2.0 ** -126))
    return np.where(amax > 0, gs, np.float32(1)).astype(np.float32)


def bits_equal(a, b):
    """Equal bf16 bit patterns, any NaN matching any NaN."""
    a = np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))
    b = np.asarray(jnp.asarray(b, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))
    nan = np.isnan(a)
    np.testing.assert_array_equal(nan, np.isnan(b))
    np.testing.assert_array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32))


@pytest.fixture(params=["cpu", "gpu"])
def device(request):
    if not _extension.available():
        pytest.fail("the jax_nvfp4 extension is not built (pip install . builds it)")
    if request.param == "cpu":
        dev = jax.devices("cpu")[0]
    else:
        devs = gpu_devices()
        if not devs:
            skip_or_fail("no GPU: the CUDA dispatch kernel is not exercised")
        if not _extension.has_cuda():
            skip_or_fail("the extension was built without the CUDA handler")
        dev = devs[0]
    with jax.default_device(dev):         # the test's arrays and calls run there
        yield dev


def bf16_rows(rng, t, k):
    """bf16 rows over a wide range of magnitudes: e2m1 ties (y / scale exactly on a midpoint)
    are common with 8-bit mantissas, so the divisions' rounding is exercised."""
    x = rng.standard_normal((t, k)) * np.exp(rng.standard_normal((t, 1)) * 3)
    return jnp.asarray(x, jnp.bfloat16)


def test_quantized_values_match_the_oracle(rng, device):
    x = bf16_rows(rng, 40, 512)
    gs = _row_global_scale(x)
    got = jax.jit(lambda x, gs: dispatch_rows(x, row_scale=gs, backend="ffi"))(x, gs)
    assert got.dtype == jnp.bfloat16 and got.shape == x.shape
    bits_equal(got, oracle_values(np.asarray(x.astype(jnp.float32)), np.asarray(gs)))


def test_float32_input_and_static_scales(rng, device):
    """float32 rows, per-row scales that saturate some blocks (values past 6 * 448 * gs), an
    invalid scale (a NaN row) and one at the 2^-126 floor."""
    x = rng.standard_normal((6, 256)).astype(np.float32) * np.float32(30)
    gs = np.array([0.01, 1e-3, np.nan, 2.0 ** -126, 0.5, 1e-4], np.float32)
    got = jax.jit(lambda x, gs: dispatch_rows(x, row_scale=gs, backend="ffi"))(x, gs)
    want = oracle_values(x, gs)
    want[2] = np.nan                       # an invalid global scale: every block NaN (quantize's rule)
    bits_equal(got, want)
    assert np.all(np.isnan(np.asarray(got[2], np.float32)))
    assert np.abs(np.asarray(got[5], np.float32)).max() == 6 * 448   # saturated


def test_every_bf16_bit_pattern(device):
    """All 65536 bf16 patterns (NaN, +-Inf, subnormals, -0) in blocks of 16, per-row scales from
    the rows' finite amax: NaN blocks stay NaN, Inf saturates, signs are kept."""
    x = jnp.asarray(np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16).reshape(256, 256))
    gs = _row_global_scale(x)
    got = jax.jit(lambda x, gs: dispatch_rows(x, row_scale=gs, backend="ffi"))(x, gs)
    bits_equal(got, oracle_values(np.asarray(x, np.float32), np.asarray(gs)))


def routing(rng, t, k, e, n=None):
    ids = jnp.asarray(rng.integers(0, e, (t, k)), jnp.int32)
    order, inv, _ = sort_rows(ids.reshape(-1), e)
    gather = (order // k).astype(jnp.int32)
    n = t * k if n is None else n
    return gather[:n], inv.reshape(t, k)


@pytest.mark.parametrize("rows", [None, 50])
def test_scatter_equals_the_gather(rng, device, rows):
    """Each token read once, stored to its rows: the same bytes as gathering the made rows;
    copies past the first ``rows`` rows (expert parallelism's capacity) are not stored."""
    t, k = 24, 3
    x = bf16_rows(rng, t, 128)
    gather, scatter = routing(rng, t, k, 5, rows)
    gs = _row_global_scale(x)
    run = jax.jit(lambda x, g, s, gs: dispatch_rows(x, g, s, row_scale=gs, backend="ffi"))
    got = run(x, gather, scatter, gs)
    assert got.shape == (gather.shape[0], 128)
    bits_equal(got, oracle_values(np.asarray(x, np.float32), np.asarray(gs))[np.asarray(gather)])
    copy = jax.jit(lambda x, g, s: dispatch_rows(x, g, s, backend="ffi"))
    xf = jnp.asarray(rng.standard_normal((t, 128)), jnp.float32)
    bits_equal(copy(xf, gather, scatter), np.asarray(xf.astype(jnp.bfloat16), np.float32)[np.asarray(gather)])
    # without the inverted map: made per token, then gathered
    bits_equal(jax.jit(lambda x, g, gs: dispatch_rows(x, g, row_scale=gs, backend="ffi"))(x, gather, gs), got)


def test_reference_backend(rng):
    """The jnp route gives the same bytes: the gather of bf16 rows, and the quantized values of
    bf16 rows with e2m1/e4m3 ties and of every bf16 bit pattern (quantize divides exactly too)."""
    t, k = 16, 2
    gather, scatter = routing(rng, t, k, 4)
    x = bf16_rows(rng, t, 64)
    for rs in (None, _row_global_scale(x)):
        a = dispatch_rows(x, gather, scatter, row_scale=rs, backend="ffi")
        b = dispatch_rows(x, gather, scatter, row_scale=rs, backend="reference")
        bits_equal(a, np.asarray(b, np.float32))
    np.testing.assert_array_equal(np.asarray(dispatch_rows_reference(x, gather), np.float32),
                                  np.asarray(x, np.float32)[np.asarray(gather)])
    every = jnp.asarray(np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16).reshape(256, 256))
    gs = _row_global_scale(every)
    bits_equal(dispatch_rows(every, row_scale=gs, backend="ffi"),
               np.asarray(dispatch_rows(every, row_scale=gs, backend="reference"), np.float32))


def test_bad_arguments():
    x = jnp.zeros((4, 32), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"x: expected \[T, K\]"):
        dispatch_rows(jnp.zeros((4, 2, 16)))
    with pytest.raises(ValueError, match=r"row_scale: expected shape \[T\] = \[4\]"):
        dispatch_rows(x, row_scale=jnp.ones((3,)))
    with pytest.raises(ValueError, match=r"gather: expected \[R\]"):
        dispatch_rows(x, jnp.zeros((2, 2), jnp.int32))
    with pytest.raises(ValueError, match=r"scatter: expected \[T, slots\] with T = 4"):
        dispatch_rows(x, jnp.zeros((8,), jnp.int32), jnp.zeros((8,), jnp.int32))
    with pytest.raises(ValueError, match="backend: expected one of"):
        dispatch_rows(x, backend="cuda")
    with pytest.raises(ValueError, match=r"scatter: expected \[T, slots\] with T = 4"):
        dispatch_rows_dynamic(x, jnp.zeros((8,), jnp.int32), jnp.zeros((3, 2), jnp.int32))
    with pytest.raises(ValueError, match="backend: expected one of"):
        dispatch_rows_dynamic(x, backend="cuda")


def test_values_next_to_e2m1_midpoints(rng, device):
    """Quotients y / scale at, just above and just below every e2m1 midpoint (where a division
    that is not correctly rounded, e.g. a product with the reciprocal, rounds the other way),
    with block scales of every e4m3 mantissa (each block's first value fixes its scale at
    amax / 6); then wide-range float32 rows."""
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    near = np.concatenate([mids, np.nextafter(mids, 0), np.nextafter(mids, 7),
                           mids * np.float32(1 + 2e-6), mids * np.float32(1 - 2e-6)])
    scales = np.float32(2.0) ** rng.integers(-6, 6, 64) * (1 + np.arange(64) % 8 / 8).astype(np.float32)
    vals = rng.choice(near, (64, 15)) * rng.choice([-1, 1], (64, 15))
    blocks = np.concatenate([6 * scales[:, None], vals * scales[:, None]], 1).astype(np.float32)
    x = blocks.reshape(8, 128)
    gs = np.ones((8,), np.float32)
    got = jax.jit(lambda x, gs: dispatch_rows(x, row_scale=gs, backend="ffi"))(x, gs)
    bits_equal(got, oracle_values(x, gs))
    y = rng.standard_normal((256, 512)).astype(np.float32) * np.exp(rng.standard_normal((256, 1)) * 4)
    gs = np.asarray(_row_global_scale(jnp.asarray(y)))
    bits_equal(jax.jit(lambda x, gs: dispatch_rows(x, row_scale=gs, backend="ffi"))(y, gs),
               oracle_values(y, gs))


def special_rows(rng, k):
    """bf16 rows for the dynamic scale's edge cases: a zero row, a row holding Inf and NaN beside
    finite values, an all-NaN row, rows whose amax / 2688 falls below 2^-126 (subnormal values),
    near the bf16 maximum, and exact ties of the division (amax = 2688 * 2^e)."""
    x = np.asarray(bf16_rows(rng, 10, k), np.float32)
    x[0] = 0
    x[1, 3], x[1, 40], x[1, 77] = np.inf, -np.inf, np.nan
    x[2] = np.nan
    x[3] *= np.float32(2.0 ** -130) / np.abs(x[3]).max()
    x[4, 5] = -np.float32(2.0 ** -133)
    x[4, :5] = x[4, 6:] = 0
    x[5] = x[5] / np.abs(x[5]).max() * np.float32(3e38)
    x[6, 9] = 2688 * 2.0 ** -20
    x[6] = np.clip(x[6], -2688 * 2.0 ** -20, 2688 * 2.0 ** -20)
    return jnp.asarray(x, jnp.bfloat16)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_dynamic_scales_match_the_oracle(rng, device, dtype):
    """The dynamic mode makes each row's scale itself: the scales equal a float64 oracle (and
    ``dynamic_global_scale``), stored per output row through the scatter map and the gather, and
    the values equal the oracle's quantization with those scales."""
    t, k, slots = 10, 256, 3
    x = special_rows(rng, k).astype(dtype)
    want_s = oracle_scales(np.asarray(x, np.float32))
    np.testing.assert_array_equal(np.asarray(jax.vmap(dynamic_global_scale)(x)), want_s)
    want = oracle_values(np.asarray(x, np.float32), want_s)
    rows, s = jax.jit(lambda x: dispatch_rows_dynamic(x, backend="ffi"))(x)
    assert rows.shape == (t, k) and s.dtype == jnp.float32 and s.shape == (t,)
    np.testing.assert_array_equal(np.asarray(s), want_s)
    bits_equal(rows, want)
    gather, scatter = routing(rng, t, slots, 4, 25)          # 5 copies past the capacity
    for sc in (scatter, None):
        rows, s = jax.jit(lambda x, g, sc: dispatch_rows_dynamic(x, g, sc, backend="ffi"))(
            x, gather, sc)
        g = np.asarray(gather)
        np.testing.assert_array_equal(np.asarray(s), want_s[g])
        bits_equal(rows, want[g])
    ref = dispatch_rows_dynamic(x, gather, scatter, backend="reference")
    bits_equal(ref[0], np.asarray(rows, np.float32))
    np.testing.assert_array_equal(np.asarray(ref[1]), np.asarray(s))


@pytest.mark.parametrize("per_sm, extra", [(4, 0), (8, 0), (8, 1)], ids=["512", "256", "128"])
def test_every_cta_width(rng, device, per_sm, extra):
    """The quantizing CUDA kernel runs 512-, 256- or 128-thread CTAs by the row count
    (DispatchThreads: the widest whose T CTAs fit 2048 threads per SM): T = 4, 8 and 8 SMs + 1 take
    each width once, with rows of 130 chunks (partial steps at every width); values and scales
    equal the oracle through a two-slot scatter map, and the copy (128 threads) equals the gather."""
    sms = getattr(device, "core_count", None) or 132
    t, k, slots = per_sm * sms + extra, 1040, 2
    x = bf16_rows(rng, t, k)
    want_s = oracle_scales(np.asarray(x, np.float32))
    gather, scatter = routing(rng, t, slots, 7)
    g = np.asarray(gather)
    rows, s = jax.jit(lambda x, g, sc: dispatch_rows_dynamic(x, g, sc, backend="ffi"))(x, gather, scatter)
    np.testing.assert_array_equal(np.asarray(s), want_s[g])
    bits_equal(rows, oracle_values(np.asarray(x, np.float32), want_s)[g])
    copy = jax.jit(lambda x, g, sc: dispatch_rows(x, g, sc, backend="ffi"))(x, gather, scatter)
    bits_equal(copy, np.asarray(x, np.float32)[g])


def test_dynamic_scales_of_every_bf16_pattern(device):
    """All 65536 bf16 patterns as rows of 256 (the amax over finite values, NaN and Inf skipped;
    subnormal rows clamped to 2^-126), and random wide-range float32 rows whose quotients by
    2688 exercise the division's rounding."""
    x = jnp.asarray(np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16).reshape(256, 256))
    rows, s = jax.jit(lambda x: dispatch_rows_dynamic(x, backend="ffi"))(x)
    want_s = oracle_scales(np.asarray(x, np.float32))
    np.testing.assert_array_equal(np.asarray(s), want_s)
    bits_equal(rows, oracle_values(np.asarray(x, np.float32), want_s))
    y = (np.random.default_rng(7).standard_normal((512, 32)) *
         np.exp(np.random.default_rng(8).standard_normal((512, 1)) * 20)).astype(np.float32)
    _, s = jax.jit(lambda x: dispatch_rows_dynamic(x, backend="ffi"))(y)
    np.testing.assert_array_equal(np.asarray(s), oracle_scales(y))
    np.testing.assert_array_equal(np.asarray(jax.vmap(dynamic_global_scale)(jnp.asarray(y))),
                                  oracle_scales(y))


def test_custom_call_rejects_bad_operands(device):
    """The custom call's own checks (what jax_nvfp4.ops.dispatch never builds): each error names the
    operand or result and what was expected."""
    x = jnp.ones((4, 32), jnp.bfloat16)
    none_s, none_i = jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.int32)

    def call(x, rs, sc, rows, scale_rows, out_dtype=jnp.bfloat16, chunk_shape=(0, 0)):
        out = (jax.ShapeDtypeStruct((rows, x.shape[1]), out_dtype),
               jax.ShapeDtypeStruct((scale_rows,), jnp.float32),
               jax.ShapeDtypeStruct(chunk_shape, jnp.float32))
        return jax.block_until_ready(jax.ffi.ffi_call(DISPATCH_TARGET, out)(x, rs, sc))

    _, s, _ = call(x, none_s, none_i, 4, 4)                    # well formed: dynamic, scale 1/2688
    np.testing.assert_array_equal(np.asarray(s), np.float32(1) / np.float32(2688))
    x128, e4m3 = jnp.ones((4, 128), jnp.bfloat16), jnp.float8_e4m3fn
    codes, _, chunk = call(x128, none_s, none_i, 4, 0, e4m3, (4, 1))   # well formed: fp8 copy
    # amax 1: the scale 2^-8 is the smallest power of two with 1 / scale <= 448
    assert (np.asarray(codes, np.float32) == 256).all() and (np.asarray(chunk) == 2.0**-8).all()
    cases = [
        ((x128, none_s, none_i, 4, 0, jnp.float32), "out must be bfloat16 or float8_e4m3fn"),
        ((x128, none_s, none_i, 4, 0, e4m3, (4, 2)),
         r"chunk_scales must be float32 \[R, K/128\] = \[4, 1\], got \[4, 2\]"),
        ((x128, none_s, none_i, 4, 0, jnp.bfloat16, (4, 1)),
         r"chunk_scales must be float32 \[0, 0\] with a bfloat16 out"),
        ((x, none_s, none_i, 4, 0, e4m3, (4, 0)),
         "the e4m3 output needs K to be a multiple of 128"),
        ((x, jnp.ones((4,), jnp.float32), none_i, 4, 4),
         r"row_scale \(given\) and row_scale_out \(dynamic\) exclude each other"),
        ((x, none_s, none_i, 4, 3), r"row_scale_out must be \[R\] = \[4\] or \[0\], got \[3\]"),
        ((x, jnp.ones((3,), jnp.float32), none_i, 4, 0), r"row_scale must be \[T\] = \[4\] or \[0\]"),
        ((x.astype(jnp.float32), none_s, none_i, 4, 0), r"the copy \(no row scale\) takes a bf16 x"),
        ((jnp.ones((4, 24), jnp.bfloat16), none_s, none_i, 4, 4), "K must be a multiple of 16"),
        ((x, none_s, jnp.zeros((3, 2), jnp.int32), 8, 8), r"scatter must be \[T, slots\] = \[4, slots\]"),
        ((x, none_s, none_i, 5, 5), "without a scatter map the output has one row per input row"),
    ]
    for args, msg in cases:
        with pytest.raises(jax.errors.JaxRuntimeError, match=msg):
            call(*args)


def _scatter_case(rng, t, slots):
    """A random (gather [R], scatter [T, slots]) pair naming each other, R = T * slots."""
    perm = rng.permutation(t * slots)
    return (jnp.asarray(np.argsort(perm) // slots, jnp.int32),
            jnp.asarray(perm.reshape(t, slots), jnp.int32))


@pytest.mark.parametrize("mode", ["copy", "given", "dynamic"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fp8_output_matches_the_oracle(rng, device, mode, dtype):
    """fp8=True: the rows the bf16 output holds (the bf16 row, or the oracle's NVFP4 values)
    quantized per 128-wide chunk by the fp8 oracle (ml_dtypes e4m3 casts, float64 scales), the
    codes in the kernel k order; chunks holding Inf or NaN included; through the scatter map, the
    gather alone and no map, eager and in jit."""
    t, k, slots = 6, 384, 3
    x = np.asarray(bf16_rows(rng, t, k), np.float32)
    x[1, 5], x[2, 300], x[4, 129] = np.inf, np.nan, -np.inf
    x = jnp.asarray(x, dtype)
    gather, scatter = _scatter_case(rng, t, slots)
    gs = jnp.asarray(np.abs(rng.standard_normal(t)) + 0.05, jnp.float32)
    if mode == "copy":
        rows = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
        call = lambda x, g, sc: (dispatch_rows(x, g, sc, fp8=True, backend="ffi"), None)  # noqa: E731
    elif mode == "given":
        rows = oracle_values(x, gs)
        call = lambda x, g, sc: (dispatch_rows(x, g, sc, row_scale=gs, fp8=True,  # noqa: E731
                                               backend="ffi"), None)
    else:
        scales = oracle_scales(x)
        rows = oracle_values(x, scales)
        call = lambda x, g, sc: dispatch_rows_dynamic(x, g, sc, fp8=True, backend="ffi")  # noqa: E731
    for g, sc, jit in ((gather, scatter, False), (gather, scatter, True), (gather, None, False),
                       (None, None, True)):
        f = jax.jit(call) if jit else call
        got, row_scale = f(x, g, sc)
        assert isinstance(got, Fp8Rows) and got.k_order == "kernel"
        want = rows if g is None else rows[np.asarray(g)]
        want_c, want_s = oracle_quantize_fp8(want)
        np.testing.assert_array_equal(np.asarray(from_kernel_k_order(got.codes)).view(np.uint8),
                                      want_c.view(np.uint8))
        np.testing.assert_array_equal(np.asarray(got.scales), want_s.astype(np.float32))
        assert float(got.global_scale) == 1.0
        if mode == "dynamic":
            np.testing.assert_array_equal(np.asarray(row_scale),
                                          scales if g is None else scales[np.asarray(g)])


def test_fp8_output_equals_the_reference_backend(rng, device):
    """The custom call's Fp8Rows are the reference backend's (jnp dispatch then the jnp
    quantizer), with unused scatter slots (an index outside [0, R)) writing nothing."""
    t, k = 5, 256
    x = bf16_rows(rng, t, k)
    gather, scatter = _scatter_case(rng, t, 2)
    keep = np.asarray(scatter) < 7                          # rows 7.. are not written
    scatter = jnp.where(keep, scatter, 10**6)
    r = int(keep.sum())
    gather = jnp.asarray(np.argsort(np.where(keep, np.asarray(scatter), 10**7).ravel())[:r] // 2,
                         jnp.int32)
    for dyn in (False, True):
        fn = dispatch_rows_dynamic if dyn else dispatch_rows
        got = fn(x, gather, scatter, fp8=True, backend="ffi")
        # jitted: the reference quantizer's ~40 operations would each compile eagerly
        ref = jax.jit(lambda x, g: fn(x, g, None, fp8=True, backend="reference"))(x, gather)
        if dyn:
            np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(ref[1]))
            got, ref = got[0], ref[0]
        np.testing.assert_array_equal(np.asarray(got.codes).view(np.uint8),
                                      np.asarray(ref.codes).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(ref.scales))


def test_fp8_output_needs_k_multiple_of_128(rng):
    x = bf16_rows(rng, 4, 64)
    for fn in (dispatch_rows, dispatch_rows_dynamic):
        for backend in ("ffi", "reference"):
            with pytest.raises(ValueError, match=r"x: K=64: fp8=True needs K to be a positive "
                                                 r"multiple of 128"):
                fn(x, fp8=True, backend=backend)


def test_fp8_output_of_zero_rows(rng, device):
    """No token rows, or none dispatched (R = 0): empty Fp8Rows of the right shapes (the CUDA
    handler gets null buffers for them)."""
    x0 = jnp.zeros((0, 256), jnp.bfloat16)
    got = dispatch_rows(x0, fp8=True, backend="ffi")
    assert got.codes.shape == (0, 256) and got.scales.shape == (0, 2)
    rows, s = dispatch_rows_dynamic(x0, fp8=True, backend="ffi")
    assert rows.codes.shape == (0, 256) and s.shape == (0,)
    x = bf16_rows(rng, 3, 256)
    none = jnp.full((3, 2), 10**6, jnp.int32)               # every copy elsewhere: R = 0
    got, s = dispatch_rows_dynamic(x, jnp.zeros((0,), jnp.int32), none, fp8=True, backend="ffi")
    assert got.codes.shape == (0, 256) and got.scales.shape == (0, 2) and s.shape == (0,)


def test_default_backend_is_auto():
    """backend defaults to "auto" (as the grouped GEMM's): the custom call where the extension is
    built, bit for bit dispatch_rows_reference, with and without fp8."""
    x = jnp.asarray(np.random.default_rng(58).standard_normal((6, 128)), jnp.float32)
    gather = jnp.asarray([5, 0, 0, 3], jnp.int32)
    for fp8 in (False, True):
        got = jax.jit(lambda x, g, f=fp8: dispatch_rows(x, g, fp8=f))(x, gather)
        want = dispatch_rows_reference(x, gather, fp8=fp8)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.bool_])
def test_integer_x_is_refused_in_every_mode(dtype):
    """x is float (its documented type) in every mode: an integer or bool x is one ValueError
    naming x and its dtype (not cast silently in the copy mode, nor numpy's "not inexact" in the
    dynamic one), on both backends, eagerly and under jit."""
    x = jnp.ones((4, 128), dtype)
    gather = jnp.array([3, 0, 1], jnp.int32)
    calls = {"copy": lambda x, b: dispatch_rows(x, gather, backend=b),
             "copy-fp8": lambda x, b: dispatch_rows(x, gather, backend=b, fp8=True),
             "row_scale": lambda x, b: dispatch_rows(x, gather, row_scale=jnp.ones((4,)),
                                                     backend=b),
             "dynamic": lambda x, b: dispatch_rows_dynamic(x, gather, backend=b)}
    for what, call in calls.items():
        for backend in ("ffi", "reference"):
            for run in (call, jax.jit(call, static_argnums=1)):
                with pytest.raises(ValueError, match=rf"x: expected a float \[T, K\], got "
                                                     rf"{jnp.dtype(dtype).name}"):
                    run(x, backend)


def test_fp8_output_k_edges(rng):
    """fp8=True needs K a positive multiple of 128 (the fp8 chunk), not of 64 or 16: K = 0 and
    K = 192 are refused naming K on both backends, K = 128 and 384 run (the custom call)."""
    for k in (0, 64, 192):
        x = jnp.zeros((3, k), jnp.bfloat16)
        for fn in (dispatch_rows, dispatch_rows_dynamic):
            for backend in ("ffi", "reference"):
                with pytest.raises(ValueError, match=rf"x: K={k}: fp8=True needs K to be a "
                                                     r"positive multiple of 128"):
                    fn(x, fp8=True, backend=backend)
    for k in (128, 384):
        got = dispatch_rows(bf16_rows(rng, 3, k), jnp.array([2, 0], jnp.int32), fp8=True,
                            backend="ffi" if _extension.available() else "reference")
        assert got.codes.shape == (2, k) and got.scales.shape == (2, k // 128)
