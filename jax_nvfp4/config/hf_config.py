"""A :class:`~jax_nvfp4.MoEConfig` from a Hugging Face ``config.json`` (and its quantization config).

Families (``model_type``) and what their keys map to:

=======================================  ===============================================================
``model_type``                           MoEConfig fields
=======================================  ===============================================================
``deepseek_v3``, ``deepseek_v32``,       num_experts = ``n_routed_experts``, top_k =
``kimi_k2`` (DeepSeek-V3 architecture)   ``num_experts_per_tok``, hidden_size, intermediate_size =
                                         ``moe_intermediate_size``, scoring_func = ``scoring_func``
                                         (``"sigmoid"`` when absent), n_group, topk_group,
                                         norm_topk_prob, routed_scaling_factor, n_shared_experts,
                                         swiglu_limit (None when absent)
``deepseek_v4``                          the same keys; scoring_func ``"sqrtsoftplus"`` when absent,
                                         n_group/topk_group 1 when absent, ``swiglu_limit`` required
``glm4_moe`` (GLM-4.5/4.6)               the DeepSeek-V3 keys (sigmoid routing with
                                         ``e_score_correction_bias``, grouped top-k)
``qwen3_moe``                            num_experts = ``num_experts``, top_k, hidden_size,
                                         intermediate_size = ``moe_intermediate_size``, scoring_func
                                         ``"softmax"``, norm_topk_prob, no shared experts
=======================================  ===============================================================

A key that changes the layer's arithmetic and has no safe default (``n_group``, ``topk_group``,
``norm_topk_prob``, ``routed_scaling_factor``, ``n_shared_experts`` for the DeepSeek-style
families) must be present: a missing one is a ValueError rather than a guessed default. What the
layer cannot express (a ``topk_method`` other than ``noaux_tc``, a ``hidden_act`` other than
``silu``, Qwen2-MoE's gated shared expert, ...) is a ValueError naming the key and its value.
Multimodal configs that nest the language model under ``text_config`` are read from there
(its ``quantization_config`` too, when the top level has none).

Quantization (sets ``activation`` and ``activation_scale``):

* ModelOpt (``hf_quant_config.json`` next to ``config.json`` with ``quantization.quant_algo``,
  or ``quantization_config.quant_method == "modelopt"``): ``quant_algo == "NVFP4"`` -> ``w4a4``
  with the static calibrated ``input_scale`` (``activation_scale="static"``).
* AMD Quark (``quantization_config.quant_method == "quark"``): NVFP4 weights are
  ``global_quant_config.weight == [fp4 per_group group_size 16, fp8_e4m3 per_tensor]``;
  ``input_tensors`` None -> ``w4a16``, the same two-entry NVFP4 spec -> ``w4a4``, ``"static"`` when
  its per-tensor entry is not dynamic (``input_scale_2`` stored), else ``"dynamic"``.
* No quantization config: the MoEConfig defaults (``w4a4``, ``dynamic``).
* Anything else (compressed-tensors, FP8, MXFP4, ...) is a ValueError; pass both ``activation``
  and ``activation_scale`` as overrides to build the config regardless. So are malformed
  configs (an ``hf_quant_config.json`` that is not an object or whose ``quantization`` is not
  one) and conflicting ones (an ``hf_quant_config.json`` beside a ``quantization_config`` that
  is not ModelOpt's with the same ``quant_algo``; top-level and ``text_config``
  ``quantization_config`` that differ).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Optional, Union

__all__ = ["read_hf_config", "moe_config_fields_from_hf", "quantization_from_hf", "HF_MODEL_TYPES"]

CONFIG_NAME = "config.json"
MODELOPT_QUANT_NAME = "hf_quant_config.json"

_DEEPSEEK_TYPES = ("deepseek_v3", "deepseek_v32", "kimi_k2")
HF_MODEL_TYPES = _DEEPSEEK_TYPES + ("deepseek_v4", "glm4_moe", "qwen3_moe")
"""``model_type`` values :func:`moe_config_fields_from_hf` understands."""


def read_hf_config(path_or_dict: Union[str, os.PathLike, Mapping[str, Any]]
                   ) -> tuple[dict, Optional[str]]:
    """Return ``(config dict, folder or None)`` from a config.json path, its folder, or a dict."""
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict), None
    if not isinstance(path_or_dict, (str, os.PathLike)):
        raise TypeError("path_or_dict: expected a path to config.json, a model folder or a dict, "
                        f"got {type(path_or_dict).__name__}")
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
        path = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file (expected a Hugging Face config.json or the "
                                "model folder holding it)")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a JSON config: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg, os.path.dirname(os.path.abspath(path))


class _Keys:
    """Typed access to config keys with errors naming the key and its value."""

    def __init__(self, cfg: Mapping[str, Any], where: str):
        self.cfg, self.where = cfg, where

    def err(self, key: str, why: str) -> ValueError:
        shown = repr(self.cfg[key]) if key in self.cfg else "absent"
        return ValueError(f"{self.where}: {key} = {shown}: {why}")

    def has(self, key: str) -> bool:
        return self.cfg.get(key) is not None

    def int(self, key: str, default: Optional[int] = None, *, field: str) -> int:
        v = self.cfg.get(key)
        if v is None:
            if default is None:
                raise self.err(key, f"required for MoEConfig.{field}")
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.err(key, f"expected an integer (MoEConfig.{field})")
        return v

    def float(self, key: str, default: Optional[float] = None, *, field: str) -> float:
        v = self.cfg.get(key)
        if v is None:
            if default is None:
                raise self.err(key, f"required for MoEConfig.{field}")
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.err(key, f"expected a number (MoEConfig.{field})")
        return float(v)

    def bool(self, key: str, default: Optional[bool] = None, *, field: str) -> bool:
        v = self.cfg.get(key)
        if v is None:
            if default is None:
                raise self.err(key, f"required for MoEConfig.{field}")
            return default
        if not isinstance(v, bool):
            raise self.err(key, f"expected true or false (MoEConfig.{field})")
        return v

    def str(self, key: str, default: Optional[str] = None) -> Optional[str]:
        v = self.cfg.get(key)
        return default if v is None else v


def _text_config(cfg: dict) -> dict:
    """The language model's config (multimodal checkpoints nest it under ``text_config``)."""
    tc = cfg.get("text_config")
    if isinstance(tc, dict) and cfg.get("model_type") not in HF_MODEL_TYPES:
        return tc
    return cfg


