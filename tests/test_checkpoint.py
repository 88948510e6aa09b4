"""Tests of jax_nvfp4.checkpoint: the safetensors reader/writer and the ModelOpt/Quark MoE loader.

Small shapes (E=4, H=64, I=32, one shared expert), random non-zero data, CPU only.
"""

from __future__ import annotations

import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_nvfp4 import checkpoint as ckpt
from jax_nvfp4.maths import quantization
from jax_nvfp4.maths.formats import NVFP4Tensor
from jax_nvfp4.config.moe_params import MoEConfig, MoEWeights

E, H, I, TOPK, VOCAB = 4, 64, 32, 2, 50
PREFIX = "model.layers.1.mlp"
F8 = np.dtype(ml_dtypes.float8_e4m3fn)
PROJ = {"hf": ("gate_proj", "up_proj", "down_proj"), "deepseek": ("w1", "w3", "w2")}
INPUT = {"modelopt": "input_scale", "quark": "input_scale_2"}


def cfg(**kw) -> MoEConfig:
    base = dict(num_experts=E, top_k=TOPK, hidden_size=H, intermediate_size=I, n_shared_experts=1)
    base.update(kw)
    return MoEConfig(**base)


# ------------------------------------------------------------------------------------------------
# reference data, built independently of save_moe
# ------------------------------------------------------------------------------------------------

