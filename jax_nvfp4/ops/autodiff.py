"""Gradients with respect to the activations through GEMMs with frozen NVFP4 weights.

NVFP4 weights are inference weights: nothing here differentiates them. What a model around a
frozen NVFP4 layer needs is the cotangent of the layer's *input*, and for the grouped GEMM that is
a linear map of the output cotangent alone: row ``r`` of group ``g`` gets
``alpha_g * dy[r] @ W_g`` (``W_g`` the dequantized weights, ``alpha_g`` the global scale).

The backward pass computes exactly that in pure jnp (``jax.lax.ragged_dot`` on the dequantized
weights, float32 accumulation) on every backend. The custom call's kernels read the weights as
``[N, K]`` only (no transposed-weight variant), so the backward is not a custom call: on the GPU
it is XLA's dequantize + ragged_dot, slower than the forward kernel and holding a float32 copy of
the weights while it runs.

Whatever quantizes or rounds the GEMM input inside the forward (the bf16 cast of W4A16, the NVFP4
quantization of W4A4) is treated as the identity in the backward: a straight-through estimator.
The weights (codes, block scales, global scales), group sizes and any auxiliary inputs get zero
cotangents.

First-order reverse mode only. Forward mode (``jax.jvp``, ``jax.jacfwd``, ``jax.linearize``, at
the call) and second order (grad of grad, ``jax.hessian``) raise TypeError (:data:`FORWARD_MODE`,
:data:`SECOND_ORDER`): the backward is a rule for the first derivative, not a differentiable
function of x. Applied to a function already wrapped in ``jax.jit``, forward mode meets the
traced program, not this package: JAX's own forward-mode TypeError.

An input quantized *outside* the GEMM (:func:`jax_nvfp4.quantize`) has no derivative (raises): a
straight-through estimator needs the float input, so pass x and quantize it inside ``forward``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..maths.formats import FP8_WEIGHT_SHIFT, Fp8Rows, Fp8Weights, NVFP4Tensor
from ..maths.quantization import e2m1_scaled, refuse_derivative
from .gemm_args import check_group_sizes, group_bounds, row_groups
from ..maths.varying import varying_axes


@jax.custom_batching.custom_vmap
def _ragged_dot(d, w, sizes):
    """``jax.lax.ragged_dot`` in float32 that also batches when only some operands are batched."""
    return jax.lax.ragged_dot(d, w, sizes, precision=jax.lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32)


@_ragged_dot.def_vmap
def _ragged_dot_vmap(axis_size, in_batched, d, w, sizes):
    # ragged_dot's own batching rule needs every operand batched (the weights would be copied
    # per batch element); one call per element instead, as the custom call's vmap does.
    def one(i):
        pick = lambda v, batched: v[i] if batched else v  # noqa: E731
        return _ragged_dot(*(pick(v, b) for v, b in zip((d, w, sizes), in_batched)))

    return jax.lax.map(one, jnp.arange(axis_size)), True


def lhs_cotangent(dy: jax.Array, rhs: NVFP4Tensor, group_sizes: jax.Array) -> jax.Array:
    """The cotangent of a grouped GEMM's float lhs, pure jnp.

    Args:
      dy: float ``[M, N]``, the output cotangent.
      rhs: NVFP4Tensor ``[G, N, K]`` (either layout), global_scale ``[G]`` or ``[]``; or
        :class:`~jax_nvfp4.maths.formats.Fp8Weights` (then ``W`` is its e4m3 values times 8, the
        weights the fp8 forward computes with).
      group_sizes: int32 ``[G]`` (negative sizes count as 0, the running sum is clamped to M).

    Returns:
      float32 ``[M, K]``: row r of group g is ``rhs.global_scale[g] * dy[r] @ e2m1_scaled(rhs[g])``
      (float32 accumulation); rows past the groups are 0; the rows of a group whose weights hold a
      NaN are NaN (as that group's forward rows are).
    """
    m = dy.shape[0]
    g = rhs.shape[0]
    if isinstance(rhs, Fp8Weights):                  # the e4m3 weights the forward used, exact
        w = rhs.logical_codes().astype(jnp.float32) * jnp.float32(2.0**FP8_WEIGHT_SHIFT)
    else:
        w = e2m1_scaled(rhs, jnp.float32)                        # [G, N, K], exact
    alpha = jnp.broadcast_to(rhs.global_scale.astype(jnp.float32), (g,))
    starts, ends = group_bounds(group_sizes, m)
    gid, valid = row_groups(ends, m)
    d = jnp.where(valid[:, None], dy.astype(jnp.float32) * alpha[gid][:, None], 0.0)
    # As in reference.grouped_gemm: ragged_dot may mix groups through products with 0, so it runs
    # on finite weights and a group with a NaN weight gets NaN rows back.
    nan = jnp.isnan(w)
    dx = _ragged_dot(d, jnp.where(nan, 0.0, w), (ends - starts).astype(jnp.int32))
    return jnp.where((jnp.any(nan, axis=(1, 2))[gid] & valid)[:, None], jnp.nan, dx)


def sum_to_varying_axes_of(ct, primal):
    """``ct`` summed (``psum``) over the manual axes along which it varies and ``primal`` does
    not: the cotangent of a value that is the same on every device of those axes (replicated)
    and was used by each of them is the sum of their cotangents. Outside ``shard_map``, ``ct``."""
    extra = varying_axes(ct) - varying_axes(primal)
    return jax.lax.psum(ct, tuple(sorted(extra))) if extra else ct


FORWARD_MODE = (
    "jax_nvfp4: a grouped GEMM with frozen NVFP4 weights has a reverse-mode derivative only "
    "(jax.grad, jax.vjp, jax.jacrev; with respect to its float lhs). Forward mode (jax.jvp, "
    "jax.jacfwd, jax.linearize) is not supported: use jax.jacrev for a Jacobian.")
"""The TypeError message of forward-mode differentiation through :func:`frozen_weights`."""
SECOND_ORDER = (
    "jax_nvfp4: second-order derivatives (grad of grad, jax.hessian, jacfwd of grad) through a "
    "grouped GEMM with frozen NVFP4 weights are not supported with respect to its float lhs: its "
    "backward is a straight-through first-order rule (jax_nvfp4.ops.autodiff), not a differentiable "
    "function. First-order reverse mode (jax.grad, jax.vjp, jax.jacrev) works.")
"""The TypeError message of differentiating :func:`frozen_weights`' own derivative."""


def _is_forward_mode(x, error: Exception) -> bool:
    """Whether ``error``, raised by the custom_vjp call on ``x``, comes from forward-mode
    differentiation: JAX's own message for a custom_vjp under jvp, or x being a forward-mode
    tracer (under ``jax.jacfwd`` the forward runs under vmap first and can fail there)."""
    return ("forward-mode" in str(error) and "custom_vjp" in str(error)) or isinstance(
        x, jax.interpreters.ad.JVPTracer)


def _under_linearize(x) -> bool:
    """Whether ``x`` carries a tangent of ``jax.linearize`` (forward mode: its linear function is
    evaluated, never transposed). ``jax.vjp`` and ``jax.grad`` linearize too, then transpose:
    their trace says so (``is_vjp``). Looks through the tracers wrapping x (vmap's, jvp's)."""
    for _ in range(64):                         # a nesting depth no program reaches
        trace = getattr(x, "_trace", None)        # tracers only (jax.core.Tracer's attribute)
        if trace is None:
            return False
        if getattr(trace, "is_vjp", None) is False:
            return True
        x = getattr(x, "primal", getattr(x, "val", None))
    return False


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _frozen(forward, x, rhs, group_sizes, aux, gather):
    return forward(x, rhs, group_sizes, aux)


def _frozen_fwd(forward, x, rhs, group_sizes, aux, gather):
    # Only x's row count, dtype and varying manual axes are needed in the backward: keep an
    # empty [M, 0] slice of x (it has x's type but holds nothing), not x.
    proto = x[:, :0]
    # x carries a tangent here only when an outer transformation differentiates this rule.
    x = refuse_derivative(x, SECOND_ORDER)
    return forward(x, rhs, group_sizes, aux), (rhs, group_sizes, proto, gather)


def _frozen_bwd(forward, res, dy):
    rhs, group_sizes, x_proto, gather = res
    dx = lhs_cotangent(dy, rhs, group_sizes)
    if gather is not None:                     # the GEMM's rows were x[gather]: scatter-add back
        dx = jnp.zeros((x_proto.shape[0], dx.shape[1]), dx.dtype).at[gather].add(dx)
    # Under shard_map a replicated x (e.g. all tokens, before the dispatch gather) meets
    # device-varying weights or rows: its cotangent is the sum of the devices' ones.
    return sum_to_varying_axes_of(dx, x_proto).astype(x_proto.dtype), None, None, None, None


_frozen.defvjp(_frozen_fwd, _frozen_bwd)


def frozen_weights(forward, x: jax.Array, rhs: NVFP4Tensor, group_sizes: jax.Array, aux=None,
                   gather=None):
    """``forward(x, rhs, group_sizes, aux)`` with the straight-through backward of this module.

    Args:
      forward: a function returning ``[M, N]``, approximately ``x @ (alpha_g * W_g).T`` per group
        (a grouped GEMM of x, or of x rounded or quantized, with ``rhs``); it must not close over
        traced values (pass them in ``aux``).
      x: float ``[M, K]``, the only input that gets a cotangent: :func:`lhs_cotangent` of the
        output cotangent, in x's dtype.
      rhs, group_sizes: as for :func:`jax_nvfp4.grouped_gemm`; zero cotangents.
      aux: any pytree of arrays ``forward`` needs (scales, row ids); zero cotangents.
      gather: None, or int32 ``[R]`` when the GEMM's rows are ``x[gather]`` (``forward`` applies
        it itself, e.g. after quantizing each row of x once, and returns ``[R, N]``): the rows'
        cotangents are then summed back into x's ``[M, K]``.

    First-order reverse mode only (``jax.grad``, ``jax.vjp``, ``jax.jacrev``): forward mode
    raises TypeError(:data:`FORWARD_MODE`), second order TypeError(:data:`SECOND_ORDER`). Under
    ``jax.vmap`` the backward runs once per batch element (sequential, like the custom call).
    Inside ``jax.shard_map``, x's cotangent is summed over the manual axes along which it varies
    and x does not (:func:`sum_to_varying_axes_of`), e.g. a replicated x against sharded weights.
    """
    if _under_linearize(x):        # else linearize succeeds and its linear function fails
        raise TypeError(FORWARD_MODE)
    try:
        return _frozen(forward, x, rhs, group_sizes, aux, gather)
    except (TypeError, NotImplementedError) as e:
        if str(e) == SECOND_ORDER or not _is_forward_mode(x, e):
            raise
        raise TypeError(FORWARD_MODE) from e


def differentiable_lhs(gemm):
    """Wrap a grouped GEMM ``gemm(lhs, rhs, group_sizes, **static)`` so that a float lhs gets the
    cotangent of :func:`lhs_cotangent`, whatever backend computes the forward. An NVFP4Tensor or
    Fp8Rows lhs is passed through unchanged (its codes have no derivative)."""

    @functools.wraps(gemm)
    def wrapped(lhs, rhs, group_sizes, **kwargs):
        if isinstance(lhs, (NVFP4Tensor, Fp8Rows)) or not isinstance(rhs, (NVFP4Tensor,
                                                                             Fp8Weights)):
            return gemm(lhs, rhs, group_sizes, **kwargs)   # (bad rhs: gemm raises the error)
        # Checked here, before custom_vjp turns them into an int32 array (a wrap).
        group_sizes = check_group_sizes(group_sizes, rhs.shape[0])
        return frozen_weights(lambda a, w, gs, _: gemm(a, w, gs, **kwargs), lhs, rhs, group_sizes)

    return wrapped
