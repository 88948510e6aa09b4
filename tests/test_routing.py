"""The router: float32 logits (bf16 activations through the three-term bf16 split, non-finite
ones as the float32 dot), the scores, top-k, and route() against the float64 oracle."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_nvfp4 as jn
from jax_nvfp4.layer import routing
from oracles import route64


@pytest.mark.parametrize("t,e,h", [(37, 48, 7168), (5, 9, 64)])
def test_bf16_logits_equal_a_float32_dot(rng, t, e, h):
    x = rng.standard_normal((t, h)).astype(ml_dtypes.bfloat16)
    x[0, :5] = [1e30, -1e-30, 0.0, 3.0, -7.5]                    # wide range in one row
    w = (rng.standard_normal((e, h)) * rng.uniform(1e-3, 10, (e, 1))).astype(np.float32)
    w[1, :3] = [1.0 + 2.0**-23, -(1.0 - 2.0**-24), 2.0**-100]    # bits past bf16's 8 and 16
    terms = np.asarray(jax.jit(routing._bf16_terms)(jnp.asarray(w))).astype(np.float64)
    np.testing.assert_array_equal(terms[:e] + terms[e:2 * e] + terms[2 * e:], w)   # exact split
    assert routing._bf16_terms(jnp.asarray(w)).dtype == jnp.bfloat16    # read as bf16 operands
    got = np.asarray(jax.jit(routing.router_logits)(jnp.asarray(x), jnp.asarray(w)))
    want = x.astype(np.float64) @ w.astype(np.float64).T
    f32 = np.asarray(jax.jit(routing.router_logits)(jnp.asarray(x.astype(np.float32)),
                                                    jnp.asarray(w)))
    assert got.dtype == np.float32 and got.shape == (t, e)
    # float32 summation error bound: |x| . |w| * h * 2^-24 (both ways alike)
    bound = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T * h * 2.0**-24
    assert np.all(np.abs(got - want) <= bound)
    assert np.all(np.abs(f32 - want) <= bound)
    # much closer than a bf16 rounding of w would give
    rough = x.astype(np.float64) @ w.astype(ml_dtypes.bfloat16).astype(np.float64).T
    assert np.abs(got - want).max() < 1e-2 * np.abs(rough - want).max()


def _numpy_top_k(c, k):
    """The float32 total order (-NaN < -inf < -0.0 < +0.0 < +inf < +NaN), largest first, ties to
    the lower index, from numpy's stable argsort of the bit patterns."""
    b = c.view(np.int32).astype(np.int64)
    key = np.where(b < 0, -(b & 0x7FFFFFFF) - 1, b)     # sign-magnitude -> ordered integers
    return np.argsort(-key, axis=1, kind="stable")[:, :k].astype(np.int32)


@pytest.mark.parametrize("fn", ["rank_top_k_ids", "top_k_ids"])
@pytest.mark.parametrize("t,e,k", [(32, 48, 6), (5, 384, 6), (3, 8, 8), (1, 1, 1), (64, 9, 3)])
def test_top_k_ids_equals_lax_top_k(rng, t, e, k, fn):
    # rank_top_k_ids is the pairwise ranking itself; top_k_ids runs it on CUDA GPUs at these sizes
    assert t * e * e <= routing.RANK_TOP_K_MAX_COMPARES
    c = rng.standard_normal((t, e)).astype(np.float32)
    c[:, : e // 2] = np.round(c[:, : e // 2])                   # ties, -0.0 among them
    if e >= 8 and t >= 3:
        c[0, 3], c[0, 4] = -0.0, 0.0
        c[1, :] = -np.inf
        c[1, 5] = 1.0
        c[2, 1], c[2, 2], c[2, 6] = np.nan, -np.nan, np.inf
    got = np.asarray(jax.jit(getattr(routing, fn), static_argnums=1)(jnp.asarray(c), k))
    want = np.asarray(jax.lax.top_k(jnp.asarray(c), k)[1])
    assert got.dtype == np.int32 and got.shape == (t, k)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, _numpy_top_k(c, k))


