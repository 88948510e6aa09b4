"""Loading NVFP4 Mixture-of-Experts checkpoints (ModelOpt and Quark) into :class:`MoEWeights`.

Checkpoint formats
==================

Both NVIDIA ModelOpt (``hf_quant_config.json``: ``quant_algo NVFP4``, ``group_size 16``) and AMD
Quark NVFP4 store each linear layer ``y = x @ W.T`` (``W`` of shape ``[N, K]``) as:

========================  ==========================  ==============================================
tensor                    dtype / shape               meaning
========================  ==========================  ==============================================
``weight``                U8 ``[N, K/2]`` (or I8)     E2M1 codes, element 2j in the low nibble of
                                                      byte j
``weight_scale``          F8_E4M3 ``[N, K/16]``       per-16-block scale ``amax_blk / (6 * ws2)``
                                                      rounded to e4m3 (so its maximum is ~448);
                                                      loaded by a *bitcast* of the bytes
``weight_scale_2``        F32 or BF16 scalar          ``ws2 = amax(W) / (6 * 448) = amax / 2688``,
                                                      a dequantization multiplier
``input_scale``           F32 scalar (ModelOpt)       static calibrated ``amax(x) / 2688``
``input_scale_2``         F32 scalar (Quark)          the same thing as ModelOpt ``input_scale``
                                                      (Quark's per-16 activation scales are
                                                      dynamic, so only the global one is stored)
========================  ==========================  ==============================================

Every ``weight_scale_2`` and input scale must be finite and at least 2^-126, the smallest normal
float32 (:data:`MIN_SCALE`, the layer's own bound; a ValueError naming the tensor and its file
otherwise: a negative or NaN scale would be hidden by the max of gate and up, a zero one divides
by zero, a subnormal one flushes to zero in XLA).

So ``W ~= e2m1(weight) * float32(weight_scale) * weight_scale_2``: exactly this package's
:class:`~jax_nvfp4.maths.formats.NVFP4Tensor` convention (``global_scale = weight_scale_2``). Scalars
may be stored with shape ``[]`` or ``[1]``. Weight-only (W4A16) checkpoints have no input scale.

The *static activation scale* is the checkpoint's input scale: a calibration constant, the
dequantization multiplier ``amax_calib / 2688`` of the GEMM input. A kernel quantizing with it
uses ``1 / input_scale`` as the quantization-side multiplier; real activations larger than the
calibration amax saturate (to 6 * 448 * input_scale). The GEMM epilogue factor is
``alpha = input_scale * weight_scale_2``.

Compressed-tensors (llm-compressor) checkpoints store the *inverse*, ``*_global_scale =
2688 / amax``; those are not this format. :func:`load_moe` warns when a checkpoint looks like
that (a weight_scale_2 above 1 means amax(W) > 2688, which real weights never have) or when the
block scales do not reach ~448 (the per-block scale convention is not ``amax_blk / (6 * ws2)``).

Tensor names (Hugging Face DeepSeek style, ``{prefix}`` e.g. ``model.layers.3.mlp``)
===================================================================================

* ``{prefix}.gate.weight`` ``[E, H]``, router (F32, BF16, F16 or F64; loaded as float32; an
  integer, bool or 8-bit float router is refused: its values would need a scale it lacks);
* ``{prefix}.gate.e_score_correction_bias`` ``[E]`` (optional; original DeepSeek: ``gate.bias``;
  the same dtypes);
* ``{prefix}.gate.tid2eid`` ``[vocab, top_k]`` (optional; hash-routed layers: expert ids per
  input token id);
* ``{prefix}.experts.{e}.{gate_proj|up_proj|down_proj}.{weight|weight_scale|weight_scale_2|
  input_scale|input_scale_2}``, or with the original DeepSeek names ``w1`` (gate), ``w3`` (up),
  ``w2`` (down);
* ``{prefix}.shared_experts.{gate_proj|up_proj|down_proj|w1|w3|w2}.*`` (present iff
  ``config.n_shared_experts > 0``; width ``I * n_shared_experts``).

Hugging Face folders
====================

:func:`load_moe` also takes a model folder or its ``model.safetensors.index.json``
(:mod:`jax_nvfp4.checkpoint.hf_folder`: only the shards holding the requested tensors are opened);
:func:`load_model_moe` / :func:`iter_model_moe` load every MoE layer of a model (found by
:func:`moe_layer_prefixes`) with a progress bar; :meth:`MoEConfig.from_hf_config`
(:mod:`jax_nvfp4.config.hf_config`) builds the layer's config from ``config.json``.

Safetensors
===========

Files are read and written by :mod:`jax_nvfp4.checkpoint.safetensors_io` (re-exported by :mod:`jax_nvfp4.checkpoint`:
:func:`read_safetensors`, :func:`save_safetensors`, :class:`SafetensorsReader`), which keeps
F8_E4M3 block scales as stored, validates every header entry and writes atomically.
"""

from __future__ import annotations

import operator
import os
import re
import sys
import warnings
from collections.abc import Mapping
from typing import Any, Iterable, Optional, Sequence

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .hf_folder import open_checkpoint, where_looked
from ..maths.formats import BLOCK_SIZE, E2M1_VALUES, E4M3_MAX, E2M1_MAX, K_MULTIPLE, NVFP4Tensor
from ..config.options import CHECKPOINT_FORMATS, WEIGHT_LAYOUTS, caller_stacklevel
from ..ops.prepare import prepare_weights
from ..maths.quantization import MIN_GLOBAL_SCALE
from ..config.moe_params import MoEConfig, MoEWeights

FORMATS = CHECKPOINT_FORMATS
"""Checkpoint formats :func:`load_moe` understands (``"auto"`` picks one from the names;
:data:`jax_nvfp4.config.options.CHECKPOINT_FORMATS`)."""

# ------------------------------------------------------------------------------------------------
# names and format detection
# ------------------------------------------------------------------------------------------------

_PROJ_NAMES = {  # role -> (HF name, original DeepSeek name)
    "gate": ("gate_proj", "w1"),
    "up": ("up_proj", "w3"),
    "down": ("down_proj", "w2"),
}
_INPUT_SCALE = {"modelopt": "input_scale", "quark": "input_scale_2"}