def _deepseek_family(k: _Keys, model_type: str) -> dict:
    v4 = model_type == "deepseek_v4"
    kw = dict(
        num_experts=k.int("n_routed_experts", field="num_experts"),
        top_k=k.int("num_experts_per_tok", field="top_k"),
        hidden_size=k.int("hidden_size", field="hidden_size"),
        intermediate_size=k.int("moe_intermediate_size", field="intermediate_size"),
        scoring_func=k.str("scoring_func", "sqrtsoftplus" if v4 else "sigmoid"),
        n_group=k.int("n_group", 1 if v4 else None, field="n_group"),
        topk_group=k.int("topk_group", 1 if v4 else None, field="topk_group"),
        norm_topk_prob=k.bool("norm_topk_prob", field="norm_topk_prob"),
        routed_scaling_factor=k.float("routed_scaling_factor", field="routed_scaling_factor"),
        n_shared_experts=k.int("n_shared_experts", field="n_shared_experts"),
    )
    if v4 or k.has("swiglu_limit"):
        kw["swiglu_limit"] = k.float("swiglu_limit", field="swiglu_limit")
    method = k.str("topk_method", "noaux_tc")
    if method != "noaux_tc":
        raise k.err("topk_method", "only 'noaux_tc' (score + e_score_correction_bias selection, "
                                   "best groups by the sum of their top-2) is expressible")
    return kw


def _glm4_moe(k: _Keys, model_type: str) -> dict:
    kw = _deepseek_family(k, model_type)
    if kw["scoring_func"] != "sigmoid":
        raise k.err("scoring_func", "GLM-4.5 routing is sigmoid")
    return kw


def _qwen3_moe(k: _Keys, model_type: str) -> dict:
    if k.cfg.get("shared_expert_intermediate_size"):
        raise k.err("shared_expert_intermediate_size",
                    "a sigmoid-gated shared expert (Qwen2-MoE) is not expressible")
    return dict(
        num_experts=k.int("num_experts", field="num_experts"),
        top_k=k.int("num_experts_per_tok", field="top_k"),
        hidden_size=k.int("hidden_size", field="hidden_size"),
        intermediate_size=k.int("moe_intermediate_size", field="intermediate_size"),
        scoring_func="softmax",
        norm_topk_prob=k.bool("norm_topk_prob", field="norm_topk_prob"),
        routed_scaling_factor=1.0,
        n_shared_experts=0,
    )


