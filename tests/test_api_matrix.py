"""The public API the ways users call it (issue 46 item 15): the MoE layer and grouped_gemm over
their option matrix, each jitted with the weights as arguments, jitted with the weights closed
over, and eagerly, on 0, 1 and many tokens and a ``[B, S, H]`` input. The three must agree bit
for bit; one input per case is also checked against a float64 oracle, so that the matrix cannot
pass with every form equally wrong. On the CPU the option axes are covered pairwise
(conftest.pairwise): every pair of option values together in at least one case.

Bit for bit holds on the CPU between the weights as arguments and closed over (the router's dot
contracts both operands' H axes, routing.router_logits, so XLA sums it in the same order whether
the router weight is an argument or a folded constant), and for grouped_gemm also eagerly. The
exception: the layer eagerly against jitted, float32 ulps (see test_layer_matrix). The default tier runs a diagonal that takes every value of every
axis; the pairwise cases are marked slow.
"""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as jn
from conftest import QUANTIZE, QUANTIZE_STACK, gpu_devices, pairwise, skip_or_fail
from oracles import dequant64, grouped_gemm64, rel_err
from test_fp8 import assert_within_f32_accumulation, oracle_gemm, oracle_quantize, oracle_weights
from test_moe import W4A4_TOL, W4A16_TOL, float_layer, np_moe, quantized

E, H, I, VOCAB = 4, 128, 128, 16          # fp8 needs H, I multiples of 128; sm90 N % 128, K % 64
FP8_TOL = {"w4a16": 0.08, "w4a4": 0.16}
"""fp8 layer vs the float64 oracle of the exact layer (test_fp8.test_moe_fp8_against_exact_and_
float64's bounds: the e4m3 roundings, amplified in W4A4 by requantized codes); a wrong scale or
combine is off by O(1)."""


def _platform_device(platform):
    if platform == "cpu":
        return jax.devices("cpu")[0]
    gpus = gpu_devices()
    if not gpus:
        skip_or_fail("no GPU")
    return gpus[0]


def assert_same(a, b, what):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.shape == y.shape and x.dtype == y.dtype, what
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8),
                                      err_msg=what)


# ------------------------------------------------------------------ the layer
LAYER_AXES = dict(activation=("w4a4", "w4a16"), scale=("dynamic", "static"),
                  precision=("exact", "fp8"), routing=("score", "hash"), shared=(True, False),
                  layout=("checkpoint", "prepared"))
LAYER_DIAGONAL = [("w4a4", "static", "fp8", "hash", False, "prepared"),
                  ("w4a16", "dynamic", "exact", "score", True, "checkpoint")]
"""Two complementary cases: every value of every axis in the default tier (the layer run eagerly,
op by op, is slow on the CPU)."""
LAYER_CASES = [pytest.param(*c, marks=() if c in LAYER_DIAGONAL else pytest.mark.slow)
               for c in pairwise(LAYER_AXES, seed=LAYER_DIAGONAL)]
"""The diagonal, then every pair of option values (slow): a layer run eagerly and closed over
costs ~1-3 min of CPU per case."""


@functools.lru_cache(maxsize=None)
def layer_weights(shared: bool):
    """Checkpoint-layout weights with static input scales, a hash table and (or not) a shared
    expert; fixed seed."""
    rng = np.random.default_rng(46)
    f = float_layer(rng, e=E, h=H, i=I, shared=shared)
    scales = dict(w13_input_scale=np.full(E, 3.0 / 2688, np.float32),
                  w2_input_scale=np.full(E, 0.05 / 2688, np.float32))
    if shared:
        scales.update(shared_w13_input_scale=np.float32(3.0 / 2688),
                      shared_w2_input_scale=np.float32(0.05 / 2688))
    return quantized(f, hash_table=rng.integers(0, E, (VOCAB, 2)).astype(np.int32), **scales)


def layer_inputs():
    """(x, token_ids) for 0, 1 and many tokens and a [B, S, H] bf16 input."""
    rng = np.random.default_rng(15)
    shapes = [(0,), (1,), (24,), (2, 5)]
    xs = [jnp.asarray(rng.standard_normal(s + (H,)), jnp.bfloat16 if len(s) == 2 else jnp.float32)
          for s in shapes]
    toks = [jnp.asarray(rng.integers(0, VOCAB, s), jnp.int32) for s in shapes]
    return xs, toks


