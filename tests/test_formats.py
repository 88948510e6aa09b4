"""NVFP4Tensor's static ``layout`` field (jax_nvfp4/formats.py): pytree aux data that survives
jit, vmap, shard_map and tree_map, default "checkpoint", checked by validate()."""

import jax
import jax.numpy as jnp
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
