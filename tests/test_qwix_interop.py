"""qwix interop (jax_nvfp4/maths/qwix_interop.py) against the real qwix: NVFP4 QArray <-> NVFP4Tensor
with identical dequantized values (qwix.dequantize is the oracle), refusals where not exact, and
grouped_gemm / moe taking qwix NVFP4 weights directly."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import QUANTIZE, QUANTIZE_STACK

import jax_nvfp4 as jn
from jax_nvfp4 import _extension
from jax_nvfp4.maths import qwix_interop as qi

qwix = pytest.importorskip("qwix", reason="qwix is not installed (pip install '.[interop]')")
BACKENDS = ["ffi", "reference"] if _extension.available() else ["reference"]


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def _weights(rng, shape, spread=True):
    """float32 values whose 16-value blocks span many octaves (and one all-zero block)."""
    w = rng.standard_normal(shape).astype(np.float32)
    if spread:
        w *= np.exp2(rng.integers(-12, 6, shape[:-2] + (1, shape[-1]))).astype(np.float32)
    w.reshape(-1)[:16] = 0.0
    return jnp.asarray(w)


def _qwix_nvfp4(w, axis, dtype=jnp.float32):
    others = tuple(a for a in range(w.ndim) if a != axis)
    return qwix.quantize(w.astype(dtype), "nvfp4", channelwise_axes=others, tiled_axes={axis: 16})


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape,axis", [((3, 64, 48), 1), ((64, 40), 0), ((5, 32), 1)])
def test_from_qwix_dequantizes_as_qwix_does(rng, shape, axis, dtype):
    q = _qwix_nvfp4(_weights(rng, shape), axis, dtype)
    assert q.qtype == "nvfp4" and q.qvalue.dtype == jnp.float4_e2m1fn
    t = qi.from_qwix(q)
    assert t.layout == "checkpoint" and t.shape == tuple(np.moveaxis(np.empty(shape), axis, -1).shape)
    assert t.global_scale.shape == tuple(t.shape[:-2])
    g = np.asarray(t.global_scale)                       # powers of two
    assert np.all(np.frexp(g)[0] == 0.5)
    oracle = np.moveaxis(np.asarray(qwix.dequantize(q)), axis, -1)
    assert oracle.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(_bits(jn.dequantize(t, dtype)), _bits(oracle))
    # and jitted (traced scales: no refusal possible, none needed here)
    t2 = jax.jit(qi.from_qwix)(q)
    np.testing.assert_array_equal(_bits(jn.dequantize(t2, dtype)), _bits(oracle))


def test_shared_scales_broadcast(rng):
    """qwix's default (no channelwise axes): one scale per K block shared by every row."""
    q = qwix.quantize(_weights(rng, (2, 64, 8), spread=False), "nvfp4", tiled_axes={1: 16})
    assert q.scale.shape == (1, 4, 1)
    t = qi.from_qwix(q)
    np.testing.assert_array_equal(_bits(jn.dequantize(t)),
                                  _bits(np.moveaxis(np.asarray(qwix.dequantize(q)), 1, -1)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_round_trip_back_to_qwix(rng, dtype):
    q = _qwix_nvfp4(_weights(rng, (3, 64, 48)), 1, dtype)
    back = qi.to_qwix(qi.from_qwix(q), axis=1, dtype=dtype)
    assert isinstance(back, qwix.QArray) and back.qtype == "nvfp4" and back.zero_point is None
    np.testing.assert_array_equal(np.asarray(back.qvalue, np.float32),
                                  np.asarray(q.qvalue, np.float32))
    np.testing.assert_array_equal(_bits(back.scale), _bits(q.scale))
    np.testing.assert_array_equal(_bits(qwix.dequantize(back)), _bits(qwix.dequantize(q)))


def test_to_qwix_of_library_weights(rng):
    """A power-of-two global scale converts exactly; jn.quantize's amax-derived one generally
    does not (block scale x global scale rounds in float32) and is refused, naming a block."""
    x = _weights(rng, (2, 48, 64), spread=False)
    pow2 = jax.jit(jax.vmap(lambda v, g: jn.quantize(v, g), in_axes=(0, None)))
    exact = pow2(x, jnp.float32(2.0 ** -7))
    for t in (exact, jax.jit(jn.prepare_weights)(pow2(_weights(rng, (2, 128, 64), spread=False),
                                                      jnp.float32(0.25)))):
        q = qi.to_qwix(t, axis=1)
        np.testing.assert_array_equal(_bits(np.moveaxis(np.asarray(qwix.dequantize(q)), 1, -1)),
                                      _bits(jn.dequantize(t)))
    t = QUANTIZE_STACK(x)
    assert not np.all(np.frexp(np.asarray(t.global_scale))[0] == 0.5)
    with pytest.raises(ValueError, match=r"block \(\d+, \d+, \d+\).*not exact in float32"):
        qi.to_qwix(t)
    # traced: the inexact blocks' scales are NaN, never other numbers
    q = jax.jit(qi.to_qwix)(t)
    d = np.asarray(qwix.dequantize(q))
    ref = np.asarray(jn.dequantize(t))
    finite = np.isfinite(d)
    assert not finite.all()
    np.testing.assert_array_equal(d[finite], ref[finite])


def test_inexact_qwix_scale_is_refused_or_nan(rng):
    """A scale that is no e4m3 value times a power of two (here 0.3, 0.3 * 2^-k has a full
    mantissa) cannot be NVFP4: a ValueError naming the block when concrete, NaN when traced."""
    q = _qwix_nvfp4(_weights(rng, (2, 32, 8), spread=False), 1)
    bad = dataclasses.replace(q, scale=q.scale.at[1, 1, 3].set(0.3))
    with pytest.raises(ValueError, match=r"scale 0\.3.* of block \(1, 3, 1\).*not an e4m3 value"):
        qi.from_qwix(bad, name="w")
    t = jax.jit(qi.from_qwix)(bad)
    d = np.asarray(jn.dequantize(t))
    assert np.isnan(d[1, 3, 16:32]).all()
    np.testing.assert_array_equal(d[0], np.moveaxis(np.asarray(qwix.dequantize(bad)), 1, -1)[0])
    for v in (np.nan, np.inf):
        with pytest.raises(ValueError, match="not an e4m3 value"):
            qi.from_qwix(dataclasses.replace(q, scale=q.scale.at[0, 0, 0].set(v)))


def test_not_nvfp4_is_refused(rng):
    w = _weights(rng, (64, 32), spread=False)
    with pytest.raises(ValueError, match=r"w: expected a qwix QArray with qtype 'nvfp4', got"):
        qi.from_qwix(qwix.quantize(w, jnp.int8, channelwise_axes=(1,)), name="w")
    for k in (16, 48):
        with pytest.raises(ValueError, match=r"tiled axis 0\).*multiple of 32"):
            qi.from_qwix(_qwix_nvfp4(w[:k], 0))
    q = _qwix_nvfp4(w, 0)
    with pytest.raises(ValueError, match="no zero point"):
        qi.from_qwix(dataclasses.replace(q, zero_point=jnp.zeros(q.scale.shape, jnp.float4_e2m1fn)))
    with pytest.raises(ValueError, match="exactly one axis"):
        qi.from_qwix(dataclasses.replace(q, scale=jnp.ones((4, 2), jnp.float32)))
    with pytest.raises(ValueError, match="expected a qwix QArray"):
        qi.from_qwix(w)
    assert qi.as_nvfp4(w, "w") is w and not qi.is_qwix_array(QUANTIZE(w))


def _ragged_oracle(x, w_gkn, gs):
    """float64 numpy: row r of group g is x[r] @ w[g] (rows past the groups 0)."""
    x, w = np.asarray(x, np.float64), np.asarray(w_gkn, np.float64)
    out, r = np.zeros((x.shape[0], w.shape[2])), 0
    for g, n in enumerate(np.asarray(gs)):
        out[r:r + n] = x[r:r + n] @ w[g]
        r += n
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_gemm_takes_qwix_weights(rng, backend):
    """A qwix ragged_dot weight [G, K, N]: the same bits as its conversion, every idiom (eager,
    jit with arguments, jit closed over), and the float64 product of qwix's own dequantization."""
    q = _qwix_nvfp4(_weights(rng, (3, 64, 128)), 1)
    x = jnp.asarray(rng.standard_normal((20, 64)), jnp.bfloat16)
    gs = jnp.array([7, 0, 11], jnp.int32)
    want = jn.grouped_gemm(x, qi.from_qwix(q), gs, backend=backend, out_dtype=jnp.float32)
    runs = [jn.grouped_gemm(x, q, gs, backend=backend, out_dtype=jnp.float32),
            jax.jit(lambda x, q, gs: jn.grouped_gemm(x, q, gs, backend=backend,
                                                     out_dtype=jnp.float32))(x, q, gs),
            jax.jit(lambda x: jn.grouped_gemm(x, q, gs, backend=backend,
                                              out_dtype=jnp.float32))(x)]
    for got in runs:
        if backend == "reference" and jax.default_backend() == "gpu":
            # the reference's float32 dot on XLA:GPU sums in an order that depends on the program
            # around it (seen: 4 of 2,560 outputs 1 ulp apart on an H100): the same values, not bits
            np.testing.assert_array_less(np.abs(_bits(got).astype(np.int64) - _bits(want)), 3)
        else:
            np.testing.assert_array_equal(_bits(got), _bits(want))
    oracle = _ragged_oracle(x, qwix.dequantize(q), gs)
    scale = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(qwix.dequantize(q), np.float64)
                                                       ).max(0)
    assert np.all(np.abs(np.asarray(want, np.float64) - oracle) <= 2e-6 * scale + 1e-30)
    assert np.all(np.asarray(want)[18:] == 0)
    # no rows: an empty lhs
    assert jn.grouped_gemm(x[:0], q, gs * 0, backend=backend).shape == (0, 128)


def _moe_case(rng):
    e, h, i = 4, 64, 32
    f = lambda *s: _weights(rng, s, spread=False) * 0.1  # noqa: E731
    qw = jn.MoEWeights(
        router_weight=jnp.asarray(rng.standard_normal((e, h)), jnp.float32),
        w13=_qwix_nvfp4(f(e, h, 2 * i), 1), w2=_qwix_nvfp4(f(e, i, h), 1),
        shared_w13=_qwix_nvfp4(f(h, 2 * i), 0), shared_w2=_qwix_nvfp4(f(i, h), 0))
    config = jn.MoEConfig.deepseek_v4_pro(num_experts=e, hidden_size=h, intermediate_size=i,
                                          n_shared_experts=1, top_k=2, n_group=1, topk_group=1)
    return qw, jax.jit(qi.weights_from_qwix)(qw), config, h


def test_moe_takes_qwix_weights(rng):
    """MoEWeights whose w13 [E, H, 2I] and w2 [E, I, H] (and the shared expert's) are qwix NVFP4
    arrays: the jitted layer equals the layer on their conversions bit for bit, with one and
    many tokens."""
    qw, converted, config, h = _moe_case(rng)
    e, i = config.num_experts, config.intermediate_size
    assert isinstance(converted.w13, jn.NVFP4Tensor) and converted.w13.shape == (e, 2 * i, h)
    assert converted.shared_w2.shape == (h, i) and converted.shared_w2.global_scale.shape == ()
    layer = jax.jit(lambda x, w: jn.moe(x, w, config, backend=BACKENDS[0]))
    for t in (1, 9):
        x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
        np.testing.assert_array_equal(_bits(layer(x, qw)), _bits(layer(x, converted)))


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_moe_takes_qwix_weights_eager_and_every_backend(rng, backend):
    """As above, eager (every operation dispatched alone: slow) and on each backend."""
    qw, converted, config, h = _moe_case(rng)
    x = jnp.asarray(rng.standard_normal((5, h)), jnp.bfloat16)
    want = jax.jit(lambda x, w: jn.moe(x, w, config, backend=backend))(x, converted)
    np.testing.assert_array_equal(_bits(jn.moe(x, qw, config, backend=backend)), _bits(want))


# ------------------------------------------------------------------ issue 68: qwix weights in every consumer


def _moe_case_sm90(rng):
    """As :func:`_moe_case` with sizes every prepared layout takes (N % 128, K % 128)."""
    e, h, i = 2, 128, 128
    f = lambda *s: _weights(rng, s, spread=False) * 0.1  # noqa: E731
    qw = jn.MoEWeights(
        router_weight=jnp.asarray(rng.standard_normal((e, h)), jnp.float32),
        w13=_qwix_nvfp4(f(e, h, 2 * i), 1), w2=_qwix_nvfp4(f(e, i, h), 1),
        shared_w13=_qwix_nvfp4(f(h, 2 * i), 0), shared_w2=_qwix_nvfp4(f(i, h), 0))
    config = jn.MoEConfig.deepseek_v4_pro(num_experts=e, hidden_size=h, intermediate_size=i,
                                          n_shared_experts=1, top_k=1, n_group=1, topk_group=1)
    return qw, qi.weights_from_qwix(qw), config, h


def _assert_same_tree(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a).reshape(-1).view(np.uint8),
                                      np.asarray(b).reshape(-1).view(np.uint8))


