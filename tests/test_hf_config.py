"""Tests of jax_nvfp4.config.hf_config: MoEConfig.from_hf_config for the DeepSeek-V3/V4, Kimi-K2, GLM-4.5
and Qwen3-MoE families, the quantization configs (ModelOpt, Quark), and the errors for what the
layer cannot express."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as jn
from jax_nvfp4.config.moe_params import MoEConfig, MoEWeights

# The MoE keys of the published config.json files (values as shipped).
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "moe_intermediate_size": 2048,
               "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1,
               "n_group": 8, "topk_group": 4, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
               "scoring_func": "sigmoid", "topk_method": "noaux_tc", "hidden_act": "silu"}
DEEPSEEK_V4_PRO = {"model_type": "deepseek_v4", "hidden_size": 7168, "moe_intermediate_size": 3072,
                   "n_routed_experts": 384, "num_experts_per_tok": 6, "n_shared_experts": 1,
                   "norm_topk_prob": True, "routed_scaling_factor": 2.5,
                   "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "swiglu_limit": 10.0,
                   "num_hash_layers": 3, "hc_mult": 4}
KIMI_K2 = {"model_type": "kimi_k2", "hidden_size": 7168, "moe_intermediate_size": 2048,
           "n_routed_experts": 384, "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 1,
           "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.827,
           "scoring_func": "sigmoid", "topk_method": "noaux_tc", "hidden_act": "silu"}
GLM_45 = {"model_type": "glm4_moe", "hidden_size": 5120, "moe_intermediate_size": 1536,
          "n_routed_experts": 160, "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 1,
          "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
          "first_k_dense_replace": 3, "hidden_act": "silu"}
QWEN3_30B = {"model_type": "qwen3_moe", "hidden_size": 2048, "moe_intermediate_size": 768,
             "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
             "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu"}
QUARK_NVFP4 = [{"dtype": "fp4", "qscheme": "per_group", "group_size": 16, "is_dynamic": False},
               {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False}]


def quark(weight=QUARK_NVFP4, inputs=None):
    return {"quant_method": "quark",
            "global_quant_config": {"weight": weight, "input_tensors": inputs}}


def test_families_map_to_the_known_configs():
    assert MoEConfig.from_hf_config(DEEPSEEK_V3) == MoEConfig.deepseek_v3()
    assert MoEConfig.from_hf_config(DEEPSEEK_V4_PRO) == MoEConfig.deepseek_v4_pro()
    assert MoEConfig.from_hf_config(KIMI_K2) == MoEConfig(
        num_experts=384, top_k=8, hidden_size=7168, intermediate_size=2048, scoring_func="sigmoid",
        routed_scaling_factor=2.827, n_shared_experts=1)
    assert MoEConfig.from_hf_config(GLM_45) == MoEConfig(
        num_experts=160, top_k=8, hidden_size=5120, intermediate_size=1536, scoring_func="sigmoid",
        routed_scaling_factor=2.5, n_shared_experts=1)
    assert MoEConfig.from_hf_config(QWEN3_30B) == MoEConfig(
        num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768, scoring_func="softmax",
        norm_topk_prob=True, routed_scaling_factor=1.0, n_shared_experts=0)
    # multimodal wrappers nest the language model's config
    assert MoEConfig.from_hf_config({"model_type": "kimi_k25", "text_config": KIMI_K2}) == \
        MoEConfig.from_hf_config(KIMI_K2)
    # overrides replace mapped fields
    assert MoEConfig.from_hf_config(DEEPSEEK_V3, top_k=4).top_k == 4


def test_from_path_and_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GLM_45))
    want = MoEConfig.from_hf_config(GLM_45)
    assert MoEConfig.from_hf_config(tmp_path) == want
    assert MoEConfig.from_hf_config(str(tmp_path / "config.json")) == want
    with pytest.raises(FileNotFoundError, match="config.json"):
        MoEConfig.from_hf_config(tmp_path / "missing")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON config"):
        MoEConfig.from_hf_config(tmp_path / "x.json")
    with pytest.raises(TypeError, match="path_or_dict"):
        MoEConfig.from_hf_config(3)


@pytest.mark.parametrize("base,key,value,match", [
    (DEEPSEEK_V3, "model_type", "llama", r"model_type = 'llama'"),
    (DEEPSEEK_V3, "topk_method", "group_limited_greedy", r"topk_method = 'group_limited_greedy'"),
    (DEEPSEEK_V3, "hidden_act", "gelu", r"hidden_act = 'gelu'"),
    (DEEPSEEK_V3, "scoring_func", "tanh", r"scoring_func"),
    (DEEPSEEK_V3, "n_group", None, r"n_group = absent: required"),
    (DEEPSEEK_V3, "norm_topk_prob", None, r"norm_topk_prob = absent: required"),
    (DEEPSEEK_V3, "n_routed_experts", 256.0, r"n_routed_experts = 256.0: expected an integer"),
    (DEEPSEEK_V3, "n_group", 7, r"n_group.*must divide num_experts"),
    (DEEPSEEK_V3, "moe_intermediate_size", 100, r"intermediate_size.*multiple of 32"),
    (DEEPSEEK_V4_PRO, "swiglu_limit", None, r"swiglu_limit = absent"),
    (GLM_45, "scoring_func", "softmax", r"scoring_func = 'softmax'"),
    (QWEN3_30B, "shared_expert_intermediate_size", 5632, r"shared_expert_intermediate_size = 5632"),
    (QWEN3_30B, "norm_topk_prob", "yes", r"norm_topk_prob = 'yes'"),
])
def test_what_the_layer_cannot_express(base, key, value, match):
    c = dict(base)
    if value is None:
        del c[key]
    else:
        c[key] = value
    with pytest.raises(ValueError, match=match):
        MoEConfig.from_hf_config(c)


def test_quantization_configs(tmp_path):
    def q(qc, **kw):
        return MoEConfig.from_hf_config({**DEEPSEEK_V3, "quantization_config": qc}, **kw)
    c = q(quark(inputs=QUARK_NVFP4))
    assert (c.activation, c.activation_scale) == ("w4a4", "static")
    dyn = [QUARK_NVFP4[0], {**QUARK_NVFP4[1], "is_dynamic": True}]
    assert q(quark(inputs=dyn)).activation_scale == "dynamic"
    assert q(quark(inputs=None)).activation == "w4a16"
    with pytest.raises(ValueError, match=r"global_quant_config\.weight.*not Quark NVFP4"):
        q(quark(weight={"dtype": "fp4", "qscheme": "per_group", "group_size": 32}))
    with pytest.raises(ValueError, match=r"input_tensors"):
        q(quark(inputs=[{"dtype": "fp8_e4m3", "qscheme": "per_tensor"}]))
    with pytest.raises(ValueError, match=r"quant_method = 'compressed-tensors'"):
        q({"quant_method": "compressed-tensors"})
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    with pytest.raises(ValueError, match=r"quant_method = 'fp8'"):
        q(fp8)
    # both activation settings given: the quantization config is not consulted
    assert q(fp8, activation="w4a16", activation_scale="dynamic").activation == "w4a16"
    c = q({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16})
    assert (c.activation, c.activation_scale) == ("w4a4", "static")
    # NVFP4's group is 16: a config that does not say is NVFP4's, another group is refused
    c = q({"quant_method": "modelopt", "quant_algo": "NVFP4"})
    assert (c.activation, c.activation_scale) == ("w4a4", "static")
    with pytest.raises(ValueError, match=r"group_size = 32: NVFP4 uses 16"):
        q({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32})
    with pytest.raises(ValueError, match=r"quant_algo = 'NVFP4_AWQ'"):
        q({"quant_method": "modelopt", "quant_algo": "NVFP4_AWQ"})
    # ModelOpt's hf_quant_config.json beside config.json
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8"}}))
    with pytest.raises(ValueError, match=r"quant_algo = 'FP8'"):
        MoEConfig.from_hf_config(tmp_path)
    with pytest.raises(TypeError, match="not MoEConfig fields"):
        MoEConfig.from_hf_config(DEEPSEEK_V3, topk=3)


def _softmax(z):
    z = z - z.max(-1, keepdims=True)
    return np.exp(z) / np.exp(z).sum(-1, keepdims=True)


def test_qwen3_and_glm_routing_match_their_definitions():
    """The mapped configs route as the models define it (float64 numpy, written from the
    Qwen3MoeSparseMoeBlock / DeepseekV3TopkRouter formulas): Qwen3 softmax -> top-k ->
    renormalize; GLM-4.5 sigmoid, bias-chosen, grouped, unbiased weights x scaling."""
    rng = np.random.default_rng(0)
    T, Hs, E = 16, 32, 16
    x = rng.standard_normal((T, Hs)).astype(np.float32)
    wr = rng.standard_normal((E, Hs)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(E)).astype(np.float32)
    logits = x.astype(np.float64) @ wr.astype(np.float64).T

    qwen = MoEConfig.from_hf_config({**QWEN3_30B, "num_experts": E, "num_experts_per_tok": 4,
                                     "hidden_size": Hs, "moe_intermediate_size": 32})
    ids, w = jn.route(jnp.asarray(x), MoEWeights(router_weight=jnp.asarray(wr), w13=None, w2=None),
                      qwen)
    p = _softmax(logits)
    ref_ids = np.argsort(-p, axis=1, kind="stable")[:, :4]
    ref_w = np.take_along_axis(p, ref_ids, 1)
    ref_w /= ref_w.sum(1, keepdims=True)
    np.testing.assert_array_equal(np.asarray(ids), ref_ids)
    np.testing.assert_allclose(np.asarray(w), ref_w, rtol=1e-5)

    glm = MoEConfig.from_hf_config({**GLM_45, "n_routed_experts": E, "num_experts_per_tok": 4,
                                    "hidden_size": Hs, "moe_intermediate_size": 32, "n_group": 4,
                                    "topk_group": 2})
    ids, w = jn.route(jnp.asarray(x), MoEWeights(router_weight=jnp.asarray(wr), w13=None, w2=None,
                                                 router_bias=jnp.asarray(bias)), glm)
    s = 1 / (1 + np.exp(-logits))
    choice = s + bias
    grp = np.sort(choice.reshape(T, 4, E // 4), axis=-1)[..., -2:].sum(-1)
    keep = np.argsort(-grp, axis=1, kind="stable")[:, :2]
    mask = np.zeros((T, 4), bool)
    np.put_along_axis(mask, keep, True, 1)
    masked = np.where(np.repeat(mask, E // 4, 1), choice, -np.inf)
    ref_ids = np.argsort(-masked, axis=1, kind="stable")[:, :4]
    ref_w = np.take_along_axis(s, ref_ids, 1)
    ref_w = ref_w / ref_w.sum(1, keepdims=True) * 2.5
    np.testing.assert_array_equal(np.sort(np.asarray(ids), 1), np.sort(ref_ids, 1))
    order = np.argsort(np.asarray(ids), 1)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, 1),
                               np.take_along_axis(ref_w, np.argsort(ref_ids, 1), 1), rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# malformed and conflicting quantization configs (issue 46 item 9)
# ------------------------------------------------------------------------------------------------

MODELOPT_NVFP4 = {"producer": {"name": "modelopt", "version": "0.35.0"},
                  "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                   "exclude_modules": ["lm_head"]}}


def _folder(tmp_path, config, hf_quant=None):
    (tmp_path / "config.json").write_text(json.dumps(config))
    if hf_quant is not None:
        (tmp_path / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    return tmp_path


@pytest.mark.parametrize("hf_quant,match", [
    ([], r"hf_quant_config\.json: expected a JSON object"),
    ("NVFP4", r"hf_quant_config\.json: expected a JSON object"),
    ({"quantization": None}, r"hf_quant_config\.json: quantization = None: expected an object"),
    ({"quantization": ["NVFP4"]}, r"hf_quant_config\.json: quantization = \['NVFP4'\]"),
    ({"producer": {"name": "modelopt"}}, r"hf_quant_config\.json: quant_algo = None"),
])
def test_malformed_hf_quant_config_is_an_error(tmp_path, hf_quant, match):
    """Before, these fell back to the defaults (w4a4 with dynamic scales) without a word."""
    with pytest.raises(ValueError, match=match):
        MoEConfig.from_hf_config(_folder(tmp_path, DEEPSEEK_V3, hf_quant))


def test_hf_quant_config_and_quantization_config_must_agree(tmp_path):
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    with pytest.raises(ValueError, match=r"hf_quant_config\.json \(quant_algo = 'NVFP4'\) and "
                                         r"config\.json quantization_config \(quant_method = 'fp8'"):
        MoEConfig.from_hf_config(_folder(tmp_path, {**DEEPSEEK_V3, "quantization_config": fp8},
                                         MODELOPT_NVFP4))
    mo_fp8 = {"quant_method": "modelopt", "quant_algo": "FP8"}
    with pytest.raises(ValueError, match=r"quant_algo = 'FP8'\) disagree"):
        MoEConfig.from_hf_config(_folder(tmp_path, {**DEEPSEEK_V3, "quantization_config": mo_fp8},
                                         MODELOPT_NVFP4))
    with pytest.raises(ValueError, match=r"quant_method = 'quark'.*disagree"):
        MoEConfig.from_hf_config(_folder(
            tmp_path, {**DEEPSEEK_V3, "quantization_config": quark(inputs=QUARK_NVFP4)},
            MODELOPT_NVFP4))
    # ModelOpt exports that describe the same NVFP4 quantization in both places load
    mo = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
    c = MoEConfig.from_hf_config(_folder(tmp_path, {**DEEPSEEK_V3, "quantization_config": mo},
                                         MODELOPT_NVFP4))
    assert (c.activation, c.activation_scale) == ("w4a4", "static")
    # both activation settings given: neither config is consulted
    c = MoEConfig.from_hf_config(_folder(tmp_path, {**DEEPSEEK_V3, "quantization_config": fp8},
                                         MODELOPT_NVFP4), activation="w4a16",
                                 activation_scale="dynamic")
    assert c.activation == "w4a16"


def test_quantization_config_nested_in_text_config_is_honoured():
    """Multimodal wrappers may keep quantization_config in text_config (vLLM's get_quant_config
    reads it from there when the top level has none): it sets the activation, and an unloadable
    one is refused instead of ignored."""
    def wrap(tc, **top):
        return {"model_type": "kimi_k25", "text_config": tc, **top}
    c = MoEConfig.from_hf_config(wrap({**KIMI_K2, "quantization_config": quark()}))
    assert (c.activation, c.activation_scale) == ("w4a16", "dynamic")
    c = MoEConfig.from_hf_config(wrap({**KIMI_K2, "quantization_config": quark(inputs=QUARK_NVFP4)}))
    assert (c.activation, c.activation_scale) == ("w4a4", "static")
    with pytest.raises(ValueError, match=r"quant_method = 'fp8'"):
        MoEConfig.from_hf_config(wrap({**KIMI_K2, "quantization_config": {"quant_method": "fp8"}}))
    # the same config at both levels is one config; two different ones are an error
    same = quark(inputs=QUARK_NVFP4)
    c = MoEConfig.from_hf_config(wrap({**KIMI_K2, "quantization_config": same},
                                      quantization_config=same))
    assert c.activation == "w4a4"
    with pytest.raises(ValueError, match=r"text_config\.quantization_config.*disagree"):
        MoEConfig.from_hf_config(wrap({**KIMI_K2, "quantization_config": quark()},
                                      quantization_config=same))