@pytest.mark.parametrize("activation,scale,precision,routing,shared,layout", LAYER_CASES)
def test_layer_matrix(activation, scale, precision, routing, shared, layout):
    w = layer_weights(shared)
    if routing == "score":
        w = dataclasses.replace(w, hash_table=None)
    wl = jn.prepare_weights(w) if layout == "prepared" else w
    c = jn.MoEConfig.deepseek_v4_pro(num_experts=E, top_k=2, hidden_size=H, intermediate_size=I,
                                     n_shared_experts=int(shared), activation=activation,
                                     activation_scale=scale, precision=precision)
    xs, toks = layer_inputs()
    if routing == "score":
        toks = [None] * len(xs)

    def run(xs, w, toks):
        return [jn.moe(x, w, c, token_ids=t) for x, t in zip(xs, toks)]

    on_gpu_fp8_sm90 = (precision == "fp8" and layout == "prepared"
                       and jax.default_backend() == "gpu")
    if on_gpu_fp8_sm90:       # the CUDA fp8 kernel reads checkpoint-layout weights only
        with pytest.raises(ValueError, match="rhs.layout: precision='fp8' on the GPU"):
            jax.jit(run)(xs, wl, toks)
        return
    args = jax.jit(run)(xs, wl, toks)
    closed = jax.jit(lambda xs, toks: run(xs, wl, toks))(xs, toks)
    eager = run(xs, wl, toks)
    for x, a in zip(xs, args):
        assert a.shape == x.shape and a.dtype == x.dtype
    assert_same(args, closed, "jit with weights as arguments vs closed over")
    # Eager is not bit for bit the jit on the CPU: XLA fuses the layer's float32 epilogues
    # (router, SwiGLU, scales) differently from the ops run one by one, a few ulps (seen: one
    # token, exact W4A4, 39 of 128 elements a few ulps apart), which a W4A4 requantization can
    # turn into one e2m1 step on a rare element.
    for e, a in zip(eager, args):
        assert e.shape == a.shape and e.dtype == a.dtype
        assert rel_err(e, a) <= 2e-3, rel_err(e, a)
    # the many-token input against the float64 layer (of the checkpoint-layout weights)
    many, tok = np.asarray(xs[2]), None if routing == "score" else np.asarray(toks[2])
    ref, _ = np_moe(many, w, dataclasses.replace(c, precision="exact"), token_ids=tok)
    tol = FP8_TOL[activation] if precision == "fp8" else (
        W4A16_TOL if activation == "w4a16" else W4A4_TOL)
    assert np.abs(ref).max() > 0 and rel_err(args[2], ref) <= tol
    assert np.array_equal(np.asarray(args[3]).reshape(10, H),
                          np.asarray(jax.jit(run)([xs[3].reshape(10, H)], wl,
                                                  [None if toks[3] is None
                                                   else toks[3].reshape(10)])[0]))


# ------------------------------------------------------------------ grouped_gemm
G, N, K = 3, 128, 128
GEMM_AXES = dict(lhs=("bf16", "float32", "nvfp4"), layout=("checkpoint", "sm90"),
                 precision=("exact", "fp8"), backend=("reference", "ffi"),
                 platform=("cpu", "gpu"))