@pytest.mark.slow
def test_prepare_weights_converts_qwix_fields(rng):
    """prepare_weights on MoEWeights holding qwix QArrays (as jn.moe accepts them) prepares their
    conversions: w13 paired for "sm90" (not marked paired with its rows in the stored order),
    Fp8Weights for "fp8": the same pytree (layouts, pairing, every bit) as prepare_weights of the
    converted weights, so the same layer."""
    qw, converted, config, h = _moe_case_sm90(rng)
    prepare = jax.jit(jn.prepare_weights, static_argnums=1)
    for layout in ("sm90", "fp8"):
        got = jn.prepare_weights(qw, layout) if layout == "sm90" else prepare(qw, layout)
        want = prepare(converted, layout)
        assert got.w13_paired == (layout == "sm90")
        for f in qi.WEIGHT_FIELDS:
            assert getattr(got, f).layout == layout, f
        _assert_same_tree(got, want)
    # a bare qwix weight [G, K, N] converts to the grouped GEMM's [G, N, K] first
    _assert_same_tree(jn.prepare_weights(qw.w2, "checkpoint"), converted.w2)


@pytest.mark.slow
def test_prepare_weights_of_qwix_fields_runs_the_same_layer(rng):
    """The layer on prepare_weights(qwix weights) (sm90: paired, fused SwiGLU) equals the layer
    on the unprepared qwix weights."""
    qw, converted, config, h = _moe_case_sm90(rng)
    x = jnp.asarray(rng.standard_normal((6, h)), jnp.bfloat16)
    layer = jax.jit(lambda x, w: jn.moe(x, w, config, backend="reference"))
    np.testing.assert_array_equal(_bits(layer(x, jn.prepare_weights(qw))),
                                  _bits(layer(x, jn.prepare_weights(converted))))
    want = layer(x, qw)
    np.testing.assert_allclose(np.asarray(layer(x, jn.prepare_weights(qw)), np.float32),
                               np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.slow
def test_framework_modules_and_save_moe_take_qwix_fields(rng):
    """nn.eqx.MoE, nn.nnx.MoE, nn.linen.freeze and checkpoint.save_moe take what jn.moe takes:
    MoEWeights whose expert weights (shared_w2 included) are qwix NVFP4 QArrays; they hold (and
    write) the conversions, every bit."""
    qw, converted, config, h = _moe_case(rng)
    from jax_nvfp4 import checkpoint  # noqa: PLC0415
    from jax_nvfp4.nn.frozen import FrozenMoEWeights  # noqa: PLC0415
    frozen = FrozenMoEWeights.freeze(qw)       # what eqx.MoE, nnx.MoE and linen.freeze store
    _assert_same_tree(frozen.weights(), converted)
    eqx = pytest.importorskip("jax_nvfp4.nn.eqx")
    _assert_same_tree(eqx.MoE(frozen, config).moe_weights, converted)
    nnx = pytest.importorskip("jax_nvfp4.nn.nnx")
    _assert_same_tree(nnx.MoE(qw, config).moe_weights, converted)
    mcfg = jn.MoEConfig(num_experts=config.num_experts, top_k=config.top_k, hidden_size=h,
                        intermediate_size=config.intermediate_size, n_shared_experts=1)
    got = checkpoint.save_moe(qw, mcfg, "m")
    ref = checkpoint.save_moe(converted, mcfg, "m")
    assert sorted(got) == sorted(ref)
    for k in ref:
        np.testing.assert_array_equal(np.asarray(got[k]).reshape(-1).view(np.uint8),
                                      np.asarray(ref[k]).reshape(-1).view(np.uint8), err_msg=k)


@pytest.mark.slow
def test_framework_modules_run_qwix_weights(rng):
    """The eqx and nnx layers built from qwix weights equal jn.moe on their conversions."""
    qw, converted, config, h = _moe_case(rng)
    x = jnp.asarray(rng.standard_normal((5, h)), jnp.bfloat16)
    want = jax.jit(lambda x, w: jn.moe(x, w, config, backend="reference"))(x, converted)
    for mod in ("eqx", "nnx"):
        m = pytest.importorskip(f"jax_nvfp4.nn.{mod}")
        layer = m.MoE(qw, config, backend="reference")
        np.testing.assert_array_equal(_bits(jax.jit(lambda x: layer(x))(x)), _bits(want))


def test_to_qwix_refuses_an_axis_out_of_range():
    """axis names where K goes among the QArray's ndim axes: -ndim..ndim-1; anything else is a
    ValueError naming axis (never wrapped around: axis=3 on a 3-D tensor is not axis 0)."""
    t = jax.jit(jax.vmap(lambda v: jn.quantize(v, jnp.float32(2.0 ** -7))))(
        jnp.linspace(-1, 1, 2 * 8 * 32, dtype=jnp.float32).reshape(2, 8, 32))
    for axis, where in ((2, 2), (-3, 0)):
        assert qi.to_qwix(t, axis=axis).qvalue.shape[where] == 32
    for axis in (3, -4, 7):
        with pytest.raises(ValueError, match=r"axis: expected an axis in \[-3, 3\)"):
            qi.to_qwix(t, axis=axis)


def test_e4m3_membership_is_ml_dtypes():
    """from_qwix's exactness test (integer tests on the float32 bits: XLA:GPU drops the convert
    pair of a float round trip ``float32(e4m3(b)) == b`` under excess precision, so that test
    passes every b there) against ml_dtypes' round trip: every e4m3 value, its float32
    neighbours, halves and doubles, values past 448 and below the smallest subnormal 2^-9,
    non-finite ones and random floats; eager and jitted."""
    import ml_dtypes  # noqa: PLC0415
    e4 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    e4 = e4[np.isfinite(e4)]
    rng = np.random.default_rng(68)
    cand = np.concatenate([
        e4, np.nextafter(e4, np.float32(np.inf)), np.nextafter(e4, np.float32(-np.inf)),
        e4 * 2, e4 / 2, e4 * 3, np.float32([0.3, 464, 480, 512, 2.0**-10, 3 * 2.0**-10,
                                            np.inf, -np.inf, np.nan, 1e-40, -0.0]),
        rng.standard_normal(2000).astype(np.float32) * np.exp2(rng.integers(-12, 10, 2000))])
    cand = cand.astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        want = cand.astype(ml_dtypes.float8_e4m3fn).astype(np.float32) == cand
    assert want.sum() > 400 and (~want).sum() > 400
    np.testing.assert_array_equal(np.asarray(qi._is_e4m3(jnp.asarray(cand))), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(qi._is_e4m3)(jnp.asarray(cand))), want)


