"""MoEConfig's ranges at their edges (docs/usage.md, README "Limits": every field checked when the
config is built): for each range the largest (or smallest) valid value builds, and the first
invalid one beyond it is a ValueError naming the field. Also known_range, which decides when a
weight's values can be checked."""

import pathlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_nvfp4.config.moe_params import AUTO_FP8_MIN_ROWS, MoEConfig, known_range

BASE = dict(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32)
F32_MAX = float(np.finfo(np.float32).max)
F32_TINY_SUB = float(np.float32(2.0**-149))           # the smallest positive float32
BELOW_F32_SUB = 2.0**-151                               # rounds to 0 in float32
ABOVE_F32_MAX = 3.5e38                                  # rounds to inf in float32


def build(**kw):
    return MoEConfig(**{**BASE, **kw})


# (valid overrides, invalid overrides, the field the error names): each pair is one range's edge
EDGES = [
    (dict(num_experts=1, top_k=1), dict(num_experts=0, top_k=1), "num_experts"),
    (dict(top_k=1), dict(top_k=0), "top_k"),
    (dict(top_k=8), dict(top_k=9), "top_k"),                       # top_k <= num_experts
    (dict(n_group=8, topk_group=1, top_k=1), dict(n_group=16, topk_group=1, top_k=1), "n_group"),
    (dict(n_group=4, topk_group=1, top_k=2), dict(n_group=3, topk_group=1), "n_group"),
    (dict(n_group=1), dict(n_group=0), "n_group"),
    (dict(n_group=4, topk_group=4), dict(n_group=4, topk_group=5), "topk_group"),
    (dict(n_group=4, topk_group=1), dict(n_group=4, topk_group=0), "topk_group"),
    # the kept groups must hold top_k experts: 2 groups of 2 hold 4
    (dict(n_group=4, topk_group=2, top_k=4), dict(n_group=4, topk_group=2, top_k=5),
     "topk_group"),
    (dict(n_group=2, topk_group=1, top_k=4), dict(n_group=2, topk_group=1, top_k=5),
     "topk_group"),                                                # the smallest grouping
    (dict(n_shared_experts=0), dict(n_shared_experts=-1), "n_shared_experts"),
    (dict(hidden_size=32), dict(hidden_size=0), "hidden_size"),
    (dict(hidden_size=32), dict(hidden_size=16), "hidden_size"),
    (dict(hidden_size=96), dict(hidden_size=80), "hidden_size"),
    (dict(intermediate_size=32), dict(intermediate_size=48), "intermediate_size"),
    (dict(precision="fp8", hidden_size=128, intermediate_size=128),
     dict(precision="fp8", hidden_size=96, intermediate_size=128), "hidden_size"),
    (dict(precision="fp8", hidden_size=128, intermediate_size=256),
     dict(precision="fp8", hidden_size=128, intermediate_size=224), "intermediate_size"),
    (dict(routed_scaling_factor=F32_MAX), dict(routed_scaling_factor=ABOVE_F32_MAX),
     "routed_scaling_factor"),
    (dict(routed_scaling_factor=F32_TINY_SUB), dict(routed_scaling_factor=BELOW_F32_SUB),
     "routed_scaling_factor"),
    (dict(swiglu_limit=F32_TINY_SUB), dict(swiglu_limit=BELOW_F32_SUB), "swiglu_limit"),
    (dict(swiglu_limit=float("inf")), dict(swiglu_limit=float("nan")), "swiglu_limit"),
    (dict(swiglu_limit=None), dict(swiglu_limit=-F32_TINY_SUB), "swiglu_limit"),
]


@pytest.mark.parametrize("valid,invalid,field", EDGES, ids=[
    f"{e[2]}-{list(e[1].values())}" for e in EDGES])
def test_every_range_edge(valid, invalid, field):
    build(**valid)
    with pytest.raises(ValueError, match=f"^{field}: "):
        build(**invalid)


@pytest.mark.parametrize("field,choices", [
    ("scoring_func", ("sqrtsoftplus", "sigmoid", "softmax")), ("activation", ("w4a4", "w4a16")),
    ("activation_scale", ("dynamic", "static")), ("precision", ("exact", "fp8")),
    ("row_dtype", ("bfloat16", "float32"))])
def test_every_choice_and_a_near_miss(field, choices):
    size = dict(hidden_size=128, intermediate_size=128)
    for c in choices:
        assert getattr(build(**size, **{field: c}), field) == c
    for bad in (choices[0].upper(), choices[0] + " ", ""):
        with pytest.raises(ValueError, match=f"^{field}: expected one of"):
            build(**size, **{field: bad})


INT_FIELDS = ("num_experts", "top_k", "hidden_size", "intermediate_size", "n_group",
              "topk_group", "n_shared_experts")


