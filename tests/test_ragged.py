"""jax_nvfp4.ragged_dot (jax_nvfp4/ops/ragged.py): jax.lax.ragged_dot's signature and [G, K, N] rhs on
NVFP4 weights, checked against jax.lax.ragged_dot / float64 on the dequantized weights, and used
as tokamax's implementation callable (real tokamax and qwix when installed; skips otherwise)."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import QUANTIZE, QUANTIZE_STACK

import jax_nvfp4 as jn
from jax_nvfp4 import _extension
from jax_nvfp4.ops.ragged import TRANSPOSED_RHS_DIMENSION_NUMBERS, Unsupported

BACKENDS = ["ffi", "reference"] if _extension.available() else ["reference"]
needs_qwix = pytest.mark.skipif(importlib.util.find_spec("qwix") is None,
                                reason="qwix is not installed (pip install '.[interop]')")


def _tokamax():
    """tokamax, or a skip with the reason it does not import."""
    try:
        import tokamax  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip
        pytest.skip(f"tokamax does not import: {type(e).__name__}: {e}"[:300])
    return tokamax


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def _case(rng, m=24, k=64, n=128, g=3, sizes=(9, 0, 11)):
    t = QUANTIZE_STACK(jnp.asarray(rng.standard_normal((g, n, k)), jnp.float32))   # [G, N, K]
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    return x, t, jnp.array(sizes, jnp.int32)


def _oracle(x, w_gkn, gs):
    """float64: jax.lax.ragged_dot's definition (rows past the groups 0)."""
    x, w = np.asarray(x, np.float64), np.asarray(w_gkn, np.float64)
    out, r = np.zeros((x.shape[0], w.shape[2])), 0
    for g, n in enumerate(np.asarray(gs)):
        out[r:r + n] = x[r:r + n] @ w[g]
        r += n
    return out


def _close(got, x, w_gkn, gs, rtol=2e-6):
    want = _oracle(x, w_gkn, gs)
    bound = rtol * _oracle(np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(w_gkn, np.float64)),
                           gs)
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound), \
        np.max(np.abs(np.asarray(got, np.float64) - want) - bound)


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_lax_ragged_dot_on_dequantized_weights(rng, backend):
    x, t, gs = _case(rng)
    w = jn.ragged_rhs(t)
    assert w.shape == (3, 64, 128) and w.tensor is t
    w_gkn = jnp.swapaxes(jn.dequantize(t), 1, 2)                      # [G, K, N] float32
    lax = jax.lax.ragged_dot(x.astype(jnp.float32), w_gkn, gs, precision="highest")
    f = lambda x, w, gs: jn.ragged_dot(x, w, gs, preferred_element_type=jnp.float32,  # noqa: E731
                                       backend=backend)
    runs = [f(x, w, gs), jax.jit(f)(x, w, gs), jax.jit(lambda x: f(x, w, gs))(x)]
    for got in runs:
        assert got.dtype == jnp.float32 and got.shape == (24, 128)
        np.testing.assert_array_equal(_bits(got), _bits(runs[0]))
        _close(got, x, w_gkn, gs)
        _close(lax, x, w_gkn, gs)                                   # the oracle agrees with lax
    assert np.all(np.asarray(runs[0])[20:] == 0)
    # default output type: lhs's (bfloat16), as jax.lax.ragged_dot
    y = jn.ragged_dot(x, w, gs, backend=backend)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(_bits(y), _bits(runs[0].astype(jnp.bfloat16)))
    # the transposed-rhs dimension numbers take the NVFP4Tensor itself
    yt = jn.ragged_dot(x, t, gs, preferred_element_type=jnp.float32, backend=backend,
                       ragged_dot_dimension_numbers=TRANSPOSED_RHS_DIMENSION_NUMBERS)
    np.testing.assert_array_equal(_bits(yt), _bits(runs[0]))


@pytest.mark.parametrize("m,sizes", [(0, (0, 0, 0)), (1, (0, 1, 0))])
def test_empty_and_one_row(rng, m, sizes):
    x, t, gs = _case(rng, m=m, sizes=sizes)
    y = jax.jit(lambda x: jn.ragged_dot(x, jn.ragged_rhs(t), gs))(x)
    assert y.shape == (m, 128) and y.dtype == jnp.bfloat16
    _close(y.astype(jnp.float32), x, jnp.swapaxes(jn.dequantize(t), 1, 2), gs, rtol=2 ** -8)


