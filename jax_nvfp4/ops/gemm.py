"""The grouped NVFP4 GEMM as XLA FFI custom calls (CPU and CUDA handlers): the plain call, its FP8
mode and the gate/up call with the SwiGLU epilogue."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _extension
from . import autodiff, fp8, gemm_args, reference
from ..config import kernel_config
from ..maths import quantization, qwix_interop
from ..maths.formats import Fp8Weights, NVFP4Tensor
from ..config.kernel_config import KernelConfig
from ..config.options import EXACT, LAYOUT_CODES, Backend, Precision, check_fp8_k, check_precision, resolve_backend
from ..maths.varying import varying_type


def workspace_bytes(num_groups: int, k: int = 0) -> int:
    """Bytes of the custom call's workspace output (the handlers allocate nothing themselves):
    the CUDA handler's schedules for ``num_groups`` groups, plus ``k`` for the CPU handler's
    decoded weight rows. The formula is the compiled extension's (csrc/gemm_contract.h), the
    one the handlers check the buffer against."""
    return int(_extension.load().workspace_bytes(num_groups, k))


SYMBOLIC_ROWS_PER_GROUP = 128
"""With a symbolic M (``jax.export`` with a symbolic token count) the kernel configuration, a static
attribute of the custom call, is chosen for ``rows_hint`` rows when one is given, else for this many
rows per group on average (the prefill-sized tiles). Any configuration computes every M."""


def _rows_for_choice(m, rows_hint: int, g: int) -> tuple[int, int]:
    """``(M, rows_hint)`` as static ints for the kernel choice (M symbolic: SYMBOLIC_ROWS_PER_GROUP);
    a hint at or past M means M (as the kernels read it)."""
    if not isinstance(m, int):
        m = int(rows_hint) if rows_hint else SYMBOLIC_ROWS_PER_GROUP * g
    return m, min(int(rows_hint), m)


def _ffi_call(target, args, out_cols, out_dtype, rows_decoded, config, rhs_layout, ws_extra=None,
              **attrs):
    """One of the custom calls on ``args`` (``lhs, lhs_scales, rhs_data, rhs_scales, ...``):
    out ``[M, out_cols]`` out_dtype, and the workspace for ``rows_decoded`` weight rows of the CPU
    handler (K bytes each; rhs_data's last axis is K/2)."""
    m, g, k = args[0].shape[0], args[2].shape[0], 2 * args[2].shape[2]
    out_t = varying_type(args, (m, out_cols), out_dtype)
    extra = rows_decoded * k if ws_extra is None else ws_extra
    # a symbolic extra (jax.export with a symbolic M: the fp8-prepared call's 4 M K/128 bytes) is
    # added to the formula's constant part (it is linear in the extra bytes)
    ws = workspace_bytes(g, extra) if isinstance(extra, int) else workspace_bytes(g, 0) + extra
    ws_t = varying_type(args, (ws,), jnp.uint8)
    out, _ = jax.ffi.ffi_call(target, (out_t, ws_t), vmap_method="sequential")(
        *args, rhs_layout=np.int32(rhs_layout), **config.attributes(), **attrs)
    return out


def _ffi_grouped_gemm(lhs, lhs_scales, rhs_data, rhs_scales, alpha, group_sizes, out_dtype,
                      config, rhs_layout):
    return _ffi_call(_extension.TARGET, (lhs, lhs_scales, rhs_data, rhs_scales, alpha, group_sizes),
                     rhs_data.shape[1], out_dtype, 1, config, rhs_layout)


@functools.partial(jax.custom_jvp, nondiff_argnums=(6, 7, 8))
def _grouped_gemm_op(lhs, lhs_scales, rhs_data, rhs_scales, alpha, group_sizes, out_dtype,
                     config, rhs_layout):
    """The custom call; ``config`` a KernelConfig, ``rhs_layout`` the int code of rhs_data's
    layout (LAYOUT_CODES)."""
    return _ffi_grouped_gemm(lhs, lhs_scales, rhs_data, rhs_scales, alpha, group_sizes, out_dtype,
                             config, rhs_layout)


@_grouped_gemm_op.defjvp
def _grouped_gemm_jvp(out_dtype, config, rhs_layout, primals, tangents):
    raise NotImplementedError(
        "jax_nvfp4.grouped_gemm (backend 'ffi'): the custom call has no derivative with respect to "
        "an NVFP4 lhs or the NVFP4 weights (inference weights). A float lhs is differentiable "
        "(reverse mode, jax.grad/jax.vjp; see jax_nvfp4.ops.autodiff), and jax_nvfp4.moe quantizes "
        "its W4A4 activations with a straight-through estimator.")


def _ffi_grouped_gemm_fp8(codes, scales_t, rhs_data, rhs_scales, alpha, group_sizes, out_dtype,
                          config, rhs_layout):
    # prepared e4m3 weights (rhs_layout 2) are read as they lie (the CPU handler decodes no row); their
    # workspace holds cutlass_fp8's [M, K/128] copy of the chunk scales (the extension's formula)
    ws_extra = None
    if rhs_layout == LAYOUT_CODES["fp8"]:
        ws_extra = 4 * codes.shape[0] * (rhs_data.shape[2] // 128)
    # the grouped GEMM's target: the configuration's (FP8) family states the mode
    return _ffi_call(_extension.TARGET, (codes, scales_t, rhs_data, rhs_scales, alpha, group_sizes),
                     rhs_data.shape[1], out_dtype, 1, config, rhs_layout, ws_extra=ws_extra)


@functools.partial(jax.custom_jvp, nondiff_argnums=(6, 7, 8))
def _grouped_gemm_fp8_op(codes, scales_t, rhs_data, rhs_scales, alpha, group_sizes, out_dtype,
                         config, rhs_layout):
    """The custom call in the FP8 mode (an FP8 family in ``config``): ``codes`` e4m3 ``[M, K]``
    in the kernel k order, ``scales_t`` float32 ``[K/128, M]`` (chunk-major), ``alpha`` the full
    epilogue factor per group (without the 8)."""
    return _ffi_grouped_gemm_fp8(codes, scales_t, rhs_data, rhs_scales, alpha, group_sizes,
                                 out_dtype, config, rhs_layout)


_grouped_gemm_fp8_op.defjvp(_grouped_gemm_jvp)


def _on_gpu(*arrays) -> bool:
    """Whether the computation runs on a GPU: the platform of the first concrete array, else the
    default device's (``jax.default_device``), else the default backend's."""
    for a in arrays:
        if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
            try:
                return next(iter(a.devices())).platform == "gpu"
            except Exception:  # noqa: BLE001  (a deleted or otherwise unreadable array)
                break
    dev = getattr(jax.config, "jax_default_device", None)       # (typed as absent in jax's stubs)
    if dev is not None:
        return (dev if isinstance(dev, str) else dev.platform) in ("gpu", "cuda", "rocm")
    return jax.default_backend() == "gpu"


def _fp8_ffi(lhs, rhs, group_sizes, rhs_gs, out_dtype, kernel, m, n, k, g, rows_hint, precision):
    """The fp8 mode through the custom call: activations quantized by the quantizer's custom call
    (fp8.kernel_lhs: the kernel k order, scales ``[K/128, M]``; jnp for an lhs it does not take).
    Fp8Weights reach it as their e4m3 bytes ``[G, N, K]`` (rhs_layout 2, no block scales)."""
    prepared = isinstance(rhs, Fp8Weights)
    if rhs.layout == "sm90" and _on_gpu(*jax.tree.leaves(lhs), *jax.tree.leaves(rhs)):
        # No CUDA kernel computes the FP8 mode on sm90 NVFP4 weights (wgmma_fp8 reads the
        # checkpoint layout, wgmma_fp8_prepared the e4m3 one).
        raise ValueError("rhs.layout: precision='fp8' on the GPU reads checkpoint-layout NVFP4 "
                         "weights or Fp8Weights, got 'sm90'; use jax_nvfp4.prepare_weights(w, "
                         "'checkpoint') or jax_nvfp4.prepare_weights(w, 'fp8')")
    if prepared:
        rhs_data = jax.lax.bitcast_convert_type(rhs.codes, jnp.uint8)
        rhs_scales = jnp.zeros((0,), jnp.float8_e4m3fn)
    else:
        rhs_data, rhs_scales = rhs.data, rhs.scales
    config = kernel_config.resolve(kernel, m, n, k, g, rows_hint=rows_hint, rhs_layout=rhs.layout,
                                   precision=precision)
    codes, scales_t, lhs_gs = fp8.kernel_lhs(lhs, use_ffi=True, scales_transposed=True)
    alpha = lhs_gs * rhs_gs
    return _grouped_gemm_fp8_op(codes, scales_t, rhs_data, rhs_scales,
                                alpha, group_sizes, out_dtype, config,
                                LAYOUT_CODES[rhs.layout])


def _w4a4_routes(out_dtype, native_config, bf16_config, rhs_layout="checkpoint"):
    """The two ways to run W4A4 through the custom call: ``(native, via_bf16)``, each taking
    ``(lhs_data, lhs_scales, rhs_data, rhs_scales, alpha, group_sizes)``; ``rhs_data`` is in
    ``rhs_layout`` ("checkpoint" or "sm90"); each runs its KernelConfig."""
    no_sf = jnp.zeros((0,), jnp.float8_e4m3fn)
    code = LAYOUT_CODES[rhs_layout]

    def native(a, a_sf, w, w_sf, al, gs):
        return _grouped_gemm_op(a, a_sf, w, w_sf, al, gs, out_dtype, native_config, code)

    def via_bf16(a, a_sf, w, w_sf, al, gs):
        # W4A4 on the GPU: a fused elementwise pre-pass dequantizes the activations exactly
        # (e2m1 x e4m3 has at most 6 significant bits, so bf16 holds it; the global scale stays
        # in alpha), then the W4A16 kernel runs. Costs 2*M*K bytes of transient memory.
        a16 = quantization.e2m1_scaled(NVFP4Tensor(a, a_sf, jnp.float32(1.0)), jnp.bfloat16)
        return _grouped_gemm_op(a16, no_sf, w, w_sf, al, gs, out_dtype, bf16_config, code)

    return native, via_bf16


def _mma_requested(lhs, rhs, kernel) -> bool:
    """Whether kernel 'mma' is requested (argument or JAX_NVFP4_KERNEL). Under it W4A4 stays
    native (packed e2m1 activations), which no kernel reads with sm90 weights: that pairing is a
    ValueError on every platform, so a program fails the same way on CPU and GPU."""
    req = kernel_config.requested_family(kernel)
    mma = (req.family if isinstance(req, KernelConfig) else req) == "mma"
    if mma and rhs.layout != "checkpoint" and isinstance(lhs, NVFP4Tensor):
        raise ValueError(f"rhs.layout: {rhs.layout!r} weights with an NVFP4 lhs need the bf16 "
                         "activation path, but kernel 'mma' keeps W4A4 native; choose another "
                         "kernel or use jax_nvfp4.prepare_weights(rhs, 'checkpoint')")
    return mma


def check_rows_hint(rows_hint) -> int:
    """``rows_hint`` (None: 0) as a static int >= 0, else a ValueError naming it."""
    if rows_hint is None:
        return 0
    if isinstance(rows_hint, bool) or not isinstance(rows_hint, (int, np.integer)) or rows_hint < 0:
        raise ValueError(f"rows_hint: expected a static int >= 0 or None, got {rows_hint!r}")
    return int(rows_hint)


def grouped_gemm(lhs, rhs: NVFP4Tensor, group_sizes: jax.Array, *, out_dtype=jnp.bfloat16,
                 backend: str = "auto", rows_hint: int | None = None,
                 kernel: str | KernelConfig | None = None, precision: str = "exact") -> jax.Array:
    """Grouped NVFP4 GEMM: one GEMM per group (expert), group sizes on the device.

    Same semantics as :func:`jax_nvfp4.ops.reference.grouped_gemm`.

    Args:
      lhs: bfloat16 ``[M, K]`` (weights-only NVFP4, "W4A16") or an NVFP4Tensor ``[M, K]`` with a
        scalar global scale, e.g. from :func:`jax_nvfp4.stage_activation` ("W4A4"). The reference
        backend, and every backend with ``precision="fp8"``, also takes float16/float32 lhs; the
        exact custom call takes bf16 only.
      rhs: NVFP4Tensor ``[G, N, K]``: data uint8 ``[G, N, K/2]``, scales float8_e4m3fn
        ``[G, N, K/16]``, global_scale float32 ``[G]``; ``rhs.layout`` "checkpoint" or "sm90"
        (from :func:`jax_nvfp4.prepare_weights`: every CUDA kernel reads it, with fewer
        instructions; with ``kernel="mma"`` a W4A4 lhs is a ValueError, since that choice keeps
        W4A4 native and no kernel reads packed activations with sm90 weights) Or a qwix NVFP4
        ``QArray`` ``[G, K, N]`` tiled along K (converted on each call by
        :func:`jax_nvfp4.maths.qwix_interop.from_qwix`; convert once to keep that out of the step).
      group_sizes: int32 ``[G]`` (or a list, tuple or array of other integers whose values fit
        int32; a concrete value that does not is a ValueError); rows are grouped consecutively in
        group order. Negative sizes count as 0 and the running sum is clamped to M.
      out_dtype: bfloat16 or float32 (accumulation is always float32).
      backend: "ffi" (the custom call for the platform the arrays live on), "reference", or
        "auto" (ffi when the extension is built for this platform, else the reference with a
        one-time warning).
      rows_hint: optional static int, the expected number of rows inside the groups when it is
        much smaller than M (e.g. under expert parallelism, where M counts every routed row but
        only the local experts' rows are grouped). It only steers the CUDA kernel and tile choice;
        results do not depend on it (values at or above M mean M).
      kernel: which CUDA kernel configuration runs (backend "ffi"; see
        :mod:`jax_nvfp4.config.kernel_config`): None for the heuristic's choice for this device and
        problem (or the ``JAX_NVFP4_KERNEL`` environment variable's family, an override), a
        family name (:data:`jax_nvfp4.config.kernel_config.FAMILIES`: an exact family, or with
        precision="fp8" one of the FP8 families) at that family's token-tile rule, or a
        :class:`~jax_nvfp4.config.kernel_config.KernelConfig` from ``kernel_configs()``. The choice is
        lowered into the custom call's attributes; the CPU handler checks it and ignores it.
        Results do not depend on it beyond float32 summation order.
      precision: "exact" (default: the products of the NVFP4 values, float32 accumulation) or
        "fp8" (K % 128 == 0): activations rounded to e4m3 with a power-of-two float32 scale per
        row and 128-wide k chunk, weights to e4m3 (``e2m1 * scale / 8``), FP8 tensor-core
        products promoted to float32 every 128 k (:mod:`jax_nvfp4.ops.fp8`; docs/usage.md, "The FP8
        compute mode"). A W4A4 lhs is dequantized exactly (without its global scale) and rounded the
        same way; a :class:`jax_nvfp4.maths.formats.Fp8Rows` lhs (:func:`jax_nvfp4.ops.fp8.quantize_rows`)
        is used as it is. The rhs may then also be :class:`jax_nvfp4.maths.formats.Fp8Weights`
        (``prepare_weights(w, "fp8")``: the e4m3 weights made once; the same numbers as ``w``,
        bit for bit on the CPU handler and the reference; on the GPU their own kernel,
        ``wgmma_fp8_prepared``, whose chunk sums run in the tensor cores as ``wgmma_fp8``'s
        do). On the GPU it needs an sm_90 device and checkpoint-layout NVFP4 weights or
        Fp8Weights (sm90 ones are a ValueError); the CPU handler and the reference use the same
        operand bytes and differ only in the order of each chunk's float32 sum: within
        ``2 * (K/128 + 130) * 2^-24`` times the sum of the products' magnitudes
        (:mod:`jax_nvfp4.ops.fp8`).

    On the GPU, W4A4 runs as a fused exact dequantization of the activations to bf16 followed by
    the W4A16 kernel (transient bf16 copy of lhs, ``2 * M * K`` bytes); on the CPU, and with
    ``kernel="mma"`` (or a KernelConfig of that family), the custom call takes W4A4 natively.

    Gradients: reverse mode (``jax.grad``, ``jax.vjp``) with respect to a float lhs, on every
    backend: row r of group g gets ``alpha_g * dy[r] @ W_g`` (:func:`jax_nvfp4.ops.autodiff.lhs_cotangent`,
    pure jnp on the dequantized weights: the custom call has no transposed-weight kernel). The
    weights get zero cotangents (frozen); an NVFP4 lhs has no derivative (with backend "ffi",
    differentiating through it raises).

    Returns:
      ``[M, N]`` out_dtype; row r of group g is ``alpha_g * lhs[r] @ W_g.T`` with ``alpha_g = lhs
      global scale * rhs.global_scale[g]`` applied in the epilogue; rows past the groups are 0.
    """
    rhs = qwix_interop.as_nvfp4(rhs, "rhs")
    rows_hint = check_rows_hint(rows_hint)
    precision = check_precision(precision)           # checked once: passed down as a Precision
    gemm_args.check_lhs_precision(lhs, precision)
    gemm_args.check_rhs_precision(rhs, precision)
    return checked_grouped_gemm(lhs, rhs, group_sizes, out_dtype=out_dtype,
                                backend=resolve_backend(backend), rows_hint=rows_hint,
                                kernel=kernel, precision=precision)


@autodiff.differentiable_lhs
def checked_grouped_gemm(lhs, rhs: NVFP4Tensor, group_sizes: jax.Array, *, out_dtype,
                         backend: Backend, rows_hint: int, kernel, precision: Precision) -> jax.Array:
    """:func:`grouped_gemm` with its options checked by the caller and not checked again:
    ``backend`` resolved (:func:`jax_nvfp4.config.options.resolve_backend`), ``precision`` a
    :class:`~jax_nvfp4.config.options.Precision` that ``lhs`` and ``rhs`` were checked against
    (``gemm_args.check_lhs_precision``/``check_rhs_precision``), ``rows_hint`` an int >= 0, ``rhs``
    an NVFP4Tensor or Fp8Weights. The layer calls this; the operands' shapes are checked here."""
    if backend == "reference":
        return reference.checked_grouped_gemm(lhs, rhs, group_sizes, out_dtype=out_dtype,
                                              precision=precision)
    # fp8 quantizes the activations before the GEMM call (the quantizer's custom call, or jnp for
    # an lhs it does not take): any float lhs dtype works.
    m, k, g, n = gemm_args.validate_gemm_args(
        lhs, rhs, group_sizes, out_dtype,
        float_lhs_dtypes=None if precision == "fp8" else (jnp.bfloat16,))
    if precision == "fp8":
        check_fp8_k(k)
    group_sizes = gemm_args.check_group_sizes(group_sizes, g)
    m_choice, rows_hint = _rows_for_choice(m, rows_hint, g)
    if precision == "fp8":
        if m == 0:
            return jnp.zeros((0, n), jnp.dtype(out_dtype))
        rhs_gs = jnp.broadcast_to(rhs.global_scale.astype(jnp.float32), (g,))
        return _fp8_ffi(lhs, rhs, group_sizes, rhs_gs, jnp.dtype(out_dtype), kernel, m_choice, n,
                        k, g, rows_hint, precision)
    mma = _mma_requested(lhs, rhs, kernel)
    code = LAYOUT_CODES[rhs.layout]
    shape: dict[str, Any] = dict(rows_hint=int(rows_hint), rhs_layout=rhs.layout, precision=precision)
    out_dtype = jnp.dtype(out_dtype)
    rhs_gs = jnp.broadcast_to(rhs.global_scale.astype(jnp.float32), (g,))
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    no_sf = jnp.zeros((0,), jnp.float8_e4m3fn)
    if not isinstance(lhs, NVFP4Tensor):
        config = kernel_config.resolve(kernel, m_choice, n, k, g, **shape)
        return _grouped_gemm_op(jnp.asarray(lhs), no_sf, rhs.data, rhs.scales, rhs_gs, group_sizes,
                                out_dtype, config, code)
    alpha = lhs.global_scale.astype(jnp.float32) * rhs_gs
    # the native route runs on the CPU only unless kernel "mma" was asked for (and the CPU
    # handler checks the configuration but ignores it), so a wgmma request still lowers
    native_config = kernel_config.resolve(kernel if mma else None, m_choice, n, k, g, w4a4=True,
                                          **shape)
    args = (lhs.data, lhs.scales, rhs.data, rhs.scales, alpha, group_sizes)
    if mma:                                           # the mma kernel reads packed activations
        native, _ = _w4a4_routes(out_dtype, native_config, native_config, rhs.layout)
        return native(*args)
    bf16_config = kernel_config.resolve(kernel, m_choice, n, k, g, **shape)
    native, via_bf16 = _w4a4_routes(out_dtype, native_config, bf16_config, rhs.layout)
    return jax.lax.platform_dependent(*args, cpu=native, default=via_bf16)


GLU_TARGET = _extension.target_name("jax_nvfp4_grouped_gemm_glu")
"""The gate/up GEMM with the SwiGLU in its epilogue (docs/design.md, "The fused SwiGLU epilogue")."""


def _ffi_grouped_gemm_glu(lhs, lhs_scales, rhs_data, rhs_scales, alpha, group_sizes, row_scale,
                          out_dtype, config, rhs_layout, glu_limit):
    # out [M, N/2]; the CPU handler decodes a gate and an up row's codes
    return _ffi_call(GLU_TARGET, (lhs, lhs_scales, rhs_data, rhs_scales, alpha, group_sizes, row_scale),
                     rhs_data.shape[1] // 2, out_dtype, 2, config, rhs_layout,
                     glu_limit=np.float32(glu_limit))


@functools.partial(jax.custom_jvp, nondiff_argnums=(7, 8, 9, 10))
def _grouped_gemm_glu_op(lhs, lhs_scales, rhs_data, rhs_scales, alpha, group_sizes, row_scale,
                         out_dtype, config, rhs_layout, glu_limit):
    """The fused custom call: ``rhs_data`` rows paired, ``alpha`` float32 ``[2G]`` (gate, up)
    factors per group, ``row_scale`` float32 ``[M]`` or ``[0]``, ``glu_limit`` a float (inf: none)."""
    return _ffi_grouped_gemm_glu(lhs, lhs_scales, rhs_data, rhs_scales, alpha, group_sizes,
                                 row_scale, out_dtype, config, rhs_layout, glu_limit)


@_grouped_gemm_glu_op.defjvp
def _grouped_gemm_glu_jvp(out_dtype, config, rhs_layout, glu_limit, primals, tangents):
    raise NotImplementedError(
        "jax_nvfp4.grouped_gemm_swiglu (backend 'ffi'): the fused custom call has no derivative. "
        "Differentiate the unfused computation instead (jax_nvfp4.grouped_gemm of the paired "
        "weights, then the SwiGLU on the paired columns); jax_nvfp4.moe does that in its backward.")


def grouped_gemm_swiglu(lhs, rhs: NVFP4Tensor, group_sizes: jax.Array, *, row_scale=None,
                        limit=None, out_dtype=jnp.bfloat16, backend: str = "auto",
                        rows_hint: int | None = None,
                        kernel: str | KernelConfig | None = None) -> jax.Array:
    """The gate/up grouped GEMM with the (clamped) SwiGLU in its epilogue: ``[M, K] -> [M, I]``.

    Same semantics as :func:`jax_nvfp4.ops.reference.grouped_gemm_swiglu`; exact precision only.

    Args:
      lhs: bfloat16 ``[M, K]`` (W4A16) or an NVFP4Tensor ``[M, K]`` with a scalar global scale
        (W4A4); the reference backend also takes float16/float32.
      rhs: NVFP4Tensor ``[G, N, K]``, ``N = 2I`` a multiple of 16, rows in the paired gate/up
        order (:func:`jax_nvfp4.maths.layout.pair_gate_up`; ``prepare_weights`` of a MoEWeights gives
        it), "checkpoint" or "sm90" layout; global_scale float32 ``[G]`` or ``[G, 2]`` (gate, up).
      group_sizes: int32 ``[G]``, as for :func:`grouped_gemm`.
      row_scale: None, or float32 ``[M]``: multiplies row r's GEMM output before the SwiGLU
        (e.g. a dynamic per-row activation global scale).
      limit: None, or a static number > 0: ``silu(min(gate, L)) * clip(up, -L, L)``.
      out_dtype: bfloat16 (default) or float32.
      backend, rows_hint, kernel: as for :func:`grouped_gemm` (the kernel configuration is the one
        the plain call picks for the same M, N, K, G and layout).

    The custom call's epilogue computes, per row r of group g and paired column pair, ``h =
    acc * alpha_half`` (``alpha_half`` = lhs global scale * rhs global scale of the half), then
    ``h * row_scale[r]``, then the SwiGLU in float32 (the CUDA kernels' exp and reciprocal are the
    hardware approximations, ~1e-6 relative), and writes ``[M, I]`` only (no float32 ``[M, 2I]``
    intermediate). On the GPU a W4A4 lhs is dequantized exactly to bf16 first (as in
    :func:`grouped_gemm`); on the CPU it is read natively.

    Gradients: none on backend "ffi" (differentiating raises NotImplementedError);
    :func:`jax_nvfp4.moe` differentiates its fused path through the unfused computation.

    Returns:
      ``[M, N/2]`` out_dtype; rows past the groups are 0.
    """
    return checked_grouped_gemm_swiglu(lhs, rhs, group_sizes, row_scale=row_scale, limit=limit,
                                       out_dtype=out_dtype, backend=resolve_backend(backend),
                                       rows_hint=check_rows_hint(rows_hint), kernel=kernel)


def checked_grouped_gemm_swiglu(lhs, rhs: NVFP4Tensor, group_sizes: jax.Array, *, row_scale, limit,
                                out_dtype, backend: Backend, rows_hint: int, kernel) -> jax.Array:
    """:func:`grouped_gemm_swiglu` with ``backend`` resolved and ``rows_hint`` an int >= 0 by the
    caller (not checked again); the operands are checked here."""
    if backend == "reference":
        return reference.grouped_gemm_swiglu(lhs, rhs, group_sizes, row_scale=row_scale,
                                             limit=limit, out_dtype=out_dtype)
    m, k, g, n, alpha2, row_scale, lim = gemm_args.validate_swiglu_args(
        lhs, rhs, group_sizes, out_dtype, row_scale, limit, float_lhs_dtypes=(jnp.bfloat16,))
    group_sizes = gemm_args.check_group_sizes(group_sizes, g)
    mma = _mma_requested(lhs, rhs, kernel)
    out_dtype = jnp.dtype(out_dtype)
    if m == 0:
        return jnp.zeros((0, n // 2), out_dtype)
    m_choice, rows_hint = _rows_for_choice(m, rows_hint, g)
    code = LAYOUT_CODES[rhs.layout]
    shape: dict[str, Any] = dict(rows_hint=int(rows_hint), rhs_layout=rhs.layout, precision=EXACT)
    no_sf = jnp.zeros((0,), jnp.float8_e4m3fn)
    rs = jnp.zeros((0,), jnp.float32) if row_scale is None else row_scale

    def call(a, a_sf, al, config):
        return _grouped_gemm_glu_op(a, a_sf, rhs.data, rhs.scales, al.reshape(-1), group_sizes,
                                    rs, out_dtype, config, code, lim)

    if not isinstance(lhs, NVFP4Tensor):
        return call(jnp.asarray(lhs), no_sf, alpha2, kernel_config.resolve(kernel, m_choice, n, k,
                                                                           g, **shape))
    alpha2 = lhs.global_scale.astype(jnp.float32) * alpha2
    native_config = kernel_config.resolve(kernel if mma else None, m_choice, n, k, g, w4a4=True,
                                          **shape)

    def native(a, a_sf, al):
        return call(a, a_sf, al, native_config)

    if mma:                                           # the mma kernel reads packed activations
        return native(lhs.data, lhs.scales, alpha2)
    bf16_config = kernel_config.resolve(kernel, m_choice, n, k, g, **shape)

    def via_bf16(a, a_sf, al):
        # As in _w4a4_routes: an exact dequantization to bf16 (global scale kept in alpha).
        a16 = quantization.e2m1_scaled(NVFP4Tensor(a, a_sf, jnp.float32(1.0)), jnp.bfloat16)
        return call(a16, no_sf, al, bf16_config)

    return jax.lax.platform_dependent(lhs.data, lhs.scales, alpha2, cpu=native, default=via_bf16)