def _qarray(scale, k=32):
    """A qwix NVFP4 QArray [E, K, 1] of all-ones codes with the given scales [E, K/16, 1]."""
    scale = jnp.asarray(scale, jnp.float32)
    qv = jnp.ones(scale.shape[:-2] + (k, 1), jnp.float4_e2m1fn)
    return qwix.QArray(qv, scale, None, "nvfp4")


def test_from_qwix_global_scale_edges():
    """The expert's power of two brings its largest scale into (224, 448]: exactly 448 x 2^j
    gives 2^j and a block scale of 448; one float32 step above it gives 2^(j+1); exactly
    224 x 2^j gives 2^(j-1) (448 again)."""
    j = -5
    top = np.float32(448 * 2.0 ** j)
    above = np.nextafter(top, np.float32(np.inf))
    cases = [(top, 2.0 ** j, 448.0), (np.float32(224 * 2.0 ** j), 2.0 ** (j - 1), 448.0)]
    for amax, g, b in cases:
        t = qi.from_qwix(_qarray([[[amax], [np.float32(2.0 ** j)]]]))
        assert float(t.global_scale[0]) == g
        assert float(jnp.max(t.scales.astype(jnp.float32))) == b
    # above 448 x 2^j the next power of two; the scale is then no e4m3 value times it: refused
    with pytest.raises(ValueError, match="not an e4m3 value"):
        qi.from_qwix(_qarray([[[above], [np.float32(2.0 ** j)]]]))
    t = qi.from_qwix(_qarray([[[np.float32(480 * 2.0 ** j)], [np.float32(2.0 ** j)]]]))
    assert float(t.global_scale[0]) == 2.0 ** (j + 1)
    assert float(jnp.max(t.scales.astype(jnp.float32))) == 240.0