def test_prepared_weights_and_w4a4(rng, on_cpu):
    """sm90-layout weights give the same bits (on the CPU handler: on a GPU the two layouts may
    run different kernels); an NVFP4 lhs runs W4A4 (as grouped_gemm)."""
    x, t, gs = _case(rng)
    y = jn.ragged_dot(x, jn.ragged_rhs(t), gs, preferred_element_type=jnp.float32)
    yp = jn.ragged_dot(x, jn.ragged_rhs(jn.prepare_weights(t)), gs,
                       preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(_bits(yp), _bits(y))
    a = QUANTIZE(x.astype(jnp.float32))
    np.testing.assert_array_equal(
        _bits(jn.ragged_dot(a, jn.ragged_rhs(t), gs, preferred_element_type=jnp.float32)),
        _bits(jn.grouped_gemm(a, t, gs, out_dtype=jnp.float32)))


def test_gradient_matches_float64(rng):
    """d/dlhs: row r of group g gets ct[r] @ W_g^T (float64 oracle; bf16 output rounding)."""
    x, t, gs = _case(rng)
    w, w_gkn = jn.ragged_rhs(t), np.swapaxes(np.asarray(jn.dequantize(t), np.float64), 1, 2)
    ct = jnp.asarray(rng.standard_normal((24, 128)), jnp.float32)
    g = jax.grad(lambda x: jnp.sum(jn.ragged_dot(x, w, gs, preferred_element_type=jnp.float32)
                                   * ct))(x)
    assert g.dtype == jnp.bfloat16
    w_t = np.swapaxes(w_gkn, 1, 2)                                   # [G, N, K]
    want = _oracle(np.asarray(ct, np.float64), w_t, gs)
    bound = 2 ** -8 * np.abs(want) + 2e-6 * _oracle(np.abs(np.asarray(ct, np.float64)),
                                                     np.abs(w_t), gs)
    assert np.all(np.abs(np.asarray(g, np.float64) - want) <= bound)
    assert np.all(np.asarray(g)[20:] == 0)


def test_unsupported_calls_name_the_argument(rng):
    x, t, gs = _case(rng)
    w = jn.ragged_rhs(t)
    cases = [
        (lambda: jn.ragged_dot(x, t, gs), r"rhs: an NVFP4Tensor is \[G, N, K\]"),
        (lambda: jn.ragged_dot(x, jnp.ones((3, 64, 128), jnp.bfloat16), gs),
         "rhs: expected NVFP4 weights"),
        (lambda: jn.ragged_dot(x.astype(jnp.float32), w, gs), "lhs: expected bfloat16"),
        (lambda: jn.ragged_dot(x, w, gs, group_offset=jnp.zeros((1,), jnp.int32)),
         "group_offset"),
        (lambda: jn.ragged_dot(x, w, gs, preferred_element_type=jnp.float16),
         "preferred_element_type"),
        (lambda: jn.ragged_dot(x, w, gs, ragged_dot_dimension_numbers=(
            jax.lax.RaggedDotDimensionNumbers((([1], [1]), ([], [])), [1], [0]))),
         "ragged_dot_dimension_numbers"),
    ]
    for call, msg in cases:
        with pytest.raises(Unsupported, match=msg) as e:
            call()
        assert isinstance(e.value, NotImplementedError) and isinstance(e.value, ValueError)
    with pytest.raises(ValueError, match="lhs"):             # K mismatch: grouped_gemm's check
        jn.ragged_dot(x[:, :32], w, gs)
    with pytest.raises(ValueError, match=r"w: expected an NVFP4Tensor \[G, N, K\]"):
        jn.ragged_rhs(t.data)


@needs_qwix
def test_qwix_rhs(rng):
    """A qwix NVFP4 ragged_dot weight [G, K, N] (tiled along K) as the rhs directly."""
    import qwix  # noqa: PLC0415
    w = jnp.asarray(rng.standard_normal((3, 64, 128)), jnp.float32)
    q = qwix.quantize(w, "nvfp4", channelwise_axes=(0, 2), tiled_axes={1: 16})
    x, _, gs = _case(rng)
    y = jn.ragged_dot(x, q, gs, preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(
        _bits(y), _bits(jn.ragged_dot(x, jn.ragged_rhs(q), gs, preferred_element_type=jnp.float32)))
    _close(y, x, qwix.dequantize(q), gs)


@needs_qwix
def test_as_tokamax_implementation(rng):
    """tokamax.ragged_dot(..., implementation=(jn.ragged_dot,)) runs it (RaggedRhs and qwix rhs,
    the fused activation, GroupSizes); a sequence falls back past it for float weights. The
    one-element tuple is the form every supported tokamax takes: 0.0.12 also takes the bare
    function, 0.0.17 iterates over any non-string implementation."""
    tokamax = _tokamax()
    import qwix  # noqa: PLC0415
    x, t, gs = _case(rng)
    w = jn.ragged_rhs(t)
    want = jn.ragged_dot(x, w, gs)
    got = jax.jit(lambda x, w, gs: tokamax.ragged_dot(x, w, gs, implementation=(jn.ragged_dot,)))(
        x, w, gs)
    np.testing.assert_array_equal(_bits(got), _bits(want))
    q = qwix.quantize(jnp.asarray(rng.standard_normal((3, 64, 128)), jnp.float32), "nvfp4",
                      channelwise_axes=(0, 2), tiled_axes={1: 16})
    np.testing.assert_array_equal(
        _bits(tokamax.ragged_dot(x, q, gs, implementation=(jn.ragged_dot,))),
        _bits(jn.ragged_dot(x, q, gs)))
    act = tokamax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32,
                             activation=jax.nn.silu, implementation=(jn.ragged_dot,))
    np.testing.assert_array_equal(
        _bits(act), _bits(jax.nn.silu(jn.ragged_dot(x, w, gs, preferred_element_type=jnp.float32))))
    np.testing.assert_array_equal(
        _bits(tokamax.ragged_dot(x, w, tokamax.RaggedDotGroupSizes(gs, (9, 0, 11)),
                                 implementation=(jn.ragged_dot,))), _bits(want))
    dense = jnp.asarray(rng.standard_normal((3, 64, 128)), jnp.bfloat16)
    from absl import flags  # noqa: PLC0415 - tokamax's own ops read absl flags (defaults here)
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    fallback = tokamax.ragged_dot(x, dense, gs, implementation=[jn.ragged_dot, "xla"])
    np.testing.assert_array_equal(_bits(fallback), _bits(jax.lax.ragged_dot(x, dense, gs)))


def test_maxtext_style_block_of_the_example(rng):
    """examples/ragged_dot_moe.py's block with ragged_dot swapped for jn.ragged_dot equals the
    block with jax.lax.ragged_dot on the dequantized weights (up to bf16 rounding of the rows)."""
    import importlib.util as iu  # noqa: PLC0415
    import os  # noqa: PLC0415
    path = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "ragged_dot_moe.py")
    if not os.path.exists(path):
        pytest.skip("examples/ are not beside the tests")
    spec = iu.spec_from_file_location("ragged_dot_moe", path)
    ex = iu.module_from_spec(spec)
    spec.loader.exec_module(ex)
    e, h, i, t = 4, 64, 32, 12
    router = jnp.asarray(rng.standard_normal((h, e)), jnp.float32)
    ws = [jnp.asarray(rng.standard_normal(s) * 0.2, jnp.bfloat16) for s in ((e, h, i), (e, h, i),
                                                                            (e, i, h))]
    qs = [jn.ragged_rhs(QUANTIZE_STACK(jnp.swapaxes(w, 1, 2).astype(jnp.float32))) for w in ws]
    deq = [jax.jit(lambda t: jnp.swapaxes(jn.dequantize(t), 1, 2))(q.tensor)   # [G, K, N] f32
           for q in qs]
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    ours = jax.jit(lambda x, *w: ex.moe_block(x, router, *w, top_k=2, ragged_dot=jn.ragged_dot))(
        x, *qs)

    def lax_dot(a, w, gs):
        return jax.lax.ragged_dot(a.astype(jnp.float32), w, gs,
                                  precision="highest").astype(jnp.bfloat16)

    want = jax.jit(lambda x, *w: ex.moe_block(x, router, *w, top_k=2, ragged_dot=lax_dot))(x, *deq)
    a, b = np.asarray(ours, np.float64), np.asarray(want, np.float64)
    assert a.shape == (t, h)
    assert np.linalg.norm(a - b) <= 2 ** -6 * np.linalg.norm(b)