_FAMILIES = {**{t: _deepseek_family for t in _DEEPSEEK_TYPES}, "deepseek_v4": _deepseek_family,
             "glm4_moe": _glm4_moe, "qwen3_moe": _qwen3_moe}


def _quark_spec_is_nvfp4(spec: Any) -> bool:
    if not isinstance(spec, list) or len(spec) != 2 or not all(isinstance(s, dict) for s in spec):
        return False
    blk, glob = spec
    return (blk.get("dtype") == "fp4" and blk.get("qscheme") == "per_group"
            and blk.get("group_size") == 16 and glob.get("dtype") == "fp8_e4m3"
            and glob.get("qscheme") == "per_tensor")


def _quantization_config(cfg: Mapping[str, Any]) -> Any:
    """``quantization_config`` from the top level, else from ``text_config`` (where some
    multimodal checkpoints keep it; vLLM reads it from there too). Both present and different
    is a ValueError."""
    top = cfg.get("quantization_config")
    tc = cfg.get("text_config")
    nested = tc.get("quantization_config") if isinstance(tc, Mapping) else None
    if top is not None and nested is not None and top != nested:
        raise ValueError(f"quantization_config = {top!r:.200} and text_config.quantization_config "
                         f"= {nested!r:.200} disagree; expected one quantization config (or two "
                         "equal ones)")
    return top if top is not None else nested


def _read_modelopt_file(folder: Optional[str]) -> Optional[tuple[str, dict]]:
    """(path, quantization object) of ModelOpt's ``hf_quant_config.json`` in ``folder``, or None
    when there is none. The object is the file's ``quantization`` entry (or, in files without
    one, the file itself); anything else is a ValueError naming the file."""
    if folder is None:
        return None
    qpath = os.path.join(folder, MODELOPT_QUANT_NAME)
    if not os.path.isfile(qpath):
        return None
    try:
        with open(qpath, encoding="utf-8") as f:
            doc = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{qpath}: not a JSON file: {e}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{qpath}: expected a JSON object with a \"quantization\" object, got "
                         f"{doc!r:.100}")
    mo = doc["quantization"] if "quantization" in doc else doc
    if not isinstance(mo, dict):
        raise ValueError(f"{qpath}: quantization = {mo!r:.100}: expected an object with "
                         "\"quant_algo\" (e.g. {\"quant_algo\": \"NVFP4\", \"group_size\": 16})")
    return qpath, mo


def _modelopt(mo: Mapping[str, Any], where: str) -> dict[str, str]:
    """The settings of a ModelOpt quantization object (only NVFP4 group 16 is loadable)."""
    algo = mo.get("quant_algo")
    if algo != "NVFP4":
        raise ValueError(f"{where}: quant_algo = {algo!r}: only ModelOpt 'NVFP4' (NVFP4 weights "
                         "and activations, static input_scale) is loadable")
    if mo.get("group_size", 16) != 16:
        raise ValueError(f"{where}: group_size = {mo.get('group_size')!r}: NVFP4 uses 16")
    return dict(format="modelopt", activation="w4a4", activation_scale="static")


def _quark(qc: Mapping[str, Any]) -> dict[str, str]:
    """The settings of a Quark quantization_config (NVFP4 weights; NVFP4 or no activations)."""
    g = qc.get("global_quant_config") or {}
    if not _quark_spec_is_nvfp4(g.get("weight")):
        raise ValueError("quantization_config.global_quant_config.weight = "
                         f"{g.get('weight')!r:.300}: not Quark NVFP4 (expected [fp4 per_group "
                         "group_size 16, fp8_e4m3 per_tensor])")
    inp = g.get("input_tensors")
    if inp is None:
        return dict(format="quark", activation="w4a16", activation_scale="dynamic")
    if not _quark_spec_is_nvfp4(inp):
        raise ValueError("quantization_config.global_quant_config.input_tensors = "
                         f"{inp!r:.300}: only NVFP4 activations (or none: W4A16) are expressible")
    static = not inp[1].get("is_dynamic", False)
    return dict(format="quark", activation="w4a4",
                activation_scale="static" if static else "dynamic")


