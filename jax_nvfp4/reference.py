"""Pure-jnp references. ``grouped_gemm`` here defines what the FFI handlers must compute."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .formats import Fp8Rows, NVFP4Tensor
from .quantization import e2m1_scaled

OUT_DTYPES = (jnp.bfloat16, jnp.float32)
WEIGHT_PRESCALE = 2.0**-7
"""Every backend multiplies the weights by this before the dot and alpha by its inverse after
(the CUDA kernels' exact bf16 weight fragments e2m1 * scale * 2^-7)."""


def group_bounds(group_sizes: jax.Array, num_rows: int):
    """Row ranges of the groups: int32 ``(starts [G], ends [G])``.

    Negative sizes count as 0 and the running sum is clamped to ``num_rows``; group g covers rows
    ``[starts[g], ends[g])``. This is the documented behaviour of every backend.
    """
    # A saturating running sum: each size is clamped to [0, M] first, and min(a + b, M) of two
    # values <= M < 2^31 cannot overflow in uint32 (a plain int32 cumsum wraps past 2^31 - 1).
    sizes = jnp.clip(jnp.asarray(group_sizes), 0, num_rows).astype(jnp.uint32)
    ends = jax.lax.associative_scan(lambda a, b: jnp.minimum(a + b, jnp.uint32(num_rows)), sizes)
    ends = ends.astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends


def row_groups(ends: jax.Array, num_rows: int):
    """For each row: its group id (int32 ``[M]``) and whether it lies in a group (bool ``[M]``).

    ``ends`` is the int32 ``[G]`` from :func:`group_bounds`.
    """
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    gid = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)
    return jnp.minimum(gid, ends.shape[0] - 1), rows < ends[-1]


INT32_MAX = 2**31 - 1


def check_group_sizes(group_sizes, g: int) -> jax.Array:
    """``group_sizes`` (int array, list or tuple ``[G]``) -> int32 ``[G]``; errors name it.

    Concrete values (a list, tuple, numpy array or a jax Array outside ``jit``) of any integer
    dtype are accepted when every value fits int32; one that does not is a ValueError (it would
    otherwise wrap silently). Traced values of a wider integer dtype (x64 on) are clipped to
    ``[-2^31, 2^31 - 1]``, which changes nothing (negative sizes count as 0, the running sum is
    clamped to M < 2^31).
    """
    if isinstance(group_sizes, (list, tuple)):
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))
                   for v in group_sizes):
            raise ValueError(f"group_sizes: expected integers, got {list(group_sizes)!r}")
        if any(not -INT32_MAX - 1 <= int(v) <= INT32_MAX for v in group_sizes):
            raise ValueError(f"group_sizes: every size must fit int32 (|size| < 2^31), got "
                             f"{[int(v) for v in group_sizes]}")
        group_sizes = np.asarray([int(v) for v in group_sizes], np.int32).reshape(len(group_sizes))
    shape, dtype = np.shape(group_sizes), getattr(group_sizes, "dtype", None)
    dtype = np.asarray(group_sizes).dtype if dtype is None else jnp.dtype(dtype)
    if tuple(shape) != (g,):
        raise ValueError(f"group_sizes: expected shape [{g}] (G from rhs), got {tuple(shape)}")
    if not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"group_sizes: expected int32 or another integer dtype, got {dtype}")
    if dtype == jnp.int32:
        return jnp.asarray(group_sizes)
    if isinstance(group_sizes, jax.core.Tracer):
        return jnp.clip(group_sizes, -INT32_MAX - 1, INT32_MAX).astype(jnp.int32)
    v = np.asarray(group_sizes)
    if v.size and (v.min() < -INT32_MAX - 1 or v.max() > INT32_MAX):
        raise ValueError(f"group_sizes: every size must fit int32 (|size| < 2^31), got "
                         f"{v.tolist()}")
    if isinstance(group_sizes, jax.Array):
        return group_sizes.astype(jnp.int32)
    return jnp.asarray(v.astype(np.int32))


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
    if isinstance(lhs, Fp8Rows):
        m, lk = lhs.validate("lhs").shape
    elif isinstance(lhs, NVFP4Tensor):
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
    check_group_sizes(group_sizes, g)
    if jnp.dtype(out_dtype) not in [jnp.dtype(d) for d in OUT_DTYPES]:
        raise ValueError(f"out_dtype: expected bfloat16 or float32, got {jnp.dtype(out_dtype)}")
    return m, k, g, n