@needs_qwix
def test_bad_qwix_rhs_is_named(rng):
    """A qwix rhs that is not the NVFP4 layout ragged_dot reads is a ValueError naming rhs."""
    import qwix  # noqa: PLC0415
    w = jnp.asarray(rng.standard_normal((3, 64, 128)), jnp.float32)
    x, _, gs = _case(rng)
    q = qwix.quantize(w, "int8", channelwise_axes=(0, 2), tiled_axes={1: 16})
    with pytest.raises(ValueError, match=r"^rhs: expected a qwix QArray with qtype 'nvfp4'"):
        jn.ragged_dot(x, q, gs)


# ------------------------------------------------------------------ issue 68: edges and dtypes


@needs_qwix
def test_qwix_rhs_tiled_on_the_wrong_axis_when_n_equals_k(rng):
    """N == K: a qwix rhs tiled along N converts to a tensor of the expected shape, so only the
    tiled axis tells; it is refused naming rhs (default and transposed dimension numbers, and
    ragged_rhs), never computed with transposed weights. Tiled along K it equals
    jax.lax.ragged_dot on qwix's dequantization, with either dimension numbers."""
    import qwix  # noqa: PLC0415
    w = jnp.asarray(rng.standard_normal((2, 64, 64)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((7, 64)), jnp.bfloat16)
    gs = jnp.array([3, 4], jnp.int32)
    along = {a: qwix.quantize(w, "nvfp4", channelwise_axes=(0, 3 - a), tiled_axes={a: 16})
             for a in (1, 2)}
    dims = {1: None, 2: TRANSPOSED_RHS_DIMENSION_NUMBERS}
    for k_axis, wrong in ((1, 2), (2, 1)):
        with pytest.raises(Unsupported, match=rf"rhs: expected a qwix NVFP4 QArray .* tiled along "
                                              rf"K \(axis {k_axis}\)"):
            jn.ragged_dot(x, along[wrong], gs, ragged_dot_dimension_numbers=dims[k_axis])
        q = along[k_axis]
        got = jn.ragged_dot(x, q, gs, preferred_element_type=jnp.float32,
                            ragged_dot_dimension_numbers=dims[k_axis])
        wq = np.asarray(qwix.dequantize(q), np.float32)
        w_gkn = wq if k_axis == 1 else np.swapaxes(wq, 1, 2)
        want = jax.lax.ragged_dot(x.astype(jnp.float32), jnp.asarray(w_gkn), gs,
                                  precision=jax.lax.Precision.HIGHEST)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"rhs: expected a qwix NVFP4 QArray \[G, K, N\]"):
        jn.ragged_rhs(along[2])


