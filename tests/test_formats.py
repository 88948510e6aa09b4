"""NVFP4Tensor's static ``layout`` field (jax_nvfp4/maths/formats.py): pytree aux data that survives
jit, vmap, shard_map and tree_map, default "checkpoint", checked by validate()."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nvfp4 as jn
from conftest import cpu_devices, QUANTIZE_STACK
from oracles import dequant64


def tensor(rng, shape=(4, 128, 64)):
    return QUANTIZE_STACK(jnp.asarray(rng.standard_normal(shape).astype(np.float32)))


def test_default_layout_and_positional_constructor(rng):
    t = tensor(rng)
    assert t.layout == "checkpoint"
    assert jn.NVFP4Tensor(t.data, t.scales, t.global_scale).layout == "checkpoint"
    assert jn.NVFP4Tensor(t.data, t.scales, t.global_scale, "sm90").layout == "sm90"
    assert jn.LAYOUTS == ("checkpoint", "sm90")


def test_layout_is_aux_data_not_a_leaf(rng):
    p = jn.prepare_weights(tensor(rng))
    leaves, tree = jax.tree_util.tree_flatten(p)
    assert len(leaves) == 3 and all(isinstance(a, jax.Array) for a in leaves)
    back = jax.tree_util.tree_unflatten(tree, leaves)
    assert back.layout == "sm90"
    # two layouts are two tree structures: jit caches and tree_map pairings tell them apart
    assert tree != jax.tree_util.tree_structure(jn.prepare_weights(p, "checkpoint"))
    mapped = jax.tree.map(lambda a: a + 0 if a.dtype == jnp.uint8 else a, p)
    assert mapped.layout == "sm90"
    np.testing.assert_array_equal(np.asarray(mapped.data), np.asarray(p.data))


def test_survives_jit_and_vmap(rng):
    p = jn.prepare_weights(tensor(rng))
    out = jax.jit(lambda t: t)(p)
    assert out.layout == "sm90"
    np.testing.assert_array_equal(np.asarray(out.data), np.asarray(p.data))
    # the layout is visible to Python at trace time (a static value, not a tracer)
    flag = jax.jit(lambda t: jnp.int32(t.layout == "sm90"))
    assert int(flag(p)) == 1 and int(flag(jn.prepare_weights(p, "checkpoint"))) == 0
    seen = []

    def one_expert(t):                                    # vmap maps the expert axis
        seen.append((t.layout, t.data.shape))
        return t

    per_expert = jax.vmap(one_expert)(p)
    assert seen == [("sm90", (128, 32))] and per_expert.layout == "sm90"
    np.testing.assert_array_equal(np.asarray(per_expert.data), np.asarray(p.data))


def test_survives_shard_map(rng, on_cpu):
    mesh = jax.make_mesh((8,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=cpu_devices(8))
    p = jn.prepare_weights(tensor(rng, (8, 128, 64)))
    seen = []

    def body(t):
        seen.append(t.layout)
        return jn.prepare_weights(t, "checkpoint").data    # one expert's codes, per device

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),), out_specs=P("ep")))
    back = f(p)
    assert seen == ["sm90"]
    np.testing.assert_array_equal(np.asarray(back),
                                  np.asarray(jn.prepare_weights(p, "checkpoint").data))


def test_validate_layout_errors(rng):
    t = tensor(rng)
    bad = jn.NVFP4Tensor(t.data, t.scales, t.global_scale, "sm100")
    with pytest.raises(ValueError, match=r"w\.layout: expected one of \('checkpoint', 'sm90'\), "
                                         r"got 'sm100'"):
        bad.validate("w")
    with pytest.raises(ValueError, match=r"w: layout 'sm90' needs .* N % 128 == 0 and K % 64 == 0, "
                                         r"got N = 64, K = 64"):
        jn.NVFP4Tensor(t.data[:, :64], t.scales[:, :64], t.global_scale, "sm90").validate("w")
    t32 = tensor(rng, (2, 128, 32))                       # K = 32: a valid checkpoint tensor
    assert t32.validate("w") is t32
    with pytest.raises(ValueError, match=r"got N = 128, K = 32"):
        jn.NVFP4Tensor(t32.data, t32.scales, t32.global_scale, "sm90").validate("w")
    one = jn.quantize(jnp.ones((64,)))                    # a 1-D tensor has no N axis
    with pytest.raises(ValueError, match=r"layout 'sm90' needs data \[\.\.\., N, K/2\]"):
        jn.NVFP4Tensor(one.data, one.scales, one.global_scale, "sm90").validate("w")
    ok = jn.NVFP4Tensor(t.data, t.scales, t.global_scale, "sm90")
    assert ok.validate("w") is ok                         # 128 x 64 blocks fit


def test_dequantize_of_a_jit_constant(rng):
    # Codes closed over by a jitted function are compile-time constants; XLA's constant folding
    # of the uint8 -> float4_e2m1fn bitcast read each code as a whole byte (wrong values).
    t = tensor(rng, (2, 8, 64))
    ref = dequant64(t.data, t.scales, t.global_scale)
    np.testing.assert_allclose(np.asarray(jax.jit(lambda: jn.dequantize(t))()), ref, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.jit(jn.dequantize)(t)), ref, rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# The E2M1 codec and its byte packing, against ml_dtypes' float4_e2m1fn (an oracle we did not
# write): every code, every byte, every rounding tie.
# ------------------------------------------------------------------------------------------------

F4 = ml_dtypes.float4_e2m1fn


def _f4_values(codes):
    """The float64 values of uint8 codes 0..15 as ml_dtypes reads the 4-bit patterns."""
    codes = np.asarray(codes, np.uint8)
    return codes.view(F4).astype(np.float64)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_decode_e2m1_every_code_bit_for_bit(dtype):
    codes = np.arange(256, dtype=np.uint8)               # only the low nibble is read
    want = _f4_values(codes & 0xF).astype(jnp.dtype(dtype))
    got = np.asarray(jax.jit(lambda c: jn.formats.decode_e2m1(c, dtype))(jnp.asarray(codes)))
    assert got.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{want.itemsize}"))
    assert np.signbit(got[8]) and got[8] == 0             # code 8 is -0.0
    np.testing.assert_array_equal(jn.formats.E2M1_VALUES, _f4_values(np.arange(16)))


def test_pack_and_unpack_every_byte():
    data = np.arange(256, dtype=np.uint8).reshape(4, 64)
    codes = np.asarray(jn.formats.unpack_nibbles(jnp.asarray(data)))
    assert codes.dtype == np.uint8 and codes.shape == (4, 128)
    np.testing.assert_array_equal(codes[:, 0::2], data & 0xF)          # element 2j: low nibble
    np.testing.assert_array_equal(codes[:, 1::2], data >> 4)
    np.testing.assert_array_equal(np.asarray(jn.formats.pack_nibbles(jnp.asarray(codes))), data)
    vals = np.asarray(jn.formats.decode_packed(jnp.asarray(data), jnp.bfloat16))
    assert vals.dtype == jnp.bfloat16
    np.testing.assert_array_equal(vals.astype(np.float64), _f4_values(codes))
    f4 = np.asarray(jn.formats.unpack_codes(jnp.asarray(data)))
    assert f4.dtype == F4
    np.testing.assert_array_equal(f4.view(np.uint8) & 0xF, codes)     # the same 4-bit patterns
    np.testing.assert_array_equal(np.asarray(jn.formats.pack_codes(jnp.asarray(f4))), data)
    # a constant folded inside jit, as the docstrings promise
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda: jn.formats.pack_codes(f4))()), data)


def test_encode_e2m1_rounds_like_a_float4_cast():
    """Round to nearest, ties to even, as ml_dtypes' cast to float4_e2m1fn: every midpoint, its
    float32 neighbours, the signed zeros."""
    mags = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], np.float32)
    mids = (mags[1:] + mags[:-1]) / 2
    pts = np.concatenate([mags, mids, np.nextafter(mids, 0), np.nextafter(mids, 7), [0.1, 5.9]])
    x = np.concatenate([pts, -pts]).astype(np.float32)
    got = np.asarray(jn.formats.encode_e2m1(jnp.asarray(x)))
    want = x.astype(F4).view(np.uint8) & 0xF
    np.testing.assert_array_equal(got, want)


def test_check_k_and_scales_from_bytes():
    for k in (32, 64, 2**20):
        jn.formats.check_k(k)
    for k in (0, -32, 16, 48):
        with pytest.raises(ValueError, match=rf"^w: the last \(K\) axis has size {k}; NVFP4 needs "
                                             r"K to be a positive multiple of 32 "):
            jn.formats.check_k(k, "w")
    raw = np.arange(256, dtype=np.uint8)
    for r in (raw, raw.view(np.int8)):
        got = np.asarray(jn.formats.scales_from_bytes(jnp.asarray(r)))
        assert got.dtype == ml_dtypes.float8_e4m3fn
        np.testing.assert_array_equal(got.view(np.uint8), raw)           # a bitcast
    f8 = jnp.asarray(raw.view(ml_dtypes.float8_e4m3fn))
    assert jn.formats.scales_from_bytes(f8) is f8
    with pytest.raises(ValueError, match="^scales: expected uint8/int8 bytes or float8_e4m3fn, "
                                         "got int16"):
        jn.formats.scales_from_bytes(jnp.zeros(4, jnp.int16))


@pytest.mark.parametrize("dtype,barrier", [(jnp.bfloat16, True), (jnp.float16, True),
                                           (jnp.float32, False), (jnp.uint8, False)])
def test_keep_rounded_bars_half_precision_only(dtype, barrier):
    x = jnp.ones((4,), dtype)
    jaxpr = str(jax.make_jaxpr(jn.formats.keep_rounded)(x))
    assert ("optimization_barrier" in jaxpr) == barrier
    assert jn.formats.keep_rounded(x).dtype == x.dtype


def test_expand_global_scale():
    """A [G] scale broadcasts over the leading axis; a [G, 2] scale of [G, N, K] scales rows :N/2
    (gate) and N/2: (up) apart; a scalar stays a scalar."""
    g = jnp.asarray([2.0, 3.0])
    assert jn.formats.expand_global_scale(g, 3).shape == (2, 1, 1)
    assert jn.formats.expand_global_scale(jnp.float32(5), 2).shape == (1, 1)
    half = jnp.asarray([[1.0, 10.0], [2.0, 20.0]])
    e = np.asarray(jn.formats.expand_global_scale(half, 3, lead=(2, 6)))
    assert e.dtype == np.float32 and e.shape == (2, 6, 1)
    np.testing.assert_array_equal(e[..., 0], [[1, 1, 1, 10, 10, 10], [2, 2, 2, 20, 20, 20]])
    # [G, 2] against a stack whose rows are 2 (N = 2) is one row each, and a [G] scale with a lead
    # is only broadcast
    e2 = np.asarray(jn.formats.expand_global_scale(half, 3, lead=(2, 2)))
    np.testing.assert_array_equal(e2[..., 0], [[1, 10], [2, 20]])
    assert jn.formats.expand_global_scale(g, 3, lead=(2, 6)).shape == (2, 1, 1)


def test_kernel_k_order_is_the_documented_permutation_and_inverts():
    """Inside each 128-wide chunk, position 32j + 16h + 4t + i holds logical k 32t + 8j + 4h + i."""
    k = np.arange(256, dtype=np.int32)
    got = np.asarray(jn.formats.to_kernel_k_order(jnp.asarray(np.stack([k, k + 1000]))))
    want = np.empty(256, np.int32)
    for c in range(2):
        for t in range(4):
            for j in range(4):
                for h in range(2):
                    for i in range(4):
                        pos = 128 * c + 32 * j + 16 * h + 4 * t + i
                        want[pos] = 128 * c + 32 * t + 8 * j + 4 * h + i
    np.testing.assert_array_equal(got, np.stack([want, want + 1000]))
    np.testing.assert_array_equal(np.asarray(jn.formats.from_kernel_k_order(jnp.asarray(got))),
                                  np.stack([k, k + 1000]))
    with pytest.raises(ValueError, match="^q: K=64 is not a multiple of 128"):
        jn.formats.to_kernel_k_order(jnp.zeros((2, 64)))


@pytest.mark.parametrize("gshape,lead,half", [
    ((4, 2), (4, 6), True), ((1, 2), (4, 6), True), ((2,), (6,), True),
    ((4, 1, 2), (4, 3, 6), True), ((4, 3, 2), (4, 3, 6), True),
    ((4, 2), (4, 5), False), ((4, 2), (4, 2), False), ((3, 2), (4, 6), False),
    ((4, 2, 2), (4, 3, 6), False), ((2,), (), False), ((4, 3), (4, 6), False),
    ((4,), (4, 6), False)])
def test_global_scale_half_split(gshape, lead, half):
    """A [..., 2] global scale over [..., N] (N even, not 2; the other axes matching or 1) scales
    the two halves of N apart; anything else broadcasts as it is."""
    g = jnp.arange(1, 1 + int(np.prod(gshape)), dtype=jnp.float32).reshape(gshape)
    e = np.asarray(jn.formats.expand_global_scale(g, len(lead) + 1, lead=lead))
    if half:
        n = lead[-1]
        assert e.shape == gshape[:-1] + (n, 1)
        gate, up = (np.repeat(np.asarray(g)[..., j:j + 1], n // 2, -1) for j in (0, 1))
        np.testing.assert_array_equal(e[..., : n // 2, 0], gate)
        np.testing.assert_array_equal(e[..., n // 2:, 0], up)
    else:
        assert e.shape == gshape + (1,) * (len(lead) + 1 - len(gshape))


def _t(data_shape, scales_shape=None, g_shape=(), layout="checkpoint", ddt=jnp.uint8,
       sdt=jnp.float8_e4m3fn, gdt=jnp.float32):
    if scales_shape is None:
        scales_shape = data_shape[:-1] + (data_shape[-1] // 8,)
    return jn.NVFP4Tensor(jnp.zeros(data_shape, ddt), jnp.zeros(scales_shape, sdt),
                          jnp.ones(g_shape, gdt), layout)


def test_validate_accepts_every_documented_global_scale_and_layout():
    for g in [(), (4,), (1,), (4, 1), (4, 2), (4, 128), (1, 128)]:
        _t((4, 128, 32), g_shape=g).validate("w")
    _t((128, 32), g_shape=()).validate()
    _t((128, 32), layout="sm90").validate()                  # N 128, K 64: the smallest sm90
    _t((2, 256, 64), layout="sm90", g_shape=(2,)).validate()


@pytest.mark.parametrize("t, msg", [
    (lambda: _t((4, 128, 32), ddt=jnp.int8),
     r"^w\.data: expected uint8 packed E2M1 codes, got int8$"),
    (lambda: _t((4, 128, 32), sdt=jnp.uint8),
     r"^w\.scales: expected float8_e4m3fn, got uint8 \(raw bytes: use "
     r"jax_nvfp4\.scales_from_bytes, a bitcast\)$"),
    (lambda: _t((4, 128, 32), gdt=jnp.bfloat16),
     r"^w\.global_scale: expected float32, got bfloat16$"),
    (lambda: _t((4, 128, 8)), r"^w\.data: the last \(K\) axis has size 16; NVFP4 needs K"),
    (lambda: _t((4, 128, 32), scales_shape=(4, 128, 3)),
     r"^w\.scales: expected shape \(4, 128, 4\) for data \(4, 128, 32\), got \(4, 128, 3\)$"),
    (lambda: _t((4, 128, 32), scales_shape=(128, 4)),
     r"^w\.scales: expected shape \(4, 128, 4\) for data \(4, 128, 32\), got \(128, 4\)$"),
    (lambda: _t((4, 128, 32), g_shape=(3,)),
     r"^w\.global_scale: shape \(3,\) does not match the leading axes \(4, 128\) \(use \[\] "
     r"for one tensor, \[G\] for \[G, N, K\], \[G, 2\] for separate first/second halves of N\)$"),
    (lambda: _t((4, 128, 32), g_shape=(4, 128, 1)), r"^w\.global_scale: shape \(4, 128, 1\) does"),
    (lambda: _t((4, 5, 32), g_shape=(4, 2)), r"^w\.global_scale: shape \(4, 2\) does not match"),
    (lambda: _t((4, 128, 32), layout="tiled"),
     r"^w\.layout: expected one of \('checkpoint', 'sm90'\), got 'tiled'$"),
    (lambda: _t((64,), layout="sm90"),
     r"^w: layout 'sm90' needs data \[\.\.\., N, K/2\] with N % 128 == 0 and K % 64 == 0, got "
     r"N = None, K = 128 \(data \(64,\)\)$"),
    (lambda: _t((64, 32), layout="sm90"),
     r"^w: layout 'sm90' needs .* got N = 64, K = 64 \(data \(64, 32\)\)$"),
    (lambda: _t((128, 16), layout="sm90"), r"^w: layout 'sm90' needs .* got N = 128, K = 32 "),
])
def test_validate_errors_name_the_field(t, msg):
    with pytest.raises(ValueError, match=msg):
        t().validate("w")


def test_validate_default_name():
    with pytest.raises(ValueError, match=r"^tensor\.data: expected uint8"):
        _t((4, 32), ddt=jnp.int8).validate()
    with pytest.raises(ValueError, match=r"^tensor\.data: the last \(K\) axis"):
        _t((4, 8)).validate()


def test_python_float_global_scale_is_a_value_error_eagerly(rng):
    """An NVFP4Tensor whose global scale is a Python float (under jit it becomes a float32
    tracer and works) is refused eagerly with the documented ValueError naming the field, not an
    AttributeError, by every entry point that reads it."""
    t = tensor(rng, (2, 128, 64))
    bad = jn.NVFP4Tensor(t.data, t.scales, 0.5)
    x = jnp.ones((3, 64), jnp.bfloat16)
    gs = jnp.array([1, 2], jnp.int32)
    calls = {"dequantize": lambda: jn.dequantize(bad),
             "grouped_gemm": lambda: jn.grouped_gemm(x, bad, gs, backend="reference"),
             "prepare_weights": lambda: jn.prepare_weights(bad),
             "validate": lambda: bad.validate("w")}
    for what, call in calls.items():
        with pytest.raises(ValueError, match=r"global_scale: expected a float32 array.*float"):
            call()
    for field in ("data", "scales"):
        with pytest.raises(ValueError, match=rf"w\.{field}: expected .* array.*list"):
            jn.NVFP4Tensor(**{**t.__dict__, field: [1, 2]}).validate("w")


def test_rank_promotion_raise_is_respected(rng):
    """With jax_numpy_rank_promotion="raise" (a setting many model codebases turn on) the
    library's own operations broadcast explicitly: decode, dequantize and the reference grouped
    GEMM run (the same numbers as without it)."""
    t = tensor(rng, (2, 32, 64))
    want = jn.dequantize(t)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.bfloat16)
    gs = jnp.array([2, 3], jnp.int32)
    gemm = jax.jit(lambda x, t: jn.grouped_gemm(x, t, gs, backend="reference"))
    y = np.asarray(gemm(x, t), np.float32)
    with jax.numpy_rank_promotion("raise"):
        np.testing.assert_array_equal(np.asarray(gemm(x, t), np.float32), y)
        np.testing.assert_array_equal(np.asarray(jn.dequantize(t)), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(jax.jit(jn.dequantize)(t)), np.asarray(want))
        codes = jn.formats.unpack_nibbles(t.data)
    np.testing.assert_array_equal(np.asarray(jn.formats.pack_nibbles(codes)), np.asarray(t.data))


def test_fp8_weights_validate_k_multiple_of_128():
    """Fp8Weights needs K a positive multiple of 128 (the fp8 chunk): 0, 64, 192 and 200 are
    refused naming codes, 128 and 256 accepted."""
    for k in (0, 64, 192, 200):
        with pytest.raises(ValueError, match=r"w\.codes: expected float8_e4m3fn \[\.\.\., N, K\] "
                                             r"with K a positive multiple of 128"):
            jn.Fp8Weights(jnp.zeros((2, 8, k), jnp.float8_e4m3fn), jnp.ones((2,))).validate("w")
    for k in (128, 256):
        jn.Fp8Weights(jnp.zeros((2, 8, k), jnp.float8_e4m3fn), jnp.ones((2,))).validate("w")
