"""Pure-jnp references. ``grouped_gemm`` here defines what the FFI handlers must compute."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import fp8
from ..maths.formats import NVFP4Tensor, keep_rounded
from .gemm_args import (GLU_ROW_BLOCK, check_group_sizes, check_lhs_precision,
                        check_rhs_precision, group_bounds, row_groups, to_out_dtype,
                        validate_gemm_args, validate_swiglu_args)
from ..config.options import EXACT, Precision, check_precision
from ..maths.quantization import e2m1_scaled

WEIGHT_PRESCALE = 2.0**-7
"""Every backend multiplies the weights by this before the dot and alpha by its inverse after
(the CUDA kernels' exact bf16 weight fragments e2m1 * scale * 2^-7)."""



def grouped_gemm(lhs, rhs: NVFP4Tensor, group_sizes: jax.Array, *, out_dtype=jnp.bfloat16,
                 precision: str = "exact"):
    """Grouped NVFP4 GEMM, pure jnp: one GEMM per group, rows grouped consecutively.

    Args:
      lhs: float ``[M, K]`` or an NVFP4Tensor ``[M, K]`` with a scalar global scale; with
        ``precision="fp8"`` also :class:`jax_nvfp4.maths.formats.Fp8Rows` (rows already quantized).
      rhs: NVFP4Tensor ``[G, N, K]`` (data ``[G, N, K/2]``, scales ``[G, N, K/16]``, global_scale
        ``[G]``), in either layout (``rhs.layout``, see :func:`jax_nvfp4.prepare_weights`); with
        ``precision="fp8"`` also :class:`jax_nvfp4.maths.formats.Fp8Weights` (``prepare_weights(w,
        "fp8")``: the same numbers as the NVFP4 weights it was prepared from).
      group_sizes: int32 ``[G]``; see :func:`group_bounds` for negative sizes and sums past M.
      out_dtype: bfloat16 or float32.
      precision: "exact" (the product below) or "fp8" (K % 128 == 0: activations and weights
        rounded to e4m3 first, :func:`jax_nvfp4.ops.fp8.grouped_gemm_fp8_reference`).

    Returns:
      ``[M, N]`` in out_dtype: row r of group g is ``alpha_g * dequant(lhs)[r] @
      e2m1_scaled(rhs[g]).T`` with ``alpha_g = lhs global scale (1 for float) * rhs.global_scale[g]``,
      accumulated in float32; rows past the groups are 0.
    """
    precision = check_precision(precision)
    check_lhs_precision(lhs, precision)
    check_rhs_precision(rhs, precision)
    return checked_grouped_gemm(lhs, rhs, group_sizes, out_dtype=out_dtype, precision=precision)


def checked_grouped_gemm(lhs, rhs, group_sizes, *, out_dtype, precision: Precision):
    """:func:`grouped_gemm` with ``precision`` a :class:`~jax_nvfp4.config.options.Precision` that
    ``lhs`` and ``rhs`` were checked against by the caller (not checked again)."""
    m, k, g, n = validate_gemm_args(lhs, rhs, group_sizes, out_dtype)
    if precision == "fp8":
        return fp8.grouped_gemm_fp8_reference(lhs, rhs, group_sizes, out_dtype=out_dtype)
    group_sizes = check_group_sizes(group_sizes, g)
    if isinstance(lhs, NVFP4Tensor):
        a = e2m1_scaled(lhs, jnp.float32)
        lhs_gs = lhs.global_scale.astype(jnp.float32)
    else:
        a = keep_rounded(jnp.asarray(lhs)).astype(jnp.float32)
        lhs_gs = jnp.float32(1.0)
    # As the CUDA kernels do: the weights enter the dot as e2m1 * scale * 2^-7 (exact; |w| <= 21)
    # and the epilogue multiplies by alpha * 2^7, so the float32 accumulator holds lhs . W / 128
    # and overflows only past 2^7 * FLT_MAX (README, "Ranges").
    w = e2m1_scaled(rhs, jnp.float32) * jnp.float32(WEIGHT_PRESCALE)      # [G, N, K], exact
    alpha = lhs_gs * jnp.broadcast_to(rhs.global_scale.astype(jnp.float32), (g,))
    starts, ends = group_bounds(group_sizes, m)
    gid, valid = row_groups(ends, m)
    # ragged_dot may combine groups by multiplying the others' products by 0, so a NaN weight
    # (an e4m3 NaN scale byte) would leak into every group's rows. Run it on finite weights and
    # put NaN back where a group's weight row had a NaN (what a per-group dot gives).
    nan = jnp.isnan(w)
    nan_rows = jnp.any(nan, axis=-1)                       # [G, N]
    try:
        acc = jax.lax.ragged_dot(a, jnp.swapaxes(jnp.where(nan, 0.0, w), 1, 2),
                                 (ends - starts).astype(jnp.int32),
                                 precision=jax.lax.Precision.HIGHEST,
                                 preferred_element_type=jnp.float32)
    except NotImplementedError as e:
        if "vmap" not in str(e):
            raise
        raise NotImplementedError(
            "grouped_gemm(backend='reference') does not support jax.vmap: jax.lax.ragged_dot, "
            "which it is built on, has no batching rule for it in jax " + jax.__version__ +
            ". Use backend='ffi' (its vmap runs the custom call once per index) or jax.lax.map "
            "over the batch.") from e
    acc = jnp.where(nan_rows[gid], jnp.nan, acc)
    out = jnp.where(valid[:, None], acc * (alpha * jnp.float32(1.0 / WEIGHT_PRESCALE))[gid][:, None],
                    0.0)
    return to_out_dtype(out, out_dtype)


def split_paired(h: jax.Array):
    """``[..., 2I]`` columns in the paired order -> ``(gate, up)``, each ``[..., I]`` in feature
    order (column ``16 b + i`` is gate feature ``8 b + i`` for ``i < 8``, up feature ``8 b + i - 8``
    otherwise)."""
    *lead, n = h.shape
    b = h.reshape(*lead, n // GLU_ROW_BLOCK, 2, GLU_ROW_BLOCK // 2)
    return b[..., 0, :].reshape(*lead, n // 2), b[..., 1, :].reshape(*lead, n // 2)


def grouped_gemm_swiglu(lhs, rhs: NVFP4Tensor, group_sizes: jax.Array, *, row_scale=None,
                        limit=None, out_dtype=jnp.float32):
    """Grouped NVFP4 GEMM of paired gate/up weights followed by the (clamped) SwiGLU, pure jnp.

    Args:
      lhs: float ``[M, K]`` or an NVFP4Tensor ``[M, K]`` with a scalar global scale.
      rhs: NVFP4Tensor ``[G, N, K]``, N = 2I, N % 16 == 0, rows in the paired order
        (:func:`jax_nvfp4.maths.layout.pair_gate_up`), either layout; global_scale float32 ``[G]``
        (or ``[]``) or ``[G, 2]`` (gate, up).
      group_sizes: int32 ``[G]`` (as for :func:`grouped_gemm`).
      row_scale: None, or float32 ``[M]``: row r's GEMM output is multiplied by it before the SwiGLU.
      limit: None, or a static number > 0: the SwiGLU clamp ``L`` (inf means none).
      out_dtype: bfloat16 or float32.

    Returns:
      ``[M, N/2]`` out_dtype. For row r of group g, with ``acc`` the float32 products of
      :func:`grouped_gemm` (exact mode) before its epilogue factor, ``h[r, n] = acc[r, n] *
      alpha[g, n % 16 >= 8]`` (``alpha`` = lhs global scale * rhs global scale of that half),
      then ``h *= row_scale[r]``, and ``out[r, 8 b + i] = silu(min(h[r, 16 b + i], L)) *
      clip(h[r, 16 b + 8 + i], -L, L)`` with ``silu(x) = x / (1 + exp(-x))`` in float32; NaN
      propagates through the clamps; rows past the groups are 0.
    """
    m, k, g, n, alpha, row_scale, lim = validate_swiglu_args(lhs, rhs, group_sizes, out_dtype,
                                                             row_scale, limit)
    group_sizes = check_group_sizes(group_sizes, g)
    if isinstance(lhs, NVFP4Tensor):
        alpha = lhs.global_scale.astype(jnp.float32) * alpha
        lhs = NVFP4Tensor(lhs.data, lhs.scales, jnp.float32(1.0), lhs.layout)
    plain = NVFP4Tensor(rhs.data, rhs.scales, jnp.ones((g,), jnp.float32), rhs.layout)
    acc = checked_grouped_gemm(lhs, plain, group_sizes, out_dtype=jnp.float32,   # [M, N]
                               precision=EXACT)
    _, ends = group_bounds(group_sizes, m)
    gid, valid = row_groups(ends, m)
    half = (jnp.arange(n) % GLU_ROW_BLOCK >= GLU_ROW_BLOCK // 2).astype(jnp.int32)
    h = acc * alpha[gid][:, half]                       # the kernel's epilogue factor per half
    if row_scale is not None:
        h = h * row_scale[:, None]
    gate, up = split_paired(h)
    if lim != float("inf"):
        gate = jnp.minimum(gate, jnp.float32(lim))
        up = jnp.clip(up, jnp.float32(-lim), jnp.float32(lim))
    out = gate / (1.0 + jnp.exp(-gate)) * up
    return to_out_dtype(jnp.where(valid[:, None], out, 0.0), out_dtype)