def _gemm_sizes(m):
    return jnp.asarray([m // 3, 0, m - m // 3], jnp.int32)


@functools.lru_cache(maxsize=None)
def gemm_rhs(layout):
    rng = np.random.default_rng(7)
    rhs = jax.jit(jax.vmap(jn.quantize))(jnp.asarray(rng.standard_normal((G, N, K)), jnp.float32))
    rhs = jn.NVFP4Tensor(rhs.data, rhs.scales, jnp.asarray([0.5, 1.0, 2.0], jnp.float32))
    return rhs if layout == "checkpoint" else jn.prepare_weights(rhs)


def gemm_lhs(kind, m):
    x = np.random.default_rng(m).standard_normal((m, K)).astype(np.float32)
    if kind == "nvfp4":
        return QUANTIZE(jnp.asarray(x))
    return jnp.asarray(x, jnp.bfloat16 if kind == "bf16" else jnp.float32)


def gemm_oracle(lhs, rhs, sizes, precision):
    """float64 [M, N] and the tolerance per element (float32 accumulation)."""
    ck = jn.prepare_weights(rhs, "checkpoint")
    if isinstance(lhs, jn.NVFP4Tensor):
        a, lhs_gs = dequant64(lhs.data, lhs.scales), float(lhs.global_scale)
    else:
        a, lhs_gs = np.asarray(lhs, np.float64), 1.0
    alpha = lhs_gs * np.asarray(ck.global_scale, np.float64)
    if precision == "fp8":
        q, s = oracle_quantize(a)
        return oracle_gemm(q, s, oracle_weights(np.asarray(ck.data), np.asarray(ck.scales)),
                           alpha, sizes)
    w = dequant64(ck.data, ck.scales)
    mag = grouped_gemm64(np.abs(a), np.abs(w), np.abs(alpha), sizes)
    return grouped_gemm64(a, w, alpha, sizes), mag


GEMM_DIAGONAL = [("bf16", "checkpoint", "exact", "ffi"), ("nvfp4", "sm90", "exact", "ffi"),
                 ("float32", "checkpoint", "fp8", "ffi"), ("nvfp4", "checkpoint", "fp8", "reference"),
                 ("bf16", "sm90", "fp8", "reference"), ("float32", "sm90", "exact", "reference")]
GEMM_CASES = ([pytest.param(*c, "cpu", marks=() if c in GEMM_DIAGONAL else pytest.mark.slow)
               for c in pairwise(dict(list(GEMM_AXES.items())[:-1]), seed=GEMM_DIAGONAL)]
              + [pytest.param(*c, "gpu") for c in itertools.product(*list(GEMM_AXES.values())[:-1])])
"""On the CPU a diagonal taking every value of every axis, then every pair of values (slow; the
reference backend runs slowly op by op when eager). On the GPU (skipped without one) the full
product."""


@pytest.mark.parametrize("lhs_kind,layout,precision,backend,platform", GEMM_CASES)
def test_grouped_gemm_matrix(lhs_kind, layout, precision, backend, platform):
    dev = _platform_device(platform)
    with jax.default_device(dev):
        rhs = jax.device_put(gemm_rhs(layout), dev)
        lhss = [jax.device_put(gemm_lhs(lhs_kind, m), dev) for m in (0, 1, 40)]
        sizes = [jax.device_put(_gemm_sizes(m), dev) for m in (0, 1, 40)]

        def run(lhss, rhs, sizes):
            return [jn.grouped_gemm(a, rhs, s, backend=backend, precision=precision,
                                    out_dtype=jnp.float32) for a, s in zip(lhss, sizes)]

        refused = None
        if lhs_kind == "float32" and backend == "ffi" and precision == "exact":
            refused = "lhs: expected dtype in"        # the exact custom call takes bf16 only
        elif platform == "gpu" and backend == "ffi" and precision == "fp8" and layout == "sm90":
            refused = "rhs.layout: precision='fp8' on the GPU"
        if refused:
            for f in (lambda: jax.jit(run)(lhss, rhs, sizes),
                      lambda: jax.jit(lambda: run(lhss, rhs, sizes))(), lambda: run(lhss, rhs, sizes)):
                with pytest.raises(ValueError, match=refused):
                    f()
            return
        args = jax.jit(run)(lhss, rhs, sizes)
        closed = jax.jit(lambda lhss: run(lhss, rhs, sizes))(lhss)
        all_closed = jax.jit(lambda: run(lhss, rhs, sizes))()
        eager = run(lhss, rhs, sizes)
    assert [a.shape for a in args] == [(0, N), (1, N), (40, N)]
    assert_same(args, closed, "jit with the weights as arguments vs closed over")
    want, mag = gemm_oracle(lhss[2], rhs, np.asarray(sizes[2]), precision)
    if backend == "reference" and platform == "gpu":
        # The pure-jnp GEMM on XLA:GPU: eager runs op by op, and with every operand a constant XLA
        # evaluates it at compile time on the host; each sums in its own order (float32 ulps from
        # the jitted result, seen on the H200), so both are held to the float64 oracle's bound.
        for res, what in ((all_closed, "every operand closed over"), (eager, "eager")):
            assert [a.shape for a in res] == [a.shape for a in args], what
            assert_within_f32_accumulation(res[2], want, mag, K, what)
    else:
        assert_same(args, all_closed, "jit with every operand closed over")
        assert_same(args, eager, "jit vs eager")
    if platform == "gpu" and precision == "fp8":
        # the GPU's FP8 MMA sums each 128-k chunk with ~14 bits (test_fp8's CUDA bound)
        assert np.all(np.abs(np.asarray(args[2], np.float64) - want) <= 2.0**-9 * mag + 1e-30)
    else:
        assert_within_f32_accumulation(args[2], want, mag, K, "vs the float64 oracle")
    assert np.abs(want).max() > 0


@pytest.mark.parametrize("lhs_kind", ["bf16", "nvfp4"])
@pytest.mark.parametrize("backend", [pytest.param("reference", marks=pytest.mark.slow), "ffi"])
@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_grouped_gemm_swiglu_matrix(lhs_kind, backend, platform):
    dev = _platform_device(platform)
    with jax.default_device(dev):
        rhs = jax.device_put(jn.layout.pair_gate_up(gemm_rhs("checkpoint")), dev)
        lhss = [jax.device_put(gemm_lhs(lhs_kind, m), dev) for m in (0, 1, 40)]
        sizes = [jax.device_put(_gemm_sizes(m), dev) for m in (0, 1, 40)]

        def run(lhss, rhs, sizes):
            return [jn.grouped_gemm_swiglu(a, rhs, s, limit=7.0, backend=backend,
                                           out_dtype=jnp.float32) for a, s in zip(lhss, sizes)]

        args = jax.jit(run)(lhss, rhs, sizes)
        closed = jax.jit(lambda lhss: run(lhss, rhs, sizes))(lhss)
        eager = run(lhss, rhs, sizes)
    assert [a.shape for a in args] == [(0, N // 2), (1, N // 2), (40, N // 2)]
    assert_same(args, closed, "jit with the weights as arguments vs closed over")
    assert_same(args, eager, "jit vs eager")
    # the oracle: the float64 paired GEMM, then the clamped SwiGLU on the paired columns
    h, _ = gemm_oracle(lhss[2], rhs, np.asarray(sizes[2]), "exact")
    pairs = h.reshape(h.shape[0], N // 16, 2, 8)      # 8 gate then 8 up columns per block
    gate, up = pairs[:, :, 0].reshape(len(h), -1), pairs[:, :, 1].reshape(len(h), -1)
    gate, up = np.minimum(gate, 7.0), np.clip(up, -7.0, 7.0)
    with np.errstate(over="ignore"):
        want = gate / (1 + np.exp(-gate)) * up
    assert rel_err(args[2], want) <= 1e-5 and np.abs(want).max() > 0


# ------------------------------------------------------------------ edge inputs
# docs/usage.md, "Zero tokens, non-finite and float16 inputs, per entry point": each cell of that
# table, entry point by entry point (small shapes, jitted once each).

def _bits(a):
    return np.asarray(a).view(np.uint8) if np.asarray(a).dtype.itemsize == 1 else \
        np.asarray(a).view(f"u{np.asarray(a).dtype.itemsize}")


def _same_tensor(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert u.shape == v.shape and u.dtype == v.dtype
        np.testing.assert_array_equal(_bits(u), _bits(v))


@functools.lru_cache(maxsize=None)
def _edge_gemm_rhs():
    rng = np.random.default_rng(58)
    return QUANTIZE_STACK(jnp.asarray(rng.standard_normal((2, 128, 128)), jnp.float32))


def test_edge_zero_rows_every_entry_point():
    x = jnp.zeros((0, 128), jnp.float32)
    t = jn.quantize(x)
    assert t.data.shape == (0, 64) and t.scales.shape == (0, 8) and float(t.global_scale) == 1.0
    d, s, g = jn.stage_activation(x)
    assert d.shape == (0, 64) and s.shape == (0, 8) and float(g) == 1.0
    assert jn.dequantize(t, jnp.bfloat16).shape == (0, 128)
    assert jn.dequantize(t, jnp.bfloat16).dtype == jnp.bfloat16
    rows = jn.fp8.quantize_rows(x)
    assert rows.codes.shape == (0, 128) and rows.scales.shape[0] == 0
    rhs = _edge_gemm_rhs()
    for backend in ("reference", "ffi"):
        for lhs, precision in ((x.astype(jnp.bfloat16), "exact"), (t, "exact"), (x, "fp8")):
            out = jn.grouped_gemm(lhs, rhs, [0, 0], backend=backend, precision=precision)
            assert out.shape == (0, 128), (backend, precision)
        out = jn.grouped_gemm_swiglu(x.astype(jnp.bfloat16), jn.layout.pair_gate_up(rhs), [0, 0],
                                     backend=backend)
        assert out.shape == (0, 64)
    w = layer_weights(True)
    c = jn.MoEConfig(num_experts=E, top_k=2, hidden_size=H, intermediate_size=I,
                     n_shared_experts=1)
    ids, rw = jn.route(x, dataclasses.replace(w, hash_table=None), c)
    assert ids.shape == (0, 2) and ids.dtype == jnp.int32
    assert rw.shape == (0, 2) and rw.dtype == jnp.float32


def test_edge_float16_quantizers_read_its_exact_values(rng):
    x = rng.standard_normal((4, 128)).astype(np.float16) * np.float16(300)
    x[0, :3] = [np.inf, -np.inf, 65504]
    x[1, 5] = np.nan
    x16, x32 = jnp.asarray(x), jnp.asarray(x.astype(np.float32))
    quantizers = jax.jit(lambda x: (jn.quantize(x), jn.stage_activation(x),
                                    jn.fp8.quantize_rows(x)))      # one compile per dtype
    _same_tensor(quantizers(x16), quantizers(x32))
    rows = np.asarray(quantizers(x32)[2].codes, np.float32)
    assert np.isnan(rows[:2]).all() and not np.isnan(rows[2:]).any()   # Inf/NaN chunk: NaN
    t = QUANTIZE(x32)
    deq = jax.jit(jn.dequantize, static_argnums=1)
    want = np.asarray(deq(t, jnp.float32)).astype(np.float16)   # one rounding
    got = np.asarray(deq(t, jnp.float16))
    assert got.dtype == np.float16
    np.testing.assert_array_equal(_bits(got), _bits(want))
    big = QUANTIZE(jnp.full((1, 32), 1e5, jnp.float32))
    assert np.isinf(np.asarray(deq(big, jnp.float16))).all()   # past 65504: Inf


def test_edge_float16_gemm(rng):
    rhs = _edge_gemm_rhs()
    x = (rng.standard_normal((6, 128)) * 3).astype(np.float16)
    x16, x32 = jnp.asarray(x), jnp.asarray(x.astype(np.float32))
    sizes = [2, 3]
    for backend, precision in (("reference", "exact"), ("reference", "fp8"), ("ffi", "fp8")):
        a = jn.grouped_gemm(x16, rhs, sizes, backend=backend, precision=precision,
                            out_dtype=jnp.float32)
        b = jn.grouped_gemm(x32, rhs, sizes, backend=backend, precision=precision,
                            out_dtype=jnp.float32)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=backend + precision)
    ref = jn.grouped_gemm(x16, jn.layout.pair_gate_up(rhs), sizes, backend="reference")
    assert ref.dtype == jnp.bfloat16
    for call in (lambda: jn.grouped_gemm(x16, rhs, sizes, backend="ffi"),
                 lambda: jn.grouped_gemm_swiglu(x16, jn.layout.pair_gate_up(rhs), sizes,
                                                backend="ffi")):
        with pytest.raises(ValueError, match="lhs: expected dtype in \\['bfloat16'\\] or an "
                                             "NVFP4Tensor, got float16"):
            call()


@pytest.mark.parametrize("backend", ["reference", "ffi"])
def test_edge_gemm_non_finite_rows_stay_in_their_rows(rng, backend):
    """A NaN or Inf in lhs row r reaches row r only, also within one kernel token tile of other
    rows and past the groups (output 0 there); a NaN block scale in weight row n of group g makes
    column n of g's rows NaN, and the rows past the groups stay 0."""
    w = rng.standard_normal((2, 128, 128)).astype(np.float32)
    rhs = QUANTIZE_STACK(jnp.asarray(w))
    scales = np.asarray(rhs.scales).view(np.uint8).copy()
    scales[1, 7, 2] = 0x7F                                       # e4m3 NaN, group 1, row 7
    bad = dataclasses.replace(rhs, scales=jax.lax.bitcast_convert_type(
        jnp.asarray(scales), jnp.float8_e4m3fn))
    x = rng.standard_normal((10, 128)).astype(np.float32)
    x[1, 4], x[5, 9], x[9, 0] = np.nan, np.inf, np.nan          # row 9 lies past the groups
    xb = jnp.asarray(x, jnp.bfloat16)
    sizes = [4, 4]
    out = np.asarray(jn.grouped_gemm(xb, rhs, sizes, backend=backend, out_dtype=jnp.float32))
    clean_x = np.where(np.isfinite(x), x, 0).astype(np.float32)
    clean = np.asarray(jn.grouped_gemm(jnp.asarray(clean_x, jnp.bfloat16), rhs, sizes,
                                       backend=backend, out_dtype=jnp.float32))
    assert np.isnan(out[1]).all() and not np.isfinite(out[5]).any()
    keep = [0, 2, 3, 4, 6, 7]
    np.testing.assert_array_equal(out[keep], clean[keep])
    np.testing.assert_array_equal(out[8:], 0)
    outw = np.asarray(jn.grouped_gemm(jnp.asarray(clean_x, jnp.bfloat16), bad, sizes,
                                      backend=backend, out_dtype=jnp.float32))
    assert np.isnan(outw[4:8, 7]).all()
    np.testing.assert_array_equal(np.isnan(outw), np.isin(np.arange(10), [4, 5, 6, 7])[:, None]
                                  & (np.arange(128) == 7)[None, :])
    np.testing.assert_array_equal(outw[8:], 0)


def _edge_layer(activation="w4a16", scale="dynamic", precision="exact"):
    w = dataclasses.replace(layer_weights(True), hash_table=None)
    c = jn.MoEConfig.deepseek_v4_pro(num_experts=E, top_k=2, hidden_size=H, intermediate_size=I,
                                     n_shared_experts=1, activation=activation,
                                     activation_scale=scale, precision=precision)
    return w, c


@pytest.mark.parametrize("activation,scale,precision", [("w4a16", "dynamic", "exact"),
                                                        ("w4a4", "static", "fp8")])
def test_edge_float16_layer_is_the_float32_layer_rounded_once(rng, activation, scale, precision):
    w, c = _edge_layer(activation, scale, precision)
    x = (rng.standard_normal((5, H)) * 2).astype(np.float16)
    run = jax.jit(lambda x: jn.moe(x, w, c))
    a = run(jnp.asarray(x))
    b = run(jnp.asarray(x.astype(np.float32)))
    assert a.dtype == jnp.float16
    np.testing.assert_array_equal(_bits(a), _bits(b.astype(jnp.float16)))
    route = jax.jit(lambda x: jn.route(x, w, c))
    _same_tensor(route(jnp.asarray(x)), route(jnp.asarray(x.astype(np.float32))))


@pytest.mark.parametrize("activation,scale,precision", [("w4a4", "dynamic", "exact"),
                                                        ("w4a4", "static", "fp8")])
def test_edge_non_finite_tokens_touch_only_their_rows(rng, activation, scale, precision):
    w, c = _edge_layer(activation, scale, precision)
    x = rng.standard_normal((6, H)).astype(np.float32)
    x[1, 3], x[4, 8] = np.nan, np.inf
    run = jax.jit(lambda x: jn.moe(x, w, c))
    out = np.asarray(run(jnp.asarray(x)))
    assert np.isnan(out[[1, 4]]).all()
    keep = [0, 2, 3, 5]
    np.testing.assert_array_equal(out[keep], np.asarray(run(jnp.asarray(x[keep]))))
