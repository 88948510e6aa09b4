"""The NVFP4 storage format: E2M1 codes, e4m3 block scales, a float32 global scale.

Convention (the one every module, kernel and test in this package uses):

* E2M1 magnitudes are {0, 0.5, 1, 1.5, 2, 3, 4, 6}; bit 3 is the sign (sign-magnitude, so code 8
  is -0). Element ``2j`` of a row is stored in the low nibble of byte ``j`` and element ``2j+1`` in
  the high nibble. Packed data is uint8 ``[..., K/2]``.
* One block scale per 16 consecutive elements along the last axis, float8_e4m3fn ``[..., K/16]``.
  Raw scale bytes become e4m3 by a bitcast (:func:`scales_from_bytes`), never a value conversion.
* The global scale is a float32 *dequantization multiplier*: ``global_scale = amax / (6 * 448)``,
  and ``x ~= e2m1 * float(scale) * global_scale`` (the ModelOpt convention, and that of JAX's own
  nvfp4 quantizer). A stack of G experts carries ``global_scale`` of shape ``[G]``.
* K must be a multiple of 32: 16 values per scale, 2 per byte, and what the kernels tile by.
* Codes are encoded and decoded with integer shifts, masks and comparisons (the decode ends in a
  same-width ``uint32 -> float32`` bitcast of the value's bit pattern: :func:`encode_e2m1`,
  :func:`decode_e2m1`), never a sub-byte bitcast: XLA constant-folds the
  ``uint8 <-> float4_e2m1fn`` bitcast wrongly on some versions (a closed-over NVFP4 tensor in
  ``jit`` read different values than the same tensor passed as an argument).
* ``NVFP4Tensor.layout`` names the byte order of ``data`` and ``scales``: ``"checkpoint"`` (the
  order above) or ``"sm90"``, a load-time permutation of the same bytes for the Hopper kernels
  (:mod:`jax_nvfp4.maths.layout`, :func:`jax_nvfp4.prepare_weights`): codes re-laid-out within 128 x 64
  blocks, scales reordered into one 512-byte record per 128 rows x 64 k. Shapes are unchanged.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .rows import take_rows

BLOCK_SIZE = 16
"""Values per e4m3 block scale."""
E2M1_MAX = 6.0
E4M3_MAX = 448.0
K_MULTIPLE = 32
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
"""Value of each 4-bit code 0..15."""
SM90_BLOCK_N, SM90_BLOCK_K = 128, 64
"""The sm90 layout permutes codes within blocks of 128 rows x 64 k: N and K must divide."""
LAYOUTS = ("checkpoint", "sm90")
"""The byte layouts of NVFP4 codes and block scales (``NVFP4Tensor.layout``)."""
FP8_LAYOUT = "fp8"
"""The layout of NVFP4 weights prepared once as e4m3 for the FP8 mode (:class:`Fp8Weights`)."""
FP8_CHUNK = 128
"""k per FP8-mode promotion chunk: the activations' scale granularity, and the K multiple the
mode needs."""
FP8_K_ORDERS = ("logical", "kernel")
"""The k orders of :class:`Fp8Rows` codes."""


def check_k(k: int, name: str = "x") -> None:
    """Raise ValueError unless the contraction size ``k`` is a positive multiple of 32."""
    if k <= 0 or k % K_MULTIPLE:
        raise ValueError(
            f"{name}: the last (K) axis has size {k}; NVFP4 needs K to be a positive multiple of "
            f"{K_MULTIPLE} (16 values per block scale, 2 values per byte)")


def keep_rounded(x: jax.Array) -> jax.Array:
    """``x`` itself; a bfloat16/float16 ``x`` passes an optimization barrier first.

    XLA:GPU may skip a narrowing convert that feeds a widening one in the same program
    (SimplifyFPConversions: excess precision), so a function that widens a half-precision input
    would compute on the unrounded value the caller's cast came from. Behind the barrier it
    computes on the value it was given, as the custom calls do (docs/design.md, "Roundings that
    XLA may not skip")."""
    if jnp.dtype(x.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return jax.lax.optimization_barrier(x)
    return x


def encode_e2m1(values: jax.Array) -> jax.Array:
    """float ``[...]`` already in [-6, 6] -> uint8 E2M1 codes 0..15, round to nearest, ties to even.

    Integer arithmetic and comparisons only (no sub-byte dtype): XLA constant-folds bitcasts
    to and from ``float4_e2m1fn`` wrongly on some versions, so no code path relies on them. A
    negative value that rounds to 0 gives code 8 (-0), as a cast to float4_e2m1fn does.
    """
    v = jnp.asarray(values, jnp.float32)
    a = jnp.abs(v)
    # Midpoints between neighbouring magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}; a tie goes to the
    # even code, i.e. up at 0.75, 1.75, 3.5 (to codes 2, 4, 6) and down at 0.25, 1.25, 2.5, 5.
    mag = ((a > 0.25).astype(jnp.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5)
           + (a >= 3.5) + (a > 5.0))
    return mag.astype(jnp.uint8) | (jnp.signbit(v).astype(jnp.uint8) << 3)


def decode_e2m1(codes: jax.Array, dtype=jnp.float32) -> jax.Array:
    """uint8 E2M1 codes 0..15 (only the low nibble is read) -> their values (:data:`E2M1_VALUES`).

    Builds each value's float32 bit pattern with integer operations and reinterprets it with one
    same-width ``uint32 -> float32`` bitcast (never a sub-byte bitcast, see :func:`encode_e2m1`).
    Code 8 is -0.0. No subnormal is ever formed (a subnormal intermediate would be flushed to 0
    by XLA's flush-to-zero arithmetic on the CPU, and on the GPU where that is on).
    """
    c = jnp.asarray(codes).astype(jnp.uint32) & 0xF
    mag = c & 7                       # e1 e0 m0
    # Magnitude bits at float32 bits 24..22 (exponent low bits, top mantissa bit) plus an
    # exponent bias of 126 give (1 + m0/2) * 2^(e - 1), right for e >= 1; codes 0 and 1 (0 and
    # 0.5 = 2^-1, exponent field 126, mantissa 0) are ``mag * 0x3F000000``.
    bits = jnp.where(mag > 1, (mag << 22) + 0x3F000000, mag * 0x3F000000) | ((c & 8) << 28)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint32), jnp.float32).astype(dtype)


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """uint8 codes ``[..., K]`` (0..15) -> uint8 ``[..., K/2]``, element 2j in the low nibble."""
    pairs = jnp.asarray(codes).astype(jnp.uint8)
    pairs = pairs.reshape(pairs.shape[:-1] + (pairs.shape[-1] // 2, 2))
    return (pairs[..., 0] & 0xF) | (pairs[..., 1] << 4)


def unpack_nibbles(data: jax.Array) -> jax.Array:
    """uint8 ``[..., K/2]`` -> uint8 codes ``[..., K]`` (the inverse of :func:`pack_nibbles`)."""
    data = jnp.asarray(data)
    # A broadcast and a per-position shift (0, 4), not a stack of two halves: elementwise, so a
    # fused decode reads as a plain loop (a concatenate made XLA's CPU loop 4x slower).
    # (the shifts spelled at full rank: jax_numpy_rank_promotion="raise" refuses a rank-1 operand)
    shifts = jnp.array([0, 4], data.dtype).reshape((1,) * data.ndim + (2,))
    codes = (data[..., None] >> shifts) & 0xF
    return codes.reshape(data.shape[:-1] + (data.shape[-1] * 2,))


def decode_packed(data: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Packed uint8 ``[..., K/2]`` (checkpoint layout) -> E2M1 values ``[..., K]`` in ``dtype``."""
    return decode_e2m1(unpack_nibbles(data), dtype)


def pack_codes(codes: jax.Array) -> jax.Array:
    """float4_e2m1fn ``[..., K]`` -> uint8 ``[..., K/2]`` (element 2j in the low nibble of byte j).

    Through a value conversion to float32 and :func:`encode_e2m1` (exact for E2M1 values), not a
    sub-byte bitcast, so a constant input is folded correctly inside ``jit``.
    """
    return pack_nibbles(encode_e2m1(jnp.asarray(codes).astype(jnp.float32)))


def unpack_codes(data: jax.Array) -> jax.Array:
    """uint8 ``[..., K/2]`` -> float4_e2m1fn ``[..., K]`` (the inverse of :func:`pack_codes`).

    For computing, use :func:`decode_packed` (float values, no sub-byte dtype at all).
    """
    return decode_packed(data).astype(jnp.float4_e2m1fn)


def scales_from_bytes(raw: jax.Array) -> jax.Array:
    """Reinterpret uint8/int8 scale bytes as float8_e4m3fn (a bitcast: byte 0x3F reads as 1.875)."""
    raw = jnp.asarray(raw)
    if raw.dtype == jnp.float8_e4m3fn:
        return raw
    if raw.dtype not in (jnp.uint8, jnp.int8):
        raise ValueError(f"scales: expected uint8/int8 bytes or float8_e4m3fn, got {raw.dtype}")
    return jax.lax.bitcast_convert_type(raw, jnp.float8_e4m3fn)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class NVFP4Tensor:
    """An NVFP4-quantized tensor of logical shape ``[..., K]``.

    Attributes:
      data: uint8 ``[..., K/2]``, two E2M1 codes per byte (low nibble first).
      scales: float8_e4m3fn ``[..., K/16]``, one block scale per 16 values along K.
      global_scale: float32, broadcastable over the leading axes of ``data`` without K: ``[]``
        for one tensor, ``[G]`` for a stack of G experts ``[G, N, K]``.
      layout: static str, the byte order of ``data`` and ``scales``: ``"checkpoint"`` (default;
        element ``2j`` in the low nibble of byte ``j``, scale ``b`` for elements ``16 b ..``) or
        ``"sm90"`` (the Hopper load-time layout of :mod:`jax_nvfp4.maths.layout`; needs N % 128 == 0
        and K % 64 == 0 on the last two axes). It is
        pytree aux data, not a leaf, so it survives jit, vmap, shard_map and tree_map.

    Dequantized value: ``e2m1(data) * float32(scales) * global_scale`` (codes and scales read
    per ``layout``).
    """

    data: jax.Array
    scales: jax.Array
    global_scale: jax.Array
    layout: str = "checkpoint"

    def tree_flatten(self):
        return (self.data, self.scales, self.global_scale), self.layout

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, layout=aux)

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape ``[..., K]`` (K = 2 * data.shape[-1])."""
        return tuple(self.data.shape[:-1]) + (2 * self.data.shape[-1],)

    @property
    def ndim(self) -> int:
        return len(self.data.shape)

    def validate(self, name: str = "tensor") -> "NVFP4Tensor":
        """Check dtypes and shapes; raise ValueError naming ``name`` and what was expected."""
        d, s, g = self.data, self.scales, self.global_scale
        for field, v, want in (("data", d, "uint8"), ("scales", s, "float8_e4m3fn"),
                               ("global_scale", g, "float32")):
            if not (hasattr(v, "dtype") and hasattr(v, "shape")):   # e.g. a Python float
                raise ValueError(f"{name}.{field}: expected a {want} array, got "
                                 f"{type(v).__name__} (e.g. jnp.{want}(value))")
        if d.dtype != jnp.uint8:
            raise ValueError(f"{name}.data: expected uint8 packed E2M1 codes, got {d.dtype}")
        if s.dtype != jnp.float8_e4m3fn:
            raise ValueError(f"{name}.scales: expected float8_e4m3fn, got {s.dtype} "
                             "(raw bytes: use jax_nvfp4.scales_from_bytes, a bitcast)")
        if jnp.dtype(g.dtype) != jnp.float32:
            raise ValueError(f"{name}.global_scale: expected float32, got {g.dtype}")
        check_k(2 * d.shape[-1], f"{name}.data")
        k = 2 * d.shape[-1]
        if tuple(s.shape) != tuple(d.shape[:-1]) + (k // BLOCK_SIZE,):
            raise ValueError(f"{name}.scales: expected shape {tuple(d.shape[:-1]) + (k // 16,)} "
                             f"for data {tuple(d.shape)}, got {tuple(s.shape)}")
        lead = tuple(d.shape[:-1])
        if not _is_half_split(g.shape, lead) and (
                g.ndim > len(lead) or any(a not in (1, b) for a, b in zip(g.shape, lead))):
            raise ValueError(f"{name}.global_scale: shape {tuple(g.shape)} does not match the "
                             f"leading axes {lead} (use [] for one tensor, [G] for [G, N, K], "
                             f"[G, 2] for separate first/second halves of N)")
        if self.layout not in LAYOUTS:
            raise ValueError(f"{name}.layout: expected one of {LAYOUTS}, got {self.layout!r}")
        if self.layout == "sm90":
            # The layout permutes codes inside 128-row x 64-k blocks of the last two axes.
            if d.ndim < 2 or d.shape[-2] % SM90_BLOCK_N or k % SM90_BLOCK_K:
                n = d.shape[-2] if d.ndim >= 2 else None
                raise ValueError(
                    f"{name}: layout 'sm90' needs data [..., N, K/2] with N % {SM90_BLOCK_N} == 0 "
                    f"and K % {SM90_BLOCK_K} == 0, got N = {n}, K = {k} (data {tuple(d.shape)})")
        return self



@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Fp8Rows:
    """Activation rows quantized for the FP8 compute mode (:func:`jax_nvfp4.ops.fp8.quantize_rows`),
    a grouped GEMM lhs with ``precision="fp8"``.

    Attributes:
      codes: float8_e4m3fn ``[M, K]``, in ``k_order``.
      scales: float32 ``[M, K/128]``: the power-of-two scale of each row's 128-wide k chunk.
      global_scale: float32 ``[]``: a factor applied in the GEMM epilogue (an NVFP4 lhs's global
        scale, else 1).
      k_order: "logical" (codes[r, k] is element k) or "kernel": within each 128-wide chunk the
        order the CUDA kernel reads (:func:`jax_nvfp4.ops.fp8.to_kernel_k_order`), so that gathered
        rows (:meth:`take`) reach the custom call without a permutation of their own.

    Row r's value is ``codes[r, k] * scales[r, k // 128] * global_scale`` (k logical). Quantizing
    each row once and gathering rows of this (:meth:`take`) gives the same operand as gathering
    the float rows and quantizing them: the quantization is per row.
    """

    codes: jax.Array
    scales: jax.Array
    global_scale: jax.Array
    k_order: str = "logical"

    def tree_flatten(self):
        return (self.codes, self.scales, self.global_scale), self.k_order

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, k_order=aux)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    def take(self, rows: jax.Array) -> "Fp8Rows":
        """The rows ``rows`` (int ``[R]``, each in ``[0, M)``) of codes and scales."""
        return Fp8Rows(take_rows(self.codes, rows), self.scales[rows], self.global_scale,
                       self.k_order)

    def validate(self, name: str = "lhs") -> "Fp8Rows":
        """Check dtypes and shapes; raise ValueError naming ``name`` and what was expected."""
        c, s, g = self.codes, self.scales, self.global_scale
        if self.k_order not in FP8_K_ORDERS:
            raise ValueError(f"{name}.k_order: expected one of {FP8_K_ORDERS}, got "
                             f"{self.k_order!r}")
        if c.dtype != jnp.float8_e4m3fn or c.ndim != 2 or c.shape[1] % 128:
            raise ValueError(f"{name}.codes: expected float8_e4m3fn [M, K] with K % 128 == 0, got "
                             f"{c.dtype} {list(c.shape)}")
        if jnp.dtype(s.dtype) != jnp.float32 or tuple(s.shape) != (c.shape[0], c.shape[1] // 128):
            raise ValueError(f"{name}.scales: expected float32 [{c.shape[0]}, {c.shape[1] // 128}], "
                             f"got {s.dtype} {list(s.shape)}")
        if jnp.dtype(g.dtype) != jnp.float32 or g.ndim != 0:
            raise ValueError(f"{name}.global_scale: expected a float32 scalar, got {g.dtype} "
                             f"{list(g.shape)}")
        return self


def _permute_in_chunks(q: jax.Array, split: tuple, axes: tuple) -> jax.Array:
    """Each 128-wide chunk of q's last axis reshaped to ``split`` and its axes transposed."""
    lead, k = q.shape[:-1], q.shape[-1]
    if k % FP8_CHUNK:
        raise ValueError(f"q: K={k} is not a multiple of {FP8_CHUNK}")
    n = len(lead)
    v = q.reshape(lead + (k // FP8_CHUNK,) + split)
    v = jnp.transpose(v, tuple(range(n + 1)) + tuple(n + 1 + a for a in axes))
    return v.reshape(lead + (k,))


def to_kernel_k_order(q: jax.Array) -> jax.Array:
    """``[..., K]`` -> ``[..., K]``: inside each 128-wide chunk, position ``32j + 16h + 4t + i``
    holds logical k ``32t + 8j + 4h + i`` (t, j in 0..3, h in 0..1, i in 0..3), the order the
    CUDA kernel's fp8 fragments read. Any dtype; K % 128 == 0."""
    return _permute_in_chunks(q, (4, 4, 2, 4), (1, 2, 0, 3))          # (t, j, h, i) -> (j, h, t, i)


def from_kernel_k_order(q: jax.Array) -> jax.Array:
    """The inverse of :func:`to_kernel_k_order`."""
    return _permute_in_chunks(q, (4, 2, 4, 4), (2, 0, 1, 3))          # (j, h, t, i) -> (t, j, h, i)


FP8_WEIGHT_SHIFT = 3
"""Weights prepared for the FP8 mode hold ``e2m1 * scale * 2^-3`` (at most 336, inside e4m3's 448);
the GEMM epilogue multiplies by ``2^3``."""


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Fp8Weights:
    """NVFP4 weights prepared once as e4m3 for the FP8 compute mode (``precision="fp8"``), the
    layout ``"fp8"`` of :func:`jax_nvfp4.prepare_weights`: a grouped GEMM rhs and a MoE layer
    weight, like an :class:`NVFP4Tensor` in the other layouts.

    Attributes:
      codes: float8_e4m3fn ``[..., N, K]`` (K % 128 == 0), one byte per weight:
        ``e4m3(e2m1 * float(block scale) * 2^-3)`` of the source NVFP4 weight (the operand the FP8
        mode computes with on every backend; the product is exact in float32, the cast rounds to
        nearest even, a NaN block scale gives NaN codes), with k in the kernel order inside each
        128-wide chunk (:func:`to_kernel_k_order`: the order of the activations' codes, so the
        CUDA kernel loads both operands as they lie).
      global_scale: float32, the source tensor's global scale unchanged (``[]``, ``[G]``, or
        ``[G, 2]`` for separate halves of N, as :class:`NVFP4Tensor`).

    Value: ``codes[..., n, k] * 2^3 * global_scale`` (codes read in the logical k order). The GEMM
    epilogue factor is ``global_scale * 2^3`` (times the lhs's global scale), as for NVFP4 weights
    in the FP8 mode, so the prepared weights give that mode's numbers exactly.

    Memory: 8 bits per weight, against NVFP4's 4.5 (codes plus one e4m3 scale per 16). The e4m3
    rounding is not invertible (``e2m1 * scale`` can need 6 significant bits, e4m3 holds 4): keep
    the NVFP4 weights to go back to the exact mode or to a checkpoint.
    """

    codes: jax.Array
    global_scale: jax.Array

    layout = FP8_LAYOUT
    """Always ``"fp8"`` (a class constant, not a field: the type is the layout)."""

    def tree_flatten(self):
        return (self.codes, self.global_scale), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape ``[..., N, K]`` (the codes' shape)."""
        return tuple(self.codes.shape)

    @property
    def ndim(self) -> int:
        return len(self.codes.shape)

    def logical_codes(self) -> jax.Array:
        """float8_e4m3fn ``[..., N, K]``: the codes in the logical k order."""
        return from_kernel_k_order(self.codes)

    def validate(self, name: str = "tensor") -> "Fp8Weights":
        """Check dtypes and shapes; raise ValueError naming ``name`` and what was expected."""
        c, g = self.codes, self.global_scale
        if c.dtype != jnp.float8_e4m3fn or c.ndim < 2 or c.shape[-1] == 0 or c.shape[-1] % FP8_CHUNK:
            raise ValueError(f"{name}.codes: expected float8_e4m3fn [..., N, K] with K a positive "
                             f"multiple of {FP8_CHUNK} (jax_nvfp4.prepare_weights(w, 'fp8')), got "
                             f"{c.dtype} {list(c.shape)}")
        if jnp.dtype(g.dtype) != jnp.float32:
            raise ValueError(f"{name}.global_scale: expected float32, got {g.dtype}")
        lead = tuple(c.shape[:-1])
        if not _is_half_split(g.shape, lead) and (
                g.ndim > len(lead) or any(a not in (1, b) for a, b in zip(g.shape, lead))):
            raise ValueError(f"{name}.global_scale: shape {tuple(g.shape)} does not match the "
                             f"leading axes {lead} (use [] for one tensor, [G] for [G, N, K], "
                             f"[G, 2] for separate first/second halves of N)")
        return self


def _is_half_split(gshape, lead) -> bool:
    """A global scale ``[..., 2]`` over ``[..., N]``: one per half of the row axis (gate | up)."""
    return (len(gshape) == len(lead) and len(lead) >= 1 and gshape[-1] == 2 and lead[-1] % 2 == 0
            and lead[-1] != 2 and all(a in (1, b) for a, b in zip(gshape[:-1], lead[:-1])))


def expand_global_scale(global_scale: jax.Array, ndim: int, lead=None) -> jax.Array:
    """Reshape a global scale so it broadcasts against an array of rank ``ndim``.

    The global scale is aligned with the *leading* axes (``[G]`` scales expert g of
    ``[G, N, K]``). Given the leading shape ``lead`` (without K), a ``[G, 2]`` scale of
    ``[G, N, K]`` scales rows ``:N/2`` and ``N/2:`` separately (w13's gate and up halves).
    """
    g = jnp.asarray(global_scale, jnp.float32)
    if lead is not None and _is_half_split(g.shape, tuple(lead)):
        g = jnp.repeat(g, lead[-1] // 2, axis=-1)
    return g.reshape(g.shape + (1,) * (ndim - g.ndim))
