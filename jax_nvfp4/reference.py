"""Pure-jnp references. ``grouped_gemm`` here defines what the FFI handlers must compute."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .formats import NVFP4Tensor
from .quantization import e2m1_scaled

OUT_DTYPES = (jnp.bfloat16, jnp.float32)


def group_bounds(group_sizes: jax.Array, num_rows: int):
    """Row ranges of the groups: int32 ``(starts [G], ends [G])``.

    Negative sizes count as 0 and the running sum is clamped to ``num_rows``; group g covers rows
    ``[starts[g], ends[g])``. This is the documented behaviour of every backend.
    """
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), num_rows).astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends


def row_groups(ends: jax.Array, num_rows: int):
    """For each row: its group id (int32 ``[M]``) and whether it lies in a group (bool ``[M]``).

    ``ends`` is the int32 ``[G]`` from :func:`group_bounds`.
    """
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    gid = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)
    return jnp.minimum(gid, ends.shape[0] - 1), rows < ends[-1]


def validate_gemm_args(lhs, rhs, group_sizes, out_dtype, *, float_lhs_dtypes=None):
    """Check the grouped GEMM's arguments; return ``(M, K, G, N)``. Errors name the argument."""
    if not isinstance(rhs, NVFP4Tensor):
        raise ValueError(f"rhs: expected an NVFP4Tensor [G, N, K], got {type(rhs).__name__}")
    rhs.validate("rhs")
    if rhs.data.ndim != 3:
        raise ValueError(f"rhs: expected [G, N, K] (data [G, N, K/2]), got data {rhs.data.shape}")
    g, n, k = rhs.shape
    if g < 1 or n < 1:
        raise ValueError(f"rhs: expected at least one group and one row (G, N >= 1), got {rhs.shape}")
    if rhs.global_scale.shape not in ((g,), ()):
        raise ValueError(f"rhs.global_scale: expected shape [{g}] (one per group), "
                         f"got {tuple(rhs.global_scale.shape)}")
    if isinstance(lhs, NVFP4Tensor):
        if lhs.layout != "checkpoint":
            # The sm90 layout is a weight (rhs) layout; activations are quantized on the fly.
            raise ValueError(f"lhs.layout: expected 'checkpoint' (the sm90 layout is for rhs "
                             f"weights), got {lhs.layout!r}")
        lhs.validate("lhs")
        if lhs.data.ndim != 2:
            raise ValueError(f"lhs: expected an NVFP4Tensor [M, K], got data {lhs.data.shape}")
        if lhs.global_scale.ndim != 0:
            raise ValueError(f"lhs.global_scale: expected a scalar, got {lhs.global_scale.shape}")
        m, lk = lhs.shape
    else:
        lhs = jnp.asarray(lhs)
        if lhs.ndim != 2:
            raise ValueError(f"lhs: expected [M, K], got shape {lhs.shape}")
        ok = float_lhs_dtypes or (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64)
        if lhs.dtype not in [jnp.dtype(d) for d in ok]:
            raise ValueError(f"lhs: expected dtype in {[jnp.dtype(d).name for d in ok]} or an "
                             f"NVFP4Tensor, got {lhs.dtype}")
        m, lk = lhs.shape
    if lk != k:
        raise ValueError(f"lhs: K={lk} does not match rhs K={k}")
    group_sizes = jnp.asarray(group_sizes)
    if group_sizes.shape != (g,):
        raise ValueError(f"group_sizes: expected shape [{g}] (G from rhs), got {group_sizes.shape}")
    if group_sizes.dtype != jnp.int32:
        raise ValueError(f"group_sizes: expected int32, got {group_sizes.dtype}")
    if jnp.dtype(out_dtype) not in [jnp.dtype(d) for d in OUT_DTYPES]:
        raise ValueError(f"out_dtype: expected bfloat16 or float32, got {jnp.dtype(out_dtype)}")
    return m, k, g, n


def grouped_gemm(lhs, rhs: NVFP4Tensor, group_sizes: jax.Array, *, out_dtype=jnp.bfloat16):
    """Grouped NVFP4 GEMM, pure jnp: one GEMM per group, rows grouped consecutively.

    Args:
      lhs: float ``[M, K]`` or an NVFP4Tensor ``[M, K]`` with a scalar global scale.
      rhs: NVFP4Tensor ``[G, N, K]`` (data ``[G, N, K/2]``, scales ``[G, N, K/16]``, global_scale
        ``[G]``), in either layout (``rhs.layout``, see :func:`jax_nvfp4.prepare_weights`).
      group_sizes: int32 ``[G]``; see :func:`group_bounds` for negative sizes and sums past M.
      out_dtype: bfloat16 or float32.

    Returns:
      ``[M, N]`` in out_dtype: row r of group g is ``alpha_g * dequant(lhs)[r] @
      e2m1_scaled(rhs[g]).T`` with ``alpha_g = lhs global scale (1 for float) * rhs.global_scale[g]``,
      accumulated in float32; rows past the groups are 0.
    """
    m, k, g, n = validate_gemm_args(lhs, rhs, group_sizes, out_dtype)
    if isinstance(lhs, NVFP4Tensor):
        a = e2m1_scaled(lhs, jnp.float32)
        lhs_gs = lhs.global_scale.astype(jnp.float32)
    else:
        a = jnp.asarray(lhs).astype(jnp.float32)
        lhs_gs = jnp.float32(1.0)
    w = e2m1_scaled(rhs, jnp.float32)                      # [G, N, K], exact
    alpha = lhs_gs * jnp.broadcast_to(rhs.global_scale.astype(jnp.float32), (g,))
    starts, ends = group_bounds(group_sizes, m)
    gid, valid = row_groups(ends, m)
    # ragged_dot may combine groups by multiplying the others' products by 0, so a NaN weight
    # (an e4m3 NaN scale byte) would leak into every group's rows. Run it on finite weights and
    # put NaN back where a group's weight row had a NaN (what a per-group dot gives).
    nan = jnp.isnan(w)
    nan_rows = jnp.any(nan, axis=-1)                       # [G, N]
    acc = jax.lax.ragged_dot(a, jnp.swapaxes(jnp.where(nan, 0.0, w), 1, 2),
                             (ends - starts).astype(jnp.int32),
                             precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)
    acc = jnp.where(nan_rows[gid], jnp.nan, acc)
    out = jnp.where(valid[:, None], acc * alpha[gid][:, None], 0.0)
    return out.astype(out_dtype)
