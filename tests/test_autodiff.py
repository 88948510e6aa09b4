"""Gradients wrt the lhs of the grouped GEMM (frozen NVFP4 weights), on every backend: JAX's
gradient checker on the reference path and a float64 numpy oracle on both backends."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_nvfp4 as jn
from jax_nvfp4.ops import autodiff
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


# --- what has no derivative raises, naming the way that has one ---------------------------------

def test_quantize_refuses_differentiation(rng):
    x, rhs, gs, ct = problem(rng)
    x = jnp.asarray(x)
    no_derivative = pytest.raises(TypeError, match="no derivative with respect to x")
    with no_derivative:                         # not a silent zero gradient
        jax.grad(lambda a: jnp.sum(jn.dequantize(jn.quantize(a))))(x)
    with no_derivative:
        jax.jit(jax.grad(lambda a: jnp.sum(jn.stage_activation(a)[2])))(x)
    with no_derivative:                         # a traced static scale is refused too
        jax.grad(lambda s: jnp.sum(jn.dequantize(jn.quantize(x, s))))(jnp.float32(0.01))
    with no_derivative:
        jax.jvp(jn.quantize, (x,), (x,))
    for backend in ("reference", "ffi"):
        with no_derivative:
            jax.grad(lambda a: jnp.sum(jn.grouped_gemm(jn.quantize(a), rhs, gs, backend=backend,
                                                       out_dtype=jnp.float32)))(x)
    # no tangent reaching it: no error, and the value is unchanged
    got = jax.grad(lambda a: jnp.sum(a) + jnp.sum(jn.dequantize(
        jn.quantize(jax.lax.stop_gradient(a)))))(x)
    np.testing.assert_array_equal(got, np.ones_like(x))


def test_fp8_quantizers_refuse_differentiation(rng):
    x = jnp.asarray(rng.standard_normal((3, 128)), jnp.float32)
    for f in (lambda a: jn.fp8.quantize_rows(a).scales,
              lambda a: jn.fp8.quantize_activations_fp8(a)[0].astype(jnp.float32)):
        with pytest.raises(TypeError, match="no derivative"):
            jax.grad(lambda a: jnp.sum(f(a)))(x)


@pytest.mark.parametrize("backend", ["reference", "ffi"])
def test_straight_through_recipe_against_float64(rng, backend):
    # The documented straight-through way for W4A4: quantize inside frozen_weights' forward.
    # Oracle: the straight-through cotangent gs_g * ct @ W_g in float64.
    x, rhs, gs, ct = problem(rng)
    fwd = lambda a, w, s, _: jn.grouped_gemm(jn.quantize(a), w, s, out_dtype=jnp.float32,  # noqa: E731
                                             backend=backend)
    loss = lambda a: jnp.sum(autodiff.frozen_weights(fwd, a, rhs, gs) * ct)  # noqa: E731
    got = jax.jit(jax.grad(loss))(jnp.asarray(x))
    assert rel_err(got, lhs_cotangent64(ct, rhs, SIZES)) <= 1e-6
    # the fake-quantized value's idiom of quantization.py is the identity in the derivative
    def fake(a):
        stopped = jax.lax.stop_gradient(a)
        return a + (jn.dequantize(jn.quantize(stopped)) - stopped)

    np.testing.assert_array_equal(jax.grad(lambda a: jnp.sum(fake(a) * x))(jnp.asarray(x)), x)


def _layer_gemm(backend, rhs, gs):
    cast = jnp.bfloat16 if backend == "ffi" else jnp.float32     # the custom call takes bf16
    return lambda a: jn.grouped_gemm(a.astype(cast), rhs, gs, out_dtype=jnp.float32,
                                     backend=backend)


@pytest.mark.parametrize("backend", ["reference", "ffi"])
def test_forward_mode_is_a_clear_error(rng, backend):
    x, rhs, gs, _ = problem(rng, m=4)
    x = jnp.asarray(x)
    f = _layer_gemm(backend, rhs, gs)
    # (jacfwd runs the forward under vmap: the reference's vmap message must not show)
    for call in (lambda: jax.jacfwd(f)(x), lambda: jax.jit(jax.jacfwd(f))(x),
                 lambda: jax.jvp(f, (x,), (x,))):
        with pytest.raises(TypeError, match="reverse-mode derivative only"):
            call()
    # jit(jvp) fails when compiling the tangent, outside this package: JAX's own message
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jit(lambda a: jax.jvp(f, (a,), (a,)))(x)
    assert jax.jacrev(f)(x).shape == (4, 24, 4, 64)


@pytest.mark.parametrize("backend", ["reference", "ffi"])
def test_second_order_is_a_clear_error(rng, backend):
    x, rhs, gs, _ = problem(rng, m=4)
    x = jnp.asarray(x)
    f = _layer_gemm(backend, rhs, gs)
    loss = lambda a: jnp.sum(f(a) ** 2)  # noqa: E731
    # (not the ffi op's message about an NVFP4 lhs, nor JAX's "Linearization failed")
    for call in (lambda: jax.grad(lambda a: jnp.sum(jax.grad(loss)(a) ** 2))(x),
                 lambda: jax.jit(jax.hessian(loss))(x)):
        with pytest.raises(TypeError, match="second-order derivatives") as info:
            call()
        assert "NVFP4 lhs" not in str(info.value)
    # under jax.checkpoint the derivative is still first order: no error
    ref = jax.grad(loss)(x)
    np.testing.assert_array_equal(jax.grad(jax.checkpoint(loss))(x), ref)


@pytest.mark.parametrize("backend", ["reference", "ffi"])
def test_linearize_is_refused_at_the_call(rng, backend):
    """jax.linearize is forward mode: refused with the library's TypeError when it is called
    (as jax.jvp and jax.jacfwd are), not later by JAX's generic message when its linear
    function runs; jax.vjp (also a linearization, then transposed) keeps working."""
    x, rhs, gs, _ = problem(rng, m=4)
    x = jnp.asarray(x)
    f = _layer_gemm(backend, rhs, gs)
    for call in (lambda: jax.linearize(f, x),
                 lambda: jax.jit(lambda a: jax.linearize(f, a)[1](a))(x),
                 lambda: jax.linearize(jax.vmap(f), x[None])):
        with pytest.raises(TypeError, match="reverse-mode derivative only"):
            call()
    y, pullback = jax.vjp(f, x)
    assert pullback(y)[0].shape == x.shape


@pytest.mark.slow
def test_linearize_through_the_layer_is_refused_at_the_call(rng):
    c = jn.MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=32)
    r = lambda *s: rng.standard_normal(s) * 0.1  # noqa: E731
    w = jn.quantize_moe(r(4, 64), r(4, 64, 64), r(4, 64, 32))
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    with pytest.raises(TypeError, match="reverse-mode derivative only"):
        jax.linearize(lambda a: jn.moe(a, w, c), x)
    assert jax.grad(lambda a: jn.moe(a, w, c).sum())(x).shape == x.shape



def test_lhs_cotangent_of_fp8_weights():
    """Through prepare_weights(w, "fp8") the lhs cotangent is ``global_scale[g] * dy[r] @ W[g]``
    with W the prepared weights' value (formats.Fp8Weights: e4m3(e2m1 * scale * 2^-3) * 2^3,
    the weights the fp8 forward computes with); rows past the groups are 0."""
    import ml_dtypes  # noqa: PLC0415

    rng = np.random.default_rng(58)
    w = QUANTIZE_STACK(jnp.asarray(rng.standard_normal((2, 128, 128)), jnp.float32))
    gsc = np.asarray([0.5, 2.0], np.float32)
    w = jn.NVFP4Tensor(w.data, w.scales, jnp.asarray(gsc))
    e2m1_times_scale = np.asarray(jn.dequantize(jn.NVFP4Tensor(w.data, w.scales, jnp.ones(2))),
                                  np.float32)
    wv = (e2m1_times_scale / 8).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * 8
    dy = rng.standard_normal((10, 128)).astype(np.float32)
    gid = np.asarray([0] * 4 + [1] * 5)
    want, scale = np.zeros((10, 128)), np.ones((10, 128))
    want[:9] = gsc[gid][:, None] * np.einsum("rn,rnk->rk", dy[:9].astype(np.float64), wv[gid])
    scale[:9] = gsc[gid][:, None] * np.einsum("rn,rnk->rk", np.abs(dy[:9]), np.abs(wv[gid]))
    got = jax.jit(autodiff.lhs_cotangent)(jnp.asarray(dy), jn.prepare_weights(w, "fp8"),
                                          jnp.asarray([4, 5], jnp.int32))
    assert not np.asarray(got)[9].any()
    assert (np.abs(np.asarray(got, np.float64) - want) <= 1e-6 * scale).all()  # float32 sums
