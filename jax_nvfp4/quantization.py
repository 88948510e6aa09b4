"""NVFP4 quantization and dequantization (pure jnp; jittable and vmappable).

The format is described in :mod:`jax_nvfp4.formats`. Quantization, per tensor:

1. ``global_scale = amax / (6 * 448)`` (dynamic) or the given static value; an all-zero input
   gets 1.0 (never 0 or NaN).
2. ``y = x / global_scale``; per block of 16: ``scale = e4m3(clip(amax_block(y) / 6, 0, 448))``
   (round to nearest even).
3. ``code = e2m1(clip(y / float(scale), -6, 6))`` (nearest, ties to even); a block whose scale
   rounds to 0 is all zeros.

Values beyond a static range saturate at ``+-6 * 448 * global_scale``.

Non-finite inputs (E2M1 has no Inf or NaN): the dynamic amax ignores them; +-Inf saturates to the
largest magnitude (its block scale becomes 448, its code +-6); a NaN makes its whole block's scale
NaN (e4m3 0x7F), so the block dequantizes to NaN: visible, never silently a number.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .formats import (BLOCK_SIZE, E2M1_MAX, E4M3_MAX, NVFP4Tensor, check_k, expand_global_scale,
                      pack_codes, unpack_codes)
from .layout import checkpoint_data, checkpoint_scales


def _as_float(x, name: str) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name}: expected a floating-point array, got {x.dtype}")
    if x.ndim < 1:
        raise ValueError(f"{name}: expected at least 1 axis [..., K], got a scalar")
    check_k(x.shape[-1], name)
    return x


def dynamic_global_scale(x: jax.Array) -> jax.Array:
    """float32 ``[]``: ``amax(|x|) / (6 * 448)`` over the finite values of x, or 1.0 if that is 0."""
    a = jnp.abs(jnp.asarray(x).astype(jnp.float32))
    amax = jnp.max(jnp.where(jnp.isfinite(a), a, 0.0), initial=0.0)
    # XLA may compute this as amax * (1/2688) (last bit can differ under vmap); harmless: the
    # scale that is stored is the one every block was quantized with.
    return jnp.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), 1.0).astype(jnp.float32)


def quantize(x: jax.Array, global_scale=None) -> NVFP4Tensor:
    """Quantize ``x`` (float ``[..., K]``, K a multiple of 32) to NVFP4.

    Args:
      x: float array ``[..., K]`` (any float dtype; computed in float32).
      global_scale: None for dynamic (``amax / 2688`` of the whole x), or a static float32
        scalar (a checkpoint's calibrated input scale).

    Returns:
      NVFP4Tensor with data uint8 ``[..., K/2]``, scales float8_e4m3fn ``[..., K/16]`` and
      global_scale float32 ``[]``.
    """
    x = _as_float(x, "x").astype(jnp.float32)
    if global_scale is None:
        gs = dynamic_global_scale(x)
    else:
        gs = jnp.asarray(global_scale, jnp.float32)
        if gs.ndim != 0:
            raise ValueError(f"global_scale: expected a scalar, got shape {gs.shape} "
                             "(use jax.vmap for one scale per slice)")
    blocks = x.reshape(x.shape[:-1] + (x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE))
    y = blocks / gs
    block_amax = jnp.max(jnp.abs(y), axis=-1, keepdims=True)  # NaN propagates, Inf stays Inf
    # The barriers make the e4m3 and e2m1 roundings real inside any jit: XLA on GPU may otherwise
    # elide a narrowing convert followed by a widening one (excess precision), so codes would be
    # computed against an unrounded scale (JAX's own nvfp4 quantizer guards the same way).
    scales = jax.lax.optimization_barrier(
        jnp.clip(block_amax / E2M1_MAX, 0.0, E4M3_MAX).astype(jnp.float8_e4m3fn))
    scale_f32 = scales.astype(jnp.float32)
    safe = jnp.where(scale_f32 > 0, scale_f32, 1.0)
    q = jnp.clip(y / safe, -E2M1_MAX, E2M1_MAX)
    q = jnp.where((scale_f32 > 0) & ~jnp.isnan(y), q, 0.0)
    codes = q.astype(jnp.float4_e2m1fn).reshape(x.shape)
    data = jax.lax.optimization_barrier(pack_codes(codes))
    return NVFP4Tensor(data, scales[..., 0], gs)


def e2m1_scaled(t: NVFP4Tensor, dtype=jnp.float32) -> jax.Array:
    """``e2m1(t.data) * float(t.scales)`` without the global scale, ``[..., K]`` in ``dtype``.

    Exact in bfloat16 (an E2M1 value times an e4m3 value has at most 6 significant bits). Reads
    the codes and scales in either layout (``t.layout``): sm90 ones are put back in checkpoint order first.
    """
    codes = unpack_codes(checkpoint_data(t)).astype(jnp.float32)
    k = codes.shape[-1]
    blocks = codes.reshape(codes.shape[:-1] + (k // BLOCK_SIZE, BLOCK_SIZE))
    out = blocks * checkpoint_scales(t).astype(jnp.float32)[..., None]
    return out.reshape(codes.shape).astype(dtype)


def dequantize(t: NVFP4Tensor, dtype=jnp.float32) -> jax.Array:
    """Dequantize to ``dtype``: ``e2m1 * float(scale) * global_scale``, shape ``t.shape``."""
    if not isinstance(t, NVFP4Tensor):
        raise ValueError(f"t: expected an NVFP4Tensor, got {type(t).__name__}")
    t.validate("t")
    vals = e2m1_scaled(t, jnp.float32)
    return (vals * expand_global_scale(t.global_scale, vals.ndim, t.data.shape[:-1])).astype(dtype)


def stage_activation(x: jax.Array, global_scale=None):
    """Quantize activations ``x`` (float ``[M, K]``) into the GEMM's staging triple.

    Returns:
      ``(x_fp4, x_sf, input_global_scale)``: uint8 ``[M, K/2]``, float8_e4m3fn ``[M, K/16]``,
      float32 ``[]``. ``global_scale`` is None (dynamic, amax of x) or a static scalar.
    """
    x = _as_float(x, "x")
    if x.ndim != 2:
        raise ValueError(f"x: expected [M, K], got shape {x.shape}")
    t = quantize(x, global_scale)
    return t.data, t.scales, t.global_scale
