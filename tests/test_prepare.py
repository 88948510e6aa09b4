"""prepare_weights (jax_nvfp4/ops/prepare.py) on a whole MoEWeights: every NVFP4 field converted the
way the single-tensor conversion does it (that one is checked against independent oracles in
tests/test_layout.py and tests/test_fp8.py), the other fields and the row order as documented,
and errors naming the field. The single-tensor cases are in tests/test_layout.py and
tests/test_fp8.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as jn
from jax_nvfp4.maths import layout
from jax_nvfp4.maths.formats import Fp8Weights

WEIGHTS = ("w13", "w2", "shared_w13", "shared_w2")


def moe_weights(rng, e=2, h=128, i=128):
    f = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.05  # noqa: E731
    return jn.quantize_moe(f(e, h), f(e, 2 * i, h), f(e, h, i), router_bias=f(e),
                           shared_w13=f(2 * i, h), shared_w2=f(h, i),
                           w13_input_scale=np.full(e, 0.01, np.float32))


def same_bytes(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))


@pytest.mark.parametrize("source,how", [("checkpoint", "eager"), ("sm90", "jit")])
def test_moe_weights_to_fp8(rng, source, how):
    """Each NVFP4 field becomes the Fp8Weights its own tensor gives; the row order (w13_paired)
    and every other field are kept, eager and under jit; prepared weights are returned as they
    are."""
    w = moe_weights(rng)
    if source == "sm90":
        w = jn.prepare_weights(w)
    if how == "jit":
        p = jax.jit(jn.prepare_weights, static_argnames="layout")(w, layout="fp8")
    else:
        p = jn.prepare_weights(w, "fp8")
    assert isinstance(p, jn.MoEWeights)
    assert p.w13_paired == (source == "sm90")
    for name in WEIGHTS:
        got, want = getattr(p, name), jn.prepare_weights(getattr(w, name), "fp8")
        assert isinstance(got, Fp8Weights) and got.layout == "fp8", name
        assert same_bytes(got.codes, want.codes), name
        assert same_bytes(got.global_scale, getattr(w, name).global_scale), name
    for f in dataclasses.fields(w):
        if f.name not in WEIGHTS:
            a, b = getattr(w, f.name), getattr(p, f.name)
            assert (a is None and b is None) or same_bytes(a, b), f.name
    again = jn.prepare_weights(p, "fp8")
    assert all(getattr(again, n) is getattr(p, n) for n in WEIGHTS)
    assert again.w13_paired == p.w13_paired


def test_moe_weights_without_shared_experts(rng):
    """Optional NVFP4 fields left None stay None in every layout."""
    w = dataclasses.replace(moe_weights(rng), shared_w13=None, shared_w2=None)
    for lay in ("sm90", "fp8"):
        p = jn.prepare_weights(w, lay)
        assert p.shared_w13 is None and p.shared_w2 is None, lay
    back = jn.prepare_weights(jn.prepare_weights(w), "checkpoint")
    for name in ("w13", "w2"):
        assert same_bytes(getattr(back, name).data, getattr(w, name).data), name


def test_moe_weights_with_fp8_fields_refuse_other_layouts(rng):
    """The e4m3 rounding is not invertible: converting back is an error naming the field."""
    p = jn.prepare_weights(moe_weights(rng), "fp8")
    for lay in ("checkpoint", "sm90"):
        with pytest.raises(ValueError, match=rf"^x\.w13: Fp8Weights .* cannot be converted to "
                                             rf"layout '{lay}'"):
            jn.prepare_weights(p, lay)
    # one field prepared by hand among NVFP4 ones: named too
    w = moe_weights(rng)
    mixed = dataclasses.replace(w, w2=jn.prepare_weights(w.w2, "fp8"))
    with pytest.raises(ValueError, match=r"^x\.w2: Fp8Weights"):
        jn.prepare_weights(mixed, "sm90")
    both = jn.prepare_weights(mixed, "fp8")             # the fp8 layout takes it as it is
    assert both.w2 is mixed.w2 and isinstance(both.w13, Fp8Weights)


def test_bad_input_names_the_argument(rng):
    w = moe_weights(rng)
    with pytest.raises(ValueError, match=r"^layout: expected one of \('checkpoint', 'sm90', 'fp8'\)"):
        jn.prepare_weights(w, "SM90")
    for bad in (None, jnp.zeros((128, 64), jnp.uint8), {"w13": w.w13}):
        with pytest.raises(ValueError, match=r"^x: expected an NVFP4Tensor, Fp8Weights or a "
                                             rf"MoEWeights, got {type(bad).__name__}$"):
            jn.prepare_weights(bad)
    one = jn.quantize(jnp.ones((96, 64), jnp.float32))     # one tensor: named x
    with pytest.raises(ValueError, match=r"^x: layout 'sm90' needs .*got N = 96, K = 64"):
        jn.prepare_weights(one)


def test_sm90_then_checkpoint_restores_the_stored_rows(rng):
    """sm90 pairs w13 and shared_w13 (layout.pair_gate_up, checked against an index oracle in
    tests/test_layout.py) and lays out every field; checkpoint gives back the stored bytes."""
    w = moe_weights(rng)
    p = jn.prepare_weights(w)
    assert p.w13_paired
    for name in WEIGHTS:
        src = getattr(w, name)
        if name in ("w13", "shared_w13"):
            src = layout.pair_gate_up(src)
        assert getattr(p, name).layout == "sm90", name
        assert same_bytes(layout.checkpoint_data(getattr(p, name)), src.data), name
        assert same_bytes(layout.checkpoint_scales(getattr(p, name)), src.scales), name
    back = jn.prepare_weights(p, "checkpoint")
    assert not back.w13_paired
    for name in WEIGHTS:
        a, b = getattr(w, name), getattr(back, name)
        assert b.layout == "checkpoint" and same_bytes(a.data, b.data) and same_bytes(
            a.scales, b.scales), name


def test_shape_errors_name_the_field(rng):
    """A field whose shape a layout cannot take is named (x.<field>) in the error."""
    w = moe_weights(rng, i=64)          # w2 [E, H, 64]: K % 128 != 0 for fp8, fine for sm90
    with pytest.raises(ValueError, match=r"^x\.w2: layout 'fp8' needs K % 128 == 0.*K = 64"):
        jn.prepare_weights(w, "fp8")
    w = moe_weights(rng, h=192)         # w2 [E, 192, I]: N % 128 != 0 for sm90
    with pytest.raises(ValueError, match=r"^x\.w2: layout 'sm90' needs .*N = 192"):
        jn.prepare_weights(w)
    bad = dataclasses.replace(w, w2=jn.NVFP4Tensor(w.w2.data, w.w2.scales, w.w2.global_scale,
                                                   "sm90"))
    with pytest.raises(ValueError, match=r"^x\.w2: layout 'sm90' needs .*N = 192"):
        jn.prepare_weights(bad, "checkpoint")


def test_pairing_errors_name_the_field(rng):
    """w13 is paired then laid out (sm90), or laid out back then unpaired (checkpoint): a shape
    the layout cannot take is reported under the field's name on both ways."""
    w = moe_weights(rng, h=128, i=96)       # w13 [E, 192, 128]: pairs (I % 8 == 0), N % 128 != 0
    with pytest.raises(ValueError, match=r"^x\.w13: layout 'sm90' needs .*N = 192"):
        jn.prepare_weights(w)
    # the same rows marked sm90 and paired (as if built by hand): converting back names it too
    odd = jn.NVFP4Tensor(w.w13.data, w.w13.scales, w.w13.global_scale, "sm90")
    paired = dataclasses.replace(w, w13=odd, w13_paired=True)
    with pytest.raises(ValueError, match=r"^x\.w13: layout 'sm90' needs .*N = 192"):
        jn.prepare_weights(paired, "checkpoint")


def test_prepared_weights_are_checked_when_passed_again(rng):
    """Fp8Weights given to prepare_weights(..., "fp8") are returned as they are, once checked:
    a malformed one is an error naming it (x, or x.<field> in a MoEWeights)."""
    w = moe_weights(rng)
    p = jn.prepare_weights(w.w2, "fp8")
    bad = Fp8Weights(p.codes, p.global_scale.astype(jnp.float16))
    with pytest.raises(ValueError, match=r"^x\.global_scale: expected float32, got float16"):
        jn.prepare_weights(bad, "fp8")
    with pytest.raises(ValueError, match=r"^x\.w2\.global_scale: expected float32, got float16"):
        jn.prepare_weights(dataclasses.replace(w, w2=bad), "fp8")


def test_a_malformed_field_is_named_on_the_pairing_path(rng):
    """w13 is paired before it is laid out: its own checks name it too."""
    w = moe_weights(rng)
    bad = jn.NVFP4Tensor(w.w13.data.astype(jnp.int32), w.w13.scales, w.w13.global_scale)
    with pytest.raises(ValueError, match=r"^x\.w13\.data: expected uint8"):
        jn.prepare_weights(dataclasses.replace(w, w13=bad))