@pytest.mark.parametrize("field", INT_FIELDS)
def test_int_fields_take_ints_only(field):
    """A wrong type is a TypeError naming the field (a bool or a float is not an int); a numpy
    integer is stored as the Python int, so equal configs compare and hash alike."""
    for bad in (True, np.bool_(False), float(BASE.get(field, 1)), "8", None):
        with pytest.raises(TypeError, match=rf"^{field}: expected an int, got {bad!r:.100}$"):
            build(**{field: bad})
    c = build(**{field: np.int64(build().__dict__[field])})
    assert type(getattr(c, field)) is int and c == build() and hash(c) == hash(build())


def test_float_and_bool_and_str_fields_are_type_checked():
    for name, bad, what in (("routed_scaling_factor", None, "a number"),
                            ("routed_scaling_factor", "2.5", "a number"),
                            ("routed_scaling_factor", True, "a number"),
                            ("swiglu_limit", "10", "a number or None"),
                            ("swiglu_limit", np.bool_(True), "a number or None")):
        with pytest.raises(TypeError, match=rf"^{name}: expected {what}, got {bad!r:.100}$"):
            build(**{name: bad})
    c = build(routed_scaling_factor=np.float32(2.5), swiglu_limit=np.float64(7.0),
              norm_topk_prob=np.bool_(False))
    assert type(c.routed_scaling_factor) is float and c.routed_scaling_factor == 2.5
    assert type(c.swiglu_limit) is float and c.swiglu_limit == 7.0
    assert c.norm_topk_prob is False
    assert c == build(routed_scaling_factor=2.5, swiglu_limit=7.0, norm_topk_prob=False)
    assert build(swiglu_limit=None).swiglu_limit is None
    for bad in (1, None, "yes"):
        with pytest.raises(TypeError, match=rf"^norm_topk_prob: expected a bool, got {bad!r}$"):
            build(norm_topk_prob=bad)
    for name in ("scoring_func", "activation", "activation_scale", "precision", "row_dtype"):
        with pytest.raises(TypeError, match=rf"^{name}: expected a str, got 1$"):
            build(**{name: 1})