def rand_linear(rng, n, k):
    """Random NVFP4 linear: uint8 [n, k/2] (never all zero), e4m3 scales whose max is 448."""
    data = rng.integers(1, 256, size=(n, k // 2), dtype=np.uint8)
    sbytes = rng.integers(0x30, 0x7E, size=(n, k // 16), dtype=np.uint8)  # positive, finite
    sbytes[rng.integers(n), rng.integers(k // 16)] = 0x7E  # 448: ModelOpt's per-tensor maximum
    ws2 = np.float32(rng.uniform(1e-4, 1e-2))
    inp = np.float32(rng.uniform(1e-3, 1e-1))
    return dict(data=data, scales=sbytes.view(F8), ws2=ws2, inp=inp)


def reference(seed=0, split_expert=1, shared_split=True, hash_table=False, bias=True):
    """Per-projection reference tensors: {('expert', e, role) | ('shared', role): linear}."""
    rng = np.random.default_rng(seed)
    lin = {}
    for e in range(E):
        for role in ("gate", "up"):
            lin[("expert", e, role)] = rand_linear(rng, I, H)
        lin[("expert", e, "down")] = rand_linear(rng, H, I)
        if e != split_expert:  # gate and up share weight_scale_2 except on split_expert
            lin[("expert", e, "up")]["ws2"] = lin[("expert", e, "gate")]["ws2"]
    for role in ("gate", "up"):
        lin[("shared", role)] = rand_linear(rng, I, H)
    lin[("shared", "down")] = rand_linear(rng, H, I)
    if not shared_split:
        lin[("shared", "up")]["ws2"] = lin[("shared", "gate")]["ws2"]
    extra = {"router": rng.standard_normal((E, H)).astype(np.float32)}
    if bias:
        extra["bias"] = rng.standard_normal(E).astype(np.float32)
    if hash_table:
        extra["tid2eid"] = rng.integers(0, E, size=(VOCAB, TOPK)).astype(np.int64)
    return lin, extra


def tensors_from(lin, extra, fmt="modelopt", names="hf", inputs=True, prefix=PREFIX):
    """Checkpoint tensor dict with the real names; scalars alternate between shape [] and [1]."""
    out = {f"{prefix}.gate.weight": extra["router"].astype(ml_dtypes.bfloat16).astype(np.float32)}
    if "bias" in extra:
        out[f"{prefix}.gate.e_score_correction_bias"] = extra["bias"]
    if "tid2eid" in extra:
        out[f"{prefix}.gate.tid2eid"] = extra["tid2eid"]
    roles = dict(zip(("gate", "up", "down"), PROJ[names]))
    count = 0
    for key, t in lin.items():
        if key[0] == "expert":
            base = f"{prefix}.experts.{key[1]}.{roles[key[2]]}"
        else:
            base = f"{prefix}.shared_experts.{roles[key[1]]}"
        shape = () if count % 2 == 0 else (1,)
        count += 1
        out[f"{base}.weight"] = t["data"]
        out[f"{base}.weight_scale"] = t["scales"]
        out[f"{base}.weight_scale_2"] = np.asarray(t["ws2"], np.float32).reshape(shape)
        if inputs:
            out[f"{base}.{INPUT[fmt]}"] = np.asarray(t["inp"], np.float32).reshape(shape)
    return out


def check_loaded(w: MoEWeights, lin, extra, inputs=True, shared=True):
    """Bit-exact comparison of a loaded MoEWeights with the reference tensors."""
    a = np.asarray
    for e in range(E):
        g, u, d = (lin[("expert", e, r)] for r in ("gate", "up", "down"))
        np.testing.assert_array_equal(a(w.w13.data)[e, :I], g["data"])
        np.testing.assert_array_equal(a(w.w13.data)[e, I:], u["data"])
        np.testing.assert_array_equal(a(w.w13.scales)[e, :I].view(np.uint8), g["scales"].view(np.uint8))
        np.testing.assert_array_equal(a(w.w13.scales)[e, I:].view(np.uint8), u["scales"].view(np.uint8))
        np.testing.assert_array_equal(a(w.w2.data)[e], d["data"])
        np.testing.assert_array_equal(a(w.w2.scales)[e].view(np.uint8), d["scales"].view(np.uint8))
        gs13 = a(w.w13.global_scale)
        if gs13.ndim == 2:
            assert gs13[e, 0] == g["ws2"] and gs13[e, 1] == u["ws2"]
        else:
            assert g["ws2"] == u["ws2"] and gs13[e] == g["ws2"]
        assert a(w.w2.global_scale)[e] == d["ws2"]
        if inputs:
            assert a(w.w13_input_scale)[e] == max(g["inp"], u["inp"])
            assert a(w.w2_input_scale)[e] == d["inp"]
    assert w.w13.data.dtype == np.uint8 and w.w13.scales.dtype == F8
    assert w.w13.global_scale.dtype == np.float32 and w.w2.global_scale.shape == (E,)
    assert w.w13.data.shape == (E, 2 * I, H // 2) and w.w13.scales.shape == (E, 2 * I, H // 16)
    assert w.w2.data.shape == (E, H, I // 2) and w.w2.scales.shape == (E, H, I // 16)
    gs = np.asarray(w.w13.global_scale)  # NVFP4Tensor.validate accepts [E] only, not [E, 2]
    NVFP4Tensor(w.w13.data, w.w13.scales, w.w13.global_scale[:, 0] if gs.ndim == 2
                else w.w13.global_scale).validate("w13")
    w.w2.validate("w2")
    assert w.router_weight.dtype == np.float32 and w.router_weight.shape == (E, H)
    np.testing.assert_array_equal(
        a(w.router_weight), extra["router"].astype(ml_dtypes.bfloat16).astype(np.float32))
    if "bias" in extra:
        np.testing.assert_array_equal(a(w.router_bias), extra["bias"])
    else:
        assert w.router_bias is None
    if "tid2eid" in extra:
        assert w.hash_table.dtype == np.int32
        np.testing.assert_array_equal(a(w.hash_table), extra["tid2eid"])
    else:
        assert w.hash_table is None
    if not inputs:
        assert w.w13_input_scale is None and w.w2_input_scale is None
        assert w.shared_w13_input_scale is None and w.shared_w2_input_scale is None
    if shared:
        g, u, d = (lin[("shared", r)] for r in ("gate", "up", "down"))
        np.testing.assert_array_equal(a(w.shared_w13.data), np.concatenate([g["data"], u["data"]]))
        np.testing.assert_array_equal(a(w.shared_w13.scales).view(np.uint8),
                                      np.concatenate([g["scales"], u["scales"]]).view(np.uint8))
        np.testing.assert_array_equal(a(w.shared_w2.data), d["data"])
        np.testing.assert_array_equal(a(w.shared_w2.scales).view(np.uint8), d["scales"].view(np.uint8))
        sgs = a(w.shared_w13.global_scale)
        if g["ws2"] == u["ws2"]:
            assert sgs.shape == () and sgs == g["ws2"]
        else:
            assert sgs.shape == (2,) and list(sgs) == [g["ws2"], u["ws2"]]
        assert a(w.shared_w2.global_scale).shape == () and a(w.shared_w2.global_scale) == d["ws2"]
        if inputs:
            assert a(w.shared_w13_input_scale).shape == ()
            assert a(w.shared_w13_input_scale) == max(g["inp"], u["inp"])
            assert a(w.shared_w2_input_scale) == d["inp"]
        NVFP4Tensor(w.shared_w13.data, w.shared_w13.scales,
                    w.shared_w13.global_scale.reshape(-1)[0]).validate("shared_w13")
        w.shared_w2.validate("shared_w2")
    else:
        assert w.shared_w13 is None and w.shared_w2 is None


def raw(a) -> np.ndarray:
    """The bytes of an array (any rank, including 0-d), for bit-exact comparisons."""
    return np.asarray(a).reshape(-1).view(np.uint8)


def load_quiet(*args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a well-formed checkpoint must load without warnings
        return ckpt.load_moe(*args, **kw)


# ------------------------------------------------------------------------------------------------
# load_moe: the three naming schemes, from files
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,names", [("modelopt", "hf"), ("quark", "hf"),
                                       ("modelopt", "deepseek"), ("quark", "deepseek")])
def test_load_from_files_bit_exact(tmp_path, fmt, names):
    lin, extra = reference(seed=2, hash_table=(names == "deepseek"), bias=(names == "hf"))
    tensors = tensors_from(lin, extra, fmt=fmt, names=names)
    # a sharded checkpoint: experts 0-1 + router in one file, the rest in another
    first = {k: v for k, v in tensors.items()
             if ".experts.0." in k or ".experts.1." in k or ".gate." in k}
    rest = {k: v for k, v in tensors.items() if k not in first}
    paths = [tmp_path / "model-00001.safetensors", tmp_path / "model-00002.safetensors"]
    ckpt.save_safetensors(paths[0], first)
    ckpt.save_safetensors(paths[1], rest)
    assert ckpt.SafetensorsReader(paths).dtype_of(
        f"{PREFIX}.experts.0.{PROJ[names][0]}.weight_scale") == "F8_E4M3"
    assert ckpt.detect_format(tensors, PREFIX) == fmt
    for f in ("auto", fmt):
        w = load_quiet(paths, PREFIX, cfg(), format=f)
        check_loaded(w, lin, extra)
    assert np.asarray(w.w13.global_scale).shape == (E, 2)  # expert 1 has gate != up ws2
    assert np.asarray(w.shared_w13.global_scale).shape == (2,)


def test_load_single_path_and_equal_scales(tmp_path):
    lin, extra = reference(seed=3, split_expert=-1, shared_split=False)
    p = tmp_path / "one.safetensors"
    ckpt.save_safetensors(p, tensors_from(lin, extra))
    w = load_quiet(str(p), PREFIX, cfg())
    check_loaded(w, lin, extra)
    assert np.asarray(w.w13.global_scale).shape == (E,)
    assert np.asarray(w.shared_w13.global_scale).shape == ()


def test_load_from_mapping_of_raw_bytes_and_jax_arrays():
    """A mapping source: block scales as uint8 bytes (bitcast), weights as int8, jax arrays,
    bf16 weight_scale_2 (converted to float32)."""
    lin, extra = reference(seed=4)
    for t in lin.values():  # make ws2 exactly representable in bf16
        t["ws2"] = np.float32(np.asarray(t["ws2"]).astype(ml_dtypes.bfloat16))
    lin[("expert", 1, "up")]["ws2"] = np.float32(lin[("expert", 1, "gate")]["ws2"] * 2)
    tensors = tensors_from(lin, extra, fmt="quark")
    src = {}
    for i, (k, v) in enumerate(tensors.items()):
        if k.endswith(".weight_scale"):
            v = v.view(np.uint8)
        elif k.endswith(".weight") and ".gate." not in k and i % 3 == 0:
            v = v.view(np.int8)
        elif k.endswith(".weight_scale_2"):
            v = v.astype(ml_dtypes.bfloat16)
        src[k] = jnp.asarray(v) if i % 2 else v
    w = load_quiet(src, PREFIX, cfg())
    check_loaded(w, lin, extra)
    assert w.w13.global_scale.dtype == np.float32
    # the original DeepSeek bias name, and a bf16 router
    src[f"{PREFIX}.gate.bias"] = src.pop(f"{PREFIX}.gate.e_score_correction_bias")
    src[f"{PREFIX}.gate.weight"] = np.asarray(src[f"{PREFIX}.gate.weight"]).astype(ml_dtypes.bfloat16)
    w = load_quiet(src, PREFIX, cfg())
    check_loaded(w, lin, extra)


def test_scale_bytes_bitcast_not_value_converted():
    lin, extra = reference(seed=5)
    lin[("expert", 0, "gate")]["scales"].view(np.uint8)[0, 0] = 0x3F
    tensors = tensors_from(lin, extra)
    tensors[f"{PREFIX}.experts.0.gate_proj.weight_scale"] = (
        tensors[f"{PREFIX}.experts.0.gate_proj.weight_scale"].view(np.uint8))
    w = load_quiet(tensors, PREFIX, cfg())
    assert float(np.asarray(w.w13.scales)[0, 0, 0].astype(np.float32)) == 1.875


def test_weight_only_checkpoint():
    lin, extra = reference(seed=6)
    tensors = tensors_from(lin, extra, inputs=False)
    assert ckpt.detect_format(tensors, PREFIX) is None
    for f in ("auto", "modelopt", "quark"):
        w = load_quiet(tensors, PREFIX, cfg(), format=f)
        check_loaded(w, lin, extra, inputs=False)


def test_no_shared_experts_and_expert_subset():
    lin, extra = reference(seed=7)
    tensors = {k: v for k, v in tensors_from(lin, extra).items() if ".shared_experts." not in k}
    w = load_quiet(tensors, PREFIX, cfg(n_shared_experts=0))
    check_loaded(w, lin, extra, shared=False)
    sub = load_quiet(tensors, PREFIX, cfg(n_shared_experts=0), experts=[3, 1])
    np.testing.assert_array_equal(np.asarray(sub.w13.data), np.asarray(w.w13.data)[[3, 1]])
    np.testing.assert_array_equal(np.asarray(sub.w2.scales).view(np.uint8),
                                  np.asarray(w.w2.scales).view(np.uint8)[[3, 1]])
    np.testing.assert_array_equal(np.asarray(sub.w13.global_scale), np.asarray(w.w13.global_scale)[[3, 1]])
    np.testing.assert_array_equal(np.asarray(sub.w2_input_scale), np.asarray(w.w2_input_scale)[[3, 1]])
    assert sub.router_weight.shape == (E, H)
    with pytest.raises(ValueError, match="shared_experts"):
        ckpt.load_moe(tensors_from(lin, extra), PREFIX, cfg(n_shared_experts=0))


@pytest.mark.parametrize("fmt,names,scalar_shape", [("modelopt", "hf", ()), ("quark", "deepseek", (1,))])
def test_save_moe_roundtrip(tmp_path, fmt, names, scalar_shape):
    lin, extra = reference(seed=8, hash_table=True)
    w = load_quiet(tensors_from(lin, extra), PREFIX, cfg())
    out = ckpt.save_moe(w, cfg(), "layers.0.ffn", fmt, names=names, scalar_shape=scalar_shape)
    assert out[f"layers.0.ffn.experts.2.{PROJ[names][2]}.weight_scale"].dtype == F8
    assert out[f"layers.0.ffn.shared_experts.{PROJ[names][1]}.{INPUT[fmt]}"].shape == scalar_shape
    p = tmp_path / "rt.safetensors"
    ckpt.save_safetensors(p, out)
    w2 = load_quiet(p, "layers.0.ffn", cfg())
    for a, b in zip(jax.tree.leaves(w), jax.tree.leaves(w2)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(raw(a), raw(b))


def test_quantized_weights_roundtrip():
    """Real quantized weights (jax_nvfp4.maths.quantization.quantize) load without warnings and
    dequantize to the same values."""
    q = pytest.importorskip("jax_nvfp4.maths.quantization")
    rng = np.random.default_rng(9)
    tensors = {f"{PREFIX}.gate.weight": rng.standard_normal((E, H)).astype(np.float32)}
    dense = {}
    for e in range(E):
        for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            x = (rng.standard_normal(shape) * 0.02 * (e + 1)).astype(np.float32)
            t = q.quantize(jnp.asarray(x))
            base = f"{PREFIX}.experts.{e}.{proj}"
            tensors[f"{base}.weight"] = np.asarray(t.data)
            tensors[f"{base}.weight_scale"] = np.asarray(t.scales)
            tensors[f"{base}.weight_scale_2"] = np.asarray(t.global_scale, np.float32).reshape(())
            tensors[f"{base}.input_scale"] = np.array(3.0 / 2688, np.float32)
            dense[(e, proj)] = np.asarray(q.dequantize(t, jnp.float32))
    w = load_quiet(tensors, PREFIX, cfg(n_shared_experts=0))
    gs = np.asarray(w.w13.global_scale)
    assert gs.shape == (E, 2)  # gate and up of an expert have different amax
    w13 = np.asarray(q.e2m1_scaled(w.w13, jnp.float32))
    w2 = np.asarray(q.dequantize(w.w2, jnp.float32))
    for e in range(E):
        np.testing.assert_array_equal(w13[e, :I] * gs[e, 0], dense[(e, "gate_proj")])
        np.testing.assert_array_equal(w13[e, I:] * gs[e, 1], dense[(e, "up_proj")])
        np.testing.assert_array_equal(w2[e], dense[(e, "down_proj")])
    np.testing.assert_array_equal(np.asarray(w.w13_input_scale), np.full(E, 3.0 / 2688, np.float32))


# ------------------------------------------------------------------------------------------------
# wrong files
# ------------------------------------------------------------------------------------------------

def test_missing_tensor_names_it(tmp_path):
    lin, extra = reference(seed=10)
    tensors = tensors_from(lin, extra)
    for missing in (f"{PREFIX}.experts.2.up_proj.weight_scale",
                    f"{PREFIX}.experts.3.down_proj.weight_scale_2",
                    f"{PREFIX}.shared_experts.gate_proj.weight_scale",
                    f"{PREFIX}.gate.weight",
                    f"{PREFIX}.experts.1.down_proj.input_scale"):
        t = dict(tensors)
        del t[missing]
        p = tmp_path / "m.safetensors"
        ckpt.save_safetensors(p, t)
        with pytest.raises(KeyError, match=missing.replace(".", r"\.")):
            ckpt.load_moe([p], PREFIX, cfg())
    t = {k: v for k, v in tensors.items() if not k.startswith(f"{PREFIX}.experts.3.down_proj.")}
    with pytest.raises(KeyError, match=rf"{PREFIX}\.experts\.3\.down_proj\.weight.*w2\.weight"):
        ckpt.load_moe(t, PREFIX, cfg())


def test_wrong_shape_names_tensor_expected_and_found(tmp_path):
    lin, extra = reference(seed=11)
    tensors = tensors_from(lin, extra)
    name = f"{PREFIX}.experts.2.down_proj.weight"
    tensors[name] = tensors[name][:, :8].copy()
    p = tmp_path / "s.safetensors"
    ckpt.save_safetensors(p, tensors)
    with pytest.raises(ValueError) as ei:
        ckpt.load_moe(p, PREFIX, cfg())
    msg = str(ei.value)
    assert name in msg and str((H, I // 2)) in msg and str((H, 8)) in msg

    tensors = tensors_from(lin, extra)
    name = f"{PREFIX}.shared_experts.up_proj.weight_scale"
    tensors[name] = tensors[name][:, :2].copy()
    with pytest.raises(ValueError, match=rf"{name}.*{(I, H // 16)}.*{(I, 2)}".replace("(", r"\(")
                       .replace(")", r"\)")):
        ckpt.load_moe(tensors, PREFIX, cfg())

    # a config that does not match the checkpoint (E, H, I)
    with pytest.raises(ValueError, match=rf"{PREFIX}\.gate\.weight.*\(8, 64\).*\(4, 64\)"):
        ckpt.load_moe(tensors_from(lin, extra), PREFIX, cfg(num_experts=8))
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj\.weight.*\(64, 32\).*\(32, 32\)"):
        ckpt.load_moe(tensors_from(lin, extra), PREFIX, cfg(intermediate_size=64))
    with pytest.raises(ValueError, match=rf"{PREFIX}\.gate\.weight.*\(4, 128\).*\(4, 64\)"):
        ckpt.load_moe(tensors_from(lin, extra), PREFIX, cfg(hidden_size=128))
    t = tensors_from(lin, extra)
    t[f"{PREFIX}.gate.weight"] = np.ones((E, 128), np.float32)
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj\.weight.*\(32, 64\).*\(32, 32\)"):
        ckpt.load_moe(t, PREFIX, cfg(hidden_size=128))

    # scalars that are not scalars, unquantized weights, float block scales
    tensors = tensors_from(lin, extra)
    name = f"{PREFIX}.experts.0.gate_proj.weight_scale_2"
    tensors[name] = np.ones(2, np.float32)
    with pytest.raises(ValueError, match=rf"{name}.*scalar"):
        ckpt.load_moe(tensors, PREFIX, cfg())
    tensors = tensors_from(lin, extra)
    name = f"{PREFIX}.experts.0.up_proj.weight"
    tensors[name] = np.ones((I, H), ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match=rf"{name}.*uint8"):
        ckpt.load_moe(tensors, PREFIX, cfg())
    tensors = tensors_from(lin, extra)
    name = f"{PREFIX}.experts.0.up_proj.weight_scale"
    tensors[name] = tensors[name].astype(np.float32)
    with pytest.raises(ValueError, match=rf"{name}.*value-convert"):
        ckpt.load_moe(tensors, PREFIX, cfg())
    tensors = tensors_from(lin, extra)
    tensors[f"{PREFIX}.gate.tid2eid"] = np.full((VOCAB, TOPK), E, np.int32)
    with pytest.raises(ValueError, match="tid2eid"):
        ckpt.load_moe(tensors, PREFIX, cfg())


def test_mixed_formats_and_bad_format():
    lin, extra = reference(seed=12)
    tensors = tensors_from(lin, extra)
    tensors[f"{PREFIX}.experts.0.gate_proj.input_scale_2"] = np.float32(0.1).reshape(())
    with pytest.raises(ValueError, match="format="):
        ckpt.load_moe(tensors, PREFIX, cfg())
    with pytest.raises(ValueError, match="format"):
        ckpt.load_moe(tensors_from(lin, extra), PREFIX, cfg(), format="ct")
    # format given explicitly but the names are the other one's: input scales missing -> None
    w = load_quiet(tensors_from(lin, extra, fmt="quark"), PREFIX, cfg(), format="modelopt")
    assert w.w13_input_scale is None


def test_inverted_weight_scale_2_warns():
    """compressed-tensors stores 2688/amax instead of amax/2688."""
    lin, extra = reference(seed=13)
    for t in lin.values():
        t["ws2"] = np.float32(1.0 / t["ws2"])
    with pytest.warns(UserWarning, match="inverse 2688/amax") as rec:
        w = ckpt.load_moe(tensors_from(lin, extra), PREFIX, cfg())
    check_loaded(w, lin, extra)  # still loaded as stored
    # the warning points at the line calling load_moe, not inside the package
    assert [r.filename for r in rec] == [__file__]
    lin, extra = reference(seed=13)
    for t in lin.values():
        t["inp"] = np.float32(1.0 / t["inp"])
    with pytest.warns(UserWarning, match="input scale"):
        ckpt.load_moe(tensors_from(lin, extra), PREFIX, cfg())


def test_block_scales_not_reaching_448_warn():
    lin, extra = reference(seed=14)
    s = lin[("expert", 2, "down")]["scales"]
    lin[("expert", 2, "down")]["scales"] = (s.astype(np.float32) / 16).astype(F8)  # max 28
    with pytest.warns(UserWarning, match=rf"{PREFIX}\.experts\.2\.down_proj.*max 28"):
        ckpt.load_moe(tensors_from(lin, extra), PREFIX, cfg())
    # the exact check on expert 0: amax(dequantized) / 2688 vs weight_scale_2
    lin, extra = reference(seed=14)
    lin[("expert", 0, "down")]["data"] &= 0x11  # codes 0 / 0.5 only: amax far below 6 * 448
    with pytest.warns(UserWarning, match="amax"):
        ckpt.load_moe(tensors_from(lin, extra), PREFIX, cfg())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt.load_moe(tensors_from(lin, extra), PREFIX, cfg(), check=False)


def test_gate_up_sharing_ws2_checked_together():
    """A checkpoint whose gate and up share weight_scale_2 (the max): only the larger half
    reaches 448; that is not a convention problem."""
    lin, extra = reference(seed=15, split_expert=-1)
    s = lin[("expert", 1, "up")]["scales"]
    lin[("expert", 1, "up")]["scales"] = (s.astype(np.float32) / 16).astype(F8)
    check_loaded(load_quiet(tensors_from(lin, extra), PREFIX, cfg()), lin, extra)


# ------------------------------------------------------------------------------------------------
# save_moe writes only what it was given (issue 23 item 4)
# ------------------------------------------------------------------------------------------------

def test_save_moe_rejects_config_that_disagrees_with_weights():
    lin, extra = reference(seed=16)
    w = load_quiet(tensors_from(lin, extra), PREFIX, cfg())
    for bad, field in ((cfg(intermediate_size=64), "w13.data"), (cfg(hidden_size=128), "w13.data"),
                       (cfg(num_experts=8), "w13.data|num_experts|router_weight"),
                       (cfg(n_shared_experts=2), "shared_w13.data"),
                       (cfg(n_shared_experts=0), "shared_w13")):
        with pytest.raises(ValueError, match=rf"weights\.({field})|config\.num_experts"):
            ckpt.save_moe(w, bad, PREFIX)
    with pytest.raises(ValueError, match=r"weights\.w13\.data.*\(4, 128, 32\).*\(4, 64, 32\)"):
        ckpt.save_moe(w, cfg(intermediate_size=64), PREFIX)


def test_save_moe_keeps_expert_ids(tmp_path):
    """Weights loaded with experts=[3, 1] are written back as experts 3 and 1."""
    lin, extra = reference(seed=17)
    full = tensors_from(lin, extra)
    sub = load_quiet(full, PREFIX, cfg(), experts=[3, 1])
    assert sub.expert_ids == (3, 1)
    out = ckpt.save_moe(sub, cfg(), PREFIX)
    assert {k.split(".experts.")[1].split(".")[0] for k in out if ".experts." in k} == {"3", "1"}
    for e in (3, 1):
        for k in (f"{PREFIX}.experts.{e}.gate_proj.weight", f"{PREFIX}.experts.{e}.up_proj.weight_scale",
                  f"{PREFIX}.experts.{e}.down_proj.weight_scale_2"):
            np.testing.assert_array_equal(raw(out[k]), raw(full[k]), err_msg=k)
    p = tmp_path / "sub.safetensors"
    ckpt.save_safetensors(p, out)
    back = load_quiet(p, PREFIX, cfg(), experts=[3])
    np.testing.assert_array_equal(np.asarray(back.w13.data)[0], np.asarray(sub.w13.data)[0])
    np.testing.assert_array_equal(np.asarray(back.w2.data)[0], lin[("expert", 3, "down")]["data"])
    with pytest.raises(KeyError, match=r"experts\.0\."):
        ckpt.load_moe(p, PREFIX, cfg(), experts=[0])
    # a subset without ids (sliced by hand) is refused rather than renumbered
    sliced = dataclasses.replace(sub, expert_ids=None)
    with pytest.raises(ValueError, match="expert_ids"):
        ckpt.save_moe(sliced, cfg(), PREFIX)
    # expert_ids survives jit and tree maps (static pytree metadata)
    assert jax.tree.map(lambda x: x, sub).expert_ids == (3, 1)
    assert jax.jit(lambda w: w)(sub).expert_ids == (3, 1)
    full_w = load_quiet(full, PREFIX, cfg(), experts=[0, 1, 2, 3])
    assert full_w.expert_ids is None


def test_expert_ids_validation():
    lin, extra = reference(seed=18)
    w = load_quiet(tensors_from(lin, extra), PREFIX, cfg())
    with pytest.raises(ValueError, match="distinct"):
        dataclasses.replace(w, expert_ids=(1, 1, 2, 3))
    with pytest.raises(TypeError, match="expert_ids"):
        dataclasses.replace(w, expert_ids=(0.5, 1, 2, 3))
    with pytest.raises(ValueError, match=r"expert_ids.*\[0, config\.num_experts=4\)"):
        ckpt.save_moe(dataclasses.replace(w, expert_ids=(0, 1, 2, 7)), cfg(), PREFIX)
    with pytest.raises(ValueError, match="distinct"):
        ckpt.load_moe(tensors_from(lin, extra), PREFIX, cfg(), experts=[1, 1])


# ------------------------------------------------------------------------------------------------
# router dtypes and global scales (issue 46 items 8 and 12)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("what,dtype", [("gate.weight", np.uint8), ("gate.weight", np.int32),
                                        ("gate.weight", np.bool_), ("gate.weight", F8),
                                        ("gate.e_score_correction_bias", np.int64),
                                        ("gate.e_score_correction_bias", np.uint8)])
def test_router_stored_as_integers_is_refused(tmp_path, what, dtype):
    """An integer/bool/float8 router or bias would be value-converted to float: refused, naming
    the tensor and its dtype (from a file and from a mapping)."""
    lin, extra = reference(seed=30)
    tensors = tensors_from(lin, extra)
    name = f"{PREFIX}.{what}"
    tensors[name] = np.ones(tensors[name].shape, dtype)
    p = tmp_path / "r.safetensors"
    ckpt.save_safetensors(p, tensors)
    for src in (p, tensors):
        with pytest.raises(ValueError, match=rf"{name}: expected a float tensor.*dtype "
                                             rf"{np.dtype(dtype)}"):
            ckpt.load_moe(src, PREFIX, cfg())


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16, np.float64])
def test_router_float_dtypes_load_as_float32(dtype):
    """The float routers load with their values (oracle: the ml_dtypes/numpy cast to float32)."""
    lin, extra = reference(seed=31)
    tensors = tensors_from(lin, extra)
    stored = extra["router"].astype(dtype)
    tensors[f"{PREFIX}.gate.weight"] = stored
    tensors[f"{PREFIX}.gate.e_score_correction_bias"] = extra["bias"].astype(dtype)
    w = load_quiet(tensors, PREFIX, cfg())
    assert w.router_weight.dtype == np.float32 and w.router_bias.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(w.router_weight), stored.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(w.router_bias),
                                  extra["bias"].astype(dtype).astype(np.float32))


@pytest.mark.parametrize("fmt", ["modelopt", "quark"])
@pytest.mark.parametrize("which", ["gate_input", "up_input", "shared_gate_input", "ws2",
                                   "shared_ws2"])
@pytest.mark.parametrize("value", [-0.01, 0.0, np.nan, np.inf, -np.inf, 1e-40,
                                   np.nextafter(np.float32(2.0**-126), np.float32(0))])
def test_global_scales_must_be_finite_and_positive(fmt, which, value):
    """A negative or NaN gate input scale would vanish in max(gate, up); a zero one divides by
    zero; a subnormal one (below 2^-126, the smallest normal float32) flushes to zero in XLA.
    Each is a ValueError naming the tensor, with or without the convention check."""
    lin, extra = reference(seed=32)
    role = {"gate_input": ("expert", 1, "gate"), "up_input": ("expert", 2, "up"),
            "shared_gate_input": ("shared", "gate"), "ws2": ("expert", 3, "down"),
            "shared_ws2": ("shared", "up")}[which]
    key = "ws2" if which.endswith("ws2") else "inp"
    lin[role][key] = np.float32(value)
    proj = dict(zip(("gate", "up", "down"), PROJ["hf"]))
    base = (f"{PREFIX}.experts.{role[1]}.{proj[role[2]]}" if role[0] == "expert"
            else f"{PREFIX}.shared_experts.{proj[role[1]]}")
    name = f"{base}.{'weight_scale_2' if key == 'ws2' else INPUT[fmt]}"
    for check in (True, False):
        with pytest.raises(ValueError, match=rf"{name}: expected a finite scale >= 2\^-126"):
            ckpt.load_moe(tensors_from(lin, extra, fmt=fmt), PREFIX, cfg(), check=check)


def test_scale_bound_is_the_layers_and_names_the_file(tmp_path):
    """One lower bound for checkpoint scales, the layer's own (quantization.MIN_GLOBAL_SCALE =
    2^-126): the smallest normal float32 loads and runs, the next float32 below it is refused
    by load_moe, naming the file and the tensor, before the layer could see it."""
    assert quantization.MIN_GLOBAL_SCALE == float(np.finfo(np.float32).smallest_normal)
    assert ckpt.MIN_SCALE is quantization.MIN_GLOBAL_SCALE
    lin, extra = reference(seed=33)
    name = f"{PREFIX}.experts.1.gate_proj.input_scale"
    for value, ok in ((np.float32(2.0**-126), True),
                      (np.nextafter(np.float32(2.0**-126), np.float32(0)), False)):
        lin[("expert", 1, "gate")]["inp"] = value
        lin[("expert", 1, "up")]["inp"] = value
        path = tmp_path / f"{ok}.safetensors"
        ckpt.save_safetensors(path, tensors_from(lin, extra))
        if ok:
            w = load_quiet(path, PREFIX, cfg())
            assert float(np.asarray(w.w13_input_scale)[1]) == 2.0**-126
        else:
            with pytest.raises(ValueError, match=rf"{name} \(in {path}\): expected a finite "
                                                 r"scale >= 2\^-126 .* found 1.17549"):
                ckpt.load_moe(path, PREFIX, cfg())


@pytest.mark.parametrize("value", [1e39, -1e39, 1e-300, 1e-45])
def test_f64_scale_is_checked_as_stored(value):
    """A weight_scale_2 or input scale stored as F64 is checked before the float32 cast: one past
    float32's range is reported as stored (not "inf"), one below 2^-126 as stored (not "0.0");
    an F64 scale within range loads as its float32 rounding."""
    lin, extra = reference(seed=34)
    tensors = tensors_from(lin, extra)
    for name in (f"{PREFIX}.experts.2.down_proj.weight_scale_2",
                 f"{PREFIX}.shared_experts.gate_proj.input_scale"):
        t = dict(tensors, **{name: np.asarray(value, np.float64)})
        with pytest.raises(ValueError, match=rf"{re.escape(name)}: expected a finite scale "
                                             rf">= 2\^-126.*found {re.escape(repr(value))}$"):
            ckpt.load_moe(t, PREFIX, cfg())
    name = f"{PREFIX}.experts.2.down_proj.weight_scale_2"
    ok = np.float64(lin[("expert", 2, "down")]["ws2"]) * (1 + 2.0 ** -30)
    w = load_quiet(dict(tensors, **{name: np.asarray([ok], np.float64)}), PREFIX, cfg())
    assert np.asarray(w.w2.global_scale)[2] == np.float32(ok)


def test_expert_ids_to_load_must_be_integers():
    """load_moe(experts=...) takes integer ids (numpy integers included), like
    MoEWeights(expert_ids=...): a float id (1.5, or 2.0 from float arithmetic) is a TypeError
    naming experts, never truncated to another expert."""
    lin, extra = reference(seed=35)
    tensors = tensors_from(lin, extra)
    for bad in ([1.5, 2.9], [np.float32(1.0)], [2.0], ["1"]):
        with pytest.raises(TypeError, match=r"experts: expected integer expert ids"):
            ckpt.load_moe(tensors, PREFIX, cfg(), experts=bad)
    w = load_quiet(tensors, PREFIX, cfg(), experts=np.array([3, 1], np.int64))
    assert w.expert_ids == (3, 1)