def detect_format(names: Iterable[str], prefix: str = "") -> Optional[str]:
    """Return ``"modelopt"`` (tensors named ``*.input_scale``), ``"quark"`` (``*.input_scale_2``)
    or None (weight-only: neither) from the tensor names under ``prefix``.

    Raises ValueError when both kinds appear under the prefix.
    """
    pre = prefix + "." if prefix else ""
    has_mo = has_qk = False
    for n in names:
        if not n.startswith(pre):
            continue
        if n.endswith(".input_scale"):
            has_mo = True
        elif n.endswith(".input_scale_2"):
            has_qk = True
    if has_mo and has_qk:
        raise ValueError(f"{prefix}: both ModelOpt '*.input_scale' and Quark '*.input_scale_2' "
                         "tensors are present; pass format='modelopt' or format='quark'")
    return "modelopt" if has_mo else "quark" if has_qk else None


def _as_source(source) -> Mapping:
    if isinstance(source, Mapping):
        return source
    if isinstance(source, (str, os.PathLike)) or (
            isinstance(source, (list, tuple)) and source
            and all(isinstance(p, (str, os.PathLike)) for p in source)):
        return open_checkpoint(source)
    raise TypeError("source: expected a mapping name -> array, a model folder, its "
                    "model.safetensors.index.json, a safetensors path or a non-empty list of paths, "
                    f"got {type(source).__name__}")


def _resolve_proj(src: Mapping, base: str) -> dict[str, str]:
    """Map role -> name prefix (``{base}.gate_proj`` or ``{base}.w1``) by what the source holds."""
    out = {}
    for role, (hf, ds) in _PROJ_NAMES.items():
        a, b = f"{base}.{hf}", f"{base}.{ds}"
        if f"{a}.weight" in src:
            out[role] = a
        elif f"{b}.weight" in src:
            out[role] = b
        else:
            raise KeyError(f"missing tensor {a}.weight (or, with original DeepSeek names, "
                           f"{b}.weight){where_looked(src)}")
    return out


# ------------------------------------------------------------------------------------------------
# per-tensor loaders (numpy, host)
# ------------------------------------------------------------------------------------------------

def _get(src: Mapping, name: str) -> np.ndarray:
    # Membership first: an error the source raises for a tensor it lists (an index naming the
    # wrong shard) keeps its own message.
    if name not in src:
        raise KeyError(f"missing tensor {name}{where_looked(src)}")
    return np.asarray(src[name])


def _packed(src: Mapping, name: str, rows: int, k: int, what: str) -> np.ndarray:
    """uint8 [rows, k/2] packed E2M1 codes (int8 is bit-viewed)."""
    a = _get(src, name)
    if a.dtype == np.int8:
        a = a.view(np.uint8)
    if a.dtype != np.uint8:
        raise ValueError(f"{name}: expected packed NVFP4 codes as uint8 (or int8) [{what}], got "
                         f"dtype {a.dtype} (an unquantized or differently quantized checkpoint?)")
    if a.shape != (rows, k // 2):
        raise ValueError(f"{name}: expected shape {(rows, k // 2)} (uint8 [{what}]), found "
                         f"{tuple(a.shape)}")
    return a


def _block_scales(src: Mapping, name: str, rows: int, k: int, what: str) -> np.ndarray:
    """float8_e4m3fn [rows, k/16]: raw bytes are bitcast, never value-converted."""
    a = _get(src, name)
    if a.dtype in (np.uint8, np.int8):
        a = a.view(ml_dtypes.float8_e4m3fn)
    if a.dtype != np.dtype(ml_dtypes.float8_e4m3fn):
        raise ValueError(f"{name}: expected e4m3 block scales (F8_E4M3, or their uint8 bytes) "
                         f"[{what}], got dtype {a.dtype}; refusing to value-convert block scales")
    if a.shape != (rows, k // BLOCK_SIZE):
        raise ValueError(f"{name}: expected shape {(rows, k // BLOCK_SIZE)} (float8_e4m3fn "
                         f"[{what}]), found {tuple(a.shape)}")
    return a


def _scalar(src: Mapping, name: str) -> float:
    """A float scalar stored as [] or [1] (f32/bf16/f16/f64) -> its value as stored (float64)."""
    a = _get(src, name)
    if a.size != 1 or a.ndim > 1:
        raise ValueError(f"{name}: expected a scalar (shape [] or [1]), found shape {tuple(a.shape)}")
    if not (np.issubdtype(a.dtype, np.floating) or a.dtype == np.dtype(ml_dtypes.bfloat16)):
        raise ValueError(f"{name}: expected a float scalar (F32/BF16), got dtype {a.dtype}")
    return float(a.reshape(()).astype(np.float64))


MIN_SCALE = MIN_GLOBAL_SCALE
"""The smallest weight_scale_2 or input scale :func:`load_moe` accepts: 2^-126, the smallest
normal float32, the layer's own bound for static input scales and quantize's for a global scale
(a subnormal scale would flush to 0 inside XLA)."""


def _in_file(src: Mapping, name: str) -> str:
    """`` (in <file>)`` for a source that knows the file holding ``name`` (a tensor it holds),
    else empty."""
    file_of = getattr(src, "file_of", None)
    return "" if file_of is None else f" (in {file_of(name)})"


def _global_scale(src: Mapping, name: str) -> np.float32:
    """A weight_scale_2 or input scale: a float scalar, finite and >= :data:`MIN_SCALE` as
    stored (an F64 one is checked before its float32 cast, which would make 1e39 inf and 1e-300
    0.0), finite in float32."""
    stored = _scalar(src, name)
    with np.errstate(over="ignore"):
        v = np.float32(stored)
    if not (np.isfinite(stored) and stored >= MIN_SCALE and np.isfinite(v)):
        raise ValueError(f"{name}{_in_file(src, name)}: expected a finite scale >= 2^-126 (the "
                         "smallest normal float32; the dequantization multiplier amax / 2688) "
                         f"that float32 holds, found {stored!r}")
    return v


def _global_scale_opt(src: Mapping, name: str) -> Optional[np.float32]:
    return _global_scale(src, name) if name in src else None


_ROUTER_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16),
                  np.dtype(np.float64))


def _router_tensor(src: Mapping, name: str, shape: tuple[int, ...], what: str) -> np.ndarray:
    """A router weight or bias of ``shape``, stored as F32/BF16/F16/F64 -> float32."""
    a = _get(src, name)
    if a.shape != shape:
        raise ValueError(f"{name}: expected shape {shape} ({what}), found {tuple(a.shape)}")
    if a.dtype not in _ROUTER_DTYPES:
        raise ValueError(f"{name}: expected a float tensor (F32, BF16, F16 or F64) [{what}], got "
                         f"dtype {a.dtype}; refusing to value-convert it (a quantized or "
                         "mislabelled router?)")
    return a.astype(np.float32)