def test_floats_past_float32_do_not_warn():
    """A float beyond float32's range is the documented ValueError for routed_scaling_factor and
    no clamp (float32 inf) for swiglu_limit, without a numpy overflow RuntimeWarning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="^routed_scaling_factor: "):
            build(routed_scaling_factor=1e300)
        assert build(swiglu_limit=1e300).swiglu_limit == 1e300
        with pytest.raises(ValueError, match="^swiglu_limit: "):
            build(swiglu_limit=-1e300)


def test_known_range():
    assert known_range(None) is None
    assert known_range(np.zeros((0,), np.float32)) is None
    assert known_range(jnp.zeros((0,), jnp.float32)) is None
    assert known_range(np.array([3, -2, 7], np.int64)) == (-2, 7)
    for ints in (np.array([3, -2, 7], np.int64), jnp.array([3, -2, 7], jnp.int32)):
        assert [type(b) for b in known_range(ints)] == [int, int]  # messages print ids as ints
    assert [type(b) for b in known_range(np.array([0.5], np.float32))] == [float, float]
    assert known_range(jnp.array([0.5, 2.0])) == (0.5, 2.0)
    lo, hi = known_range(np.array([1.0, np.nan]))
    assert np.isnan(lo) and np.isnan(hi)
    lo, hi = known_range(jnp.array([np.nan, 1.0]))
    assert np.isnan(lo) and np.isnan(hi)
    assert known_range(np.float32(2.0**-140)) == (2.0**-140, 2.0**-140)   # numpy keeps subnormals
    seen = []
    jax.jit(lambda v: seen.append(known_range(v)) or v)(jnp.ones(3))
    assert seen == [None]                                  # traced: unknown
    const = jnp.array([4, 9], jnp.int32)
    jax.jit(lambda: seen.append(known_range(const)) or 0)()
    assert seen[-1] == (4, 9)                              # closed over: known


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float8_e4m3fn"])
def test_known_range_of_a_jax_array_keeps_subnormals_and_signs(rng, dtype):
    """A concrete jax Array's range is its values' exact min and max, as numpy's float64 min/max
    of the same values gives them (XLA's comparisons would read a subnormal as zero): subnormals
    of either sign, signed zeros, infinities."""
    dt = jnp.dtype(dtype)
    tiny = float(jnp.finfo(dt).smallest_subnormal)
    cases = [[tiny, 1.0], [1.0, 3 * tiny], [-3 * tiny, 2.0], [-2.5, -tiny], [tiny, -tiny],
             [-0.0, 0.0], [0.0, -0.0], [-np.inf, 0.5], [0.25, np.inf],
             rng.standard_normal(37) * rng.choice([tiny, 1.0], 37)]
    if dt == jnp.float8_e4m3fn:                              # no infinities in e4m3fn
        cases = cases[:7] + cases[9:]
    for vals in cases:
        a = np.asarray(vals, np.float64).astype(dt)          # exactly the values the array holds
        lo, hi = known_range(jnp.asarray(a))
        want = a.astype(np.float64)
        assert (lo, hi) == (want.min(), want.max()), (dtype, vals)


def test_presets_are_the_documented_models():
    """deepseek_v4_pro / deepseek_v3 (their docstrings), and overrides replace single fields."""
    v4 = MoEConfig.deepseek_v4_pro()
    assert (v4.hidden_size, v4.intermediate_size, v4.num_experts, v4.top_k, v4.scoring_func,
            v4.routed_scaling_factor, v4.swiglu_limit, v4.n_shared_experts, v4.n_group,
            v4.norm_topk_prob) == (7168, 3072, 384, 6, "sqrtsoftplus", 2.5, 10.0, 1, 1, True)
    v3 = MoEConfig.deepseek_v3()
    assert (v3.hidden_size, v3.intermediate_size, v3.num_experts, v3.top_k, v3.scoring_func,
            v3.n_group, v3.topk_group, v3.routed_scaling_factor, v3.n_shared_experts,
            v3.swiglu_limit) == (7168, 2048, 256, 8, "sigmoid", 8, 4, 2.5, 1, None)
    small = MoEConfig.deepseek_v4_pro(num_experts=8, hidden_size=64, intermediate_size=32)
    assert (small.num_experts, small.top_k, small.swiglu_limit) == (8, 6, 10.0)
    assert MoEConfig.deepseek_v3(activation="w4a16").activation == "w4a16"
    with pytest.raises(ValueError, match="^top_k: "):
        MoEConfig.deepseek_v3(num_experts=4)


# ------------------------------------------------------------------ precision="auto"
AUTO = dict(num_experts=8, top_k=2, hidden_size=128, intermediate_size=256, precision="auto")
# the token count from which the FP8 mode pays: T * top_k >= AUTO_FP8_MIN_ROWS * E
T_FP8 = AUTO_FP8_MIN_ROWS * 8 // 2


@pytest.mark.parametrize("tokens,layouts,want", [
    (0, {"checkpoint"}, "exact"), (1, {"checkpoint"}, "exact"),
    (T_FP8 - 1, {"checkpoint"}, "exact"), (T_FP8, {"checkpoint"}, "fp8"),
    (10**6, {"checkpoint"}, "fp8"), (np.int64(T_FP8), {"checkpoint"}, "fp8"),
    (10**6, {"sm90"}, "exact"), (10**6, {"checkpoint", "sm90"}, "exact"),   # sm90: the exact mode's
    (0, {"fp8"}, "fp8"), (1, {"fp8", "checkpoint"}, "fp8"),                  # e4m3: only fp8 reads it
    (10**6, set(), "fp8")])
def test_auto_precision_for_tokens(tokens, layouts, want):
    c = build(**AUTO)
    got = c.for_tokens(tokens, layouts)
    assert got.precision == want and type(got.precision).__name__ == "Precision"
    assert got == MoEConfig(**{**AUTO, "precision": want})       # only the precision resolved
    assert c.precision == "auto"                                   # the config itself unchanged


def test_auto_precision_where_fp8_cannot_run_is_exact():
    """Hidden or intermediate sizes that are not multiples of 128 (the FP8 mode's K): exact at any
    token count; a pinned precision is returned as it is."""
    for kw in (dict(hidden_size=96), dict(intermediate_size=160), dict(hidden_size=192),
               dict(intermediate_size=192)):   # 192: a multiple of 64, not of 128
        c = build(**{**AUTO, **kw})
        assert c.for_tokens(10**6, {"checkpoint"}).precision == "exact"
    for p in ("exact", "fp8"):
        c = build(**{**AUTO, "precision": p})
        assert c.for_tokens(0, {"checkpoint"}) is c and c.for_tokens(10**6, {"sm90"}) is c


def test_auto_precision_needs_a_token_count():
    c = build(**AUTO)
    with pytest.raises(ValueError, match=r"config\.precision: 'auto' picks the mode from the token "
                                         r"count.*pin precision='exact' or 'fp8'"):
        c.for_tokens(jnp.int32(3), {"checkpoint"})   # an array is no count (a symbolic dim neither)


def test_precision_vocabulary_names_auto():
    with pytest.raises(ValueError, match=r"precision: expected one of \('exact', 'fp8', 'auto'\)"):
        build(precision="fp16")
    assert build(precision="auto").precision == "auto"
    assert hash(build(precision="auto")) == hash(build(precision="auto"))


def test_the_docs_state_the_auto_threshold():
    """docs/usage.md and docs/design.md give AUTO_FP8_MIN_ROWS as it is."""
    docs = pathlib.Path(__file__).parent.parent / "docs"
    usage, design = (" ".join((docs / f).read_text().split()) for f in ("usage.md", "design.md"))
    assert (f"the fp8 mode where `T * top_k >= {AUTO_FP8_MIN_ROWS} * num_experts` "
            f"({AUTO_FP8_MIN_ROWS} routed rows per expert on average") in usage
    assert f"(fp8 from `AUTO_FP8_MIN_ROWS` = {AUTO_FP8_MIN_ROWS} routed rows per expert" in design
