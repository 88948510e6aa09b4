"""The grouped GEMM's argument checks and group arithmetic, shared by every backend.

:mod:`jax_nvfp4.ops.reference` (the pure-jnp definition), :mod:`jax_nvfp4.gemm` (the custom call),
:mod:`jax_nvfp4.ops.fp8` and :mod:`jax_nvfp4.ops.autodiff` validate their arguments and find each row's
group with these functions, so that every backend accepts, refuses and groups the same way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..maths.formats import Fp8Rows, Fp8Weights, NVFP4Tensor

OUT_DTYPES = (jnp.bfloat16, jnp.float32)
INT32_MAX = 2**31 - 1


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
    if not isinstance(rhs, (NVFP4Tensor, Fp8Weights)):
        raise ValueError(f"rhs: expected an NVFP4Tensor [G, N, K] (or Fp8Weights from "
                         f"jax_nvfp4.prepare_weights(w, 'fp8')), got {type(rhs).__name__}")
    rhs.validate("rhs")
    if isinstance(rhs, Fp8Weights):
        if rhs.codes.ndim != 3:
            raise ValueError(f"rhs: expected Fp8Weights [G, N, K], got codes {rhs.codes.shape}")
    elif rhs.data.ndim != 3:
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
    """Pre-quantized fp8 rows (:class:`jax_nvfp4.maths.formats.Fp8Rows`) are an lhs of the fp8 mode only."""
    if isinstance(lhs, Fp8Rows) and precision != "fp8":
        raise ValueError(f"lhs: Fp8Rows (activations quantized for the fp8 mode) need "
                         f"precision='fp8', got precision={precision!r}")


def check_rhs_precision(rhs, precision: str, name: str = "rhs", what: str = "precision"):
    """Weights prepared as e4m3 (:class:`jax_nvfp4.maths.formats.Fp8Weights`) are weights of the fp8
    mode only: the exact mode needs the NVFP4 values, which the e4m3 rounding does not keep."""
    if isinstance(rhs, Fp8Weights) and precision != "fp8":
        raise ValueError(f"{name}: Fp8Weights (weights prepared by jax_nvfp4.prepare_weights(w, "
                         f"'fp8')) need {what}='fp8', got {what}={precision!r}; pass the NVFP4 "
                         "weights (checkpoint or sm90 layout) for the exact mode")


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
"""Rows per paired gate/up block: 8 gate rows then 8 up rows (:func:`jax_nvfp4.maths.layout.pair_gate_up`)."""


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
    if isinstance(rhs, Fp8Weights):
        raise ValueError("rhs: Fp8Weights (weights prepared by jax_nvfp4.prepare_weights(w, 'fp8')) "
                         "are weights of the fp8 mode; grouped_gemm_swiglu computes the exact mode "
                         "only: pass the NVFP4 weights")
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
