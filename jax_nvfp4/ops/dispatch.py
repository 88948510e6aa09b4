"""The MoE layer's dispatch in one pass: each token row read once, written to each of its
expert rows as the grouped GEMM's bf16 input (the row itself, or the values of its per-row NVFP4
quantization) or as the fp8 mode's e4m3 operand made of those bf16 values, by the custom call "jax_nvfp4_dispatch_rows" (csrc/dispatch_rows.h: a CPU handler
and a CUDA kernel sharing the per-block arithmetic), beside its jnp reference.

An XLA route would write more: for W4A4 a quantizer pass (codes and block scales), a gather of the
packed codes fused with their decode to bf16, each row read once per copy; for W4A16 a gather that
reads each token row once per copy (measured in docs/archive/perf-log-layer.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import _extension
from ..maths.formats import Fp8Rows
from .fp8 import quantize_rows
from ..config.options import FP8_CHUNK, REFERENCE, resolve_backend
from ..maths.quantization import dynamic_global_scale, e2m1_scaled, quantize
from ..maths.rows import take_rows
from ..maths.varying import varying_type


DISPATCH_TARGET = _extension.target_name("jax_nvfp4_dispatch_rows")
"""The custom call of :func:`dispatch_rows` (csrc/dispatch_rows.h)."""

def dispatch_rows_reference(x: jax.Array, gather=None, row_scale=None, *, fp8: bool = False):
    """:func:`dispatch_rows` in pure jnp: the rows (bf16, or the values of their per-row NVFP4
    quantization), with ``fp8`` quantized by :func:`jax_nvfp4.ops.fp8.quantize_rows` (kernel k
    order), then taken by ``gather``."""
    if row_scale is None:
        # a real bf16 rounding in every backend (XLA on GPU may otherwise keep excess precision)
        v = jax.lax.optimization_barrier(x.astype(jnp.bfloat16))
    else:
        v = e2m1_scaled(jax.vmap(quantize)(x, row_scale.astype(jnp.float32)), jnp.bfloat16)
    if fp8:
        v = quantize_rows(v, k_order="kernel", backend=REFERENCE)
        return v if gather is None else v.take(gather)
    return v if gather is None else take_rows(v, gather)


def _use_ffi(backend: str) -> bool:
    # the grouped GEMM's resolution: the layer's dispatch and GEMMs take the same route
    return resolve_backend(backend) == "ffi"


def _dispatch_ffi(x, scatter, rows, row_scale, dynamic=False, fp8=False):
    """The custom call: (bf16 ``[rows, K]`` or, with ``fp8``, :class:`Fp8Rows` in the kernel k
    order; float32 ``[rows]`` dynamic scales or ``[0]``)."""
    rs = jnp.zeros((0,), jnp.float32) if row_scale is None else row_scale.astype(jnp.float32)
    sc = jnp.zeros((0,), jnp.int32) if scatter is None else scatter.astype(jnp.int32)
    args = (x, rs, sc)
    k = x.shape[1]
    out_t = (varying_type(args, (rows, k), jnp.float8_e4m3fn if fp8 else jnp.bfloat16),
             varying_type(args, (rows if dynamic else 0,), jnp.float32),
             varying_type(args, (rows, k // FP8_CHUNK) if fp8 else (0, 0), jnp.float32))
    out, scales, chunk_scales = jax.ffi.ffi_call(DISPATCH_TARGET, out_t,
                                                 vmap_method="sequential")(*args)
    if fp8:
        out = Fp8Rows(out, chunk_scales, jnp.float32(1.0), k_order="kernel")
    return out, scales


def _take(rows, gather):
    return rows.take(gather) if isinstance(rows, Fp8Rows) else take_rows(rows, gather)


def _check_fp8(x, fp8):
    if fp8 and (x.shape[1] == 0 or x.shape[1] % FP8_CHUNK):
        raise ValueError(f"x: K={x.shape[1]}: fp8=True needs K to be a positive multiple of "
                         f"{FP8_CHUNK}")


def _check_args(x, gather, scatter):
    x = jnp.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"x: expected [T, K], got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):       # not cast silently in any mode
        raise ValueError(f"x: expected a float [T, K], got {x.dtype}")
    if gather is not None and jnp.asarray(gather).ndim != 1:
        raise ValueError(f"gather: expected [R], got shape {jnp.asarray(gather).shape}")
    if scatter is not None and (jnp.asarray(scatter).ndim != 2 or scatter.shape[0] != x.shape[0]):
        raise ValueError(f"scatter: expected [T, slots] with T = {x.shape[0]}, got shape "
                         f"{jnp.asarray(scatter).shape}")
    return x


def dispatch_rows(x: jax.Array, gather=None, scatter=None, *, row_scale=None,
                  backend: str = "auto", fp8: bool = False):
    """The MoE layer's grouped-GEMM input rows, in one pass over x: bf16 ``[R, K]``, or with
    ``fp8`` the fp8 mode's operand made of those bf16 rows.

    Row r is token ``gather[r]``'s row of x (row r without ``gather``, R = T) as bf16, or, with
    ``row_scale``, the values ``e2m1 * block scale`` of that row's NVFP4 quantization
    ``quantize(x[t], row_scale[t])`` (the global scale not applied; exact in bf16): bit for bit
    :func:`dispatch_rows_reference`, whose gather and quantizer this fuses, and an ml_dtypes
    oracle (tests/test_dispatch.py).

    Args:
      x: ``[T, K]`` float. With ``row_scale`` bf16 or float32 (another float dtype takes the
        reference path), K a multiple of 16; without it the rows are rounded to bf16.
      gather: None or int ``[R]`` in ``[0, T)``: the token of each output row.
      scatter: None or int32 ``[T, slots]``: the same map inverted, which the custom call reads
        (each token quantized once, stored to each of its rows): ``scatter[t, j]`` is the output
        row of token t's j-th copy, or an index outside ``[0, R)`` for none. The caller
        guarantees the two name each other (the layer's sort gives both); without scatter the
        rows are made per token and then gathered.
      row_scale: None or float32 ``[T]``: each row's NVFP4 global scale.
      backend: "ffi" (the custom call: its CPU handler or CUDA kernel), "reference" (jnp) or
        "auto" (ffi when the extension is loaded for this platform).
      fp8: return :class:`jax_nvfp4.maths.formats.Fp8Rows` in the kernel k order (global scale 1):
        the bf16 rows above quantized per 128-wide k chunk, the bytes
        ``jax_nvfp4.ops.fp8.quantize_rows(rows, "kernel")`` gives, written by the same pass
        (K a positive multiple of 128).

    Not differentiable: the layer calls it inside its straight-through forward
    (:func:`jax_nvfp4.ops.autodiff.frozen_weights`).
    """
    x = _check_args(x, gather, scatter)
    _check_fp8(x, fp8)
    if row_scale is not None and jnp.asarray(row_scale).shape != (x.shape[0],):
        raise ValueError(f"row_scale: expected shape [T] = [{x.shape[0]}], got "
                         f"{jnp.asarray(row_scale).shape}")
    ffi = _use_ffi(backend) and x.shape[1] % 16 == 0
    if row_scale is None:
        # bf16 rows neither dispatched nor quantized: the cast is all
        ffi = ffi and (gather is not None or fp8)
        x = x.astype(jnp.bfloat16) if ffi else x
    else:
        ffi = ffi and x.dtype in (jnp.bfloat16, jnp.float32)
    if not ffi:
        return dispatch_rows_reference(x, gather, row_scale, fp8=fp8)
    if gather is None:
        return _dispatch_ffi(x, None, x.shape[0], row_scale, fp8=fp8)[0]
    if scatter is None:
        return _take(_dispatch_ffi(x, None, x.shape[0], row_scale, fp8=fp8)[0], gather)
    return _dispatch_ffi(x, scatter, gather.shape[0], row_scale, fp8=fp8)[0]


def dispatch_rows_dynamic(x: jax.Array, gather=None, scatter=None, *,
                          backend: str = "auto", fp8: bool = False):
    """:func:`dispatch_rows` with each row's dynamic global scale made on the way.

    The scale of token t's row is :func:`jax_nvfp4.maths.quantization.dynamic_global_scale` of it
    (``amax / 2688`` over its finite values, rounded to nearest even, at least 2^-126; 1.0 for a
    row without a finite non-zero value); the custom call takes it from the row it is reading, so
    x is not read by a separate reduction first.

    Args:
      x: ``[T, K]`` bf16 or float32 (another float dtype takes the reference path).
      gather, scatter, backend, fp8: as in :func:`dispatch_rows`.

    Returns:
      ``(rows, row_scale)``: bf16 ``[R, K]`` (or :class:`jax_nvfp4.maths.formats.Fp8Rows` with
      ``fp8``) as ``dispatch_rows(x, gather, scatter, row_scale=s, fp8=fp8)`` for the rows'
      scales s, and float32 ``[R]``, the scale of each output row (``s[gather]``), which the
      caller applies to the GEMM's output rows.
    """
    x = _check_args(x, gather, scatter)
    _check_fp8(x, fp8)
    ffi = (_use_ffi(backend) and x.shape[1] % 16 == 0 and x.dtype in (jnp.bfloat16, jnp.float32))
    if not ffi:
        s = jax.vmap(dynamic_global_scale)(x)
        return (dispatch_rows_reference(x, gather, s, fp8=fp8), s if gather is None else s[gather])
    if gather is None:
        return _dispatch_ffi(x, None, x.shape[0], None, dynamic=True, fp8=fp8)
    if scatter is None:
        rows, s = _dispatch_ffi(x, None, x.shape[0], None, dynamic=True, fp8=fp8)
        return _take(rows, gather), s[gather]
    return _dispatch_ffi(x, scatter, gather.shape[0], None, dynamic=True, fp8=fp8)
