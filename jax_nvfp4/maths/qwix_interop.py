"""Conversions between qwix's NVFP4 ``QArray`` and :class:`~jax_nvfp4.maths.formats.NVFP4Tensor`.

qwix (the JAX quantization library MaxText uses) stores ``qtype="nvfp4"`` arrays as:

- ``qvalue``: ``float4_e2m1fn`` with the array's own shape (one value per element, not packed);
- ``scale``: a float array (the original array's dtype, or ``scale_dtype``) of the same rank,
  one scale per 16 consecutive elements along one axis (the *tiled* axis: the contraction axis
  K of a weight), whose values qwix rounds to e4m3 values (``e4m3(absmax / 6)``); no second-level
  (global) scale; ``zero_point`` None;
- value ``qvalue * scale`` (in the scale's dtype).

The factorisation used here: each scale ``s`` of an expert (every index of the axes before the
last two, after the tiled axis is moved last) is ``s = b * 2^e``: ``b`` an e4m3 block scale and
``2^e`` the expert's global scale, the power of two that brings the expert's largest ``|s|`` into
(224, 448] (1 when every scale is 0). Multiplying by a power of two is exact, so
``e2m1 * b * 2^e`` is the qwix value bit for bit, in float32 and in bfloat16 (an e2m1 x e4m3
product has at most 6 significant bits). Every scale qwix writes is an e4m3 value, so every qwix
NVFP4 array converts; a scale that is not ``b * 2^e`` with ``b`` an e4m3 value (e.g. a float
scale with a full mantissa, NaN, Inf) is refused with a ValueError naming the block when the
scales are concrete, and gives a NaN block scale (so NaN outputs, never silently other numbers)
when they are traced.

Back: :func:`to_qwix` writes ``s = float32(b) * global_scale``; it is exact (and refused where not)
when that product is exact in float32, e.g. for power-of-two global scales.

This module needs qwix only in :func:`to_qwix` (to build a ``qwix.QArray``); reading a QArray is
duck-typed (``qvalue``, ``scale``, ``zero_point``, ``qtype``), so the core can accept one without
importing qwix.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .formats import (BLOCK_SIZE, NVFP4Tensor, check_k, expand_global_scale, keep_rounded,
                      pack_codes, unpack_codes)
from .layout import checkpoint_data, checkpoint_scales

QTYPE = "nvfp4"


def is_qwix_array(x) -> bool:
    """Whether ``x`` is a qwix ``QArray`` (by its type, without importing qwix)."""
    t = type(x)
    return t.__name__ == "QArray" and t.__module__.split(".")[0] == "qwix"


def _tiled_axis(qshape, sshape, name: str) -> int:
    """The one axis with a scale per 16 values (the others: one per value, or shared)."""
    tiled = [a for a, (q, s) in enumerate(zip(qshape, sshape)) if s != q and s != 1]
    if not tiled:                       # one block along the axis: K = 16, a scale dim of 1
        tiled = [a for a, (q, s) in enumerate(zip(qshape, sshape)) if q == BLOCK_SIZE and s == 1]
    if len(tiled) != 1 or qshape[tiled[0]] != BLOCK_SIZE * sshape[tiled[0]]:
        raise ValueError(f"{name}: expected a qwix NVFP4 QArray with one scale per {BLOCK_SIZE} "
                         f"values along exactly one axis, got qvalue {tuple(qshape)} and scale "
                         f"{tuple(sshape)}")
    return tiled[0]


def _is_traced(*xs) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in xs)


def _pow2_global_scale(s: jax.Array) -> jax.Array:
    """float32 ``[lead]``: per expert (all axes but the last two), the power of two ``2^e`` with
    the expert's largest ``|s|`` in ``(224, 448] * 2^e``; 1 where every scale is 0 or one is not
    finite."""
    amax = jnp.max(jnp.abs(s), axis=(-2, -1))
    m, x = jnp.frexp(amax)                       # amax = m 2^x, m in [0.5, 1)
    # 448 = 0.875 2^9: amax / 2^e <= 448 with e smallest: e = x - 9, or x - 8 when m > 0.875
    e = x - 9 + (m > 0.875).astype(x.dtype)
    ok = jnp.isfinite(amax) & (amax > 0)
    return jnp.where(ok, jnp.ldexp(jnp.ones_like(amax), e), 1.0).astype(jnp.float32)


def from_qwix(q, *, name: str = "q") -> NVFP4Tensor:
    """A qwix NVFP4 ``QArray`` as an :class:`NVFP4Tensor` with the same dequantized values.

    Args:
      q: ``qwix.QArray`` with ``qtype="nvfp4"``: qvalue ``float4_e2m1fn [..., K, ...]`` with the
        block (16-value) scales along one axis of size K (a multiple of 32), scale float of the same
        rank, no zero point. A ragged_dot / MaxText MoE weight ``[G, K, N]`` tiled along K gives
        the grouped GEMM's ``[G, N, K]``.
      name: the argument's name in error messages.

    Returns:
      NVFP4Tensor of logical shape ``q.shape`` with the tiled axis moved last (checkpoint layout):
      data uint8 ``[..., K/2]``, scales e4m3 ``[..., K/16]``, global_scale float32 over the axes
      before the last two (``[]`` for a 2-D array, ``[G]`` for a stack): the module docstring's
      factorisation. ``jax_nvfp4.dequantize(from_qwix(q))`` equals ``qwix.dequantize(q)`` (with
      the tiled axis moved last) bit for bit in float32.

    Raises:
      ValueError: not an NVFP4 QArray (qtype, zero point, dtypes, shapes), K not a multiple of 32,
        or (concrete scales) a scale that is not an e4m3 value times the expert's power of two.
    """
    qtype, zp = getattr(q, "qtype", None), getattr(q, "zero_point", None)
    if not (hasattr(q, "qvalue") and hasattr(q, "scale")):
        raise ValueError(f"{name}: expected a qwix QArray, got {type(q).__name__}")
    if qtype != QTYPE:
        raise ValueError(f"{name}: expected a qwix QArray with qtype {QTYPE!r}, got {qtype!r}")
    if zp is not None:
        raise ValueError(f"{name}: a qwix NVFP4 QArray has no zero point (symmetric), got one of "
                         f"shape {tuple(jnp.shape(zp))}")
    qv, sc = q.qvalue, q.scale
    if jnp.dtype(qv.dtype) != jnp.dtype(jnp.float4_e2m1fn):
        raise ValueError(f"{name}.qvalue: expected float4_e2m1fn, got {qv.dtype}")
    if not jnp.issubdtype(sc.dtype, jnp.floating) or jnp.finfo(sc.dtype).bits < 16:
        raise ValueError(f"{name}.scale: expected a float16/bfloat16/float32 scale, got {sc.dtype}")
    if qv.ndim != sc.ndim or qv.ndim < 2:
        raise ValueError(f"{name}: expected qvalue and scale of the same rank >= 2, got "
                         f"{tuple(qv.shape)} and {tuple(sc.shape)}")
    axis = _tiled_axis(qv.shape, sc.shape, name)
    qv, sc = jnp.moveaxis(qv, axis, -1), jnp.moveaxis(sc, axis, -1)
    check_k(qv.shape[-1], f"{name} (the tiled axis {axis})")
    s = jnp.broadcast_to(sc, qv.shape[:-1] + (sc.shape[-1],)).astype(jnp.float32)  # exact
    g = _pow2_global_scale(s)
    b = s / g[..., None, None]                   # a power of two: exact
    b8 = b.astype(jnp.float8_e4m3fn)
    exact = _is_e4m3(b)
    if _is_traced(s):
        b8 = jnp.where(exact, b8, jnp.float8_e4m3fn(jnp.nan))
    elif not bool(jnp.all(exact)):
        bad = tuple(int(i) for i in np.argwhere(~np.asarray(exact))[0])
        raise ValueError(
            f"{name}.scale: the scale {float(s[bad])} of block {bad} (tiled axis moved last) is not "
            f"an e4m3 value times its expert's power-of-two global scale {float(g[bad[:-2]])}; a "
            f"qwix NVFP4 scale is an e4m3 value (qwix rounds it so): this one cannot be stored as "
            f"NVFP4 exactly")
    # behind a barrier, a consumer in the same program (dequantize) widens the rounded e4m3
    return NVFP4Tensor(pack_codes(qv), jax.lax.optimization_barrier(b8), g).validate(name)


def to_qwix(t: NVFP4Tensor, *, axis: int = -1, dtype=jnp.float32):
    """An :class:`NVFP4Tensor` as a qwix NVFP4 ``QArray`` with the same dequantized values.

    Args:
      t: NVFP4Tensor ``[..., K]`` (either layout; read in checkpoint order).
      axis: where K goes in the QArray, in ``[-ndim, ndim)`` (e.g. ``1`` turns a grouped GEMM
        weight ``[G, N, K]`` into ragged_dot's ``[G, K, N]``); the other axes keep their order.
      dtype: the scale dtype (qwix dequantizes to it): float32 (default) or bfloat16.

    Returns:
      ``qwix.QArray(qvalue float4_e2m1fn, scale dtype [.., K/16 at axis, ..], None, "nvfp4")``
      with ``scale = float32(block scale) * global_scale``. ``qwix.dequantize`` of it equals
      ``jax_nvfp4.dequantize(t)`` bit for bit where that product is exact in ``dtype``.

    Raises:
      ImportError: qwix is not installed.
      ValueError: ``axis`` out of range; (concrete scales) a product ``block scale * global
        scale`` that ``dtype`` does not hold exactly (traced: that block's scale is NaN).
    """
    import qwix  # noqa: PLC0415 - optional dependency, needed only to build a QArray

    if not isinstance(t, NVFP4Tensor):
        raise ValueError(f"t: expected an NVFP4Tensor, got {type(t).__name__}")
    t.validate("t")
    nd = t.data.ndim
    if not -nd <= axis < nd:
        raise ValueError(f"axis: expected an axis in [-{nd}, {nd}) (where K goes among the "
                         f"QArray's {nd} axes), got {axis}")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"dtype: expected float32 or bfloat16, got {dtype}")
    data, sf = checkpoint_data(t), checkpoint_scales(t).astype(jnp.float32)
    gs = expand_global_scale(t.global_scale.astype(jnp.float32), sf.ndim, t.data.shape[:-1])
    s = (sf * gs).astype(dtype)
    exact = _product_exact(sf, gs, s)
    if not _is_traced(sf, gs):
        if not bool(jnp.all(exact)):
            bad = tuple(int(i) for i in np.argwhere(~np.asarray(exact))[0])
            g = float(np.broadcast_to(np.asarray(gs), sf.shape)[bad])
            raise ValueError(f"t: block {bad}: block scale {float(sf[bad])} x global scale {g} is "
                             f"not exact in {jnp.dtype(dtype).name}; a qwix scale has no separate "
                             "global scale (a power-of-two global scale always converts)")
    else:
        s = jnp.where(exact, s, jnp.asarray(jnp.nan, dtype))
    codes = unpack_codes(data)
    ax = axis % codes.ndim
    return qwix.QArray(jnp.moveaxis(codes, -1, ax), jnp.moveaxis(s, -1, ax), None, QTYPE)


def _is_e4m3(b: jax.Array) -> jax.Array:
    """bool: whether float32 ``b`` is an e4m3 (float8_e4m3fn) value, by integer tests on its bits.

    Not ``float32(e4m3(b)) == b``: XLA:GPU removes a convert pair that narrows and widens back
    (SimplifyFPConversions, under its default excess precision), which makes that test true for
    every finite b there. e4m3 normals ``2^(E-7) (1 + j/8)`` have float32 exponent fields 121..135
    and 3 significand bits; its subnormals ``j 2^-9`` (j = 1..7) have exponent fields 118..120
    and 0..2 bits; the largest is 448; NaN and Inf are not e4m3 values here."""
    u = jax.lax.bitcast_convert_type(b.astype(jnp.float32), jnp.uint32) & jnp.uint32(0x7FFFFFFF)
    e = (u >> 23).astype(jnp.int32)
    bits = jnp.clip(e - 118, 0, 3).astype(jnp.uint32)          # significand bits e4m3 holds there
    low = (jnp.uint32(1) << (jnp.uint32(23) - bits)) - jnp.uint32(1)
    in_range = (e >= 118) & (u <= jnp.uint32(0x43E00000))       # 2^-9 <= |b| <= 448
    return (u == 0) | (in_range & ((u & low) == 0))


def _odd_part(m: jax.Array) -> jax.Array:
    """uint32 ``m`` with its trailing zero bits removed (0 stays 0)."""
    low = m & (~m + jnp.uint32(1))                              # the lowest set bit
    return m >> jax.lax.population_count(low - jnp.uint32(1)).astype(jnp.uint32)


def _significand(x: jax.Array) -> jax.Array:
    """uint32: the integer significand of float32 ``|x|`` (implicit bit included)."""
    u = jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0x7FFFFFFF)
    m = u & jnp.uint32(0x7FFFFF)
    return jnp.where((u >> 23) > 0, m | jnp.uint32(0x800000), m)


def _product_exact(b: jax.Array, g: jax.Array, s: jax.Array) -> jax.Array:
    """bool: whether ``s`` (float32 ``b * g`` rounded to s's dtype) is the exact product of the
    e4m3 value ``b`` and the float32 ``g``, by integer arithmetic (no float rounding to trust):
    the product of the two odd significands (at most 4 + 24 bits) fits s's significand, and s is
    finite and normal (or zero where b is)."""
    odd = _odd_part(_odd_part(_significand(b)) * _odd_part(_significand(g)))
    bits = 32 - jax.lax.clz(odd).astype(jnp.int32)
    fits = bits <= jnp.finfo(s.dtype).nmant + 1
    s32 = keep_rounded(s).astype(jnp.float32)       # s as rounded, not the float32 product
    normal = jnp.abs(s32) >= jnp.finfo(s.dtype).smallest_normal
    return jnp.where(b == 0, s32 == 0, fits & jnp.isfinite(s32) & normal & jnp.isfinite(g))


def as_nvfp4(x, name: str):
    """``x`` itself, or, for a qwix NVFP4 ``QArray``, :func:`from_qwix` of it (computed where it
    is called: inside ``jit`` on every call; convert once with :func:`from_qwix` to keep it)."""
    return from_qwix(x, name=name) if is_qwix_array(x) else x


WEIGHT_FIELDS = ("w13", "w2", "shared_w13", "shared_w2")
"""The :class:`~jax_nvfp4.config.moe_params.MoEWeights` fields that may hold a qwix NVFP4 ``QArray``."""


def weights_from_qwix(weights):
    """``weights`` with each qwix NVFP4 ``QArray`` among its NVFP4 fields (w13 ``[E, H, 2I]``
    and w2 ``[E, I, H]`` tiled along H and I, i.e. K; shared ones without E) converted by
    :func:`from_qwix` to the layer's ``[E, N, K]``; anything else is returned as it is."""
    # Any dataclass instance with these fields (MoEWeights, the layer's container, lies above this
    # module: it is recognized by its fields, not imported).
    if not dataclasses.is_dataclass(weights) or isinstance(weights, type):
        return weights
    fields = {f: from_qwix(getattr(weights, f), name=f"weights.{f}") for f in WEIGHT_FIELDS
              if is_qwix_array(getattr(weights, f, None))}
    return dataclasses.replace(weights, **fields) if fields else weights
