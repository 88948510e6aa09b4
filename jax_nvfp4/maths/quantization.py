"""NVFP4 quantization and dequantization (pure jnp; jittable and vmappable).

The format is described in :mod:`jax_nvfp4.maths.formats`. Quantization, per tensor:

1. ``global_scale = amax / (6 * 448)`` (dynamic; clipped to ``[2^-126, FLT_MAX]``, 1.0 for an
   input with no finite non-zero value: never 0, Inf or NaN) or the given static value (finite,
   ``>= 2^-126``; a concrete bad one is a ValueError, a traced one makes every block NaN).
2. ``y = x / global_scale``; per block of 16: ``scale = e4m3(clip(amax_block(y) / 6, 0, 448))``
   (round to nearest even).
3. ``code = e2m1(clip(y / float(scale), -6, 6))`` (nearest, ties to even); a block whose scale
   rounds to 0 is all zeros.

Values beyond a static range saturate at ``+-6 * 448 * global_scale``; so do float64 values
beyond ``2688 * FLT_MAX`` (float64 input is divided by the global scale in float64, so values
past the float32 range get a finite global scale and keep their precision).

Non-finite inputs (E2M1 has no Inf or NaN): the dynamic amax ignores them; +-Inf saturates to the
largest magnitude (its block scale becomes 448, its code +-6); a NaN makes its whole block's scale
NaN (e4m3 0x7F), so the block dequantizes to NaN: visible, never silently a number.

Derivatives: :func:`quantize` and :func:`stage_activation` have none. Their outputs are E2M1
codes (uint8: an integer has no tangent) and block and global scales, which cannot carry a
per-element derivative of ``x``, so a straight-through estimator cannot pass through an
NVFP4Tensor; differentiating them with respect to ``x`` (or a traced static global scale) raises
TypeError instead of returning zeros. Straight-through gradients are available where the float
input is still at hand: :func:`jax_nvfp4.ops.autodiff.frozen_weights` around a GEMM that quantizes
its input, and ``xs = jax.lax.stop_gradient(x); x + (dequantize(quantize(xs)) - xs)`` for a
fake-quantized value (the error comes from the tangent reaching quantize's input, even when its
result is discarded or stopped later: quantize a stopped value). :func:`dequantize` itself is
differentiable in the scales and the global scale.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .formats import (BLOCK_SIZE, E2M1_MAX, E4M3_MAX, NVFP4Tensor, check_k, decode_packed,
                      encode_e2m1, expand_global_scale, keep_rounded, pack_nibbles)
from .layout import checkpoint_data, checkpoint_scales


def _as_float(x, name: str) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name}: expected a floating-point array, got {x.dtype}")
    if x.ndim < 1:
        raise ValueError(f"{name}: expected at least 1 axis [..., K], got a scalar")
    check_k(x.shape[-1], name)
    return x


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def refuse_derivative(x, message: str):
    """``x`` unchanged; differentiating through it (forward or reverse mode, any order) raises
    ``TypeError(message)`` at trace time. Operations whose derivative would otherwise come out
    silently zero (integer codes, bit manipulation) guard their differentiable inputs with it.
    A value that carries no tangent (constants, ``jax.lax.stop_gradient``, the primal inside a
    ``custom_vjp``) passes without error."""
    return x


@refuse_derivative.defjvp
def _refuse_derivative_jvp(message, primals, tangents):
    # JAX calls a custom_jvp rule only for a nonzero (non-symbolic-zero) tangent.
    raise TypeError(message)


QUANTIZE_NO_DERIVATIVE = (
    "jax_nvfp4.quantize / stage_activation: no derivative with respect to x or a static "
    "global_scale (the result is integer E2M1 codes and block scales, which cannot carry a "
    "per-element derivative; it would be silently zero). For a straight-through gradient keep the "
    "float input: wrap a GEMM that quantizes its input in jax_nvfp4.ops.autodiff.frozen_weights, or "
    "use xs = jax.lax.stop_gradient(x); x + (dequantize(quantize(xs)) - xs); quantize "
    "jax.lax.stop_gradient(x) whenever no gradient should flow through it.")
"""The TypeError message of differentiating :func:`quantize` (:func:`refuse_derivative`)."""


MIN_GLOBAL_SCALE = float(jnp.finfo(jnp.float32).smallest_normal)
"""2^-126: the dynamic global scale is never below it (a subnormal scale would flush to 0)."""
MAX_GLOBAL_SCALE = float(jnp.finfo(jnp.float32).max)


def _compute_dtype(x: jax.Array):
    """float64 for float64 input (x64 on: values past the float32 range stay finite until they
    are divided by the global scale), else float32 (exact for float16/bfloat16/float32)."""
    return x.dtype if jnp.finfo(x.dtype).bits > 32 else jnp.dtype(jnp.float32)


def _significand(y):
    """float32 y as ``(bits, sign bit, exponent, 24-bit significand, keep)``: subnormals normalized
    (exponent 1 - shift), ``keep`` true for zeros, infinities and NaNs (passed through as bits)."""
    yb = jax.lax.bitcast_convert_type(y.astype(jnp.float32), jnp.uint32)
    ey = ((yb >> 23) & 0xFF).astype(jnp.int32)
    fy = yb & 0x7FFFFF
    sub = ey == 0
    nz = jnp.where(sub, jax.lax.clz(fy).astype(jnp.int32) - 8, 0)
    my = jnp.where(sub, fy << nz.astype(jnp.uint32), fy | 0x800000)
    keep = (sub & (fy == 0)) | (ey == 255)
    return yb, yb & jnp.uint32(0x80000000), jnp.where(sub, 1 - nz, ey), my, keep


@jax.jit
def _div_exact(y: jax.Array, d) -> jax.Array:
    """``y / d`` rounded to nearest even, float32, for float32 y and a positive normal float32 d
    (broadcast against y), by integer long division of the significands. XLA compiles a float
    division by a constant or by a broadcast operand as a product with the reciprocal, which can
    put a quotient that lies exactly on a rounding midpoint of the E2M1 or E4M3 grid one ulp off
    (common for bf16 inputs); integer arithmetic is compiled exactly. Quotients below 2^-126 come
    out as a zero of y's sign (they round to 0 in both formats); Inf and NaN y pass through, a
    zero y as itself; subnormal y are exact (read from their bits). Only for y and d that are finite where it
    matters: an invalid d gives an unspecified number (quantize masks those blocks to NaN).
    Jitted: called eagerly it is one compiled program, not some forty dispatched operations.
    """
    yb, sign, ey, my, keep = _significand(y)
    db = jax.lax.bitcast_convert_type(jnp.asarray(d, jnp.float32), jnp.uint32)
    ed = ((db >> 23) & 0xFF).astype(jnp.int32)
    md = (db & 0x7FFFFF) | 0x800000
    lo = my < md                                              # then shift my: my / md in [1, 2)
    r = jnp.where(lo, my << 1, my) - md                       # the quotient's leading 1 taken
    q = jnp.ones_like(r)
    for _ in range(3):                                        # 3 x 8 more bits; r < md < 2^24
        r = r << 8
        digit = r // md
        r = r - digit * md
        q = (q << 8) | digit                                  # 25 bits: 24 and a round bit
    # y / d = (q + r / md) 2^(ey - ed - 24 - lo)
    return _round_quotient(q, r != 0, jnp.uint32(1), ey - ed + 126 - lo.astype(jnp.int32), sign,
                           keep, yb)


@jax.jit
def _div_small(y: jax.Array, m, e) -> jax.Array:
    """:func:`_div_exact` for a divisor ``m * 2^e`` with an integer m in [1, 15] (6, and every
    e4m3 value), in one integer division: the 24-bit significand shifted by 7 over m keeps 27 to
    31 quotient bits."""
    yb, sign, ey, my, keep = _significand(y)
    m = jnp.asarray(m).astype(jnp.uint32)
    n = my << 7
    q = n // m
    r = n - q * m
    shift = (8 - jax.lax.clz(q).astype(jnp.int32)).astype(jnp.uint32)   # bits past 24: 3 to 7
    return _round_quotient(q, r != 0, shift, ey - jnp.asarray(e).astype(jnp.int32) - 7, sign,
                           keep, yb)


def _round_quotient(q, inexact, shift, exp, sign, keep, yb):
    """float32 bits of ``(q + frac) 2^(exp - 150)`` rounded to nearest even (frac in [0, 1),
    nonzero where ``inexact``), as a float32; zero of ``sign`` below 2^-126, infinity past the
    range, ``yb`` itself where ``keep``."""
    kept = q >> shift
    low = q & ((jnp.uint32(1) << shift) - 1)
    half = jnp.uint32(1) << (shift - 1)
    up = (low > half) | ((low == half) & (inexact | ((kept & 1) == 1)))
    kept = kept + up.astype(jnp.uint32)
    carry = kept >> 24                                        # rounded up to 2^24
    kept = kept >> carry
    field = shift.astype(jnp.int32) + carry.astype(jnp.int32) + exp
    out = sign | (jnp.clip(field, 0, 255).astype(jnp.uint32) << 23) | (kept & 0x7FFFFF)
    out = jnp.where(field >= 255, sign | jnp.uint32(0x7F800000), out)
    out = jnp.where(field <= 0, sign, out)
    return jax.lax.bitcast_convert_type(jnp.where(keep, yb, out), jnp.float32)


def dynamic_global_scale(x: jax.Array) -> jax.Array:
    """float32 ``[]``: ``amax(|x|) / (6 * 448)`` over the finite values of x, clipped to
    ``[2^-126, FLT_MAX]``, or 1.0 when there is no finite non-zero value. Never 0, Inf or NaN.

    The amax is taken in x's precision (float64 input: beyond the float32 range too).
    """
    x = keep_rounded(jnp.asarray(x))
    if _compute_dtype(x) == jnp.float32:
        # On the float32 bits, so subnormal values count on every backend (XLA's CPU backend
        # flushes them in float compares), and an exact division (XLA would multiply by 1/2688):
        # every backend and the dispatch kernel (csrc/dispatch_rows.h) make the same scale.
        bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32) & 0x7FFFFFFF
        top = jnp.max(jnp.where(bits < 0x7F800000, bits, 0), initial=jnp.uint32(0))
        nonzero = top > 0
        q = _div_exact(jax.lax.bitcast_convert_type(top, jnp.float32), E2M1_MAX * E4M3_MAX)
    else:
        a = jnp.abs(x.astype(_compute_dtype(x)))
        amax = jnp.max(jnp.where(jnp.isfinite(a), a, 0.0), initial=0.0)
        nonzero = amax > 0
        q = amax / (E2M1_MAX * E4M3_MAX)
    gs = jnp.clip(q, MIN_GLOBAL_SCALE, MAX_GLOBAL_SCALE)
    return jnp.where(nonzero, gs, 1.0).astype(jnp.float32)


def _check_static_scale(gs: jax.Array) -> None:
    if isinstance(gs, jax.core.Tracer):
        return                          # traced: a bad value gives NaN blocks (see quantize)
    v = float(gs)
    if not MIN_GLOBAL_SCALE <= v <= MAX_GLOBAL_SCALE:
        raise ValueError(f"global_scale: expected a finite float32 >= 2^-126 (the smallest normal "
                         f"float32), got {v!r}; a zero, negative, subnormal or non-finite scale "
                         "cannot dequantize to the input")


def quantize(x: jax.Array, global_scale=None) -> NVFP4Tensor:
    """Quantize ``x`` (float ``[..., K]``, K a multiple of 32) to NVFP4.

    Args:
      x: float array ``[..., K]`` (any float dtype; computed in float32, float64 input divided
        by the global scale in float64 first).
      global_scale: None for dynamic (``amax / 2688`` of the whole x, at least 2^-126), or a
        static float32 scalar (a checkpoint's calibrated input scale): a concrete one must be
        finite and >= 2^-126 (else ValueError); a traced one that is not makes every block's
        scale NaN, so the result dequantizes to NaN.

    Returns:
      NVFP4Tensor with data uint8 ``[..., K/2]``, scales float8_e4m3fn ``[..., K/16]`` and
      global_scale float32 ``[]``.

    Not differentiable: ``jax.grad`` / ``jax.jvp`` with respect to ``x`` or a traced
    ``global_scale`` raise TypeError (:data:`QUANTIZE_NO_DERIVATIVE`; the module docstring gives
    the straight-through alternatives).
    """
    x = keep_rounded(refuse_derivative(_as_float(x, "x"), QUANTIZE_NO_DERIVATIVE))
    if global_scale is None:
        gs = dynamic_global_scale(x)
    else:
        gs = jnp.asarray(global_scale, jnp.float32)
        if gs.ndim != 0:
            raise ValueError(f"global_scale: expected a scalar, got shape {gs.shape} "
                             "(use jax.vmap for one scale per slice)")
        _check_static_scale(gs)
        gs = refuse_derivative(gs, QUANTIZE_NO_DERIVATIVE)
    ct = _compute_dtype(x)
    bad_scale = ~((gs >= MIN_GLOBAL_SCALE) & (gs <= MAX_GLOBAL_SCALE))   # NaN compares False
    x = x.astype(ct)
    blocks = x.reshape(x.shape[:-1] + (x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE))
    if ct == jnp.float32:               # (an invalid scale: any divisor, the blocks become NaN)
        y = _div_exact(blocks, jnp.where(bad_scale, 1.0, gs))
    else:                               # float64 (x64): values past the float32 range stay finite
        y = (blocks / gs.astype(ct)).astype(jnp.float32)
    # Inf stays Inf; a NaN is found by its own reduction: XLA's CPU max reduction can drop NaNs
    # (vectorized max instructions), which would make a NaN block a number.
    block_amax = jnp.where(jnp.any(jnp.isnan(y), axis=-1, keepdims=True), jnp.nan,
                           jnp.max(jnp.abs(y), axis=-1, keepdims=True))
    # The barriers make the e4m3 and e2m1 roundings real inside any jit: XLA on GPU may otherwise
    # elide a narrowing convert followed by a widening one (excess precision), so codes would be
    # computed against an unrounded scale (JAX's own nvfp4 quantizer guards the same way).
    # The divisions are integer arithmetic (_div_exact, _div_small): as float divisions XLA may
    # compile them as products with a reciprocal, one ulp off on exact ties.
    scales = jax.lax.optimization_barrier(
        jnp.where(bad_scale, jnp.nan, jnp.clip(_div_small(block_amax, 3, 1), 0.0, E4M3_MAX))
        .astype(jnp.float8_e4m3fn))
    scale_f32 = scales.astype(jnp.float32)
    pos = scale_f32 > 0                                       # false for 0 and NaN
    code = jax.lax.bitcast_convert_type(scales, jnp.uint8).astype(jnp.int32)
    exp, man = (code >> 3) & 0xF, code & 7                    # e4m3: (8 + m) 2^(e - 10), or m 2^-9
    q = _div_small(y, jnp.where(pos, jnp.where(exp > 0, 8 + man, man), 1),
                   jnp.where(pos, jnp.where(exp > 0, exp - 10, -9), 0))
    q = jnp.clip(q, -E2M1_MAX, E2M1_MAX)
    q = jnp.where(pos & ~jnp.isnan(y), q, 0.0)
    # Integer encoding (no float4 dtype): round to nearest even, exactly as a float4_e2m1fn cast.
    codes = encode_e2m1(q).reshape(x.shape)
    data = jax.lax.optimization_barrier(pack_nibbles(codes))
    return NVFP4Tensor(data, scales[..., 0], gs.astype(jnp.float32))


def e2m1_scaled(t: NVFP4Tensor, dtype=jnp.float32) -> jax.Array:
    """``e2m1(t.data) * float(t.scales)`` without the global scale, ``[..., K]`` in ``dtype``.

    Exact in bfloat16 (an E2M1 value times an e4m3 value has at most 6 significant bits). Reads
    the codes and scales in either layout (``t.layout``): sm90 ones are put back in checkpoint order first.
    """
    codes = decode_packed(checkpoint_data(t), jnp.float32)
    k = codes.shape[-1]
    blocks = codes.reshape(codes.shape[:-1] + (k // BLOCK_SIZE, BLOCK_SIZE))
    out = blocks * checkpoint_scales(t).astype(jnp.float32)[..., None]
    return out.reshape(codes.shape).astype(dtype)


def dequantize(t: NVFP4Tensor, dtype=jnp.float32) -> jax.Array:
    """Dequantize to ``dtype``: ``e2m1 * float(scale) * global_scale``, shape ``t.shape``.

    Computed in float32, or in float64 when ``dtype`` is float64 (x64 on)."""
    if not isinstance(t, NVFP4Tensor):
        raise ValueError(f"t: expected an NVFP4Tensor, got {type(t).__name__}")
    t.validate("t")
    # float64 output (x64 on) multiplies in float64: a float32 product could overflow where the
    # value itself (a float64 input past the float32 range) does not.
    ct = jnp.dtype(dtype) if jnp.finfo(dtype).bits > 32 else jnp.dtype(jnp.float32)
    vals = e2m1_scaled(t, ct)
    gs = expand_global_scale(t.global_scale, vals.ndim, t.data.shape[:-1]).astype(ct)
    return (vals * gs).astype(dtype)


def stage_activation(x: jax.Array, global_scale=None):
    """Quantize activations ``x`` (float ``[M, K]``) into the GEMM's staging triple.

    Returns:
      ``(x_fp4, x_sf, input_global_scale)``: uint8 ``[M, K/2]``, float8_e4m3fn ``[M, K/16]``,
      float32 ``[]``. ``global_scale`` is None (dynamic, amax of x) or a static scalar.

    Not differentiable (as :func:`quantize`: a TypeError, not a zero gradient).
    """
    x = _as_float(x, "x")
    if x.ndim != 2:
        raise ValueError(f"x: expected [M, K], got shape {x.shape}")
    t = quantize(x, global_scale)
    return t.data, t.scales, t.global_scale