def test_to_qwix_exactness_edges():
    """block scale x global scale is written when float32 (or bfloat16) holds it exactly: a
    product using every significand bit converts, one more bit is refused; a product below the
    smallest normal of the scale dtype is refused, the smallest normal itself converts."""
    def tensor(b, g):
        return jn.NVFP4Tensor(jnp.full((1, 16), 0x22, jnp.uint8),
                              jnp.full((1, 2), b, jnp.float8_e4m3fn), jnp.float32(g))
    b = 1.875                                            # 1.111b: 4 significand bits
    for dtype, bits in ((jnp.float32, 24), (jnp.bfloat16, 8)):
        g_fits = 1 + 2.0 ** -(bits - 4)                  # 1.0..01b: bits - 3 significand bits
        g_over = 1 + 2.0 ** -(bits - 3)
        q = qi.to_qwix(tensor(b, g_fits), dtype=dtype)
        assert float(q.scale[0, 0]) == b * g_fits
        with pytest.raises(ValueError, match=rf"not exact in {jnp.dtype(dtype).name}"):
            qi.to_qwix(tensor(b, g_over), dtype=dtype)
        # the smallest e4m3 subnormal 2^-9 times 2^-117 is 2^-126: the smallest normal float32
        assert float(qi.to_qwix(tensor(2.0 ** -9, 2.0 ** -117), dtype=dtype).scale[0, 0]) \
            == 2.0 ** -126
        with pytest.raises(ValueError, match="not exact"):
            qi.to_qwix(tensor(2.0 ** -9, 2.0 ** -118), dtype=dtype)