def quantization_from_hf(cfg: Mapping[str, Any], folder: Optional[str] = None
                         ) -> Optional[dict[str, str]]:
    """``{"format", "activation", "activation_scale"}`` from the checkpoint's quantization config.

    Reads ``cfg["quantization_config"]`` (or, when absent, ``cfg["text_config"]
    ["quantization_config"]``) and, when ``folder`` is given, ModelOpt's ``hf_quant_config.json``
    in it. Returns None when there is no quantization config (the weights are not quantized, or
    the config was given as a dict without one). ``format`` is ``"modelopt"`` or ``"quark"``
    (the names :func:`jax_nvfp4.checkpoint.load_moe` expects).

    Raises:
      ValueError naming the key and value of a quantization this package does not load, a
      malformed ``hf_quant_config.json`` (not an object, ``quantization`` not an object), or
      configs that disagree (an ``hf_quant_config.json`` beside a ``quantization_config`` that
      is not ModelOpt's with the same ``quant_algo``; a top-level and a ``text_config``
      ``quantization_config`` that differ).
    """
    qc = _quantization_config(cfg)
    if qc is not None and not isinstance(qc, dict):
        raise ValueError(f"quantization_config = {qc!r:.100}: expected an object")
    method = qc.get("quant_method") if qc is not None else None
    found = _read_modelopt_file(folder)
    if found is not None:
        qpath, mo = found
        if qc is not None and (method != "modelopt" or (
                qc.get("quant_algo") is not None and qc.get("quant_algo") != mo.get("quant_algo"))):
            raise ValueError(
                f"{qpath} (quant_algo = {mo.get('quant_algo')!r}) and config.json "
                f"quantization_config (quant_method = {method!r}, quant_algo = "
                f"{qc.get('quant_algo')!r}) disagree; expected one quantization, described the "
                "same way in both")
        return _modelopt(mo, qpath)
    if qc is None:
        return None
    if method == "modelopt":
        return _modelopt(qc, "quantization_config")
    if method != "quark":
        raise ValueError(f"quantization_config.quant_method = {method!r}: only ModelOpt NVFP4 "
                         "('modelopt' or hf_quant_config.json) and AMD Quark NVFP4 ('quark') "
                         "checkpoints are loadable (compressed-tensors stores inverse scales)")
    return _quark(qc)


def moe_config_fields_from_hf(path_or_dict: Union[str, os.PathLike, Mapping[str, Any]],
                              overrides: Mapping[str, Any]) -> tuple[dict, str]:
    """The :class:`~jax_nvfp4.MoEConfig` fields of a model's routed MoE layers, from its Hugging
    Face config (:meth:`jax_nvfp4.MoEConfig.from_hf_config` builds the config from them).

    Args:
      path_or_dict: a ``config.json`` path, the model folder holding it (ModelOpt's
        ``hf_quant_config.json`` beside it is read too), or the parsed dict.
      overrides: fields that replace the mapped values (e.g. ``activation_scale="dynamic"``).
        When both ``activation`` and ``activation_scale`` are given, the quantization config is
        not consulted.

    Returns:
      ``(fields, where)``: the keyword arguments of MoEConfig (see the module docstring for the
      key mapping per ``model_type``) and a description of the config they came from, for
      messages.

    Raises:
      ValueError naming the config key and value the layer cannot express, a missing required
      key, or an unsupported ``model_type`` / quantization; FileNotFoundError for a path with no
      config.json.
    """
    cfg, folder = read_hf_config(path_or_dict)
    where = os.path.join(folder, CONFIG_NAME) if folder else "config"
    tc = _text_config(cfg)
    if tc is not cfg:
        where += " text_config"
    model_type = tc.get("model_type")
    if model_type not in _FAMILIES:
        raise ValueError(f"{where}: model_type = {model_type!r}: expected one of {HF_MODEL_TYPES} "
                         "(build MoEConfig(...) by hand for other architectures)")
    k = _Keys(tc, where)
    act = k.str("hidden_act", "silu")
    if act != "silu":
        raise k.err("hidden_act", "the experts are SwiGLU (silu(gate) * up)")
    kw = _FAMILIES[model_type](k, model_type)
    if not ("activation" in overrides and "activation_scale" in overrides):
        q = quantization_from_hf(cfg, folder)
        if q is not None:
            kw["activation"], kw["activation_scale"] = q["activation"], q["activation_scale"]
    kw.update(overrides)
    return kw, f"{where} (model_type {model_type!r})"
