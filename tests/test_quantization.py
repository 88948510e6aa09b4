"""Quantization: bit-exact against oracles not written here, hand-worked vectors, old bugs."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_nvfp4 as jn
from jax_nvfp4.maths.formats import pack_codes, unpack_codes
from jax_nvfp4.maths.quantization import dynamic_global_scale, e2m1_scaled
from oracles import decode_e2m1_bytes, decode_e4m3, dequant64, quantize64

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def codes_of(t):
    """4-bit codes [..., K] as uint8, decoded by plain numpy bit ops (not our unpack)."""
    d = np.asarray(t.data)
    return np.stack([d & 0xF, d >> 4], -1).reshape(d.shape[:-1] + (-1,))


def oracle_quantize(x, gs):
    """NVFP4 quantization built only from ml_dtypes casts (RNE) and float32 numpy."""
    x = np.asarray(x, np.float32)
    y = (x.reshape(x.shape[:-1] + (-1, 16)) / np.float32(gs)).astype(np.float32)
    amax = np.abs(y).max(-1, keepdims=True)
    s = np.clip(amax / np.float32(6), 0, 448).astype(ml_dtypes.float8_e4m3fn)
    sf = s.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(sf > 0, np.clip(y / np.where(sf > 0, sf, 1), -6, 6), 0).astype(np.float32)
    codes = q.astype(ml_dtypes.float4_e2m1fn).view(np.uint8).reshape(x.shape)
    return codes, s[..., 0].view(np.uint8)


class TestAgainstOracles:
    @pytest.mark.parametrize("shape,scale", [((64, 256), 1.0), ((8, 3, 512), 1e-3),
                                             ((33, 7168), 50.0)])
    def test_jax_cudnn_quantizer_bit_exact(self, rng, shape, scale):
        from jax._src.cudnn.scaled_matmul_stablehlo import quantize as jax_quantize  # noqa: PLC0415 - private
        x = jnp.asarray(rng.standard_normal(shape, np.float32) * scale)
        t = jn.quantize(x)
        cfg = jax.nn.get_scaled_dot_general_config("nvfp4", t.global_scale)
        q, s = jax_quantize(x, cfg)
        their_codes = np.asarray(q).view(np.uint8)
        their_scales = np.asarray(s).view(np.uint8)
        code_diff = int((codes_of(t) != their_codes).sum())
        scale_diff = int((np.asarray(t.scales).view(np.uint8) != their_scales).sum())
        # Both divide exactly and cast with RNE, so not even ties may differ.
        assert scale_diff == 0, f"{scale_diff} block scales differ"
        assert code_diff == 0, f"{code_diff} of {their_codes.size} codes differ"

    def test_ml_dtypes_rounding_bit_exact(self, rng):
        x = rng.standard_normal((16, 1024)).astype(np.float32) * rng.uniform(0.01, 100, (16, 1))
        gs = np.float32(np.abs(x).max() / 2688)
        t = jn.quantize(jnp.asarray(x))
        assert np.float32(t.global_scale) == gs
        codes, scales = oracle_quantize(x, gs)
        np.testing.assert_array_equal(codes_of(t), codes)
        np.testing.assert_array_equal(np.asarray(t.scales).view(np.uint8), scales)

    def test_bf16_rows_on_ties_bit_exact(self, rng):
        """bf16 rows (8-bit mantissas: y / scale often lands exactly on an e2m1 midpoint, and
        amax / 6 on an e4m3 one), one global scale per row under vmap: the divisions must round
        as divisions (XLA compiles float divisions by broadcast or constant operands as products
        with the reciprocal, one ulp off on exactly those ties)."""
        x = (rng.standard_normal((256, 512)) * np.exp(rng.standard_normal((256, 1)) * 3))
        x = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
        gs = (np.abs(x).max(-1) / 2688).astype(np.float32)
        t = jax.jit(jax.vmap(jn.quantize))(jnp.asarray(x, jnp.bfloat16), jnp.asarray(gs))
        codes, scales = zip(*(oracle_quantize(x[i:i + 1], gs[i]) for i in range(len(x))))
        np.testing.assert_array_equal(np.asarray(t.scales).view(np.uint8), np.concatenate(scales))
        np.testing.assert_array_equal(codes_of(t), np.concatenate(codes))

    def test_every_bf16_pattern_per_row_scales(self):
        """All 65536 bf16 patterns (NaN, Inf, subnormals, -0) in rows of 256 with each row's own
        finite-amax scale: codes and scales as the oracle's; a block holding a NaN has a NaN
        scale (XLA's vectorized CPU max reduction can drop NaNs, which made such blocks 0)."""
        bits = np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16).reshape(256, 256)
        x = np.asarray(bits, np.float32)
        fin = np.where(np.isfinite(x), np.abs(x), 0).max(-1)
        gs = np.where(fin > 0, np.clip(fin / np.float32(2688), 2.0 ** -126, None), 1).astype(np.float32)
        t = jax.jit(jax.vmap(jn.quantize))(jnp.asarray(bits), jnp.asarray(gs))
        codes, scales = zip(*(oracle_quantize(x[i:i + 1], gs[i]) for i in range(len(x))))
        np.testing.assert_array_equal(np.asarray(t.scales).view(np.uint8), np.concatenate(scales))
        mine, theirs = codes_of(t), np.concatenate(codes)
        nan_block = np.repeat(np.isnan(np.concatenate(scales).view(ml_dtypes.float8_e4m3fn)
                                       .astype(np.float32)), 16, -1)
        # a NaN block's codes are not specified by the oracle's float4 cast (NaN -> code)
        np.testing.assert_array_equal(mine[~nan_block], theirs[~nan_block])
        assert nan_block.any()

    def test_static_scale_and_saturation(self, rng):
        x = rng.standard_normal((4, 64)).astype(np.float32)
        gs = np.float32(0.5 / 2688)                   # calibrated for amax 0.5: x exceeds it
        t = jn.quantize(jnp.asarray(x), gs)
        codes, scales = oracle_quantize(x, gs)
        np.testing.assert_array_equal(codes_of(t), codes)
        np.testing.assert_array_equal(np.asarray(t.scales).view(np.uint8), scales)
        d = np.asarray(jn.dequantize(t))
        assert np.abs(d).max() <= 6 * 448 * gs * (1 + 1e-6)
        big = np.abs(x) > 0.5
        assert np.all(np.abs(d[big]) >= 0.5 * 0.99)   # saturated, not wrapped or zeroed