def test_expert_parallel_takes_qwix_fields(rng):
    """shard_moe_weights and moe_expert_parallel take what jn.moe takes: qwix NVFP4 fields, with
    per-channel scales and with scales shared by every expert (which have no expert axis to
    split: placed as their conversions); the layer equals jn.moe on the conversions."""
    from conftest import cpu_devices  # noqa: PLC0415
    mesh = jax.sharding.Mesh(np.array(cpu_devices(2)), ("ep",))
    e, h, i = 2, 64, 32
    config = jn.MoEConfig(num_experts=e, top_k=1, hidden_size=h, intermediate_size=i)
    x = jnp.asarray(rng.standard_normal((4, h)), jnp.bfloat16)
    for shared in (False, True):
        def q(w, shared=shared):
            return qwix.quantize(w, "nvfp4", tiled_axes={1: 16},
                                 channelwise_axes=() if shared else (0, 2))
        qw = jn.MoEWeights(router_weight=jnp.asarray(rng.standard_normal((e, h)), jnp.float32),
                           w13=q(_weights(rng, (e, h, 2 * i), spread=False) * 0.1),
                           w2=q(_weights(rng, (e, i, h), spread=False) * 0.1))
        converted = qi.weights_from_qwix(qw)
        placed = jn.shard_moe_weights(qw, mesh)
        _assert_same_tree(placed, converted)
        assert placed.w13.data.sharding.spec == jax.sharding.PartitionSpec("ep")
        want = jn.moe(x, converted, config, backend="reference")
        got = jn.moe_expert_parallel(x, qw, config, mesh, backend="reference")
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=1e-2, atol=1e-2)
