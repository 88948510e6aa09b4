"""The flax.nnx, flax.linen and Equinox modules (each skipped when its framework is missing)."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as jn

E, H, I = 4, 64, 32


def layer(rng, activation="w4a16"):
    config = jn.MoEConfig.deepseek_v4_pro(num_experts=E, hidden_size=H, intermediate_size=I,
                                          top_k=2, activation=activation)
    weights = jn.quantize_moe(rng.standard_normal((E, H)) * 0.1,
                              rng.standard_normal((E, 2 * I, H)) * 0.1,
                              rng.standard_normal((E, H, I)) * 0.1,
                              shared_w13=rng.standard_normal((2 * I, H)) * 0.1,
                              shared_w2=rng.standard_normal((H, I)) * 0.1)
    return weights, config


def leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(u).tobytes() == np.asarray(v).tobytes()
        for u, v in zip(la, lb))


@pytest.mark.slow
def test_nnx_model_trains_around_the_frozen_moe(rng):
    nnx = pytest.importorskip("flax.nnx")
    optax = pytest.importorskip("optax")
    from jax_nvfp4.nn.nnx import MoE, FrozenWeights

    weights, config = layer(rng, "w4a4")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.inp = nnx.Linear(16, H, rngs=rngs)
            self.moe = MoE(weights, config)
            self.out = nnx.Linear(H, 8, rngs=rngs)

        def __call__(self, x):
            h = self.inp(x)
            return self.out(h + self.moe(h))

    model = Model(nnx.Rngs(0))
    x = jnp.asarray(rng.standard_normal((2, 8, 16)), jnp.float32)      # [B, S, features]
    y = jnp.asarray(rng.standard_normal((2, 8, 8)), jnp.float32)
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    before = jax.tree.map(lambda v: v, nnx.state(model, FrozenWeights))

    @nnx.jit
    def step(model, opt, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        opt.update(model, grads)
        return loss, grads

    losses = []
    for _ in range(6):
        loss, grads = step(model, opt, x, y)
        losses.append(float(loss))
    assert losses[-1] < 0.9 * losses[0], losses
    # the input layer is trained through the MoE (its gradient passes the layer)
    assert np.any(np.asarray(grads["inp"]["kernel"][...]))
    assert not nnx.state(grads, FrozenWeights)                       # no gradient for the MoE
    assert leaves_equal(nnx.state(model, FrozenWeights), before)


@pytest.mark.slow
def test_linen_module(rng):
    nn = pytest.importorskip("flax.linen")
    from jax_nvfp4.nn.linen import COLLECTION, MoE

    weights, config = layer(rng)
    x = jnp.asarray(rng.standard_normal((3, 5, H)), jnp.float32)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(H)(x)
            return MoE(config, name="moe")(h)

    model = Model()
    variables = model.init(jax.random.key(0), x)
    assert COLLECTION in variables and "moe" not in variables["params"]
    variables = {"params": variables["params"], COLLECTION: {"moe": {"weights": weights}}}
    out = model.apply(variables, x)
    h = nn.Dense(H).apply({"params": variables["params"]["Dense_0"]}, x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jn.moe(h, weights, config)))
    # jitted: one compile (op by op the backward pass took ~13 s on CPU)
    g = jax.jit(jax.grad(lambda p: jnp.sum(model.apply(
        {"params": p, COLLECTION: variables[COLLECTION]}, x) ** 2)))(variables["params"])
    assert np.any(np.asarray(g["Dense_0"]["kernel"]))


@pytest.mark.slow
def test_equinox_module(rng):
    eqx = pytest.importorskip("equinox")
    from jax_nvfp4.nn.eqx import MoE, trainable

    weights, config = layer(rng)
    m = MoE(weights, config)
    x = jnp.asarray(rng.standard_normal((2, 3, H)), jnp.float32)
    np.testing.assert_allclose(np.asarray(eqx.filter_jit(lambda m, x: m(x))(m, x)),
                               np.asarray(jn.moe(x, weights, config)), rtol=1e-6, atol=1e-7)
    # jitted: one compile each (op by op the backward passes took most of this test's time)
    gx = eqx.filter_jit(eqx.filter_grad(lambda x, m: jnp.sum(m(x) ** 2)))(x, m)
    assert gx.shape == x.shape and np.any(np.asarray(gx))
    gm = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2)))(m)
    assert all(not np.any(np.asarray(v, np.float32)) for v in jax.tree.leaves(gm))
    params, static = eqx.partition(m, trainable(m))
    assert not jax.tree.leaves(params)                       # nothing of the MoE is trainable
    with pytest.raises(TypeError, match="config"):
        MoE(weights, "v4")


def test_importing_jax_nvfp4_needs_no_framework():
    # A child interpreter where flax and equinox cannot be imported.
    code = ("import sys; sys.modules['flax'] = None; sys.modules['equinox'] = None\n"
            "import jax_nvfp4, jax_nvfp4.nn\n"
            "for name, pkg in (('nnx', 'flax'), ('linen', 'flax'), ('eqx', 'equinox')):\n"
            "    try:\n"
            "        __import__('jax_nvfp4.nn.' + name)\n"
            "    except ImportError as e:\n"
            "        assert pkg in str(e) and 'jax_nvfp4[frameworks]' in str(e), str(e)\n"
            "    else:\n"
            "        raise AssertionError(name + ' imported without ' + pkg)\n"
            "print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=str(__import__("pathlib").Path(jn.__file__).parents[1]))
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]