@pytest.mark.parametrize("layout", ["checkpoint", "sm90"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_e2m1_scaled_of_a_stack_is_the_float64_product(rng, layout, dtype):
    """e2m1(data) * scale without the global scale, [G, N, K] in dtype (exact in bfloat16), read
    in either layout: the float64 oracle's product."""
    w = jnp.asarray(rng.standard_normal((3, 128, 128)) * 3, jnp.float32)
    t = jax.vmap(jn.quantize)(w)
    want = dequant64(np.asarray(t.data), np.asarray(t.scales))
    if layout == "sm90":
        t = jn.prepare_weights(t)
    got = np.asarray(e2m1_scaled(t, dtype))
    assert got.dtype == jnp.dtype(dtype) and got.shape == (3, 128, 128)
    np.testing.assert_array_equal(got.astype(np.float64), want)


class TestHandWorked:
    def test_every_code_both_signs(self):
        vals = np.array(E2M1 + [-v for v in E2M1], np.float32)       # 16 values, K = 32 below
        x = np.concatenate([vals, vals[::-1]])[None] * np.float32(1.0)
        t = jn.quantize(jnp.asarray(x), 1.0)                          # block amax 6 -> scale 1
        assert np.all(decode_e4m3(t.scales) == 1.0)
        dq = np.asarray(jn.dequantize(t))
        np.testing.assert_array_equal(dq, x)
        c = codes_of(t)[0, :16]
        np.testing.assert_array_equal(c[:8], np.arange(8))           # positive codes 0..7
        np.testing.assert_array_equal(c[9:16], np.arange(9, 16))      # negatives keep bit 3
        assert c[8] == 8                                              # -0.0 keeps its sign bit

    @pytest.mark.parametrize("v,expect", [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0),
                                          (2.5, 2.0), (3.5, 4.0), (5.0, 4.0), (0.26, 0.5),
                                          (5.01, 6.0), (-0.75, -1.0), (-2.5, -2.0), (-5.0, -4.0)])
    def test_ties_to_even(self, v, expect):
        x = np.zeros((1, 32), np.float32)
        x[0, 0] = 6.0                                                 # pins block scale to 1
        x[0, 1] = v
        t = jn.quantize(jnp.asarray(x), 1.0)
        assert float(jn.dequantize(t)[0, 1]) == expect
        assert decode_e2m1_bytes(t.data)[0, 1] == expect             # ml_dtypes agrees

    def test_saturation_at_six(self):
        x = np.zeros((1, 32), np.float32)
        x[0, :16] = 6.0
        x[0, 3] = -7.0
        t = jn.quantize(jnp.asarray(x), 1.0)
        # block amax 7 -> scale e4m3(7/6) = 1.125; -7/1.125 = -6.2 saturates to -6
        assert decode_e4m3(t.scales)[0, 0] == 1.125
        assert float(jn.dequantize(t)[0, 3]) == -6.75

    def test_zero_block_next_to_large_block(self):
        x = np.zeros((1, 64), np.float32)
        x[0, 16:32] = np.linspace(-1000, 1000, 16)
        t = jn.quantize(jnp.asarray(x))
        s = decode_e4m3(t.scales)[0]
        assert s[0] == 0 and s[2] == 0 and s[3] == 0 and s[1] == 448
        dq = np.asarray(jn.dequantize(t))[0]
        assert np.all(dq[:16] == 0) and np.all(dq[32:] == 0)
        assert dq[16] == -1000 and dq[31] == 1000                     # the amax is exact

    def test_all_zero_input(self):
        t = jn.quantize(jnp.zeros((3, 32)))
        assert float(t.global_scale) == 1.0
        assert np.all(np.asarray(jn.dequantize(t)) == 0)
        assert np.all(np.asarray(t.data) == 0)

    def test_nan_and_inf(self):
        x = np.ones((1, 64), np.float32)
        x[0, 5] = np.nan
        x[0, 20] = np.inf
        x[0, 40] = -np.inf
        t = jn.quantize(jnp.asarray(x))
        assert np.isfinite(float(t.global_scale))                     # amax ignores non-finite
        assert float(t.global_scale) == np.float32(1.0 / 2688)
        dq = np.asarray(jn.dequantize(t))[0]
        assert np.all(np.isnan(dq[:16]))                              # NaN marks its block
        assert dq[20] == 6 * 448 * float(t.global_scale)              # +Inf saturates
        assert dq[40] == -6 * 448 * float(t.global_scale)
        np.testing.assert_array_equal(dq[48:], 1.0)                   # other blocks untouched


def x64():
    """A context with 64-bit types on (jax.enable_x64 on jax >= 0.10, the experimental one before)."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64  # noqa: PLC0415 - jax < 0.10 only
    return enable_x64()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_dequantize_half_precision_rounds_the_float32_product_once(rng, dtype):
    """dequantize computes in float32 and rounds once to a narrower dtype (docstring): bit for
    bit dequantize(t, float32).astype(dtype), with a global scale that is not a power of two."""
    t = jax.vmap(jn.quantize)(jnp.asarray(rng.standard_normal((2, 64, 256)), jnp.float32))
    t = jn.NVFP4Tensor(t.data, t.scales, jnp.asarray([0.3, 1.7e-3], jnp.float32))
    want = np.asarray(jn.dequantize(t, jnp.float32)).astype(jnp.dtype(dtype))
    got = np.asarray(jn.dequantize(t, dtype))
    assert got.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def test_dequantize_float64_is_exact_under_x64(rng):
    """float64 output multiplies in float64: e2m1 * scale (6 bits) * a float32 global scale is
    exact there, the float64 oracle's value."""
    t = jax.vmap(jn.quantize)(jnp.asarray(rng.standard_normal((2, 64, 256)), jnp.float32))
    g = np.asarray([0.3, 1.7e-3], np.float32)
    with x64():
        t64 = jn.NVFP4Tensor(t.data, t.scales, jnp.asarray(g))
        got = np.asarray(jn.dequantize(t64, jnp.float64))
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, dequant64(np.asarray(t.data), np.asarray(t.scales), g))