def check_lhs_precision(lhs, precision: str):
    """Pre-quantized fp8 rows (:class:`jax_nvfp4.formats.Fp8Rows`) are an lhs of the fp8 mode only."""
    if isinstance(lhs, Fp8Rows) and precision != "fp8":
        raise ValueError(f"lhs: Fp8Rows (activations quantized for the fp8 mode) need "
                         f"precision='fp8', got precision={precision!r}")


def grouped_gemm(lhs, rhs: NVFP4Tensor, group_sizes: jax.Array, *, out_dtype=jnp.bfloat16,
                 precision: str = "exact"):
    """Grouped NVFP4 GEMM, pure jnp: one GEMM per group, rows grouped consecutively.

    Args:
      lhs: float ``[M, K]`` or an NVFP4Tensor ``[M, K]`` with a scalar global scale; with
        ``precision="fp8"`` also :class:`jax_nvfp4.formats.Fp8Rows` (rows already quantized).
      rhs: NVFP4Tensor ``[G, N, K]`` (data ``[G, N, K/2]``, scales ``[G, N, K/16]``, global_scale
        ``[G]``), in either layout (``rhs.layout``, see :func:`jax_nvfp4.prepare_weights`).
      group_sizes: int32 ``[G]``; see :func:`group_bounds` for negative sizes and sums past M.
      out_dtype: bfloat16 or float32.
      precision: "exact" (the product below) or "fp8" (K % 128 == 0: activations and weights
        rounded to e4m3 first, :func:`jax_nvfp4.fp8.grouped_gemm_fp8_reference`).

    Returns:
      ``[M, N]`` in out_dtype: row r of group g is ``alpha_g * dequant(lhs)[r] @
      e2m1_scaled(rhs[g]).T`` with ``alpha_g = lhs global scale (1 for float) * rhs.global_scale[g]``,
      accumulated in float32; rows past the groups are 0.
    """
    from . import fp8  # noqa: PLC0415  (fp8 builds on this module)
    fp8.check_precision(precision)
    check_lhs_precision(lhs, precision)
    m, k, g, n = validate_gemm_args(lhs, rhs, group_sizes, out_dtype)
    if precision == "fp8":
        return fp8.grouped_gemm_fp8_reference(lhs, rhs, group_sizes, out_dtype=out_dtype)
    group_sizes = check_group_sizes(group_sizes, g)
    if isinstance(lhs, NVFP4Tensor):
        a = e2m1_scaled(lhs, jnp.float32)
        lhs_gs = lhs.global_scale.astype(jnp.float32)
    else:
        a = jnp.asarray(lhs).astype(jnp.float32)
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


def round_to(x: jax.Array, dtype) -> jax.Array:
    """float32 ``x`` rounded to the values of float dtype ``dtype`` (nearest even), still float32.
    A ``reduce_precision``, which holds inside any jit, where a narrowing convert that a widening
    one follows may be elided by XLA (excess precision)."""
    info = jnp.finfo(dtype)
    return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def to_out_dtype(out: jax.Array, out_dtype) -> jax.Array:
    """float32 ``out`` rounded to ``out_dtype`` (bfloat16 or float32) by :func:`round_to` before
    the convert: a caller that widens the reference's bf16 output again inside its jit then sees
    the custom call's rounded values."""
    d = jnp.dtype(out_dtype)
    return (out if d == jnp.float32 else round_to(out, d)).astype(d)


GLU_ROW_BLOCK = 16
"""Rows per paired gate/up block: 8 gate rows then 8 up rows (:func:`jax_nvfp4.layout.pair_gate_up`)."""


