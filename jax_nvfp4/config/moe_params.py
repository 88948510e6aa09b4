"""MoE layer configuration and weights: :class:`MoEConfig` and the :class:`MoEWeights` pytree."""

from __future__ import annotations

import dataclasses
import numbers
import operator
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import hf_config
from ..maths.formats import NVFP4Tensor
from .options import (ACTIVATION_SCALES, ACTIVATIONS, EXACT, FP8, FP8_CHUNK, FP8_LAYOUT, ROW_DTYPES,
                      SCORING_FUNCS, check_choice, check_layer_precision)


def _float_range(v: jax.Array) -> np.ndarray:
    """float64 ``[min, max]`` of a concrete float jax Array, both NaN when any value is NaN.

    XLA's float comparisons treat subnormals as zero on CPU (and a GPU may flush them), so a
    jnp.min over ``[1e-40, 1]`` reads 0.0: the comparison runs on the bit patterns instead, mapped
    to integers ordered as the floats are (a negative float's magnitude bits flipped), and the
    chosen patterns are read back as floats on the host.
    """
    width = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[v.dtype.itemsize]
    flip = jnp.iinfo(width).max
    bits = jax.lax.bitcast_convert_type(v.reshape(-1), width)
    key = jnp.where(bits < 0, bits ^ flip, bits)          # an involution: key -> bits likewise
    ends = jnp.stack([jnp.min(key), jnp.max(key)])
    both = np.asarray(jnp.where(ends < 0, ends ^ flip, ends)).view(np.dtype(v.dtype)).astype(np.float64)
    if bool(jnp.any(jnp.isnan(v))):
        both[:] = np.nan
    return both


def known_range(v) -> Optional[tuple]:
    """``(min, max)`` of the values of ``v`` as Python scalars when they are known while tracing,
    else None (a traced value, or an empty one).

    Known means anything but a tracer: numpy values and concrete jax Arrays, also those a
    ``jax.jit`` closes over. Inside a jit trace a jnp reduction of such a constant is itself staged
    (a tracer, which ``float`` cannot read), so the reductions of a jax Array run eagerly here;
    they copy two scalars to the host, not ``v``. Floats come back as Python floats, both NaN
    when any value is NaN (found by its own reduction, not left to min/max); integers as Python
    ints (numpy values as they are, not first converted to a narrower jax dtype).
    """
    if v is None or isinstance(v, jax.core.Tracer):
        return None
    if isinstance(v, jax.Array):
        with jax.ensure_compile_time_eval():
            if v.size == 0:
                return None
            if jnp.issubdtype(v.dtype, jnp.floating):
                both = _float_range(v)
            else:
                both = np.asarray(jnp.stack([jnp.min(v), jnp.max(v)]))
    else:
        a = np.asarray(v)
        if a.size == 0:
            return None
        if jnp.issubdtype(a.dtype, jnp.inexact):
            a = a.astype(np.float64)
        both = np.array([a.min(), a.max()])
        if jnp.issubdtype(a.dtype, jnp.inexact) and np.isnan(a).any():
            both[:] = np.nan
    if jnp.issubdtype(both.dtype, jnp.inexact):
        return tuple(float(b) for b in both)
    return tuple(int(b) for b in both)