def test_dequantize_refuses_what_is_not_a_tensor():
    with pytest.raises(ValueError, match="^t: expected an NVFP4Tensor, got ndarray$"):
        jn.dequantize(np.zeros((2, 16), np.uint8))


def test_dynamic_global_scale_counts_subnormals_and_empty_input():
    """docstring: amax over the finite values, clipped to [2^-126, FLT_MAX], 1.0 when there is no
    finite non-zero value. Subnormal float32 values are non-zero (on every backend: XLA's CPU
    compares flush them); no value at all is 1.0."""
    for x in (np.array([1e-40, -3e-41, 0.0], np.float32), np.array([-2.0**-149], np.float32)):
        assert float(dynamic_global_scale(jnp.asarray(x))) == 2.0**-126
        assert float(jax.jit(dynamic_global_scale)(jnp.asarray(x))) == 2.0**-126
    for x in (np.zeros((0,), np.float32), np.zeros((0, 32), np.float32),
              np.array([0.0, -0.0, np.nan, np.inf], np.float32)):
        assert float(dynamic_global_scale(jnp.asarray(x))) == 1.0


def test_dequantize_gate_up_global_scales(rng):
    """A [G, 2] global scale of a [G, 2I, H] stack scales rows :I (gate) and I: (up) apart."""
    t = jax.vmap(jn.quantize)(jnp.asarray(rng.standard_normal((2, 64, 128)), jnp.float32))
    g = np.asarray([[0.5, 3.0], [0.25, 7.0]], np.float32)
    t = jn.NVFP4Tensor(t.data, t.scales, jnp.asarray(g))
    want = dequant64(np.asarray(t.data), np.asarray(t.scales))
    want = want * np.repeat(g.astype(np.float64), 32, axis=1)[..., None]
    np.testing.assert_array_equal(np.asarray(jn.dequantize(t)).astype(np.float64), want)


