"""The FP8 compute mode's arithmetic (``precision="fp8"``): e4m3 operands, power-of-two scales.

Every backend computes this arithmetic (docs/design.md, "FP8 mode"), with the same operand bytes:

1. Activations, per row and 128-wide k chunk: ``p = max(E - 135 + (F > 0x600000), -126)`` from the
   float32 bits (exponent E, fraction F) of the chunk's amax, i.e. the smallest power of two
   ``s = 2^p`` with ``amax / s <= 448``; codes ``e4m3(x / s)``, round to nearest even (exact
   scaling: no saturation ever happens). A chunk holding an Inf or NaN has NaN codes (scale 1).
2. Weights: ``w8 = e4m3(e2m1 * block_scale * 2^-3)`` (the product is exact; ``|w8| <= 336``).
3. The GEMM: per chunk a float32 dot of the codes, folded as ``acc = fma(part, s, acc)``;
   ``out = acc * (alpha * 8)``.

Only the order in which a chunk's 128 products (each exact in float32) are summed is left to the
backend: the CPU handler adds them one by one in the kernel k order (:func:`to_kernel_k_order`),
XLA's dot (the reference, eager or jitted) in an order of its own, the GPU's tensor cores with ~14
significant bits. So the CPU handler and the reference, eager or jitted, are not bit-identical:
for every output element (float32 output)

    |a - b| <= 2 * (K/128 + 130) * 2^-24 * mag,   mag = |alpha * 8| * sum_k |q_k * s_k * w8_k|

(each within half of that of the exact result: 127 roundings of a chunk's sum in any order, one
per chunk fold, the epilogue, one to spare); bf16 output adds one bf16 rounding of each. Measured
(Gaussian bf16 rows, K 512, 64 x 128 outputs): 19 of 8192 elements differ, by at most
``6.2e-9 * mag`` (tests/test_fp8.py, ``test_cpu_handler_and_reference_within_stated_bound``).

The quantizer finds each chunk's amax with integer operations on the float32 bit patterns (exact
everywhere, NaN found whatever a float ``max`` does with it). It then scales by ``2^-p`` on one of
two routes, chosen per lowering platform: on CUDA GPUs a float multiply ``x * 2^-p`` (XLA:GPU keeps
subnormal float32 operands unless ``--xla_gpu_ftz=true``; every product that can reach a nonzero
code is exact), elsewhere integer operations that never feed a subnormal to float arithmetic (XLA
on the CPU flushes subnormal float32 operands to zero, TPUs do too). Both give the same bytes; the
argument is at :func:`_codes_float` and in docs/design.md, "FP8 mode".
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from .. import _extension
from ..maths.formats import (FP8_WEIGHT_SHIFT, Fp8Rows, Fp8Weights, NVFP4Tensor,
                      from_kernel_k_order, keep_rounded, to_kernel_k_order)
from ..maths.layout import _on_each_shard
from ..maths.quantization import e2m1_scaled, refuse_derivative
from .gemm_args import check_group_sizes, group_bounds, row_groups, to_out_dtype, validate_gemm_args
from ..config.options import FP8_CHUNK, FP8_K_ORDERS, check_fp8_k, resolve_backend
from ..maths.varying import varying_type

CHUNK = FP8_CHUNK
"""k values per activation scale (and per float32 promotion of the kernel's accumulator)."""
WEIGHT_SHIFT = FP8_WEIGHT_SHIFT
"""The weights enter e4m3 as ``e2m1 * scale * 2^-3``; the epilogue multiplies by ``2^3``."""
QUANTIZE_TARGET = _extension.target_name("jax_nvfp4_quantize_fp8")
"""The custom call of the activation quantizer in the kernel k order (csrc/quantize_fp8.h)."""
FP8_NO_DERIVATIVE = (
    "jax_nvfp4.ops.fp8: quantizing activations to e4m3 (quantize_rows, quantize_activations_fp8) has "
    "no derivative (the codes come from bit operations; it would be silently zero). For a "
    "straight-through gradient pass the float activations to jax_nvfp4.grouped_gemm(..., "
    "precision='fp8'), which quantizes inside its straight-through backward "
    "(jax_nvfp4.ops.autodiff); or quantize jax.lax.stop_gradient(x) when no gradient should flow.")
"""The TypeError message of differentiating the fp8 activation quantizer."""
_F32_SIGN = np.uint32(0x80000000)
_F32_ABS = np.uint32(0x7FFFFFFF)


def _f32_bits(x: jax.Array) -> jax.Array:
    """The float32 bit patterns (uint32) of x's values, float64 rounded to float32 first.
    Conversions from bf16/f16 are exact (also for their subnormals)."""
    return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def _pow2(e: jax.Array) -> jax.Array:
    """float32 ``2^e`` for int32 ``e`` in [-126, 127] (built from its bits, exact)."""
    return jax.lax.bitcast_convert_type(((e + 127).astype(jnp.uint32) << 23), jnp.float32)


def _amax_bits(x: jax.Array) -> jax.Array:
    """uint32 ``[M, K/128]``: the float32 bits of each 128-chunk's amax (x ``[M, K]`` float).

    Ordering of non-negative float bit patterns as integers is that of their values, with Inf and
    NaN above every finite value: the integer max is the float amax (subnormals too). A bf16 input
    is reduced on its own 16-bit patterns (the reduction reads x and nothing [M, K]-sized)."""
    m, k = x.shape
    if x.dtype == jnp.bfloat16:
        m16 = jax.lax.bitcast_convert_type(x, jnp.uint16).reshape(m, k // CHUNK, CHUNK)
        return jnp.max(m16 & np.uint16(0x7FFF), axis=-1).astype(jnp.uint32) << 16
    return jnp.max(_f32_bits(x).reshape(m, k // CHUNK, CHUNK) & _F32_ABS, axis=-1)


def _scale_exponent(amax: jax.Array):
    """amax bits uint32 ``[M, C]`` -> ``(p, nonfinite)``: int32 ``p = max(E - 135 + (F >
    0x600000), -126)`` (0 where nonfinite) and bool ``nonfinite`` (amax Inf or NaN)."""
    # E + (F > 0x600000) is the exponent field of amax + 0x1FFFFF (F + 0x1FFFFF carries into it
    # exactly when F >= 0x600001); no wrap-around, amax <= 0x7FFFFFFF.
    p = jnp.maximum(((amax + np.uint32(0x1FFFFF)) >> 23).astype(jnp.int32) - 135, -126)
    nonfinite = amax >= np.uint32(0x7F800000)
    return jnp.where(nonfinite, 0, p), nonfinite


def _codes_exact(x32: jax.Array, p: jax.Array, nonfinite: jax.Array) -> jax.Array:
    """e4m3 ``[M, C, 128]`` of float32 ``x32 [M, C, 128]`` by ``2^p`` (``p``, ``nonfinite`` as
    :func:`_scale_exponent`), no subnormal operand ever reaching float arithmetic: every backend.

    ``y = x * 2^-p`` exactly, as a float32: a normal x times a normal power of two (the product
    is exact unless it is below 2^-126, where e4m3 rounds it to a signed 0 anyway); a subnormal x
    is F * 2^-149, i.e. float(F) * 2^(-149 - p), the factor a normal float32 whenever the result
    can reach e4m3's 2^-10 (else 0)."""
    bits = jax.lax.bitcast_convert_type(x32, jnp.uint32)
    mag = bits & _F32_ABS
    e_x = ((mag >> 23) & np.uint32(0xFF)).astype(jnp.int32)
    neg = (bits & _F32_SIGN) != 0
    xf = jax.lax.bitcast_convert_type(mag, jnp.float32)
    pc = p[..., None]
    y_normal = xf * _pow2(-pc)
    sub_e = -149 - pc
    y_sub = jnp.where(sub_e >= -126, (mag & np.uint32(0x7FFFFF)).astype(jnp.float32)
                      * _pow2(jnp.maximum(sub_e, -126)), 0.0)
    y = jnp.where(e_x == 0, y_sub, y_normal)
    y = jnp.where(neg, -y, y)
    return jnp.where(nonfinite[..., None], jnp.nan, y).astype(jnp.float8_e4m3fn)


def _codes_float(x32: jax.Array, p: jax.Array, nonfinite: jax.Array) -> jax.Array:
    """As :func:`_codes_exact` with one float multiply per element: CUDA GPUs only.

    The same bytes as :func:`_codes_exact` wherever float32 arithmetic keeps subnormal operands
    (XLA:GPU unless ``--xla_gpu_ftz=true``). Both routes end in the same cast; per element:

    - x normal: both compute the float32 product ``|x| * 2^-p`` of the same operands (the sign
      applied before or after: round to nearest is symmetric), so the same float32.
    - x subnormal, ``x = +-F * 2^-149`` (1 <= F < 2^23), and ``p <= -23``: the exact route's
      ``F * 2^(-149 - p)`` and this route's ``x * 2^-p`` are the same value, normal (>= 2^-126),
      so both products are exact and the same float32; this needs x not flushed.
    - x subnormal and ``p > -23``: the exact route gives a signed 0, this one a float32 of at
      most ``2^23 * 2^-127 = 2^-104`` in magnitude with x's sign (rounded or flushed: signed);
      e4m3 rounds both to the signed zero (its smallest subnormal is 2^-9, half of it 2^-10).
    - x a signed zero: a signed zero on both. Inf/NaN chunks: the same explicit NaN on both.

    p itself, the scales and the NaN chunks come from integer operations shared by both routes."""
    y = x32 * _pow2(-p)[..., None]
    return jnp.where(nonfinite[..., None], jnp.nan, y).astype(jnp.float8_e4m3fn)


def _gpu_flushes_subnormals() -> bool:
    """Whether XLA_FLAGS turns on flush-to-zero for GPU code (then the float route is not exact
    and the exact one runs on the GPU too)."""
    on = False
    for f in os.environ.get("XLA_FLAGS", "").split():
        if f.startswith("--xla_gpu_ftz"):
            on = f.lower() in ("--xla_gpu_ftz", "--xla_gpu_ftz=true", "--xla_gpu_ftz=1")
    return on


def quantize_activations_fp8(x: jax.Array):
    """Activations to e4m3 with one power-of-two float32 scale per row and 128-wide k chunk.

    Args:
      x: float ``[M, K]`` (bfloat16, float16, float32; float64 is rounded to float32 first),
        ``K % 128 == 0``. Jittable. On CUDA GPUs the scaling is a float multiply, elsewhere
        integer operations: the same bytes (module docstring).

    Returns:
      ``(codes, scales)``: float8_e4m3fn ``[M, K]`` (logical k order) and float32 ``[M, K/128]``,
      with ``x ~= codes * scales`` per chunk. For a chunk with amax bits (E, F):
      ``scale = 2^max(E - 135 + (F > 0x600000), -126)`` and ``codes = e4m3(x / scale)`` (round to
      nearest even, exact scaling, never saturating); an all-zero chunk has scale ``2^-126`` and
      zero codes (signs kept); a chunk holding an Inf or NaN has NaN codes (0x7F) and scale 1.

    Not differentiable: differentiating with respect to x raises TypeError
    (:data:`FP8_NO_DERIVATIVE`), rather than giving the zero derivative of the bit operations.
    """
    return _quantize_activations(x, "auto")


def _quantize_activations(x, route: str):
    """:func:`quantize_activations_fp8` with the scaling route chosen: ``"auto"`` (its own),
    ``"exact"`` (:func:`_codes_exact` on every platform) or ``"float"`` (:func:`_codes_float` on
    every platform; on the CPU it flushes subnormal inputs: for measurements and tests only)."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x: expected a floating-point array, got {x.dtype}")
    if x.ndim != 2:
        raise ValueError(f"x: expected [M, K], got shape {x.shape}")
    x = refuse_derivative(x, FP8_NO_DERIVATIVE)
    if route not in ("auto", "exact", "float"):
        raise ValueError(f"route: expected 'auto', 'exact' or 'float', got {route!r}")
    m, k = x.shape
    if k == 0 or k % CHUNK:
        raise ValueError(f"x: K={k}: precision='fp8' needs K to be a positive multiple of {CHUNK}")
    x = keep_rounded(x)
    p, nonfinite = _scale_exponent(_amax_bits(x))
    x32 = x.astype(jnp.float32).reshape(m, k // CHUNK, CHUNK)
    if route == "auto" and _gpu_flushes_subnormals():
        route = "exact"
    if route == "auto":
        codes = jax.lax.platform_dependent(x32, p, nonfinite, cuda=_codes_float,
                                           default=_codes_exact)
    else:
        codes = (_codes_float if route == "float" else _codes_exact)(x32, p, nonfinite)
    # XLA:GPU elides a narrowing convert followed by a widening one (SimplifyFPConversions under
    # its default --xla_allow_excess_precision): a consumer in the same jit that widens the codes
    # (the reference's dots) would read x / scale unrounded. The barrier keeps the e4m3 rounding.
    codes = jax.lax.optimization_barrier(codes)
    scales = jnp.where(nonfinite, jnp.float32(1.0), _pow2(p))
    return codes.reshape(m, k), scales


def weights_fp8(rhs) -> jax.Array:
    """NVFP4 weights to the fp8 mode's e4m3 operand: ``e4m3(e2m1 * float(scale) * 2^-3)``.

    Args:
      rhs: NVFP4Tensor ``[..., N, K]`` in either layout (read through
        :func:`jax_nvfp4.maths.quantization.e2m1_scaled`); the global scale is not applied. Or
        :class:`Fp8Weights` (weights already prepared so): its codes, put back in logical order.

    Returns:
      float8_e4m3fn ``[..., N, K]`` (logical k order). The float32 product is exact and at most
      ``6 * 448 / 8 = 336``; a NaN block scale gives NaN for each code of its block.
    """
    if isinstance(rhs, Fp8Weights):
        return rhs.logical_codes()
    # e2m1 * e4m3 is exact in float32 and never subnormal (>= 0.5 * 2^-9), nor is its 2^-3.
    w = e2m1_scaled(rhs, jnp.float32) * jnp.float32(2.0**-WEIGHT_SHIFT)
    # The barrier keeps the e4m3 rounding when a consumer widens the codes in the same jit (as
    # the activation codes', _quantize_activations).
    return jax.lax.optimization_barrier(w.astype(jnp.float8_e4m3fn))


def prepare_fp8(t: NVFP4Tensor, name: str = "x") -> Fp8Weights:
    """NVFP4 weights ``[..., N, K]`` (either layout, K % 128 == 0) -> :class:`Fp8Weights`: the
    codes :func:`weights_fp8` in the kernel k order, the global scale kept. ``name`` names the
    tensor in errors. Jittable; the public entry point is ``jax_nvfp4.prepare_weights(w, "fp8")``.

    A stack is converted one matrix at a time (``lax.map``: transient memory about 4 bytes per
    weight of one matrix, the float32 products, next to the 1-byte result); a stack split over
    devices along its leading axes is converted where it lies (``shard_map``, as
    :func:`jax_nvfp4.maths.layout.relayout`)."""
    if not isinstance(t, NVFP4Tensor):
        raise ValueError(f"{name}: expected an NVFP4Tensor [..., N, K], got {type(t).__name__}")
    t.validate(name)
    if t.data.ndim < 2:
        raise ValueError(f"{name}: layout 'fp8' prepares weights [..., N, K], got data "
                         f"{tuple(t.data.shape)}")
    k = t.shape[-1]
    if k % CHUNK:
        raise ValueError(f"{name}: layout 'fp8' needs K % {CHUNK} == 0 (the FP8 mode's promotion "
                         f"chunk), got K = {k}")
    layout = t.layout

    def one(data, scales):
        w = NVFP4Tensor(data, scales, jnp.float32(1.0), layout)
        return to_kernel_k_order(weights_fp8(w))

    def convert(data, scales):
        if data.ndim > 2 and data.shape[0] > 1:
            lead = data.shape[:-2]
            flat = (data.reshape((-1,) + data.shape[-2:]), scales.reshape((-1,) + scales.shape[-2:]))
            return jax.lax.map(lambda a: one(*a), flat).reshape(lead + data.shape[-2:-1] + (k,))
        return one(data, scales)

    # sm90 blocks are 128 rows x 64 k of one matrix, kernel-order chunks 128 k of one row: the
    # conversion never crosses a leading index
    codes = _on_each_shard(convert, t.data, f"{name}.data", t.scales,
                           needs="layout 'fp8' converts whole matrices")
    return Fp8Weights(codes, t.global_scale)


def fp8_lhs(lhs):
    """The fp8 mode's activation operand and the factor it brings to alpha.

    ``lhs`` a float ``[M, K]`` (quantized as it is), an NVFP4Tensor ``[M, K]`` (its exact
    ``e2m1 * scale`` values in float32 are quantized, its scalar global scale returned) or
    :class:`Fp8Rows` (already quantized: its fields).
    Returns ``(codes [M, K] e4m3 logical order, scales float32 [M, K/128], lhs_global float32 [])``.
    """
    if isinstance(lhs, Fp8Rows):
        codes = from_kernel_k_order(lhs.codes) if lhs.k_order == "kernel" else lhs.codes
        return codes, lhs.scales, lhs.global_scale.astype(jnp.float32)
    if isinstance(lhs, NVFP4Tensor):
        codes, scales = quantize_activations_fp8(e2m1_scaled(lhs, jnp.float32))
        return codes, scales, lhs.global_scale.astype(jnp.float32)
    codes, scales = quantize_activations_fp8(jnp.asarray(lhs))
    return codes, scales, jnp.float32(1.0)


def _ffi_quantizes(lhs) -> bool:
    """Whether the custom call quantizes ``lhs``: a bf16/float16/float32 array, or an NVFP4Tensor
    in the checkpoint layout with a scalar global scale (any other lhs takes the jnp route)."""
    if isinstance(lhs, NVFP4Tensor):
        return (lhs.layout == "checkpoint" and jnp.ndim(lhs.global_scale) == 0
                and lhs.data.dtype == jnp.uint8 and lhs.scales.dtype == jnp.float8_e4m3fn)
    return isinstance(lhs, (jax.Array, np.ndarray)) and jnp.dtype(lhs.dtype) in (
        jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def quantize_kernel_order_ffi(lhs, scales_transposed: bool = False):
    """:func:`kernel_lhs` by the custom call "jax_nvfp4_quantize_fp8" (its CPU handler or CUDA
    kernel: one pass over the rows, codes written in the kernel k order): the same bytes as the
    jnp route (tests/test_fp8.py checks them against it and an ml_dtypes oracle).

    Args:
      lhs: bf16/float16/float32 ``[M, K]``, or an NVFP4Tensor ``[M, K]`` in the checkpoint layout
        with a scalar global scale (its ``e2m1 * block scale`` values are quantized); K % 128 == 0.
      scales_transposed: return the scales as ``[K/128, M]`` (the GEMM custom call's operand).

    Returns:
      ``(codes e4m3 [M, K] kernel order, scales float32 [M, K/128] (or [K/128, M]), lhs_global
      float32 [])``. Not differentiable (the layer and the GEMM call it inside their
      straight-through forwards).
    """
    if not _ffi_quantizes(lhs):
        raise ValueError("lhs: expected a bf16/float16/float32 [M, K] array or a checkpoint-layout "
                         f"NVFP4Tensor with a scalar global scale, got {type(lhs).__name__}")
    if _extension.load() is None:
        raise RuntimeError(f"quantize_kernel_order_ffi: {_extension.not_built_message()}")
    if isinstance(lhs, NVFP4Tensor):
        lhs.validate("lhs")
        args = (lhs.data, lhs.scales)
        m, k = lhs.shape
        gs = lhs.global_scale.astype(jnp.float32)
    else:
        x = jnp.asarray(lhs)
        if x.ndim != 2:
            raise ValueError(f"lhs: expected [M, K], got shape {x.shape}")
        args = (x, jnp.zeros((0,), jnp.float8_e4m3fn))
        m, k = x.shape
        gs = jnp.float32(1.0)
    check_fp8_k(k)
    c = k // CHUNK
    out_t = (varying_type(args, (m, k), jnp.float8_e4m3fn),
             varying_type(args, (c, m) if scales_transposed else (m, c), jnp.float32))
    codes, scales = jax.ffi.ffi_call(QUANTIZE_TARGET, out_t, vmap_method="sequential")(
        *args, scales_transposed=bool(scales_transposed))
    return codes, scales, gs


def kernel_lhs(lhs, *, use_ffi: bool = False, scales_transposed: bool = False):
    """:func:`fp8_lhs` with the codes in the CUDA kernel's k order (:func:`to_kernel_k_order`),
    the custom call's operand; an :class:`Fp8Rows` already in that order is used as it is.
    ``use_ffi``: quantize by the custom call where it takes ``lhs`` (:func:`quantize_kernel_order_ffi`;
    the same bytes). Returns ``(codes e4m3 [M, K] kernel order, scales float32 [M, K/128] (or
    ``[K/128, M]`` with ``scales_transposed``), lhs_global float32 [])``."""
    if use_ffi and _ffi_quantizes(lhs):
        return quantize_kernel_order_ffi(lhs, scales_transposed)
    if isinstance(lhs, Fp8Rows) and lhs.k_order == "kernel":
        codes, scales, gs = lhs.codes, lhs.scales, lhs.global_scale.astype(jnp.float32)
    else:
        codes, scales, gs = fp8_lhs(lhs)
        codes = to_kernel_k_order(codes)
    return codes, (scales.T if scales_transposed else scales), gs


def quantize_rows(lhs, k_order: str = "logical", *, backend: str = "reference") -> Fp8Rows:
    """Activation rows quantized for the fp8 mode, as :func:`jax_nvfp4.grouped_gemm` with
    ``precision="fp8"`` quantizes its lhs: a float ``[M, K]`` or an NVFP4Tensor ``[M, K]`` (scalar
    global scale; K % 128 == 0) -> :class:`Fp8Rows`. Quantizing each token once and gathering its
    rows (``Fp8Rows.take``) gives the operand that quantizing gathered copies gives (the
    quantization is per row), with each token quantized once instead of once per chosen expert and
    1-byte codes gathered instead of 2-byte bf16 values.

    ``k_order``: "logical", or "kernel" (the codes permuted in the quantizer's own pass into the
    order the CUDA kernel reads: gathered rows then need no permutation before the custom call;
    on the H200 permuting 24576 gathered rows of 7168 took 0.6 ms). Same numbers either way.

    ``backend``: "reference" (jnp), "ffi" or "auto" (as :func:`jax_nvfp4.grouped_gemm` resolves
    it): with "kernel" order the custom call "jax_nvfp4_quantize_fp8" quantizes the lhs it takes
    (:func:`quantize_kernel_order_ffi`), the same bytes in one pass.

    Not differentiable: differentiating with respect to a float lhs raises TypeError
    (:data:`FP8_NO_DERIVATIVE`)."""
    if k_order not in FP8_K_ORDERS:
        raise ValueError(f"k_order: expected one of {FP8_K_ORDERS}, got {k_order!r}")
    if isinstance(lhs, (jax.Array, np.ndarray)) and jnp.issubdtype(lhs.dtype, jnp.floating):
        lhs = refuse_derivative(lhs, FP8_NO_DERIVATIVE)
    use_ffi = resolve_backend(backend) == "ffi"
    codes, scales, gs = kernel_lhs(lhs, use_ffi=use_ffi) if k_order == "kernel" else fp8_lhs(lhs)
    return Fp8Rows(codes, scales, gs, k_order=k_order)


def grouped_gemm_fp8_reference(lhs, rhs: NVFP4Tensor, group_sizes, *, out_dtype=jnp.bfloat16):
    """The fp8 mode's grouped GEMM, pure jnp (what every backend computes with ``precision="fp8"``).

    Args and group semantics as :func:`jax_nvfp4.ops.reference.grouped_gemm`; K % 128 == 0.

    Returns:
      ``[M, N]`` out_dtype: row r of group g, column n is ``acc * (alpha_g * 8)`` where ``acc``
      folds the chunks in order, ``acc = part_c * s[r, c] + acc`` (``part_c`` the float32 dot of
      chunk c's e4m3 codes with :func:`weights_fp8`, ``s`` the chunk's power-of-two scale: the
      product is exact, so this is the fma of the specification but for a product below 2^-126),
      ``alpha_g = lhs global scale (1 for float) * rhs.global_scale[g]``; rows past the groups 0.
    """
    m, k, g, n = validate_gemm_args(lhs, rhs, group_sizes, out_dtype)
    check_fp8_k(k)
    group_sizes = check_group_sizes(group_sizes, g)
    # The codes and w8 below come out of optimization barriers (_quantize_activations,
    # weights_fp8): without them XLA:GPU folded the e4m3 rounding of float activations away under
    # jit (H200, jax 0.11.2: ~2^-8 of the products' magnitude off; tests/test_excess_precision.py).
    codes, scales, lhs_gs = fp8_lhs(lhs)
    w8 = weights_fp8(rhs).astype(jnp.float32)                             # [G, N, K]
    alpha = lhs_gs * jnp.broadcast_to(rhs.global_scale.astype(jnp.float32), (g,))
    starts, ends = group_bounds(group_sizes, m)
    gid, valid = row_groups(ends, m)
    sizes = (ends - starts).astype(jnp.int32)
    # ragged_dot may mix groups through products with 0 (reference.grouped_gemm): NaN weights are
    # zeroed for the dots and put back on the rows of their group at the end.
    nan = jnp.isnan(w8)
    nan_rows = jnp.any(nan, axis=-1)                                    # [G, N]
    w8 = jnp.where(nan, 0.0, w8)
    # e4m3 values are exact in bf16 and so is each product of two (8 significant bits): the dots
    # take bf16 operands with float32 accumulation. One ragged_dot per chunk, unrolled: the same
    # chunk dots inside a lax.scan came out wrong on the GPU (H200, jax 0.11.2: errors ~0.6% of the
    # products' magnitude, while each ragged_dot alone is exact there).
    a16 = codes.astype(jnp.bfloat16)                                           # [M, K]
    w16 = jnp.swapaxes(w8.astype(jnp.bfloat16), 1, 2)                          # [G, K, N]
    acc = jnp.zeros((m, n), jnp.float32)
    for c in range(k // CHUNK):
        part = jax.lax.ragged_dot(a16[:, c * CHUNK:(c + 1) * CHUNK], w16[:, c * CHUNK:(c + 1) * CHUNK],
                                  sizes, preferred_element_type=jnp.float32)
        acc = part * scales[:, c:c + 1] + acc
    acc = jnp.where(nan_rows[gid], jnp.nan, acc)
    factor = alpha * jnp.float32(2.0**WEIGHT_SHIFT)
    out = jnp.where(valid[:, None], acc * factor[gid][:, None], 0.0)
    return to_out_dtype(out, out_dtype)


__all__ = ["CHUNK", "Fp8Rows", "Fp8Weights", "fp8_lhs", "prepare_fp8", "from_kernel_k_order",
           "grouped_gemm_fp8_reference", "kernel_lhs", "quantize_activations_fp8",
           "quantize_kernel_order_ffi", "quantize_rows",
           "to_kernel_k_order", "weights_fp8"]