AUTO_FP8_MIN_ROWS = 16
"""``precision="auto"``: the routed rows per expert (on average) from which a layer on
checkpoint-layout weights runs the FP8 mode. On an H100 (2026-12-07, ../shared/h200-baseline.md)
the exact mode is ahead at 4 rows per expert (48 experts, L1 192 rows: 0.369 against 0.388 ms; the
V4-Pro layer at 256 tokens: 4.84 against 5.15) and the FP8 mode at 32 (L1 1536 rows: 0.542 against
0.693 ms; the V4-Pro layer at 2048 tokens: 6.76 against 8.78): 16 lies between, where the
crossover has not been measured."""


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Static description of one routed MoE layer (hashable: usable as a jit static argument).

    Attributes:
      num_experts: routed experts E.
      top_k: experts per token.
      hidden_size: H (model width; K of the gate/up GEMM, N of the down GEMM).
      intermediate_size: I (expert width; gate and up each have I rows).
      scoring_func: "sqrtsoftplus" (DeepSeek-V4), "sigmoid" (V3) or "softmax".
      n_group, topk_group: grouped top-k (V3: 8 groups, keep 4); 1/1 disables grouping.
      norm_topk_prob: renormalize the chosen experts' weights to sum to 1.
      routed_scaling_factor: multiplies the routing weights.
      swiglu_limit: None for plain SwiGLU, else silu(min(gate, L)) * clip(up, -L, L).
      n_shared_experts: shared experts (an always-on MLP of width I * n_shared_experts).
      activation: "w4a4" (activations re-quantized to NVFP4 before each GEMM) or "w4a16" (bf16).
      activation_scale: "dynamic" (global scale from the data's amax) or "static" (the
        checkpoint's calibrated input scale, per expert).
      precision: the grouped GEMMs' compute mode, "exact" (default) or "fp8" (e4m3 operands,
        see :func:`jax_nvfp4.grouped_gemm`; hidden_size and intermediate_size multiples of 128),
        or "auto": each call picks one from its token count (:meth:`for_tokens`), so that one
        set of checkpoint-layout weights serves decode (exact) and prefill (fp8).
      row_dtype: "bfloat16" (default) or "float32": the dtype each routed row's SwiGLU
        activation and down-GEMM output are rounded to between the GEMMs and before the combine
        (:mod:`jax_nvfp4.moe`). float32 reproduces a float32 reference forward (e.g. Quark's) to
        float32 rounding, at twice the bytes between and after the GEMMs.
    """

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    scoring_func: str = "sqrtsoftplus"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    swiglu_limit: Optional[float] = None
    n_shared_experts: int = 0
    activation: str = "w4a4"
    activation_scale: str = "dynamic"
    precision: str = "exact"
    row_dtype: str = "bfloat16"

    def __post_init__(self):
        self._check_types()
        for name, choices in (("scoring_func", SCORING_FUNCS), ("activation", ACTIVATIONS),
                              ("activation_scale", ACTIVATION_SCALES), ("row_dtype", ROW_DTYPES)):
            check_choice(getattr(self, name), choices, name)
        # stored checked: the layer's GEMMs take it as it is ("auto": for_tokens resolves it)
        object.__setattr__(self, "precision", check_layer_precision(self.precision))
        if self.num_experts < 1:
            raise ValueError(f"num_experts: expected an int >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k: expected 1 <= top_k <= num_experts={self.num_experts}, "
                             f"got {self.top_k}")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(f"n_group: must divide num_experts={self.num_experts}, got {self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group: expected 1 <= topk_group <= n_group={self.n_group}, "
                             f"got {self.topk_group}")
        if self.n_group > 1 and self.topk_group * (self.num_experts // self.n_group) < self.top_k:
            raise ValueError("topk_group: the kept groups hold fewer experts than top_k")
        if self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts: expected an int >= 0, got {self.n_shared_experts}")
        for name in ("hidden_size", "intermediate_size"):
            v = getattr(self, name)
            if v <= 0 or v % 32:
                raise ValueError(f"{name}: must be a positive multiple of 32 (NVFP4 K), got {v}")
            if self.precision == "fp8" and v % FP8_CHUNK:
                raise ValueError(f"{name}: precision='fp8' needs a multiple of {FP8_CHUNK} (the "
                                 f"GEMMs' K), got {v}")
        # The routing weights are multiplied by it: 0 zeroes the layer, a negative value flips
        # its sign, NaN or inf poison every output.
        f = self.routed_scaling_factor
        with np.errstate(over="ignore"):
            f32 = np.float32(f)                  # the value the router multiplies by
        if not (np.isfinite(f32) and f32 > 0):
            raise ValueError(f"routed_scaling_factor: expected a number > 0, finite in float32, "
                             f"got {f!r}")
        # The clamp min(gate, L), clip(up, -L, L): L <= 0 (or one that is 0 in float32) zeroes
        # or flips the SwiGLU, NaN makes it NaN. inf means no clamp, as None does.
        lim = self.swiglu_limit
        with np.errstate(over="ignore"):                    # past float32's range: inf, no clamp
            lim32 = None if lim is None else np.float32(lim)
        if lim is not None and not lim32 > 0:               # False for NaN (inf: float32 inf)
            raise ValueError(f"swiglu_limit: expected None or a number > 0 (float32), got {lim!r}")

    def _check_types(self):
        """TypeError naming the field for a value of the wrong type; numpy scalars of the right
        kind are stored as the Python int, float or bool (so equal configs hash alike)."""
        def put(name, v):
            object.__setattr__(self, name, v)

        for name in ("num_experts", "top_k", "hidden_size", "intermediate_size", "n_group",
                     "topk_group", "n_shared_experts"):
            v = getattr(self, name)
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
                raise TypeError(f"{name}: expected an int, got {v!r:.100}")
            put(name, int(v))
        for name, optional in (("routed_scaling_factor", False), ("swiglu_limit", True)):
            v = getattr(self, name)
            if v is None and optional:
                continue
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
                raise TypeError(f"{name}: expected a number{' or None' if optional else ''}, "
                                f"got {v!r:.100}")
            put(name, float(v))
        if not isinstance(self.norm_topk_prob, (bool, np.bool_)):
            raise TypeError(f"norm_topk_prob: expected a bool, got {self.norm_topk_prob!r:.100}")
        put("norm_topk_prob", bool(self.norm_topk_prob))
        for name in ("scoring_func", "activation", "activation_scale", "precision", "row_dtype"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name}: expected a str, got {getattr(self, name)!r:.100}")

    def for_tokens(self, tokens, layouts, fp8_runs: bool = True) -> "MoEConfig":
        """This config with ``precision="auto"`` resolved for one call (any other precision: this
        config as it is).

        Args:
          tokens: the call's token count T (an int; for :func:`jax_nvfp4.moe_expert_parallel` the
            global count).
          layouts: the layouts of the weights the layer multiplies (``"checkpoint"``, ``"sm90"``,
            ``"fp8"`` for :class:`~jax_nvfp4.maths.formats.Fp8Weights`).
          fp8_runs: whether the call's backend computes the FP8 mode on checkpoint weights (the
            CPU handler and the reference do; on a GPU, a build whose kernels run it there).

        Returns:
          The config with precision ``"fp8"`` where the FP8 mode can run and pays: weights
          prepared as e4m3 (only the FP8 mode reads them), or checkpoint-layout weights, hidden and
          intermediate sizes multiples of 128 and at least :data:`AUTO_FP8_MIN_ROWS` routed rows
          per expert on average (``T * top_k >= AUTO_FP8_MIN_ROWS * num_experts``); else
          ``"exact"`` (sm90 weights are the exact mode's layout; a device where the FP8 mode does
          not run). The choice depends on shapes, the config, the layouts and ``fp8_runs`` only,
          so the CPU, the reference and a Hopper GPU make the same one.
        """
        if self.precision != "auto":
            return self
        if not isinstance(tokens, numbers.Integral):
            raise ValueError(f"config.precision: 'auto' picks the mode from the token count, which "
                             f"is not a number here ({tokens!r:.60}, e.g. symbolic under "
                             f"jax.export); pin precision='exact' or 'fp8'")
        layouts = set(layouts)
        sizes_ok = not (self.hidden_size % FP8_CHUNK or self.intermediate_size % FP8_CHUNK)
        if FP8_LAYOUT in layouts:
            mode = FP8
        elif layouts - {"checkpoint"} or not sizes_ok or not fp8_runs:
            mode = EXACT
        else:
            mode = FP8 if int(tokens) * self.top_k >= AUTO_FP8_MIN_ROWS * self.num_experts else EXACT
        return dataclasses.replace(self, precision=mode)      # checked already: a Precision

    @classmethod
    def deepseek_v4_pro(cls, **overrides) -> "MoEConfig":
        """DeepSeek-V4-Pro: H 7168, I 3072, 384 experts, top-6, sqrt(softplus), x2.5, SwiGLU limit 10."""
        kw: dict[str, Any] = dict(num_experts=384, top_k=6, hidden_size=7168, intermediate_size=3072,
                  scoring_func="sqrtsoftplus", routed_scaling_factor=2.5, swiglu_limit=10.0,
                  n_shared_experts=1)
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def deepseek_v3(cls, **overrides) -> "MoEConfig":
        """DeepSeek-V3: H 7168, I 2048, 256 experts, top-8, sigmoid, 8 groups keep 4, x2.5."""
        kw: dict[str, Any] = dict(num_experts=256, top_k=8, hidden_size=7168, intermediate_size=2048,
                  scoring_func="sigmoid", n_group=8, topk_group=4, routed_scaling_factor=2.5,
                  n_shared_experts=1)
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def from_hf_config(cls, path_or_dict, **overrides) -> "MoEConfig":
        """The routed MoE layer of a Hugging Face checkpoint, from its ``config.json``.

        ``path_or_dict``: a config.json path, the model folder holding it, or the parsed dict.
        Families: DeepSeek-V3 (and ``deepseek_v32``, Kimi-K2's ``kimi_k2``), DeepSeek-V4,
        GLM-4.5 (``glm4_moe``), Qwen3-MoE (``qwen3_moe``); the quantization config (ModelOpt
        ``hf_quant_config.json`` / ``quantization_config``, Quark) sets ``activation`` and
        ``activation_scale``. ``overrides`` replace mapped fields. What the layer cannot
        express is a ValueError naming the config key and its value. The key mapping is in
        :mod:`jax_nvfp4.config.hf_config`.
        """
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"overrides: {sorted(unknown)} are not MoEConfig fields")
        fields, where = hf_config.moe_config_fields_from_hf(path_or_dict, overrides)
        try:
            return cls(**fields)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{where}: {e}") from None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEWeights:
    """Weights of one MoE layer (a pytree; None fields are absent).

    Attributes:
      router_weight: float ``[E, H]``.
      w13: NVFP4Tensor ``[E, 2I, H]`` (rows 0..I-1 gate, I..2I-1 up); global_scale ``[E]`` or
        ``[E, 2]`` (gate, up) when the halves carry different weight_scale_2.
      w2: NVFP4Tensor ``[E, H, I]``, global_scale ``[E]``.
      router_bias: float32 ``[E]`` (e_score_correction_bias: changes selection, not weights).
      w13_input_scale: float32 ``[E]``, static global scale of the gate/up GEMM input (ModelOpt
        input_scale / Quark input_scale_2, max over gate and up).
      w2_input_scale: float32 ``[E]``, static global scale of the down GEMM input.
      shared_w13: NVFP4Tensor ``[2 * Is, H]`` (global_scale ``[]`` or ``[2]``), Is = I * n_shared.
      shared_w2: NVFP4Tensor ``[H, Is]``.
      shared_w13_input_scale, shared_w2_input_scale: float32 ``[]`` static input scales.
      hash_table: int32 ``[vocab, top_k]`` expert ids per token id (hash-routed layers).
      expert_ids: static (pytree metadata, not a leaf): the global expert id of each row of the
        expert-stacked fields (w13, w2 and their input scales) when they hold a subset of the
        layer's experts, e.g. ``load_moe(..., experts=[3, 1])`` gives ``(3, 1)``; None (default)
        means rows ``0..E-1`` in order. :func:`jax_nvfp4.checkpoint.save_moe` writes each row
        under its id. Computations do not read it (expert parallelism slices rows by position).
      w13_paired: static (pytree metadata): whether the rows of w13 AND shared_w13 are in the
        "paired" order instead of gate rows then up rows: physical row ``16 b + i`` (``i < 8``)
        holds gate feature ``8 b + i`` and row ``16 b + 8 + i`` up feature ``8 b + i`` (codes and
        block scales alike; global scales keep their meaning, ``[E, 2]`` = (gate, up)).
        :func:`jax_nvfp4.prepare_weights` sets it with the sm90 layout, and the layer then computes
        gate/up GEMM and SwiGLU as one custom call (:func:`jax_nvfp4.grouped_gemm_swiglu`);
        ``prepare_weights(w, "checkpoint")`` restores the stored order and clears it
        (:func:`jax_nvfp4.maths.layout.pair_gate_up`).
    """

    router_weight: jax.Array
    w13: NVFP4Tensor
    w2: NVFP4Tensor
    router_bias: Optional[jax.Array] = None
    w13_input_scale: Optional[jax.Array] = None
    w2_input_scale: Optional[jax.Array] = None
    shared_w13: Optional[NVFP4Tensor] = None
    shared_w2: Optional[NVFP4Tensor] = None
    shared_w13_input_scale: Optional[jax.Array] = None
    shared_w2_input_scale: Optional[jax.Array] = None
    hash_table: Optional[jax.Array] = None
    expert_ids: Optional[tuple[int, ...]] = dataclasses.field(default=None,
                                                              metadata=dict(static=True))
    w13_paired: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def __post_init__(self):
        if not isinstance(self.w13_paired, bool):
            raise TypeError(f"w13_paired: expected a bool, got {self.w13_paired!r:.100}")
        if self.expert_ids is not None:   # a hashable tuple of distinct non-negative ints
            try:
                ids = tuple(operator.index(e) for e in self.expert_ids)
            except TypeError:
                raise TypeError("expert_ids: expected a sequence of ints or None, got "
                                f"{self.expert_ids!r:.100}") from None
            if any(e < 0 for e in ids) or len(set(ids)) != len(ids):
                raise ValueError(f"expert_ids: expected distinct non-negative ids, got {ids[:16]}")
            object.__setattr__(self, "expert_ids", ids)