class TestOutOfRange:
    """Issue 23, item 6: tiny, zero and huge scales have a defined result, never a silent 0."""

    @pytest.mark.parametrize("amax", [1e-36, 3e-38, 2e-38])
    def test_tiny_amax_global_scale_never_zero(self, amax):
        x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32) * np.float32(amax)
        t = jn.quantize(jnp.asarray(x))
        assert float(t.global_scale) == 2.0**-126                    # the floor, not 0
        dq = np.asarray(jn.dequantize(t), np.float64)
        # (XLA on CPU flushes float32 subnormals to 0: values below 2^-126 may read as 0)
        np.testing.assert_allclose(dq, dequant64(t.data, t.scales, t.global_scale), rtol=1e-7,
                                   atol=2.0**-126)
        assert np.abs(dq).max() > 0
        assert np.abs(dq - x).max() <= amax / 5 + 2.0**-126   # NVFP4: <= 1/6 of the block amax

    def test_global_scale_floor_keeps_normal_inputs_bit_exact(self, rng):
        # at and above 2688 * 2^-126 the scale is amax / 2688 as before (and JAX's quantizer)
        x = rng.standard_normal((4, 64)).astype(np.float32)
        x *= np.float32(2688 * 2.0**-126 * 4) / np.abs(x).max()
        t = jn.quantize(jnp.asarray(x))
        assert float(t.global_scale) == np.float32(np.abs(x).max() / np.float32(2688))
        codes, scales = oracle_quantize(x, t.global_scale)
        np.testing.assert_array_equal(codes_of(t), codes)
        np.testing.assert_array_equal(np.asarray(t.scales).view(np.uint8), scales)

    @pytest.mark.parametrize("gs", [0.0, -0.5, np.nan, np.inf, 1e-40])
    def test_static_global_scale_zero_or_invalid_rejected(self, gs):
        with pytest.raises(ValueError, match=r"global_scale: expected a finite float32 >= 2\^-126"):
            jn.quantize(jnp.ones((2, 32)), gs)
        with pytest.raises(ValueError, match="global_scale: expected a finite"):
            jn.stage_activation(jnp.ones((2, 32)), gs)

    def test_static_global_scale_range_edges(self):
        """The smallest normal float32 and the largest finite one are accepted; the float32
        neighbours outside are refused with the value and why."""
        x = jnp.ones((2, 32))
        for gs in (2.0**-126, float(np.finfo(np.float32).max)):
            t = jn.quantize(x, gs)
            assert float(t.global_scale) == gs
            jn.stage_activation(x, gs)
        below = float(np.nextafter(np.float32(2.0**-126), np.float32(0)))
        msg = (r"^global_scale: expected a finite float32 >= 2\^-126 \(the smallest normal "
               r"float32\), got {}; a zero, negative, subnormal or non-finite scale cannot "
               r"dequantize to the input$")
        with pytest.raises(ValueError, match=msg.format(re.escape(repr(below)))):
            jn.quantize(x, below)
        with pytest.raises(ValueError, match=msg.format("inf")):
            jn.quantize(x, np.float32(np.inf))

    @pytest.mark.parametrize("gs", [0.0, -0.5, np.nan, np.inf])
    def test_traced_invalid_global_scale_gives_nan(self, gs):
        f = jax.jit(lambda x, s: jn.dequantize(jn.quantize(x, s)))
        assert np.all(np.isnan(np.asarray(f(jnp.ones((2, 32)), jnp.float32(gs)))))
        ok = jn.dequantize(jn.quantize(jnp.ones((2, 32)), 0.5))
        np.testing.assert_array_equal(np.asarray(f(jnp.ones((2, 32)), jnp.float32(0.5))), ok)

    def test_float64_beyond_float32_range(self):
        with x64():
            x = np.linspace(-1, 1, 64).reshape(2, 32) * 1e40
            x[1, 3] = np.inf
            t = jn.quantize(jnp.asarray(x))
            assert t.global_scale.dtype == jnp.float32
            assert float(t.global_scale) == np.float32(1e40 / 2688)
            dq = np.asarray(jn.dequantize(t, jnp.float64))
            np.testing.assert_allclose(dq, dequant64(t.data, t.scales, t.global_scale), rtol=1e-7)
            finite = np.isfinite(x)
            assert np.abs(dq - x)[finite].max() <= 1e40 / 5
            assert dq[1, 3] == 2688 * np.float64(np.float32(t.global_scale))   # +Inf saturates
            # past 2688 * FLT_MAX the global scale saturates at FLT_MAX, and so do the values
            big = jn.quantize(jnp.asarray(np.full((1, 32), 1e300)))
            assert float(big.global_scale) == np.finfo(np.float32).max
            assert np.all(np.asarray(jn.dequantize(big, jnp.float64)) == 2688 *
                          np.float64(np.finfo(np.float32).max))
            # float32 input still matches the float32 path bit for bit
            y = np.linspace(-3, 3, 64, dtype=np.float32).reshape(2, 32)
            a, b = jn.quantize(jnp.asarray(y)), jn.quantize(jnp.asarray(y, jnp.float64))
            np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))