class _Linear:
    """One loaded NVFP4 linear: data u8 [N, K/2], scales e4m3 [N, K/16], ws2, optional input scale."""

    __slots__ = ("data", "scales", "ws2", "inp")

    def __init__(self, data, scales, ws2, inp):
        self.data, self.scales, self.ws2, self.inp = data, scales, ws2, inp


def _load_linear(src: Mapping, base: str, rows: int, k: int, dims: tuple[str, str], sizes: str,
                 in_name: Optional[str]) -> _Linear:
    """Load ``{base}.weight/weight_scale/weight_scale_2[/in_name]`` of a [rows, k] NVFP4 linear."""
    if k % K_MULTIPLE:
        raise ValueError(f"{base}.weight: K = {k} is not a multiple of {K_MULTIPLE}")
    data = _packed(src, f"{base}.weight", rows, k, f"{dims[0]}, {dims[1]}/2 {sizes}")
    scales = _block_scales(src, f"{base}.weight_scale", rows, k, f"{dims[0]}, {dims[1]}/16 {sizes}")
    ws2 = _global_scale(src, f"{base}.weight_scale_2")
    inp = _global_scale_opt(src, f"{base}.{in_name}") if in_name else None
    return _Linear(data, scales, ws2, inp)


# ------------------------------------------------------------------------------------------------
# convention checks (cheap, vectorized)
# ------------------------------------------------------------------------------------------------

_E2M1_ABS = np.abs(E2M1_VALUES)


