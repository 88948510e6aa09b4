"""Gradients wrt the lhs of the grouped GEMM (frozen NVFP4 weights), on every backend: JAX's
gradient checker on the reference path and a float64 numpy oracle on both backends."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_nvfp4 as jn
from jax_nvfp4 import autodiff
from oracles import dequant64, rel_err
from conftest import QUANTIZE_STACK
from test_gemm import platform_device

SIZES = [5, 0, -3, 9, 2]            # an empty group, a negative one; 4 rows past the groups


def problem(rng, m=20, n=24, k=64):
    w = rng.standard_normal((len(SIZES), n, k)).astype(np.float32) * rng.uniform(0.1, 4, (len(SIZES), 1, 1))
    rhs = QUANTIZE_STACK(jnp.asarray(w))
    x = rng.standard_normal((m, k)).astype(np.float32)
    ct = rng.standard_normal((m, n)).astype(np.float32)
    return x, rhs, jnp.asarray(SIZES, jnp.int32), ct


def lhs_cotangent64(ct, rhs, sizes):
    """float64: row r of group g gets gs_g * ct[r] @ W_g; rows past the groups 0."""
    w = dequant64(rhs.data, rhs.scales, rhs.global_scale)
    out = np.zeros((ct.shape[0], w.shape[2]))
    start = 0
    for g, size in enumerate(sizes):
        end = min(start + max(size, 0), ct.shape[0])
        out[start:end] = ct[start:end].astype(np.float64) @ w[g]
        start = end
    return out


def test_check_grads_reference(rng):
    x, rhs, gs, _ = problem(rng)
    f = lambda a: jn.grouped_gemm(a, rhs, gs, out_dtype=jnp.float32, backend="reference")  # noqa: E731
    # f is linear in a: a large finite-difference step has no truncation error, only less
    # float32 round-off than the default one
    check_grads(f, (jnp.asarray(x),), order=1, modes=["rev"], eps=0.1)
    check_grads(jax.jit(f), (jnp.asarray(x),), order=1, modes=["rev"], eps=0.1)


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
@pytest.mark.parametrize("backend", ["reference", "ffi"])
def test_lhs_cotangent_against_float64(rng, platform, backend):
    dev = platform_device(platform)
    x, rhs, gs, ct = problem(rng)
    x, rhs, gs = jax.device_put((jnp.asarray(x), rhs, gs), dev)
    dtype = jnp.bfloat16 if backend == "ffi" else jnp.float32      # the custom call takes bf16
    loss = lambda a, w: jnp.sum(jn.grouped_gemm(a.astype(dtype), w, gs, out_dtype=jnp.float32,  # noqa: E731
                                                backend=backend) * ct)
    got = np.asarray(jax.jit(jax.grad(loss))(x, rhs))
    ref = lhs_cotangent64(ct, rhs, SIZES)
    assert np.all(got[sum(s for s in SIZES if s > 0):] == 0)       # rows past the groups
    # float32 accumulation; a bf16 lhs gets its cotangent in bf16
    assert rel_err(got, ref) <= (1e-2 if dtype == jnp.bfloat16 else 1e-6)
    # weights closed over (compile-time constants) give the same; XLA may drop the bf16 round
    # trip of a bf16 lhs's cotangent there (excess precision allowed), so bf16 is compared within
    # its rounding
    got_c = np.asarray(jax.jit(jax.grad(lambda a: loss(a, rhs)))(x))
    if dtype == jnp.bfloat16:
        np.testing.assert_allclose(got_c, got, rtol=2**-8, atol=0)
    else:
        np.testing.assert_array_equal(got_c, got)


def test_weights_get_zero_cotangents(rng):
    x, rhs, gs, ct = problem(rng)
    g = jax.grad(lambda w: jnp.sum(jn.grouped_gemm(jnp.asarray(x), w, gs, out_dtype=jnp.float32,
                                                   backend="reference") * ct),
                 allow_int=True)(rhs)
    assert not np.any(np.asarray(g.global_scale)) and not np.any(np.asarray(g.scales, np.float32))


def test_grad_under_vmap(rng, on_cpu):
    platform_device("cpu")
    x, rhs, gs, ct = problem(rng)
    xs = jnp.stack([jnp.asarray(x), 2 * jnp.asarray(x)]).astype(jnp.bfloat16)
    cts = jnp.stack([ct, -ct])
    g = jax.vmap(jax.grad(lambda a, c: jnp.sum(jn.grouped_gemm(a, rhs, gs, out_dtype=jnp.float32,
                                                               backend="ffi") * c)))(xs, cts)
    ref = lhs_cotangent64(ct, rhs, SIZES)
    assert rel_err(g[0], ref) <= 1e-2 and rel_err(g[1], -ref) <= 1e-2


def test_frozen_weights_is_straight_through(rng):
    # The forward may round its input (here to a coarse grid); the backward ignores that.
    x, rhs, gs, ct = problem(rng)
    fwd = lambda a, w, s, _: jn.grouped_gemm(jnp.round(a * 2) / 2, w, s, out_dtype=jnp.float32,  # noqa: E731
                                             backend="reference")
    got = jax.grad(lambda a: jnp.sum(autodiff.frozen_weights(fwd, a, rhs, gs) * ct))(jnp.asarray(x))
    assert rel_err(got, lhs_cotangent64(ct, rhs, SIZES)) <= 1e-6