class TestOldBugs:
    """One named regression test per bug of the system this project descends from."""

    def test_sign_bits_kept_not_clamped_to_unsigned(self):
        x = -(1 + np.random.default_rng(1).uniform(0, 1, (2, 32))).astype(np.float32)
        dq = np.asarray(jn.dequantize(jn.quantize(jnp.asarray(x))))
        assert np.all(dq < 0)
        assert np.all(codes_of(jn.quantize(jnp.asarray(x))) >= 8)

    def test_block_scale_is_block_max_over_six(self):
        x = np.zeros((1, 32), np.float32)
        x[0, 0] = 12.0
        x[0, 16] = 3.0
        t = jn.quantize(jnp.asarray(x), 1.0)
        np.testing.assert_array_equal(decode_e4m3(t.scales)[0], [2.0, 0.5])   # not [12, 3]

    def test_nearest_e2m1_not_uniform_half_steps(self):
        x = np.zeros((1, 32), np.float32)
        x[0, :4] = [6.0, 2.6, 3.4, 4.9]      # uniform 0.5 steps would give 2.5, 3.5, 5.0
        dq = np.asarray(jn.dequantize(jn.quantize(jnp.asarray(x), 1.0)))[0, :4]
        np.testing.assert_array_equal(dq, [6.0, 3.0, 3.0, 4.0])

    def test_e4m3_bytes_bitcast_not_value_converted(self):
        raw = jnp.array([0x3F, 0x38, 0x7E, 0x01], jnp.uint8)
        s = jn.scales_from_bytes(raw)
        np.testing.assert_array_equal(np.asarray(s, np.float32), [1.875, 1.0, 448.0, 2.0 ** -9])
        assert float(np.asarray(s, np.float32)[0]) != 63.0

    def test_large_activations_do_not_saturate_block_scales(self):
        x = np.random.default_rng(2).standard_normal((8, 256)).astype(np.float32)
        x[0, 0] = 1e4
        t = jn.quantize(jnp.asarray(x))
        assert decode_e4m3(t.scales).max() <= 448
        err = np.abs(np.asarray(jn.dequantize(t))[0, 0] - 1e4)
        assert err == 0.0                                              # the amax maps to 6 * 448

    def test_nibble_order_low_first(self):
        x = np.zeros((1, 32), np.float32)
        x[0, 0], x[0, 1] = 6.0, 0.5                                   # codes 7 and 1
        t = jn.quantize(jnp.asarray(x), 1.0)
        assert int(np.asarray(t.data)[0, 0]) == 0x17