def _max_scale(scales_u8: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """Largest |e4m3| value over ``axes`` from raw bytes (|e4m3| is monotonic in byte & 0x7F)."""
    m = np.max(scales_u8 & np.uint8(0x7F), axis=axes)
    return m.view(ml_dtypes.float8_e4m3fn).astype(np.float32)  # 0x7F -> NaN


def _deq_amax_over_gs(data: np.ndarray, scales: np.ndarray) -> float:
    """max |e2m1 * scale| of one [N, K] NVFP4 tensor (without the global scale)."""
    n = data.shape[0]
    codes = np.maximum(_E2M1_ABS[data & 0x0F], _E2M1_ABS[data >> 4])  # [N, K/2]
    blk = codes.reshape(n, -1, BLOCK_SIZE // 2).max(axis=-1)              # [N, K/16]
    return float(np.max(blk * np.abs(scales.astype(np.float32))))


def _check_conventions(name: str, groups: list[tuple[str, np.ndarray, np.ndarray]],
                       ws2: dict[str, np.ndarray], inputs: dict[str, np.ndarray],
                       sample: dict[str, tuple[np.ndarray, np.ndarray, float]]) -> None:
    """Warn (once per layer) when the scales do not look like the ModelOpt convention.

    groups: (label, scale bytes [E, ...] of tensors sharing one weight_scale_2, labels per expert)
    ws2/inputs: label -> float32 [E] values; sample: label -> (data, scales, ws2) of one tensor.
    The warning names the user's line (the first frame outside jax_nvfp4 and JAX).
    """
    problems: list[str] = []
    lo, hi = E4M3_MAX / 4, E4M3_MAX
    for label, s_u8, tensor_names in groups:
        m = _max_scale(s_u8, tuple(range(1, s_u8.ndim)))
        bad = np.flatnonzero(~((m >= lo) & (m <= hi)))  # NaN counts as bad
        if bad.size:
            ex = ", ".join(f"{tensor_names[i]} (max {m[i]:g})" for i in bad[:3])
            problems.append(
                f"{bad.size} {label} block-scale tensor(s) have a largest e4m3 block scale outside "
                f"[{lo:g}, {hi:g}] (ModelOpt: weight_scale = amax_blk / (6 * weight_scale_2), "
                f"whose maximum is ~448), e.g. {ex}")
    for label, v in ws2.items():
        bad = np.flatnonzero(~(v > 0) | ~np.isfinite(v) | (v > 1.0))
        if bad.size:
            problems.append(
                f"{bad.size} {label} weight_scale_2 value(s) are not in (0, 1] (e.g. {v[bad[0]]:g}): "
                "expected the dequantization multiplier amax(W)/2688; a value above 1 looks like "
                "the inverse 2688/amax (compressed-tensors convention)")
    for label, v in inputs.items():
        bad = np.flatnonzero(~(v > 0) | ~np.isfinite(v) | (v > 1.0))
        if bad.size:
            problems.append(
                f"{bad.size} {label} input scale(s) are not in (0, 1] (e.g. {v[bad[0]]:g}): "
                "expected the dequantization multiplier amax(x)/2688; a value above 1 (activation "
                "amax above 2688) looks like the inverse 2688/amax")
    for label, (data, scales, g) in sample.items():
        r = _deq_amax_over_gs(data, scales) / (E2M1_MAX * E4M3_MAX)
        if not 0.25 <= r <= 1.125:
            problems.append(
                f"{label}: amax(dequantized weight) / 2688 = {r * g:g} but weight_scale_2 = {g:g} "
                f"(ratio {r:g}); expected weight_scale_2 = amax(W)/2688")
    if problems:
        warnings.warn(f"{name}: the NVFP4 scales do not look like the ModelOpt/Quark convention "
                      "(x = e2m1 * weight_scale * weight_scale_2):\n  " + "\n  ".join(problems),
                      stacklevel=caller_stacklevel())


# ------------------------------------------------------------------------------------------------
# load_moe
# ------------------------------------------------------------------------------------------------

def _load_mlp(src, bases: dict[str, str], inter: int, hidden: int, in_name: Optional[str]):
    """Load gate [inter, hidden], up [inter, hidden] and down [hidden, inter] of one MLP."""
    gu = f"with I={inter}, H={hidden}"
    g = _load_linear(src, bases["gate"], inter, hidden, ("I", "H"), gu, in_name)
    u = _load_linear(src, bases["up"], inter, hidden, ("I", "H"), gu, in_name)
    d = _load_linear(src, bases["down"], hidden, inter, ("H", "I"), gu, in_name)
    return g, u, d


def _input_scales(name: str, values: list[Optional[np.float32]], names: list[str]
                  ) -> Optional[np.ndarray]:
    present = [v is not None for v in values]
    if not any(present):
        return None
    if not all(present):
        missing = names[present.index(False)]
        raise KeyError(f"missing tensor {missing} (other {name} input scales are present)")
    return np.asarray(values, np.float32)


def load_moe(source, prefix: str, config: MoEConfig, *, format: str = "auto",
             experts: Optional[Sequence[int]] = None, check: bool = True,
             layout: str = "checkpoint") -> MoEWeights:
    """Load one NVFP4 MoE layer from a ModelOpt or Quark checkpoint into :class:`MoEWeights`.

    Args:
      source: a Hugging Face model folder (with ``model.safetensors.index.json``: only the
        shards holding this layer's tensors are opened; else its ``model.safetensors`` or every
        ``*.safetensors`` in it), its index file, one safetensors file, a list of files, or a
        mapping name -> array (numpy or jax; block scales as float8_e4m3fn or their uint8
        bytes). See :func:`jax_nvfp4.checkpoint.hf_folder.open_checkpoint`.
      prefix: the layer's name prefix, e.g. ``"model.layers.3.mlp"`` (no trailing dot).
      config: the layer's :class:`MoEConfig` (E, H, I, top_k and n_shared_experts are checked).
      format: ``"modelopt"`` (input scales ``*.input_scale``), ``"quark"`` (``*.input_scale_2``)
        or ``"auto"`` (from the names; a weight-only checkpoint has neither and loads with input
        scales None).
      experts: optional integer expert ids to load (e.g. this rank's slice under expert
        parallelism);
        the expert-stacked fields then have ``len(experts)`` rows in that order and
        ``MoEWeights.expert_ids`` records the ids (so :func:`save_moe` writes them back under
        the same names), while the router weight, bias and hash table stay global (``[E, ...]``,
        ids in ``[0, E)``).
      check: warn when the scales do not look like the ModelOpt/Quark convention (cheap,
        vectorized over experts; see the module docstring).
      layout: ``"checkpoint"`` (the stored byte order) or ``"sm90"``: the NVFP4 weights come back
        through :func:`jax_nvfp4.prepare_weights` (the Hopper kernels' load-time layout, gate/up
        rows paired: ``w13_paired``); ``"fp8"``: through ``prepare_weights(w, "fp8")``, each
        NVFP4 weight an :class:`~jax_nvfp4.maths.formats.Fp8Weights` (``precision="fp8"`` only; 8 bits
        per weight; stored row order).

    Returns:
      MoEWeights with (E = config.num_experts or len(experts), I = intermediate_size,
      H = hidden_size, Is = I * n_shared_experts), all jax arrays:
        router_weight float32 [E, H]; router_bias float32 [E] or None;
        w13 NVFP4Tensor [E, 2I, H] (data uint8 [E, 2I, H/2] gate rows then up rows, scales
        float8_e4m3fn [E, 2I, H/16], global_scale float32 [E], or [E, 2] (gate, up) when some
        expert's gate and up weight_scale_2 differ); w2 NVFP4Tensor [E, H, I] (global_scale [E]);
        w13_input_scale float32 [E] (max of gate and up) and w2_input_scale [E], or None;
        shared_w13 [2Is, H] (global_scale [] or [2]), shared_w2 [H, Is], shared input scales
        float32 [] (or None); hash_table int32 [vocab, top_k] or None.

    Raises:
      KeyError naming the full tensor name (and the files or index looked in) when a tensor is
      missing; ValueError naming the tensor, the expected and the found shape (or dtype) on a
      mismatch, or a weight_scale_2 / input scale that is not finite and >= 2^-126 (as stored:
      an F64 one before its float32 cast); TypeError for ``experts`` that are not integers;
      FileNotFoundError for a path that is neither a file nor a folder.
    """
    if layout not in WEIGHT_LAYOUTS:   # before reading gigabytes
        raise ValueError(f"layout: expected one of {WEIGHT_LAYOUTS}, got {layout!r}")
    src = _as_source(source)
    prefix = prefix.rstrip(".")
    _check_dims(config)
    ids = _expert_ids(experts, config.num_experts)
    fmt = _pick_format(format, src, prefix)
    in_name = _INPUT_SCALE[fmt] if fmt else None
    router, bias, hash_table = _load_router(src, prefix, config)
    routed = _load_routed(src, prefix, ids, config, in_name)
    shared = _load_shared(src, prefix, config, in_name)
    if check:
        _check_loaded(prefix, config.intermediate_size, routed, shared)
    weights = _assemble(router, bias, hash_table, ids, config.num_experts, routed, shared)
    return weights if layout == "checkpoint" else prepare_weights(weights, layout)


def _check_dims(config: MoEConfig) -> None:
    """Raise ValueError unless H and I are multiples of K_MULTIPLE; return None."""
    for what, v in (("hidden_size", config.hidden_size), ("intermediate_size", config.intermediate_size)):
        if v % K_MULTIPLE:
            raise ValueError(f"config.{what} = {v} is not a multiple of {K_MULTIPLE}")


def _expert_ids(experts: Optional[Sequence[int]], E: int) -> list[int]:
    """Return the expert ids to load: ``experts`` checked (distinct, in [0, E)), or all E."""
    if experts is None:
        ids = list(range(E))
    else:
        try:    # integers only (as MoEWeights.expert_ids): int() would truncate 1.5 to expert 1
            ids = [operator.index(e) for e in experts]
        except TypeError:
            raise TypeError(f"experts: expected integer expert ids, got "
                            f"{list(experts)[:8]!r:.200}") from None
    if not ids or any(not 0 <= e < E for e in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"experts: expected a non-empty list of distinct ids in [0, {E}), got "
                         f"{ids[:8]}...")
    return ids


def _pick_format(format: str, src: Mapping, prefix: str) -> Optional[str]:
    """Return the checkpoint format (one of FORMATS, or None for weight-only) for ``format``."""
    if format == "auto":
        return detect_format(src.keys(), prefix)
    if format in FORMATS:
        return format
    raise ValueError(f"format: expected 'auto' or one of {FORMATS}, got {format!r}")


def _load_router(src: Mapping, prefix: str, config: MoEConfig):
    """Return (router float32 [E, H], bias float32 [E] or None, hash table int32 [vocab, top_k] or None)."""
    E, H = config.num_experts, config.hidden_size
    router = _router_tensor(src, f"{prefix}.gate.weight", (E, H), f"[E, H] with E={E}, H={H}")
    bias = None
    for bname in (f"{prefix}.gate.e_score_correction_bias", f"{prefix}.gate.bias"):
        if bname in src:
            bias = _router_tensor(src, bname, (E,), f"[E] with E={E}")
            break
    hname = f"{prefix}.gate.tid2eid"
    hash_table = _hash_table(src, hname, E, config.top_k) if hname in src else None
    return router, bias, hash_table


def _hash_table(src: Mapping, hname: str, E: int, top_k: int) -> np.ndarray:
    """Return the hash-routing table ``hname`` as int32 [vocab, top_k], ids checked in [0, E)."""
    hash_table = _get(src, hname)
    if hash_table.ndim != 2 or hash_table.shape[1] != top_k:
        raise ValueError(f"{hname}: expected shape [vocab, top_k={top_k}], found "
                         f"{tuple(hash_table.shape)}")
    if not np.issubdtype(hash_table.dtype, np.integer):
        raise ValueError(f"{hname}: expected integer expert ids, got dtype {hash_table.dtype}")
    if hash_table.size and (hash_table.min() < 0 or hash_table.max() >= E):
        raise ValueError(f"{hname}: expert ids must lie in [0, {E}), found "
                         f"[{hash_table.min()}, {hash_table.max()}]")
    return hash_table.astype(np.int32)


class _Routed:
    """The routed experts as loaded (numpy, n = len(ids) rows): w13 data u8 [n, 2I, H/2] and
    scales e4m3 [n, 2I, H/16] (gate rows then up rows), w2 data u8 [n, H, I/2] and scales
    e4m3 [n, H, I/16], gs13 float32 [n, 2] (gate, up), gs2 float32 [n], input scales float32 [n]
    or None, the tensor base names per expert, and ``split`` (some expert's gate and up
    weight_scale_2 differ)."""

    __slots__ = ("w13_d", "w13_s", "w2_d", "w2_s", "gs13", "gs2", "w13_in", "w2_in", "names",
                 "split")

    def __init__(self, w13_d, w13_s, w2_d, w2_s, gs13, gs2, w13_in, w2_in, names):
        self.w13_d, self.w13_s, self.w2_d, self.w2_s = w13_d, w13_s, w2_d, w2_s
        self.gs13, self.gs2, self.w13_in, self.w2_in, self.names = gs13, gs2, w13_in, w2_in, names
        self.split = bool(np.any(gs13[:, 0] != gs13[:, 1]))


def _load_routed(src: Mapping, prefix: str, ids: list[int], config: MoEConfig,
                 in_name: Optional[str]) -> _Routed:
    """Return the routed experts ``ids`` stacked in that order (see :class:`_Routed`)."""
    H, I = config.hidden_size, config.intermediate_size
    n = len(ids)
    w13_d = np.empty((n, 2 * I, H // 2), np.uint8)
    w13_s = np.empty((n, 2 * I, H // BLOCK_SIZE), ml_dtypes.float8_e4m3fn)
    w2_d = np.empty((n, H, I // 2), np.uint8)
    w2_s = np.empty((n, H, I // BLOCK_SIZE), ml_dtypes.float8_e4m3fn)
    gs13 = np.empty((n, 2), np.float32)
    gs2 = np.empty((n,), np.float32)
    in13: list[list] = [[], [], []]  # gate, up, down input scales
    in_names: list[list[str]] = [[], [], []]
    names_per_expert = []
    for j, e in enumerate(ids):
        bases = _resolve_proj(src, f"{prefix}.experts.{e}")
        names_per_expert.append(bases)
        g, u, d = _load_mlp(src, bases, I, H, in_name)
        w13_d[j, :I], w13_d[j, I:] = g.data, u.data
        w13_s[j, :I], w13_s[j, I:] = g.scales, u.scales
        w2_d[j], w2_s[j] = d.data, d.scales
        gs13[j] = (g.ws2, u.ws2)
        gs2[j] = d.ws2
        for r, (lin, role) in enumerate(((g, "gate"), (u, "up"), (d, "down"))):
            in13[r].append(lin.inp)
            in_names[r].append(f"{bases[role]}.{in_name}")
    w13_in, w2_in = _routed_input_scales(in13, in_names) if in_name else (None, None)
    return _Routed(w13_d, w13_s, w2_d, w2_s, gs13, gs2, w13_in, w2_in, names_per_expert)


def _routed_input_scales(values: list[list], names: list[list[str]]):
    """Return (w13 input scales = max(gate, up), w2 input scales), float32 [n] each, or (None, None)."""
    ig = _input_scales("routed gate", values[0], names[0])
    iu = _input_scales("routed up", values[1], names[1])
    w2_in = _input_scales("routed down", values[2], names[2])
    if (ig is None) != (iu is None) or (ig is None) != (w2_in is None):
        some = [nm[0] for nm, v in zip(names, (ig, iu, w2_in)) if v is None]
        raise KeyError(f"missing tensor {some[0]} (other routed input scales are present)")
    return (None if ig is None else np.maximum(ig, iu)), w2_in


def _load_shared(src: Mapping, prefix: str, config: MoEConfig, in_name: Optional[str]):
    """Return the shared experts as (base names, gate, up, down :class:`_Linear`), or None."""
    if config.n_shared_experts <= 0:
        if any(k.startswith(f"{prefix}.shared_experts.") for k in src.keys()):
            raise ValueError(f"{prefix}.shared_experts.*: the checkpoint has shared-expert tensors "
                             "but config.n_shared_experts == 0")
        return None
    Is = config.intermediate_size * config.n_shared_experts
    sbases = _resolve_proj(src, f"{prefix}.shared_experts")
    sg, su, sd = _load_mlp(src, sbases, Is, config.hidden_size, in_name)
    sh_in = [lin.inp for lin in (sg, su, sd)]
    if any(v is not None for v in sh_in) and not all(v is not None for v in sh_in):
        role = ("gate", "up", "down")[[v is None for v in sh_in].index(True)]
        raise KeyError(f"missing tensor {sbases[role]}.{in_name} (other shared-expert input "
                       "scales are present)")
    return sbases, sg, su, sd


def _check_loaded(prefix: str, I: int, rt: _Routed, sh) -> None:
    """Warn when the loaded scales break the ModelOpt/Quark convention; return None."""
    names = rt.names
    groups = []
    if rt.split:
        groups.append(("gate", rt.w13_s[:, :I].view(np.uint8), [b["gate"] for b in names]))
        groups.append(("up", rt.w13_s[:, I:].view(np.uint8), [b["up"] for b in names]))
    else:
        groups.append(("gate/up", rt.w13_s.view(np.uint8), [b["gate"] + " + up" for b in names]))
    groups.append(("down", rt.w2_s.view(np.uint8), [b["down"] for b in names]))
    ws2 = {"routed gate/up": rt.gs13.reshape(-1), "routed down": rt.gs2}
    inputs = {}
    if rt.w13_in is not None:
        inputs = {"routed gate/up": rt.w13_in, "routed down": rt.w2_in}
    b0 = names[0]
    sample = {b0["down"]: (rt.w2_d[0], rt.w2_s[0], float(rt.gs2[0]))}  # exact check on expert ids[0]
    if rt.split:
        sample[b0["gate"]] = (rt.w13_d[0, :I], rt.w13_s[0, :I], float(rt.gs13[0, 0]))
        sample[b0["up"]] = (rt.w13_d[0, I:], rt.w13_s[0, I:], float(rt.gs13[0, 1]))
    else:
        sample[b0["gate"] + " + up"] = (rt.w13_d[0], rt.w13_s[0], float(rt.gs13[0, 0]))
    if sh is not None:
        sbases, sg, su, sd = sh
        if sg.ws2 == su.ws2:
            groups.append(("shared gate/up",
                           np.concatenate([sg.scales, su.scales]).view(np.uint8)[None],
                           [sbases["gate"] + " + up"]))
        else:
            groups.append(("shared gate", sg.scales.view(np.uint8)[None], [sbases["gate"]]))
            groups.append(("shared up", su.scales.view(np.uint8)[None], [sbases["up"]]))
        groups.append(("shared down", sd.scales.view(np.uint8)[None], [sbases["down"]]))
        ws2["shared"] = np.asarray([sg.ws2, su.ws2, sd.ws2], np.float32)
        if sg.inp is not None:
            inputs["shared"] = np.asarray([sg.inp, su.inp, sd.inp], np.float32)
    _check_conventions(prefix, groups, ws2, inputs, sample)


def _assemble(router, bias, hash_table, ids: list[int], E: int, rt: _Routed, sh) -> MoEWeights:
    """Return the loaded arrays as :class:`MoEWeights` of jax arrays (checkpoint layout)."""
    j = jnp.asarray
    w13 = NVFP4Tensor(j(rt.w13_d), j(rt.w13_s), j(rt.gs13 if rt.split else rt.gs13[:, 0].copy()))
    w2 = NVFP4Tensor(j(rt.w2_d), j(rt.w2_s), j(rt.gs2))
    fields: dict[str, Any] = dict(
        router_weight=j(router), w13=w13, w2=w2,
        router_bias=None if bias is None else j(bias),
        w13_input_scale=None if rt.w13_in is None else j(rt.w13_in),
        w2_input_scale=None if rt.w2_in is None else j(rt.w2_in),
        hash_table=None if hash_table is None else j(hash_table),
        expert_ids=None if ids == list(range(E)) else tuple(ids),
    )
    if sh is not None:
        fields.update(_shared_fields(*sh[1:]))
    return MoEWeights(**fields)


def _shared_fields(sg: _Linear, su: _Linear, sd: _Linear) -> dict[str, Any]:
    """Return the MoEWeights shared_* fields (jax arrays) built from the shared gate, up, down."""
    j = jnp.asarray
    sgs = (np.float32(sg.ws2) if sg.ws2 == su.ws2
           else np.asarray([sg.ws2, su.ws2], np.float32))
    fields: dict[str, Any] = {
        "shared_w13": NVFP4Tensor(j(np.concatenate([sg.data, su.data])),
                                  j(np.concatenate([sg.scales, su.scales])),
                                  j(np.asarray(sgs, np.float32))),
        "shared_w2": NVFP4Tensor(j(np.ascontiguousarray(sd.data)),
                                 j(np.ascontiguousarray(sd.scales)),
                                 j(np.asarray(sd.ws2, np.float32))),
    }
    if sg.inp is not None:
        fields["shared_w13_input_scale"] = j(np.asarray(max(sg.inp, su.inp), np.float32))
        fields["shared_w2_input_scale"] = j(np.asarray(sd.inp, np.float32))
    return fields


# ------------------------------------------------------------------------------------------------
# save_moe (MoEWeights -> checkpoint names)
# ------------------------------------------------------------------------------------------------

def _check_weights_for_save(w: MoEWeights, config: MoEConfig) -> list[int]:
    """Check every field of ``w`` (checkpoint layout) against ``config``; return the expert ids
    of the rows of the expert-stacked fields."""
    E, H, I = config.num_experts, config.hidden_size, config.intermediate_size
    dims = f"(config: E={E}, H={H}, I={I}, n_shared_experts={config.n_shared_experts})"

    def shape(name, v, *expected):
        found = tuple(np.shape(v))
        if found not in expected:
            exp = " or ".join(str(x) for x in expected)
            raise ValueError(f"weights.{name}: expected shape {exp} {dims}, found {found}")

    if w.w13 is None or w.w2 is None or w.router_weight is None:
        raise ValueError("weights: router_weight, w13 and w2 are required")
    n = int(np.shape(w.w13.data)[0]) if np.ndim(w.w13.data) == 3 else -1
    shape("w13.data", w.w13.data, (n, 2 * I, H // 2))
    shape("w13.scales", w.w13.scales, (n, 2 * I, H // BLOCK_SIZE))
    shape("w13.global_scale", w.w13.global_scale, (n,), (n, 2))
    shape("w2.data", w.w2.data, (n, H, I // 2))
    shape("w2.scales", w.w2.scales, (n, H, I // BLOCK_SIZE))
    shape("w2.global_scale", w.w2.global_scale, (n,))
    for name in ("w13_input_scale", "w2_input_scale"):
        if getattr(w, name) is not None:
            shape(name, getattr(w, name), (n,))
    shape("router_weight", w.router_weight, (E, H))
    if w.router_bias is not None:
        shape("router_bias", w.router_bias, (E,))
    if w.hash_table is not None:
        ht = np.asarray(w.hash_table)
        if ht.ndim != 2 or ht.shape[1] != config.top_k:
            raise ValueError(f"weights.hash_table: expected shape [vocab, top_k={config.top_k}], "
                             f"found {ht.shape}")
        if ht.size and (ht.min() < 0 or ht.max() >= E):
            raise ValueError(f"weights.hash_table: expert ids must lie in [0, {E}), found "
                             f"[{ht.min()}, {ht.max()}]")
    if w.expert_ids is None:
        if n != E:
            raise ValueError(f"weights: the expert-stacked fields hold {n} experts but "
                             f"config.num_experts = {E}; weights holding a subset must carry their "
                             "ids in MoEWeights.expert_ids (load_moe(..., experts=...) sets them)")
        ids = list(range(E))
    else:
        ids = list(w.expert_ids)
        if len(ids) != n:
            raise ValueError(f"weights.expert_ids: {len(ids)} ids for {n} expert rows")
        if max(ids) >= E:
            raise ValueError(f"weights.expert_ids: ids must lie in [0, config.num_experts={E}), "
                             f"found {max(ids)}")
    have_shared = w.shared_w13 is not None or w.shared_w2 is not None
    if config.n_shared_experts == 0 and have_shared:
        raise ValueError("weights.shared_w13/shared_w2 are set but config.n_shared_experts == 0")
    if config.n_shared_experts > 0:
        if w.shared_w13 is None or w.shared_w2 is None:
            raise ValueError(f"weights.shared_w13 and shared_w2: required by "
                             f"config.n_shared_experts = {config.n_shared_experts}")
        Is = I * config.n_shared_experts
        shape("shared_w13.data", w.shared_w13.data, (2 * Is, H // 2))
        shape("shared_w13.scales", w.shared_w13.scales, (2 * Is, H // BLOCK_SIZE))
        shape("shared_w13.global_scale", w.shared_w13.global_scale, (), (1,), (2,))
        shape("shared_w2.data", w.shared_w2.data, (H, Is // 2))
        shape("shared_w2.scales", w.shared_w2.scales, (H, Is // BLOCK_SIZE))
        shape("shared_w2.global_scale", w.shared_w2.global_scale, (), (1,))
        for name in ("shared_w13_input_scale", "shared_w2_input_scale"):
            if getattr(w, name) is not None:
                shape(name, getattr(w, name), (), (1,))
    return ids


def save_moe(weights: MoEWeights, config: MoEConfig, prefix: str, format: str = "modelopt", *,
             names: str = "hf", scalar_shape: tuple[int, ...] = ()) -> dict[str, np.ndarray]:
    """Produce checkpoint tensors (name -> numpy array) for one MoE layer, the inverse of
    :func:`load_moe`.

    Args:
      weights: the layer (w13 global_scale ``[E]`` or ``[E, 2]``; shared ``[]`` or ``[2]``), in
        any layout: weights prepared by :func:`jax_nvfp4.prepare_weights` are written back in the
        checkpoint layout (the bytes a ModelOpt/Quark reader expects); fields that are qwix
        NVFP4 ``QArray`` s are written as their conversions (:func:`jax_nvfp4.prepare_weights`
        converts them).
      config: its :class:`MoEConfig`.
      prefix: name prefix, e.g. ``"model.layers.3.mlp"``.
      format: ``"modelopt"`` (input scales as ``*.input_scale``) or ``"quark"``
        (``*.input_scale_2``). The gate and up input scales are both written as the stored
        (max) ``w13_input_scale``.
      names: ``"hf"`` (gate_proj/up_proj/down_proj) or ``"deepseek"`` (w1/w3/w2).
      scalar_shape: ``()`` or ``(1,)``, the shape of the stored scalars.

    Returns:
      dict: weight uint8 ``[N, K/2]``, weight_scale float8_e4m3fn ``[N, K/16]``, weight_scale_2 /
      input scales float32 of ``scalar_shape``, router float32 ``[E, H]``, bias float32 ``[E]``,
      tid2eid int32 ``[vocab, top_k]``. Pass it to :func:`save_safetensors` to write a file.
      Row ``j`` of the expert-stacked fields is written as expert ``weights.expert_ids[j]``
      (``j`` when ``expert_ids`` is None).

    Raises:
      ValueError naming the field, the expected and the found shape when the weights disagree
      with ``config`` (E, H, I, top_k, n_shared_experts), or when the weights hold a subset of the
      experts without ``expert_ids`` (or with ids outside ``[0, E)``).
    """
    if format not in FORMATS:
        raise ValueError(f"format: expected one of {FORMATS}, got {format!r}")
    if names not in ("hf", "deepseek"):
        raise ValueError(f"names: expected 'hf' or 'deepseek', got {names!r}")
    col = 0 if names == "hf" else 1
    proj = {r: v[col] for r, v in _PROJ_NAMES.items()}
    # Checkpoints store the plain code order, and gate/up are split below by slicing rows,
    # which is only meaningful in that order.
    weights = prepare_weights(weights, "checkpoint")
    ids = _check_weights_for_save(weights, config)
    out: dict[str, np.ndarray] = {}
    put = _linear_writer(out, _INPUT_SCALE[format], scalar_shape)
    _save_router(out, prefix, weights)
    _save_routed(put, prefix, weights, ids, proj, config.intermediate_size)
    if weights.shared_w13 is not None:
        _save_shared(put, f"{prefix}.shared_experts", weights, proj,
                     config.intermediate_size * config.n_shared_experts)
    return out


def _linear_writer(out: dict[str, np.ndarray], in_name: str, scalar_shape: tuple[int, ...]):
    """Return put(base, data, scales, ws2, inp), which stores one NVFP4 linear's tensors in ``out``."""
    def sc(v) -> np.ndarray:
        return np.asarray(v, np.float32).reshape(scalar_shape)

    def put(base, data, scales, ws2, inp):
        out[f"{base}.weight"] = np.ascontiguousarray(data)
        out[f"{base}.weight_scale"] = np.ascontiguousarray(scales)
        out[f"{base}.weight_scale_2"] = sc(ws2)
        if inp is not None:
            out[f"{base}.{in_name}"] = sc(inp)
    return put


def _save_router(out: dict[str, np.ndarray], prefix: str, weights: MoEWeights) -> None:
    """Store the router weight, bias and hash table (when present) in ``out``; return None."""
    out[f"{prefix}.gate.weight"] = np.asarray(weights.router_weight, np.float32)
    if weights.router_bias is not None:
        out[f"{prefix}.gate.e_score_correction_bias"] = np.asarray(weights.router_bias, np.float32)
    if weights.hash_table is not None:
        out[f"{prefix}.gate.tid2eid"] = np.asarray(weights.hash_table, np.int32)


def _save_routed(put, prefix: str, weights: MoEWeights, ids: list[int], proj: dict[str, str],
                 I: int) -> None:
    """Store row j of the routed experts as expert ``ids[j]`` through ``put``; return None."""
    d13, s13 = np.asarray(weights.w13.data), np.asarray(weights.w13.scales)
    g13 = np.asarray(weights.w13.global_scale, np.float32)
    d2, s2 = np.asarray(weights.w2.data), np.asarray(weights.w2.scales)
    g2 = np.asarray(weights.w2.global_scale, np.float32).reshape(-1)
    E = d13.shape[0]
    g13 = np.broadcast_to(g13.reshape(E, -1), (E, 2))
    i13 = None if weights.w13_input_scale is None else np.asarray(weights.w13_input_scale, np.float32)
    i2 = None if weights.w2_input_scale is None else np.asarray(weights.w2_input_scale, np.float32)
    for r, e in enumerate(ids):
        base = f"{prefix}.experts.{e}"
        put(f"{base}.{proj['gate']}", d13[r, :I], s13[r, :I], g13[r, 0], None if i13 is None else i13[r])
        put(f"{base}.{proj['up']}", d13[r, I:], s13[r, I:], g13[r, 1], None if i13 is None else i13[r])
        put(f"{base}.{proj['down']}", d2[r], s2[r], g2[r], None if i2 is None else i2[r])


def _save_shared(put, base: str, weights: MoEWeights, proj: dict[str, str], Is: int) -> None:
    """Store the shared experts (gate/up rows split at ``Is``) under ``base`` through ``put``; return None."""
    sd13, ss13 = np.asarray(weights.shared_w13.data), np.asarray(weights.shared_w13.scales)
    sg13 = np.broadcast_to(np.asarray(weights.shared_w13.global_scale, np.float32).reshape(-1), (2,))
    si13 = (None if weights.shared_w13_input_scale is None
            else np.asarray(weights.shared_w13_input_scale, np.float32))
    si2 = (None if weights.shared_w2_input_scale is None
           else np.asarray(weights.shared_w2_input_scale, np.float32))
    put(f"{base}.{proj['gate']}", sd13[:Is], ss13[:Is], sg13[0], si13)
    put(f"{base}.{proj['up']}", sd13[Is:], ss13[Is:], sg13[1], si13)
    put(f"{base}.{proj['down']}", np.asarray(weights.shared_w2.data),
        np.asarray(weights.shared_w2.scales), np.asarray(weights.shared_w2.global_scale), si2)


# ------------------------------------------------------------------------------------------------
# every MoE layer of a model
# ------------------------------------------------------------------------------------------------

_EXPERT_WEIGHT_RE = re.compile(r"^(.+)\.experts\.\d+\.(?:gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")


def _natural_key(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def moe_layer_prefixes(names: Iterable[str]) -> list[str]:
    """The prefixes of the routed MoE layers among tensor ``names`` (those with a
    ``{prefix}.gate.weight`` router and ``{prefix}.experts.{e}.*.weight`` tensors), in natural
    order (``model.layers.2.mlp`` before ``model.layers.10.mlp``)."""
    names = set(names)
    found = {m.group(1) for n in names if (m := _EXPERT_WEIGHT_RE.match(n))}
    return sorted((p for p in found if f"{p}.gate.weight" in names), key=_natural_key)


class _StderrProgress:
    """A one-line progress display on stderr (used when tqdm is not installed)."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.n = total, desc, 0
        self._write("")

    def _write(self, what: str) -> None:
        sys.stderr.write(f"\r{self.desc}: {self.n}/{self.total} {what}".ljust(79))
        sys.stderr.flush()

    def set_postfix_str(self, what: str) -> None:
        self._write(what)

    def update(self, n: int = 1) -> None:
        self.n += n
        self._write("")

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()


def _progress_bar(total: int, desc: str):
    try:
        from tqdm.auto import tqdm  # noqa: PLC0415 - optional: a plain progress line without it
    except ImportError:
        return _StderrProgress(total, desc)
    return tqdm(total=total, desc=desc, unit="layer")


def iter_model_moe(source, config: Optional[MoEConfig] = None, *,
                   prefixes: Optional[Sequence[str]] = None, progress: bool = True, **load_kwargs):
    """Yield ``(prefix, MoEWeights)`` for every routed MoE layer of a checkpoint, one at a time.

    Args:
      source: a model folder, its ``model.safetensors.index.json``, a safetensors file, a list
        of files, or a mapping (as for :func:`load_moe`). The checkpoint is opened once; each
        shard is opened at most once, when a layer it holds is loaded.
      config: the layers' :class:`MoEConfig`; None reads it with
        :meth:`MoEConfig.from_hf_config` from the ``config.json`` beside the checkpoint (a
        folder or index source).
      prefixes: the layers to load (default: every prefix :func:`moe_layer_prefixes` finds,
        e.g. ``model.layers.3.mlp``, in layer order).
      progress: show a progress bar on stderr (``tqdm`` when installed, else a one-line
        counter); False for none.
      **load_kwargs: passed to :func:`load_moe` (``format``, ``experts``, ``check``, ``layout``).

    Yields:
      ``(prefix, MoEWeights)`` as :func:`load_moe` returns them.
    """
    src = _as_source(source)
    if config is None:
        if not isinstance(source, (str, os.PathLike)):
            raise ValueError("config: required unless source is a model folder or its index file "
                             "(whose folder holds config.json)")
        folder = os.fspath(source)
        if not os.path.isdir(folder):
            folder = os.path.dirname(os.path.abspath(folder))
        config = MoEConfig.from_hf_config(folder)
    if prefixes is None:
        prefixes = moe_layer_prefixes(src.keys())
        if not prefixes:
            raise ValueError(f"source: no MoE layer found (no '{{prefix}}.gate.weight' with "
                             f"'{{prefix}}.experts.{{e}}.*.weight' tensors){where_looked(src)}")
    bar = _progress_bar(len(prefixes), "loading MoE layers") if progress else None
    try:
        for prefix in prefixes:
            if bar is not None:
                bar.set_postfix_str(prefix)
            weights = load_moe(src, prefix, config, **load_kwargs)
            if bar is not None:
                bar.update(1)
            yield prefix, weights
    finally:
        if bar is not None:
            bar.close()


def load_model_moe(source, config: Optional[MoEConfig] = None, *,
                   prefixes: Optional[Sequence[str]] = None, progress: bool = True,
                   **load_kwargs) -> dict[str, MoEWeights]:
    """Load every routed MoE layer of a checkpoint: a dict prefix -> :class:`MoEWeights`.

    Same arguments as :func:`iter_model_moe` (use that to place or convert each layer before
    the next is read). Example::

        config = MoEConfig.from_hf_config(folder)
        layers = load_model_moe(folder, config, experts=my_rank_experts)  # progress on stderr
    """
    return dict(iter_model_moe(source, config, prefixes=prefixes, progress=progress,
                               **load_kwargs))
