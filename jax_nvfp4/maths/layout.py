"""The "sm90" load-time layout of NVFP4 weight codes for the CUDA kernels (mma.sync and wgmma).

Use it through :func:`jax_nvfp4.prepare_weights`: it re-lays-out the
``data`` of an NVFP4Tensor (or of every NVFP4 weight of a :class:`~jax_nvfp4.MoEWeights`) and
marks the tensor ``layout="sm90"``; every consumer (the custom call's CPU and CUDA handlers, the
pure-jnp reference, dequantization, checkpoint export) then reads the codes accordingly. The GPU
self-test reads it too (``tools/bench/gemm_selftest.cu --layout sm90``); its C++ constants are in
``csrc/sm90_layout.h``.

Why: on Hopper both CUDA kernels are bound, at decode sizes, by the instructions that turn E2M1
codes into bf16 MMA fragments (docs/design.md): in the checkpoint layout a thread needs byte t
of scattered words and spends ~4.5 integer ops per bf16x2 register. This layout stores, once at load
time, each thread's codes contiguously and with their bits pre-placed, so that three of every four
fragment registers come out of one AND or one shift + AND, and one LDS.128 feeds a thread's whole
k-tile. It is a bijection on the bytes (0.5 byte per code; the scales are only reordered, see below):
checkpoints are recovered with :func:`unprepare_sm90` and :func:`unprepare_scales_sm90`.

The layout, per expert and per block of 128 weight rows x 64 k (4096 bytes). Each 128-row stripe
``data[g, 128 i : 128 i + 128, :]`` (128 * K/2 contiguous bytes) holds its K/64 blocks one after
another: block ``j`` (the codes of ``k`` in ``64 j .. 64 j + 63``) is bytes ``4096 j .. 4096 j +
4095`` of the stripe, so a kernel streams a weight tile as contiguous 4 KB runs instead of 128
runs of 32 bytes (on the H200: decode 8% faster, prefill 1-8%; docs/archive/design-measurements.md).
Within a block:

- byte offset ``512 * mt + 16 * lane + 4 * kb + byte`` holds the codes that thread ``lane`` (``g8 =
  lane // 4``, ``t = lane % 4``) needs for m16 row tile ``mt`` (rows ``16 mt .. 16 mt + 15``) and
  16-wide k-block ``kb``: the mma/wgmma A-fragment registers
  ``a0 = (row g8, k 2t, 2t+1)``, ``a1 = (row g8 + 8, same k)``, ``a2 = (row g8, k 2t+8, 2t+9)``,
  ``a3 = (row g8 + 8, k 2t+8, 2t+9)``, as one little-endian 32-bit word ``w``;
- in ``w`` each register's two codes (even k in the low half, odd k in the high half, +16 bits)
  have their sign and magnitude bits (e1 e0 m0) at: a0: sign 15, mag 8 7 6; a1: sign 12, mag 5 4 3;
  a2: sign 9, mag 2 1 0; a3: sign 14, e1 13, e0 11, m0 10;
- so, with ``M = 0x81C081C0``: ``a0 = w & M``, ``a1 = (w << 3) & M``, ``a2 = (w << 6) & M`` and
  ``a3 = ((w << 1) & 0x80008000) | ((w >> 5) & 0x01000100) | ((w >> 4) & 0x00C000C0)`` are the
  bf16x2 pairs ``e2m1 * 2^-126`` (sign kept; code 1 becomes a bf16 subnormal), ready for the one
  exact ``mul.rn.bf16x2`` by ``bf16(scale * 2^119)`` the kernels already do.

:func:`fragments_sm90` is that extraction in numpy, for tests (and as the specification).

The block scales (``scales [..., N, K/16]``, e4m3, one per 16 codes) keep their shape and values
but are reordered the same way, per 128-row stripe: the stripe's 128 x K/16 bytes hold K/64
records of 512 bytes, record ``j`` being the scales of k-tile ``j`` (``k`` in ``64 j .. 64 j +
63``) as ``[128 rows][4 k-blocks]``: the scale of stripe row ``r`` and 16-wide k-block ``b`` is
byte ``512 (b // 4) + 4 r + b % 4`` of the stripe. A kernel then fetches a k-tile's scales as
one contiguous 512-byte run instead of 128 separate 4-byte pieces, one per row: on the H200 a
persistent weight stream of the decode case ran 23% faster that way (4.3 vs 3.5 TB/s,
tools/lab/stream_bulk_microbench.cu; docs/archive/design-measurements.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .formats import LAYOUTS, SM90_BLOCK_K, SM90_BLOCK_N, NVFP4Tensor

BLOCK_ROWS = SM90_BLOCK_N   # weight rows per layout block (128)
BLOCK_K = SM90_BLOCK_K      # k per layout block (64: 32 bytes of codes per row)

_MASK = 0x81C081C0


def _check_blocks(n, k, what):
    if n % BLOCK_ROWS or k % BLOCK_K:
        raise ValueError(f"{what}: the sm90 layout needs N % {BLOCK_ROWS} == 0 and K % {BLOCK_K} "
                         f"== 0, got N = {n}, K = {k}")


def _check(data, what):
    if data.dtype != jnp.uint8 or data.ndim < 2:
        raise ValueError(f"{what}: expected uint8 packed codes [..., N, K/2], got {data.dtype} "
                         f"{tuple(data.shape)}")
    _check_blocks(data.shape[-2], 2 * data.shape[-1], what)


def _split(shape):
    """[..., N, K] code axes -> [..., NB, mt, hi_row, g8, KB, kb, half8, t, parity]."""
    *lead, n, k = shape
    return (*lead, n // BLOCK_ROWS, 8, 2, 8, k // BLOCK_K, 4, 2, 4, 2)


# Each 16-bit half of a layout word (parity 0: bits 0-15, parity 1: bits 16-31) holds the codes
# of slots a0..a3 (a_s = (hi_row, half8) = (s % 2, s // 2)) at the bit positions of the module
# docstring (a0: sign 15, mag 8 7 6; a1: 12, 5 4 3; a2: 9, 2 1 0; a3: 14, 13 11 10). Byte by byte,
# with m = c & 7 the magnitude bits (e1 e0 m0) and sign = c >> 3:
#   low byte  = (a0 & 3) << 6 | m(a1) << 3 | m(a2)
#   high byte = e1(a0) | sign(a2) << 1 | m0(a3) << 2 | e0(a3) << 3 | sign(a1) << 4 | e1(a3) << 5
#               | sign(a3) << 6 | sign(a0) << 7
# All in uint8: the conversion's transient memory is about twice its input (8 times with uint32
# words).


def _bit(c, i):
    return (c >> i) & 1


def prepare_sm90(data: jax.Array) -> jax.Array:
    """Packed codes uint8 ``[..., N, K/2]`` (checkpoint layout) -> the same shape in the sm90 layout.

    Jittable; needs N % 128 == 0 and K % 64 == 0. Independent per index of the leading axes.
    """
    data = jnp.asarray(data)
    _check(data, "data")
    lead = data.shape[:-2]
    n, kh = data.shape[-2:]
    nl = len(lead)
    codes = jnp.stack([data & 0xF, data >> 4], axis=-1).reshape(*lead, n, 2 * kh)
    c = codes.reshape(_split(codes.shape))
    # axes after the lead: 0 NB, 1 mt, 2 hi_row, 3 g8, 4 KB, 5 kb, 6 half8, 7 t, 8 parity
    # -> NB, KB, mt, g8, t, kb, parity, hi_row, half8 (one layout word per (.., kb), parity-major)
    p = nl
    c = c.transpose(*range(nl), p, p + 4, p + 1, p + 3, p + 7, p + 5, p + 8, p + 2, p + 6)
    a0, a1, a2, a3 = c[..., 0, 0], c[..., 1, 0], c[..., 0, 1], c[..., 1, 1]
    lo = ((a0 & 3) << 6) | ((a1 & 7) << 3) | (a2 & 7)
    hi = (_bit(a0, 2) | (_bit(a2, 3) << 1) | (_bit(a3, 0) << 2) | (_bit(a3, 1) << 3)
          | (_bit(a1, 3) << 4) | (_bit(a3, 2) << 5) | (_bit(a3, 3) << 6) | (_bit(a0, 3) << 7))
    # [..., NB, KB, mt, g8, t, kb, parity, (lo, hi)]: the little-endian bytes of each word, each
    # 128-row stripe's 4096-byte blocks one after another
    return jnp.stack([lo, hi], axis=-1).astype(jnp.uint8).reshape(*lead, n, kh)


def unprepare_sm90(data: jax.Array) -> jax.Array:
    """The inverse of :func:`prepare_sm90`: sm90 layout -> checkpoint layout, same shape."""
    data = jnp.asarray(data)
    _check(data, "data")
    lead = data.shape[:-2]
    n, kh = data.shape[-2:]
    nl = len(lead)
    b = data.reshape(*lead, n // BLOCK_ROWS, 2 * kh // BLOCK_K, 8, 8, 4, 4, 2, 2)
    lo, hi = b[..., 0], b[..., 1]                   # [..., NB, KB, mt, g8, t, kb, parity]
    a0 = (_bit(hi, 7) << 3) | (_bit(hi, 0) << 2) | ((lo >> 6) & 3)
    a1 = (_bit(hi, 4) << 3) | ((lo >> 3) & 7)
    a2 = (_bit(hi, 1) << 3) | (lo & 7)
    a3 = (_bit(hi, 6) << 3) | (_bit(hi, 5) << 2) | (_bit(hi, 3) << 1) | _bit(hi, 2)
    # [..., NB, KB, mt, g8, t, kb, parity, hi_row, half8]
    c = jnp.stack([jnp.stack([a0, a2], -1), jnp.stack([a1, a3], -1)], -2)
    p = nl  # back to NB, mt, hi_row, g8, KB, kb, half8, t, parity
    c = c.transpose(*range(nl), p, p + 2, p + 7, p + 3, p + 1, p + 5, p + 8, p + 4, p + 6)
    codes = c.reshape(*lead, n, 2 * kh).astype(jnp.uint8)
    pairs = codes.reshape(*lead, n, kh, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _check_scales(scales, what):
    if scales.ndim < 2:
        raise ValueError(f"{what}: expected block scales [..., N, K/16], got shape {tuple(scales.shape)}")
    _check_blocks(scales.shape[-2], 16 * scales.shape[-1], what)


def prepare_scales_sm90(scales: jax.Array) -> jax.Array:
    """Block scales ``[..., N, K/16]`` (any dtype, float8_e4m3fn in practice), checkpoint order ->
    the sm90 order (module docstring): per 128-row stripe, one ``[128, 4]`` record per k-tile.
    Same shape and dtype; jittable."""
    scales = jnp.asarray(scales)
    _check_scales(scales, "scales")
    *lead, n, ks = scales.shape
    nl = len(lead)
    s = scales.reshape(*lead, n // BLOCK_ROWS, BLOCK_ROWS, ks // 4, 4)
    s = s.transpose(*range(nl), nl, nl + 2, nl + 1, nl + 3)      # NB, KT, row, kb
    return s.reshape(*lead, n, ks)


def unprepare_scales_sm90(scales: jax.Array) -> jax.Array:
    """The inverse of :func:`prepare_scales_sm90`: sm90 order -> checkpoint order, same shape."""
    scales = jnp.asarray(scales)
    _check_scales(scales, "scales")
    *lead, n, ks = scales.shape
    nl = len(lead)
    s = scales.reshape(*lead, n // BLOCK_ROWS, ks // 4, BLOCK_ROWS, 4)
    s = s.transpose(*range(nl), nl, nl + 2, nl + 1, nl + 3)      # NB, row, KT, kb
    return s.reshape(*lead, n, ks)


def fragments_sm90(block_words: np.ndarray) -> np.ndarray:
    """The kernel's extraction, in numpy: uint32 words ``[...]`` -> uint32 ``[..., 4]`` bf16x2 pairs.

    Register ``i`` of the result is the fragment register ``a_i`` (see the module docstring), each
    half the bf16 bits of ``e2m1 * 2^-126``.
    """
    w = np.asarray(block_words, np.uint32)
    a0 = w & np.uint32(_MASK)
    a1 = (w << np.uint32(3)) & np.uint32(_MASK)
    a2 = (w << np.uint32(6)) & np.uint32(_MASK)
    a3 = (((w << np.uint32(1)) & np.uint32(0x80008000)) | ((w >> np.uint32(5)) & np.uint32(0x01000100))
          | ((w >> np.uint32(4)) & np.uint32(0x00C000C0)))
    return np.stack([a0, a1, a2, a3], axis=-1)


def checkpoint_data(t: NVFP4Tensor) -> jax.Array:
    """``t.data`` in the checkpoint layout (uint8 ``[..., K/2]``, element 2j in the low nibble of
    byte j), whatever ``t.layout`` is: what every pure-jnp consumer of the codes reads."""
    if t.layout == "checkpoint":
        return t.data
    if t.layout == "sm90":
        return unprepare_sm90(t.data)
    raise ValueError(f"layout: expected one of {LAYOUTS}, got {t.layout!r}")


def checkpoint_scales(t: NVFP4Tensor) -> jax.Array:
    """``t.scales`` in the checkpoint order (float8_e4m3fn ``[..., K/16]``, scale ``b`` of a row
    covering codes ``16 b .. 16 b + 15``), whatever ``t.layout`` is."""
    if t.layout == "checkpoint":
        return t.scales
    if t.layout == "sm90":
        return unprepare_scales_sm90(t.scales)
    raise ValueError(f"layout: expected one of {LAYOUTS}, got {t.layout!r}")


def _named_sharding(x):
    """x's sharding (a NamedSharding of a concrete array, or the abstract sharding of a tracer
    under jit with explicit mesh axes) when it splits x over devices, else None."""
    candidates = [getattr(x, "sharding", None)]
    try:
        candidates.append(jax.typeof(x).sharding)
    except Exception:  # noqa: BLE001 - no abstract sharding here (what raises varies by jax version)
        pass
    for sh in candidates:
        spec, mesh = getattr(sh, "spec", None), getattr(sh, "mesh", None)
        if spec is None or mesh is None:
            continue
        try:
            if any(a is not None for a in spec):
                return sh
        except TypeError:
            continue
    return None


def _on_each_shard(fn, x, what, *more, needs="the sm90 layout needs whole 128 x 64 blocks"):
    """fn (independent per index of the leading axes, its result of x's rank) applied to
    ``(x, *more)`` where their pieces lie: through shard_map when x is split over devices (only
    leading axes may be split: ``needs`` says why the last two may not; ``more`` arrays of x's
    rank are split like x), else directly."""
    sh = _named_sharding(x)
    if sh is None:
        return fn(x, *more)
    spec = tuple(sh.spec) + (None,) * (x.ndim - len(tuple(sh.spec)))
    if spec[-2] is not None or spec[-1] is not None:
        raise ValueError(f"{what}: split over devices along its last two axes {spec[-2:]} (N, K); "
                         f"{needs}: split only the leading (expert) axes, or convert before "
                         "splitting")
    p = jax.sharding.PartitionSpec(*spec)
    return jax.shard_map(fn, mesh=sh.mesh, in_specs=(p,) * (1 + len(more)), out_specs=p)(x, *more)


def relayout(t: NVFP4Tensor, layout: str, name: str = "t") -> NVFP4Tensor:
    """``t`` with its codes and block scales in ``layout`` (``"checkpoint"`` or ``"sm90"``; same
    shapes and dtypes, global scale untouched); ``t`` itself when already there. ``name`` names the
    tensor in errors. Jittable; :func:`jax_nvfp4.prepare_weights` is the public entry point."""
    t.validate(name)
    if t.layout == layout:                       # idempotent: nothing to move
        return t
    out = dataclasses.replace(t, layout=layout).validate(name)   # shape errors name the field
    fn = prepare_sm90 if layout == "sm90" else unprepare_sm90

    def convert(d):
        if d.ndim > 2 and d.shape[0] > 1:
            # One [N, K/2] matrix at a time: the conversion's transient memory is about twice
            # its input; per expert that stays small next to the stack.
            flat = d.reshape((-1,) + d.shape[-2:])
            return jax.lax.map(fn, flat).reshape(d.shape)
        return fn(d)

    # A stack split over devices (e.g. by shard_moe_weights) is converted where it lies, one
    # matrix at a time on each device: no gather, transient memory per device as above.
    data = _on_each_shard(convert, t.data, f"{name}.data")
    sfn = prepare_scales_sm90 if layout == "sm90" else unprepare_scales_sm90
    scales = _on_each_shard(sfn, t.scales, f"{name}.scales")
    return dataclasses.replace(out, data=data, scales=scales)


PAIR_ROWS = 8
"""Paired gate/up order: runs of 8 gate rows and 8 up rows alternate (:func:`pair_gate_up`)."""


def _pair_rows(a, inverse: bool):
    """The paired row permutation (or its inverse) on axis -2 of ``a [..., 2I, C]``."""
    *lead, n, c = a.shape
    nb = n // (2 * PAIR_ROWS)
    split = (2, nb, PAIR_ROWS) if not inverse else (nb, 2, PAIR_ROWS)
    b = a.reshape(*lead, *split, c)
    nl = len(lead)
    b = b.transpose(*range(nl), nl + 1, nl, nl + 2, nl + 3)
    return b.reshape(*lead, n, c)


def _pair(t: NVFP4Tensor, name: str, inverse: bool) -> NVFP4Tensor:
    fn = "unpair_gate_up" if inverse else "pair_gate_up"
    if not isinstance(t, NVFP4Tensor):
        raise ValueError(f"{name}: {fn} expected an NVFP4Tensor [..., 2I, K], got "
                         f"{type(t).__name__}")
    t.validate(name)
    if t.data.ndim < 2:
        raise ValueError(f"{name}: {fn} expected [..., 2I, K] (gate rows then up rows), got data "
                         f"{tuple(t.data.shape)}")
    n = t.data.shape[-2]
    if n % (2 * PAIR_ROWS):
        raise ValueError(f"{name}: {fn} needs 2I rows with I % {PAIR_ROWS} == 0 (runs of "
                         f"{PAIR_ROWS} gate and {PAIR_ROWS} up rows), got {n} rows (I = {n / 2:g})")
    layout = t.layout
    if layout != "checkpoint":
        # The sm90 layout interleaves rows within 128-row stripes: permute whole rows in the
        # checkpoint order, then lay out again.
        t = relayout(t, "checkpoint", name)
    perm = lambda a: _pair_rows(a, inverse)  # noqa: E731
    t = dataclasses.replace(t, data=_on_each_shard(perm, t.data, f"{name}.data"),
                            scales=_on_each_shard(perm, t.scales, f"{name}.scales"))
    return relayout(t, layout, name)


def pair_gate_up(t: NVFP4Tensor, name: str = "t") -> NVFP4Tensor:
    """Gate/up weights ``[..., 2I, K]`` (rows ``0..I-1`` gate, ``I..2I-1`` up) -> the paired order.

    Physical row ``16 b + i`` (``i < 8``) of the result holds gate feature ``8 b + i`` and row
    ``16 b + 8 + i`` holds up feature ``8 b + i``: in every CUDA kernel a thread's accumulators
    hold weight rows n and n + 8 for n % 16 < 8, so gate and up of one feature meet in one
    thread and the SwiGLU can run in the GEMM's epilogue (:func:`jax_nvfp4.grouped_gemm_swiglu`).

    Args:
      t: NVFP4Tensor ``[..., 2I, K]`` (any leading axes; data uint8 ``[..., 2I, K/2]``, scales
        float8_e4m3fn ``[..., 2I, K/16]``), either layout; ``I % 8 == 0``.

    Returns:
      The same type, shapes, dtypes and layout with the rows of ``data`` and ``scales`` permuted
      (an sm90 tensor is converted to the checkpoint layout, permuted and converted back, since
      that layout mixes rows within 128-row stripes); ``global_scale`` unchanged (``[..., 2]``
      still means (gate, up)). Jittable. Nothing records the order: :class:`~jax_nvfp4.MoEWeights`
      carries it as ``w13_paired``.
    """
    return _pair(t, name, inverse=False)


def unpair_gate_up(t: NVFP4Tensor, name: str = "t") -> NVFP4Tensor:
    """The inverse of :func:`pair_gate_up`: paired rows -> gate rows then up rows (same layout)."""
    return _pair(t, name, inverse=True)
