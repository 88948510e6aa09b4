"""Preparing weights for the kernels, once, at load time: :func:`prepare_weights`.

The byte layouts themselves (and why the sm90 one exists) are in :mod:`jax_nvfp4.maths.layout`.
"""

from __future__ import annotations

import dataclasses

from ..maths.formats import Fp8Weights, NVFP4Tensor
from .fp8 import prepare_fp8
from ..maths.layout import pair_gate_up, relayout, unpair_gate_up
from ..config.moe_params import MoEWeights
from ..config.options import FP8_LAYOUT, WEIGHT_LAYOUTS, check_choice
from ..maths.qwix_interop import as_nvfp4, weights_from_qwix

__all__ = ["prepare_weights"]


def prepare_weights(x, layout: str = "sm90"):
    """Re-lay-out NVFP4 weights' code bytes for a kernel, once, at load time.

    Args:
      x: an :class:`~jax_nvfp4.NVFP4Tensor` ``[..., N, K]`` (data uint8 ``[..., N, K/2]``, scales
        float8_e4m3fn ``[..., N, K/16]``, global_scale float32), or a
        :class:`~jax_nvfp4.MoEWeights` (each NVFP4Tensor field is converted: w13 ``[E, 2I, H]``,
        w2 ``[E, H, I]``, shared_w13 ``[2Is, H]``, shared_w2 ``[H, Is]``; other fields kept).
        A qwix NVFP4 ``QArray`` (alone or as a MoEWeights field, as :func:`jax_nvfp4.moe` takes
        it) is converted by :func:`jax_nvfp4.maths.qwix_interop.from_qwix` first (a MoEWeights field
        by :func:`~jax_nvfp4.maths.qwix_interop.weights_from_qwix`: w13 ``[E, H, 2I]`` tiled along H
        becomes ``[E, 2I, H]``), and the result is an NVFP4Tensor or Fp8Weights.
      layout: ``"sm90"`` (default; the Hopper kernels' layout, needs N % 128 == 0 and
        K % 64 == 0 on each tensor's last two axes), ``"checkpoint"`` (back to the stored order),
        or ``"fp8"``: the weights of the FP8 compute mode (``precision="fp8"``) made once, as
        e4m3 (:class:`~jax_nvfp4.maths.formats.Fp8Weights`; needs K % 128 == 0).

    Returns:
      For ``"sm90"`` and ``"checkpoint"``: the same type with ``data`` and ``scales`` permuted
      (same shapes and dtypes) and ``layout`` set; global scales are untouched. A tensor already
      in ``layout`` is returned as is.

      For ``"fp8"``: each NVFP4 tensor becomes an :class:`~jax_nvfp4.maths.formats.Fp8Weights`: codes
      float8_e4m3fn ``[..., N, K]``, ``e4m3(e2m1 * block scale / 8)`` with k in the kernel order
      inside each 128-wide chunk, and the same global scale (the epilogue multiplies by it times
      8). A grouped GEMM or MoE layer in the FP8 mode gives the same numbers on them as on the
      NVFP4 weights (bit for bit on each backend), and the CUDA kernel on them loads both
      operands by TMA instead of decoding NVFP4 (faster for prefill-sized batches). They take 8
      bits per weight against NVFP4's 4.5 and serve the FP8 mode only (the exact mode and
      :func:`jax_nvfp4.grouped_gemm_swiglu` refuse them); the rounding is not invertible, so
      converting them back (``"checkpoint"``, ``"sm90"``) is a ValueError: keep the NVFP4 weights
      for that. A MoEWeights keeps its row order (``w13_paired`` unchanged). Tensors already
      prepared are returned as they are.
      For a MoEWeights, ``"sm90"`` also puts the rows of w13 and shared_w13 in the paired
      gate/up order (:func:`jax_nvfp4.maths.layout.pair_gate_up`, ``w13_paired=True``), so that the layer runs the
      SwiGLU in the gate/up GEMM's epilogue; ``"checkpoint"`` restores the stored row order
      (``w13_paired=False``).

    Why: the kernels' mainloops are bound by turning E2M1 codes into bf16 MMA fragments and by
    streaming the weights; the sm90 layout stores each thread's codes contiguously with their bits
    pre-placed, each 128 x 64 block as one 4 KB run and each k-tile's 128 x 4 scales as one
    512-byte run (module docstring): faster than the checkpoint layout at every size on an H200
    (docs/benchmarks.md). It is a
    one-time cost at load time, moves the same bytes (no extra memory once done), and is a
    bijection: ``prepare_weights(w, "checkpoint")`` recovers the checkpoint bytes exactly
    (``checkpoint.save_moe`` does that itself). Jittable (``layout`` is static). Stacks are
    converted one matrix at a time (``lax.map``): transient memory about twice one expert's
    ``data``. Stacks split over devices along the expert axis (e.g. by
    :func:`jax_nvfp4.shard_moe_weights`) are converted where they lie (``shard_map``), keeping
    their sharding, when called eagerly (as at load time) or under ``jit`` with explicit mesh
    axes; under ``jit`` with Auto axes a tracer carries no sharding and XLA places the result.
    A split along N or K is a ValueError.
    """
    check_choice(layout, WEIGHT_LAYOUTS, "layout")
    # qwix NVFP4 QArrays (which jax_nvfp4.moe takes) are converted first, so that they are
    # prepared (and w13 paired) like the NVFP4Tensor they stand for, not skipped
    x = weights_from_qwix(as_nvfp4(x, "x"))
    if isinstance(x, (NVFP4Tensor, Fp8Weights)):
        return _prepare_tensor(x, layout, "x")
    if isinstance(x, MoEWeights) and layout == FP8_LAYOUT:
        new = {f.name: _prepare_tensor(getattr(x, f.name), layout, f"x.{f.name}")
               for f in dataclasses.fields(x)
               if isinstance(getattr(x, f.name), (NVFP4Tensor, Fp8Weights))}
        return dataclasses.replace(x, **new)
    if isinstance(x, MoEWeights):
        paired = layout == "sm90"
        new = {}
        for f in dataclasses.fields(x):
            v = getattr(x, f.name)
            if isinstance(v, Fp8Weights):
                _prepare_tensor(v, layout, f"x.{f.name}")           # raises: not invertible
            if not isinstance(v, NVFP4Tensor):
                continue
            name = f"x.{f.name}"
            if f.name in ("w13", "shared_w13") and x.w13_paired != paired:
                if paired:      # pair in the checkpoint layout, then lay out once
                    v = relayout(pair_gate_up(v, name), layout, name)
                else:           # back to checkpoint bytes first, then the stored row order
                    v = unpair_gate_up(relayout(v, layout, name), name)
            new[f.name] = relayout(v, layout, name)
        return dataclasses.replace(x, w13_paired=paired, **new)
    raise ValueError(f"x: expected an NVFP4Tensor, Fp8Weights or a MoEWeights, got "
                     f"{type(x).__name__}")


def _prepare_tensor(t, layout: str, name: str):
    """One tensor (NVFP4Tensor or Fp8Weights) in ``layout``; errors name it ``name``."""
    if isinstance(t, Fp8Weights):
        if layout != FP8_LAYOUT:
            raise ValueError(f"{name}: Fp8Weights (weights prepared as e4m3 for precision='fp8') "
                             f"cannot be converted to layout {layout!r}: their e4m3 rounding of "
                             "e2m1 * block scale is not invertible; prepare from the NVFP4 weights")
        return t.validate(name)
    if layout == FP8_LAYOUT:
        return prepare_fp8(t, name)
    return relayout(t, layout, name)