class TestRoundTripAndApi:
    def test_round_trip_error_bound(self, rng):
        x = rng.standard_normal((32, 512)).astype(np.float32)
        t = jn.quantize(jnp.asarray(x))
        dq = np.asarray(jn.dequantize(t), np.float64)
        blocks = x.reshape(32, -1, 16)
        # Per element: half the E2M1 step at the top of the block (1 in units of scale, so
        # amax/6 * 1) plus the e4m3 rounding of the scale (2^-4 relative, times 6).
        bound = np.abs(blocks).max(-1, keepdims=True) * (1 / 6 + 6 * 2 ** -4 / 6) * 1.0001
        assert np.all(np.abs(dq.reshape(blocks.shape) - blocks) <= bound)
        assert np.linalg.norm(dq - x) / np.linalg.norm(x) < 0.12

    def test_dequantize_matches_float64_oracle(self, rng):
        w = jnp.asarray(rng.standard_normal((3, 8, 64)).astype(np.float32))
        t = jax.vmap(jn.quantize)(w)
        ref = dequant64(t.data, t.scales, t.global_scale)
        # e2m1 * e4m3 is exact; the float32 global-scale multiply rounds once.
        np.testing.assert_allclose(np.asarray(jn.dequantize(t), np.float64), ref, rtol=2 ** -24)

    def test_jit_and_vmap(self, rng):
        x = jnp.asarray(rng.standard_normal((4, 6, 64)).astype(np.float32))
        t1 = jax.jit(jax.vmap(jn.quantize))(x)
        assert t1.global_scale.shape == (4,)
        for i in range(4):
            # XLA may turn amax / 2688 into amax * (1/2688) under vmap: one ulp at most.
            np.testing.assert_allclose(float(t1.global_scale[i]),
                                       float(jn.quantize(x[i]).global_scale), rtol=2 ** -23)
            ti = jn.quantize(x[i], t1.global_scale[i])
            np.testing.assert_array_equal(np.asarray(t1.data[i]), np.asarray(ti.data))
            np.testing.assert_array_equal(np.asarray(t1.scales[i]).view(np.uint8),
                                          np.asarray(ti.scales).view(np.uint8))
        d = jax.jit(jax.vmap(jn.dequantize))(t1)
        assert d.shape == x.shape
        a, s, g = jax.jit(jax.vmap(jn.stage_activation))(x)
        assert a.shape == (4, 6, 32) and s.shape == (4, 6, 4) and g.shape == (4,)
        assert a.dtype == jnp.uint8 and s.dtype == jnp.float8_e4m3fn and g.dtype == jnp.float32

    def test_stage_activation_triple(self, rng):
        x = jnp.asarray(rng.standard_normal((5, 96)).astype(np.float32))
        a, s, g = jn.stage_activation(x)
        t = jn.quantize(x)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(t.data))
        assert s.shape == (5, 6) and g.shape == ()
        # every part of the triple against the numpy + ml_dtypes quantizer: the global scale
        # bit for bit, the dequantized values exactly
        want, want_gs = quantize64(np.asarray(x))
        assert np.float32(g) == np.float32(want_gs)
        np.testing.assert_array_equal(dequant64(a, s) * float(g), want * want_gs)

    def test_tensor_shape_and_pytree(self, rng):
        t = jn.quantize(jnp.asarray(rng.standard_normal((3, 64)).astype(np.float32)))
        assert t.shape == (3, 64)
        leaves, tree = jax.tree_util.tree_flatten(t)
        assert len(leaves) == 3 and jax.tree_util.tree_unflatten(tree, leaves).shape == (3, 64)

    def test_pack_unpack_inverse(self, rng):
        b = jnp.asarray(rng.integers(0, 256, (4, 16), dtype=np.uint8))
        np.testing.assert_array_equal(np.asarray(pack_codes(unpack_codes(b))), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(unpack_codes(b).astype(jnp.float32)),
                                      decode_e2m1_bytes(b))

    @pytest.mark.parametrize("k", [16, 48, 33, 8])
    def test_k_not_multiple_of_32(self, k):
        with pytest.raises(ValueError, match="multiple of 32"):
            jn.quantize(jnp.ones((2, k)))
        with pytest.raises(ValueError, match="multiple of 32"):
            jn.stage_activation(jnp.ones((2, k)))

    def test_bad_inputs(self):
        with pytest.raises(ValueError, match="^x: expected a floating-point array, got int32$"):
            jn.quantize(jnp.ones((2, 32), jnp.int32))
        with pytest.raises(ValueError, match="^x: expected a floating-point array, got int32$"):
            jn.stage_activation(jnp.ones((2, 32), jnp.int32))
        with pytest.raises(ValueError, match="global_scale"):
            jn.quantize(jnp.ones((2, 32)), jnp.ones((2,)))
        with pytest.raises(ValueError, match=r"x: expected \[M, K\]"):
            jn.stage_activation(jnp.ones((2, 2, 32)))
        with pytest.raises(ValueError, match="scales"):
            jn.scales_from_bytes(jnp.ones((2,), jnp.float32))
        t = jn.quantize(jnp.ones((2, 32)))
        with pytest.raises(ValueError, match="t.scales"):
            jn.dequantize(jn.NVFP4Tensor(t.data, t.scales.astype(jnp.float32), t.global_scale))
        with pytest.raises(ValueError, match="t.data"):
            jn.dequantize(jn.NVFP4Tensor(t.data.astype(jnp.int32), t.scales, t.global_scale))