def test_bf16_logits_non_finite_as_float32(rng):
    """bf16 tokens holding +-Inf or NaN get the logits of the float32 dot (IEEE: Inf * w is
    +-Inf, Inf * 0 and Inf - Inf are NaN), as float64 numpy gives them, not the NaN that the
    split weight's zero or opposite-signed low terms would add (Inf * 0, Inf - Inf)."""
    t, e, h = 6, 8, 64
    x = (rng.standard_normal((t, h)) * 0.5).astype(ml_dtypes.bfloat16)
    x[0, 3] = np.inf
    x[1, 5] = -np.inf
    x[2, 7] = np.nan
    x[3, 3], x[3, 4] = np.inf, np.inf
    x[4, 3], x[4, 5] = np.inf, -np.inf
    w = rng.standard_normal((e, h)).astype(np.float32)
    w[:4] = w[:4].astype(ml_dtypes.bfloat16).astype(np.float32)   # exact bf16: zero low terms
    w[4:, 3] += np.float32(2.0**-12) * np.sign(w[4:, 3])           # low terms of w's sign...
    w[6, 3] -= np.float32(2.0**-20) * np.sign(w[6, 3])             # ...and of the other sign
    w[2, 3] = w[5, 5] = 0.0                                        # Inf * 0
    want = x.astype(np.float64) @ w.astype(np.float64).T
    got = np.asarray(jax.jit(routing.router_logits)(jnp.asarray(x), jnp.asarray(w)))
    f32 = np.asarray(jax.jit(routing.router_logits)(jnp.asarray(x.astype(np.float32)),
                                                    jnp.asarray(w)))
    bad = ~np.isfinite(want)
    assert bad[:5].any(axis=1).all() and not bad[5].any()
    for name, v in (("bf16", got), ("float32", f32)):
        np.testing.assert_array_equal(np.isnan(v), np.isnan(want), err_msg=name)
        np.testing.assert_array_equal(v[bad], want[bad], err_msg=name)   # same +-Inf and NaN
        bound = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T * h * 2.0**-24
        assert np.all(np.abs(v - want)[~bad] <= bound[~bad]), name



@pytest.mark.parametrize("func", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_router_scores_against_float64(rng, func):
    """Each scoring function of the float32 logits, against float64 numpy: sqrt(softplus),
    sigmoid, softmax over the experts (each row sums to 1)."""
    t, e, h = 7, 6, 64
    x = rng.standard_normal((t, h)).astype(np.float32)
    w = (rng.standard_normal((e, h)) * 0.3).astype(np.float32)
    logits = x.astype(np.float64) @ w.astype(np.float64).T
    want = {"sqrtsoftplus": np.sqrt(np.log1p(np.exp(logits))),
            "sigmoid": 1 / (1 + np.exp(-logits)),
            "softmax": np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)}[func]
    got = np.asarray(routing.router_scores(jnp.asarray(x), jnp.asarray(w), func))
    assert got.dtype == np.float32 and got.shape == (t, e)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
    with pytest.raises(ValueError, match="scoring_func: unknown 'Softmax'"):
        routing.router_scores(jnp.asarray(x), jnp.asarray(w), "Softmax")


# ------------------------------------------------------------------ route (against float64)
E, H, K, VOCAB = 8, 64, 3, 20


@functools.lru_cache(maxsize=None)
def _layer():
    r = np.random.default_rng(58)
    n = lambda *s: r.standard_normal(s) * 0.2  # noqa: E731
    table = np.stack([r.permutation(E)[:K] for _ in range(VOCAB)]).astype(np.int32)
    return jn.quantize_moe(n(E, H) * 3, n(E, 64, H), n(E, H, 32), router_bias=n(E) * 0.1,
                           hash_table=table)


@pytest.mark.parametrize("kw", [
    dict(scoring_func="sqrtsoftplus"), dict(scoring_func="sigmoid", norm_topk_prob=False),
    dict(scoring_func="softmax", routed_scaling_factor=2.5),
    dict(scoring_func="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=1.5)],
    ids=["sqrtsoftplus", "sigmoid-unnormalized", "softmax-scaled", "grouped"])
def test_route_against_float64(rng, kw):
    w = dataclasses.replace(_layer(), hash_table=None)
    c = jn.MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=32, **kw)
    x = rng.standard_normal((16, H)).astype(np.float32)
    ids, rw = jax.jit(lambda x: jn.route(x, w, c))(jnp.asarray(x))
    want_ids, want_w = route64(x, w.router_weight, w.router_bias, c)
    assert ids.dtype == jnp.int32 and rw.dtype == jnp.float32 and ids.shape == (16, K)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(rw), want_w, rtol=1e-5)