def split_paired(h: jax.Array):
    """``[..., 2I]`` columns in the paired order -> ``(gate, up)``, each ``[..., I]`` in feature
    order (column ``16 b + i`` is gate feature ``8 b + i`` for ``i < 8``, up feature ``8 b + i - 8``
    otherwise)."""
    *lead, n = h.shape
    b = h.reshape(*lead, n // GLU_ROW_BLOCK, 2, GLU_ROW_BLOCK // 2)
    return b[..., 0, :].reshape(*lead, n // 2), b[..., 1, :].reshape(*lead, n // 2)


def check_glu_limit(limit) -> float:
    """``limit`` (None, or a static number > 0; inf means none) -> the float32 value of the custom
    call's ``glu_limit`` attribute (inf for None). Errors name the argument."""
    if limit is None:
        return float(np.float32(np.inf))
    if (isinstance(limit, (bool, np.bool_)) or not isinstance(limit, (int, float, np.integer,
                                                                       np.floating))):
        raise ValueError(f"limit: expected a static number > 0 or None, got {limit!r:.100}")
    v = float(limit)
    if not v > 0 or not float(np.float32(v)) > 0:     # False for NaN; 1e-50 rounds to 0
        raise ValueError(f"limit: expected a number > 0 (float32) or None, got {limit!r}")
    return float(np.float32(v))


def validate_swiglu_args(lhs, rhs, group_sizes, out_dtype, row_scale, limit, *,
                         float_lhs_dtypes=None):
    """Check :func:`grouped_gemm_swiglu`'s arguments; return ``(M, K, G, N, alpha [G, 2] float32
    rhs global scales, row_scale float32 [M] or None, limit as float)``. Errors name the argument."""
    if not isinstance(rhs, NVFP4Tensor):
        raise ValueError(f"rhs: expected an NVFP4Tensor [G, N, K], got {type(rhs).__name__}")
    if rhs.data.ndim != 3:
        raise ValueError(f"rhs: expected [G, N, K] (data [G, N, K/2]), got data {rhs.data.shape}")
    g, n = rhs.data.shape[:2]
    gs = rhs.global_scale
    if tuple(gs.shape) not in ((), (g,), (g, 2)):
        raise ValueError(f"rhs.global_scale: expected shape [], [{g}] or [{g}, 2] (gate, up), got "
                         f"{tuple(gs.shape)}")
    if jnp.dtype(gs.dtype) != jnp.float32:
        raise ValueError(f"rhs.global_scale: expected float32, got {gs.dtype}")
    plain = NVFP4Tensor(rhs.data, rhs.scales, jnp.ones((g,), jnp.float32), rhs.layout)
    m, k, g, n = validate_gemm_args(lhs, plain, group_sizes, out_dtype,
                                    float_lhs_dtypes=float_lhs_dtypes)
    if n % GLU_ROW_BLOCK:
        raise ValueError(f"rhs: N = 2I must be a multiple of {GLU_ROW_BLOCK} (paired gate/up rows, "
                         f"I % 8 == 0), got N = {n}")
    alpha = gs if gs.ndim == 2 else jnp.broadcast_to(jnp.reshape(gs, (-1, 1)), (g, 2))
    if row_scale is not None:
        if isinstance(row_scale, (list, tuple)) or not hasattr(row_scale, "dtype"):
            row_scale = np.asarray(row_scale)
        if tuple(row_scale.shape) != (m,) or jnp.dtype(row_scale.dtype) != jnp.float32:
            raise ValueError(f"row_scale: expected float32 [{m}] (one factor per lhs row) or None, "
                             f"got {jnp.dtype(row_scale.dtype)} {list(row_scale.shape)}")
        row_scale = jnp.asarray(row_scale)
    return m, k, g, n, alpha.astype(jnp.float32), row_scale, check_glu_limit(limit)


def grouped_gemm_swiglu(lhs, rhs: NVFP4Tensor, group_sizes: jax.Array, *, row_scale=None,
                        limit=None, out_dtype=jnp.float32):
    """Grouped NVFP4 GEMM of paired gate/up weights followed by the (clamped) SwiGLU, pure jnp.

    Args:
      lhs: float ``[M, K]`` or an NVFP4Tensor ``[M, K]`` with a scalar global scale.
      rhs: NVFP4Tensor ``[G, N, K]``, N = 2I, N % 16 == 0, rows in the paired order
        (:func:`jax_nvfp4.layout.pair_gate_up`), either layout; global_scale float32 ``[G]``
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
    acc = grouped_gemm(lhs, plain, group_sizes, out_dtype=jnp.float32)       # [M, N]
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
