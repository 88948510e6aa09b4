"""jax_nvfp4.options: every option vocabulary has its one home there (the modules that use one take
that very object), and ``precision`` is checked once where it enters the public API and passed
down as a checked :class:`~jax_nvfp4.options.Precision`."""

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as jn
from jax_nvfp4 import checkpoint, fp8, formats, gemm, kernel_config, options, sharding
from conftest import QUANTIZE_STACK


def test_vocabularies_live_in_options():
    assert sharding.COMBINES is options.COMBINES == ("psum", "psum_scatter")
    assert fp8.FP8_K_ORDERS is formats.FP8_K_ORDERS is options.FP8_K_ORDERS
    assert checkpoint.FORMATS is options.CHECKPOINT_FORMATS == ("modelopt", "quark")
    assert kernel_config.FAMILIES is options.FAMILIES
    assert kernel_config.FP8_FAMILIES is options.FP8_FAMILIES
    assert set(options.FP8_FAMILIES) <= set(options.FAMILIES)
    assert kernel_config.LAYOUT_CODES is options.LAYOUT_CODES
    assert not hasattr(gemm, "RHS_LAYOUT_CODES")                  # no second layout -> code map
    assert set(options.LAYOUT_CODES) == set(options.WEIGHT_LAYOUTS)
    assert sorted(options.LAYOUT_CODES.values()) == list(range(len(options.LAYOUT_CODES)))


@pytest.mark.parametrize("bad", ["fp16", "FP8", "", None, 8, b"fp8"])
def test_check_precision_refuses_naming_the_argument(bad):
    with pytest.raises(ValueError, match=r"precision: expected one of \('exact', 'fp8'\)"):
        options.check_precision(bad)
    with pytest.raises(ValueError, match="mode: expected one of"):
        options.check_precision(bad, name="mode")


def test_precision_is_its_name():
    for name in options.PRECISIONS:
        p = options.check_precision(name)
        assert isinstance(p, options.Precision) and p == name and hash(p) == hash(name)
        assert repr(p) == repr(name) and f"{p}" == name and str(p) == name
        assert options.check_precision(p) is p                     # not checked, not rebuilt
        assert pickle.loads(pickle.dumps(p)) == name
    assert options.EXACT == "exact" and options.FP8 == "fp8"
    assert options.check_precision("fp8", 256) == "fp8" and options.check_precision("exact", 96)
    with pytest.raises(ValueError, match="K=96: precision='fp8' needs K to be a multiple of 128"):
        options.check_precision(options.FP8, 96)                 # a checked value: K still checked


def test_moe_config_stores_a_checked_precision():
    c = jn.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128,
                     precision="fp8")
    assert isinstance(c.precision, options.Precision) and c.precision == "fp8"
    assert c == jn.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128,
                             precision=options.FP8)
    with pytest.raises(ValueError, match="precision: expected one of"):
        jn.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128,
                     precision="fp4")


@pytest.fixture
def counted(monkeypatch):
    """The number of times a precision string is checked against PRECISIONS."""
    calls = []
    real = options.check_choice

    def check_choice(value, choices, name):
        if choices == options.PRECISIONS:
            calls.append(value)
        return real(value, choices, name)

    monkeypatch.setattr(options, "check_choice", check_choice)
    return calls


@pytest.mark.parametrize("precision", ["exact", "fp8"])
@pytest.mark.parametrize("backend", ["ffi", "reference"])
def test_grouped_gemm_checks_precision_once_per_trace(counted, precision, backend):
    rhs = QUANTIZE_STACK(jax.random.normal(jax.random.key(0), (2, 128, 128), jnp.float32))
    x = jnp.ones((8, 128), jnp.bfloat16)
    sizes = jnp.array([3, 5], jnp.int32)
    f = jax.jit(lambda a: jn.grouped_gemm(a, rhs, sizes, precision=precision, backend=backend))
    f.lower(x)
    assert counted == [precision]
    counted.clear()
    jn.grouped_gemm(x, rhs, sizes, precision=options.check_precision(precision), backend=backend)
    assert counted == [precision]                    # the explicit check above, none inside


def test_the_layer_checks_precision_when_the_config_is_built(counted):
    rng = np.random.default_rng(0)
    f = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.1  # noqa: E731
    w = jn.quantize_moe(f(4, 128), f(4, 256, 128), f(4, 128, 128))
    c = jn.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128,
                     precision="fp8", activation="w4a16")
    assert counted == ["fp8"]
    counted.clear()
    jax.jit(lambda x: jn.moe(x, w, c, backend="ffi")).lower(jnp.ones((4, 128), jnp.bfloat16))
    assert counted == []