def test_route_hash_table_and_its_errors(rng):
    w = _layer()
    c = jn.MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=32)
    x = rng.standard_normal((6, H)).astype(np.float32)
    tok = np.array([0, 19, 3, 3, 7, 11], np.int32)
    ids, rw = jn.route(jnp.asarray(x), w, c, tok)
    want_ids, want_w = route64(x, w.router_weight, None, c, w.hash_table, tok)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(rw), want_w, rtol=1e-5)
    with pytest.raises(ValueError, match="token_ids: this layer is hash-routed"):
        jn.route(jnp.asarray(x), w, c)
    with pytest.raises(ValueError, match=r"token_ids: expected shape \[6\], got \(5,\)"):
        jn.route(jnp.asarray(x), w, c, tok[:5])
    with pytest.raises(ValueError, match=r"token_ids: expected ids in \[0, 20\).*\[0, 20\]"):
        jn.route(jnp.asarray(x), w, c, np.array([0, 20, 1, 1, 1, 1], np.int32))
    with pytest.raises(ValueError, match=r"token_ids: expected integer ids"):
        jn.route(jnp.asarray(x), w, c, tok.astype(np.float32))
    bad = dataclasses.replace(w, hash_table=np.full((VOCAB, K), E, np.int32))
    with pytest.raises(ValueError, match=r"weights.hash_table: expert ids must lie in \[0, 8\)"):
        jn.route(jnp.asarray(x), bad, c, tok)
    with pytest.raises(ValueError, match="weights.hash_table: expected an integer array, got "
                                         "float32"):
        jn.route(jnp.asarray(x), dataclasses.replace(
            w, hash_table=np.asarray(w.hash_table, np.float32)), c, tok)
    # plain Python lists are arrays too
    ids_l, _ = jn.route(jnp.asarray(x), dataclasses.replace(
        w, hash_table=np.asarray(w.hash_table).tolist()), c, tok.tolist())
    np.testing.assert_array_equal(np.asarray(ids_l), want_ids)
    with pytest.raises(ValueError, match=r"weights.hash_table: expected \[vocab, top_k=3\]"):
        jn.route(jnp.asarray(x), dataclasses.replace(w, hash_table=w.hash_table[:, :2]), c, tok)
    # traced ids or table entries out of range: that token goes nowhere (ids -1, weights NaN)
    f = jax.jit(lambda t, table: jn.route(jnp.asarray(x), dataclasses.replace(
        w, hash_table=table), c, t))
    table = np.asarray(w.hash_table).copy()
    table[3, 1] = E
    ids, rw = f(np.array([0, 20, 3, -1, 7, 11], np.int32), table)
    bad_rows = np.array([False, True, True, True, False, False])
    assert (np.asarray(ids)[bad_rows] == -1).all() and np.isnan(np.asarray(rw)[bad_rows]).all()
    np.testing.assert_array_equal(np.asarray(ids)[~bad_rows], want_ids[[0, 4, 5]])


def test_router_logits_program():
    """What router_logits promises about its program: bf16 x enters its dots as bf16 (no float32
    copy of x is made), and float32 x runs one float32 dot at HIGHEST precision (no TF32 on GPUs)."""
    w = jnp.ones((4, 64), jnp.float32)

    def eqns(x):
        return jax.make_jaxpr(routing.router_logits)(x, w).jaxpr.eqns

    bf16 = eqns(jnp.ones((3, 64), jnp.bfloat16))
    dots = [e for e in bf16 if e.primitive.name == "dot_general"]
    assert dots and all(e.invars[0].aval.dtype == jnp.bfloat16 for e in dots)
    assert not any(e.primitive.name == "convert_element_type" and e.invars[0].aval.shape == (3, 64)
                   and e.params["new_dtype"] == jnp.float32 for e in bf16)
    f32 = [e for e in eqns(jnp.ones((3, 64), jnp.float32)) if e.primitive.name == "dot_general"]
    assert len(f32) == 1
    assert jax.lax.Precision.HIGHEST in tuple(f32[0].params["precision"] or ())


def test_router_logits_sum_in_float32():
    """Sums that bf16 cannot hold come out exact (float32 accumulation of every term's dot):
    the leading terms' 1 + 2^-7 + 2^-9 and the low terms' 2^-8 + 2^-16, for bf16 and float32 x."""
    w = np.array([[1 + 2.0**-7, 2.0**-9], [1 + 2.0**-9 + 2.0**-16, 1 + 2.0**-9]], np.float32)
    want = np.array([[1 + 2.0**-7 + 2.0**-9, 2 + 2.0**-8 + 2.0**-16]], np.float32)
    for dtype in (jnp.bfloat16, jnp.float32):
        got = np.asarray(routing.router_logits(jnp.ones((1, 2), dtype), jnp.asarray(w)))
        np.testing.assert_array_equal(got, want, err_msg=str(dtype))