def test_dequantize_half_split_global_scale(rng):
    """w13 with different gate/up weight_scale_2: global_scale [E, 2] scales each half of N."""
    gate = jax.vmap(jn.quantize)(jnp.asarray(rng.standard_normal((3, 8, 32)).astype(np.float32)))
    up = jax.vmap(jn.quantize)(jnp.asarray(rng.standard_normal((3, 8, 32)).astype(np.float32) * 9))
    t = jn.NVFP4Tensor(jnp.concatenate([gate.data, up.data], 1),
                       jnp.concatenate([gate.scales, up.scales], 1),
                       jnp.stack([gate.global_scale, up.global_scale], 1))
    d = np.asarray(jn.dequantize(t))
    np.testing.assert_array_equal(d[:, :8], np.asarray(jn.dequantize(gate)))
    np.testing.assert_array_equal(d[:, 8:], np.asarray(jn.dequantize(up)))


@pytest.mark.parametrize("shape", [(256, 128), (3, 128, 320)])
def test_dequantize_reads_the_sm90_layout(rng, shape):
    """Weights prepared by jax_nvfp4.prepare_weights dequantize to the same values."""
    w = rng.standard_normal(shape).astype(np.float32)
    t = (jax.vmap(jn.quantize) if len(shape) == 3 else jn.quantize)(jnp.asarray(w))
    p = jn.prepare_weights(t)
    want = dequant64(t.data, t.scales, t.global_scale)        # ml_dtypes on checkpoint bytes
    for x in (t, p):
        np.testing.assert_allclose(np.asarray(jn.dequantize(x), np.float64), want, rtol=2 ** -24)
    np.testing.assert_array_equal(np.asarray(jn.dequantize(p)), np.asarray(jn.dequantize(t)))
    if len(shape) == 3:                                       # per expert, under vmap
        np.testing.assert_array_equal(np.asarray(jax.vmap(jn.dequantize)(p)),
                                      np.asarray(jn.dequantize(t)))