def test_ragged_rhs_needs_a_3d_tensor(rng):
    t = QUANTIZE(jnp.asarray(rng.standard_normal((64, 64)), jnp.float32))
    for bad in (t, jn.NVFP4Tensor(t.data[None, None], t.scales[None, None], t.global_scale)):
        with pytest.raises(ValueError, match=r"w: expected an NVFP4Tensor \[G, N, K\]"):
            jn.ragged_rhs(bad)


def test_activation_on_the_float32_product_and_default_dtypes(rng):
    """activation sees the float32 product (before the cast to the output type); the default
    output is lhs's dtype: bfloat16 for a bf16 lhs and for an NVFP4 lhs."""
    x, t, gs = _case(rng, m=6, k=64, n=128, g=2, sizes=(2, 4))
    w = jn.ragged_rhs(t)
    y32 = jn.ragged_dot(x, w, gs, preferred_element_type=jnp.float32, backend="reference")
    seen = []

    def act(v):
        seen.append(v.dtype)
        return v * 3.0 + 2.0 ** -20        # lost if applied after a bf16 cast, kept before it
    got = jn.ragged_dot(x, w, gs, activation=act, backend="reference")
    assert seen == [jnp.float32] and got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(_bits(got), _bits((y32 * 3.0 + 2.0 ** -20).astype(jnp.bfloat16)))
    assert jn.ragged_dot(x, w, gs, backend="reference").dtype == jnp.bfloat16
    assert jn.ragged_dot(QUANTIZE(x), w, gs, backend="reference").dtype == jnp.bfloat16
