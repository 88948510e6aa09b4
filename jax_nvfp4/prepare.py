"""Preparing weights for the kernels, once, at load time: :func:`prepare_weights`.

The byte layouts themselves (and why the sm90 one exists) are in :mod:`jax_nvfp4.layout`.
"""

from __future__ import annotations

import dataclasses

from .formats import NVFP4Tensor
from .layout import pair_gate_up, relayout, unpair_gate_up
from .moe_params import MoEWeights
from .options import check_layout

__all__ = ["prepare_weights"]


def prepare_weights(x, layout: str = "sm90"):
    """Re-lay-out NVFP4 weights' code bytes for a kernel, once, at load time.

    Args:
      x: an :class:`~jax_nvfp4.NVFP4Tensor` ``[..., N, K]`` (data uint8 ``[..., N, K/2]``, scales
        float8_e4m3fn ``[..., N, K/16]``, global_scale float32), or a
        :class:`~jax_nvfp4.MoEWeights` (each NVFP4Tensor field is converted: w13 ``[E, 2I, H]``,
        w2 ``[E, H, I]``, shared_w13 ``[2Is, H]``, shared_w2 ``[H, Is]``; other fields kept).
      layout: ``"sm90"`` (default; the Hopper kernels' layout, needs N % 128 == 0 and
        K % 64 == 0 on each tensor's last two axes) or ``"checkpoint"`` (back to the stored order).

    Returns:
      The same type with ``data`` and ``scales`` permuted (same shapes and dtypes) and ``layout``
      set; global scales are untouched. A tensor already in ``layout`` is returned as is.
      For a MoEWeights, ``"sm90"`` also puts the rows of w13 and shared_w13 in the paired
      gate/up order (:func:`jax_nvfp4.layout.pair_gate_up`, ``w13_paired=True``), so that the layer runs the
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
    check_layout(layout)
    if isinstance(x, NVFP4Tensor):
        return relayout(x, layout, "x")
    if isinstance(x, MoEWeights):
        paired = layout == "sm90"
        new = {}
        for f in dataclasses.fields(x):
            v = getattr(x, f.name)
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
    raise ValueError(f"x: expected an NVFP4Tensor or a MoEWeights, got {type(x).__name__}")
