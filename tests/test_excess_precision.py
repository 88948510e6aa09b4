"""Roundings that XLA:GPU may not elide.

XLA:GPU runs SimplifyFPConversions under its default ``--xla_allow_excess_precision``: a chain of
float converts ``A -> B -> C`` becomes ``A -> C``, so a value rounded to e4m3 (or e2m1) and widened
again in the same program is used unrounded. The CPU compiler does not do it, so a CPU test of
the numbers cannot see it: the fp8 reference on the GPU was off by ~2^-8 of the products'
magnitude under jit that way, and the NVFP4 quantizer once divided by unrounded block scales.

The library keeps every such rounding behind ``jax.lax.optimization_barrier`` (which XLA:GPU
expands only after scheduling, long after that pass). These tests trace each public entry point
(``jax.make_jaxpr``, nothing runs) and look for a narrowing float convert to an 8- or 4-bit
float (or bf16/f16) whose result reaches a widening convert through data-movement ops only, across
nested jaxprs (jit, cond, scan, custom_jvp/vjp). The walker's own tests show that it finds such a
chain and accepts one broken by a barrier.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as jn
from test_moe import float_layer, quantized

QUANTIZED = {jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)}
if hasattr(jnp, "float4_e2m1fn"):
    QUANTIZED.add(jnp.dtype(jnp.float4_e2m1fn))
NARROW = QUANTIZED | {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)}
"""The narrow types whose rounding must happen: e4m3/e2m1 (quantization) and bf16/f16 (the
kernels' operand types and the layer's rows: elided, a backend would compute on other values).
Gradient programs are checked for QUANTIZED only: JAX casts the cotangent of a bf16 output to bf16
and the backward widens it, a rounding whose loss only makes the gradient more precise."""
IGNORED = ("varying_type",)
"""Widening converts are reported where the library makes them (a source frame in jax_nvfp4/),
not in the caller's code, except in these functions, where it has no numeric effect: varying_type sums one element
of each custom-call operand only to type the call's result (jax_nvfp4/maths/varying.py)."""
MOVES = {"reshape", "transpose", "slice", "squeeze", "expand_dims", "broadcast_in_dim", "copy",
         "copy_p", "rev", "dynamic_slice", "concatenate", "pad", "gather", "select_n"}
"""Ops that move a narrowed value without computing on it (an algebraic simplifier may move a
convert across them): the chain is followed through them."""


def _is_float(dt):
    return jnp.issubdtype(dt, jnp.floating)


def _sub_jaxprs(eqn):
    for v in eqn.params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            if hasattr(x, "jaxpr") and hasattr(x, "consts"):
                yield x.jaxpr
            elif hasattr(x, "eqns") and hasattr(x, "invars"):
                yield x


def _where(eqn):
    return jax._src.source_info_util.summarize(eqn.source_info)


def narrowed_then_widened(jaxpr, narrowed=frozenset(), library_only=True, narrow=NARROW):
    """``(found, out_marks)`` for ``jaxpr`` (a core Jaxpr): the source locations of the widening
    converts of a narrowed value (``library_only``: only those made in jax_nvfp4's code), and which
    outvars carry a narrowed value out (for chains that leave a nested jaxpr); ``narrowed`` holds
    the invars that carry one in."""
    marked, found = set(narrowed), []

    def is_marked(v):
        return not hasattr(v, "val") and v in marked

    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "convert_element_type":
            src, dst = jnp.dtype(eqn.invars[0].aval.dtype), jnp.dtype(eqn.params["new_dtype"])
            if dst in narrow and _is_float(src) and src.itemsize > dst.itemsize:
                marked.add(eqn.outvars[0])
            elif (is_marked(eqn.invars[0]) and _is_float(dst) and dst.itemsize > src.itemsize
                  and (not library_only or "jax_nvfp4" + os.sep in _where(eqn))
                  and not any(f"({f}" in _where(eqn) for f in IGNORED)):
                found.append(f"{src} -> {dst} at {_where(eqn)}")
            continue
        if name == "optimization_barrier":
            continue
        subs = list(_sub_jaxprs(eqn))
        if subs:
            # operands of a cond's branches follow its index; the others line up one to one
            ins = eqn.invars[1:] if name == "cond" else eqn.invars
            for sj in subs:
                inner = {iv for iv, ov in zip(sj.invars, ins)
                         if len(sj.invars) == len(ins) and is_marked(ov)}
                sub_found, out_marks = narrowed_then_widened(sj, frozenset(inner), library_only,
                                                             narrow)
                found += sub_found
                if len(sj.outvars) == len(eqn.outvars):
                    marked.update(ov for ov, m in zip(eqn.outvars, out_marks) if m)
            continue
        if name in MOVES and any(is_marked(v) for v in eqn.invars):
            marked.update(eqn.outvars)
    return found, [is_marked(v) for v in jaxpr.outvars]


def elided_roundings(fn, *args, library_only=True, narrow=NARROW):
    return narrowed_then_widened(jax.make_jaxpr(fn)(*args).jaxpr, library_only=library_only,
                                 narrow=narrow)[0]


# ------------------------------------------------------------------ the walker itself
def _round_e4m3(x):
    return x.astype(jnp.float8_e4m3fn)


@pytest.mark.parametrize("form", ["direct", "reshaped", "through jit", "out of jit", "in cond",
                                  "in scan", "bf16"])
def test_walker_finds_a_round_trip(form):
    x = jnp.ones((4, 8), jnp.float32)
    fns = {
        "direct": lambda x: _round_e4m3(x * 3).astype(jnp.float32),
        "bf16": lambda x: (x * 3).astype(jnp.bfloat16).astype(jnp.float32),
        "reshaped": lambda x: _round_e4m3(x * 3).reshape(8, 4).T.astype(jnp.bfloat16),
        "through jit": lambda x: jax.jit(lambda c: c.astype(jnp.float32))(_round_e4m3(x)),
        "out of jit": lambda x: jax.jit(_round_e4m3)(x).astype(jnp.float32),
        "in cond": lambda x: jax.lax.cond(x[0, 0] > 0, lambda c: c.astype(jnp.float32),
                                          lambda c: c.astype(jnp.float32) + 1, _round_e4m3(x)),
        "in scan": lambda x: jax.lax.scan(lambda c, r: (c, _round_e4m3(r).astype(jnp.float32)),
                                          0.0, x)[1],
    }
    assert elided_roundings(fns[form], x, library_only=False), form


def test_walker_accepts_a_barrier_and_computed_values():
    x = jnp.ones((4, 8), jnp.float32)
    assert not elided_roundings(
        lambda x: jax.lax.optimization_barrier(_round_e4m3(x)).astype(jnp.float32), x,
        library_only=False)
    # arithmetic on the narrow value is not a convert chain (the rounding happened)
    assert not elided_roundings(lambda x: (x.astype(jnp.bfloat16) * 3).astype(jnp.float32), x,
                                library_only=False)
    # nor is a narrowing from float32 to float32-or-wider, or between integer types
    assert not elided_roundings(lambda x: x.astype(jnp.int8).astype(jnp.float32), x,
                                library_only=False)


# ------------------------------------------------------------------ the public entry points
G, N, K, M = 2, 128, 256, 24


def _gemm_inputs():
    rng = np.random.default_rng(3)
    w = jax.vmap(jn.quantize)(jnp.asarray(rng.standard_normal((G, N, K)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    return x, w, jnp.asarray([10, 14], jnp.int32)


LHS = {"bf16": lambda x: x, "float32": lambda x: x.astype(jnp.float32),
       "bf16 rounded in the program": lambda x: (x.astype(jnp.float32) * 3).astype(jnp.bfloat16),
       "float16": lambda x: x.astype(jnp.float16), "nvfp4": jn.quantize,
       "fp8_rows": lambda x: jn.fp8.quantize_rows(x, k_order="kernel"),
       "staged": lambda x: jn.NVFP4Tensor(*jn.stage_activation(x))}
LAYOUTS = {"checkpoint": lambda w: w, "sm90": jn.prepare_weights,
           "fp8": lambda w: jn.prepare_weights(w, "fp8")}


@pytest.mark.parametrize("backend", ["reference", "ffi"])
@pytest.mark.parametrize("precision", ["exact", "fp8"])
@pytest.mark.parametrize("lhs", list(LHS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grouped_gemm_keeps_its_roundings(layout, lhs, precision, backend):
    """Quantization, weight preparation and the GEMM in one program, as a user's jit holds them."""
    if layout == "fp8" and precision == "exact":
        pytest.skip("Fp8Weights compute precision='fp8' only")
    if lhs == "fp8_rows" and precision == "exact":
        pytest.skip("Fp8Rows are the fp8 mode's operand")
    if lhs in ("float32", "float16") and (precision, backend) == ("exact", "ffi"):
        pytest.skip("the exact custom call takes bf16 or NVFP4 activations")
    x, w, s = _gemm_inputs()

    def fn(x, w, s):
        return jn.grouped_gemm(LHS[lhs](x), LAYOUTS[layout](w), s, backend=backend,
                               precision=precision)

    if (layout, precision, backend) == ("sm90", "fp8", "ffi") and jax.default_backend() == "gpu":
        # no CUDA kernel reads sm90 NVFP4 weights in the fp8 mode: refused at trace time
        with pytest.raises(ValueError, match="rhs.layout: precision='fp8' on the GPU"):
            elided_roundings(fn, x, w, s)
        return
    assert elided_roundings(fn, x, w, s) == []


@pytest.mark.parametrize("backend", ["reference", "ffi"])
def test_grouped_gemm_swiglu_and_gradient_keep_their_roundings(backend):
    x, w, s = _gemm_inputs()

    def swiglu(x, w, s):
        return jn.grouped_gemm_swiglu(jn.quantize(x), jn.prepare_weights(w), s, backend=backend)

    def grad(x, w, s):
        return jax.grad(lambda x: jn.grouped_gemm(x, w, s, backend=backend, precision="fp8")
                        .astype(jnp.float32).sum())(x)

    assert elided_roundings(swiglu, x, w, s) == []
    # checkpoint-layout weights: the fp8 mode's custom call reads those on every platform
    assert elided_roundings(grad, x.astype(jnp.float32), w, s, narrow=QUANTIZED) == []


def test_quantizers_and_preparation_keep_their_roundings():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((G, N, K)), jnp.float32)
    programs = {
        "quantize -> dequantize": lambda x: jn.dequantize(jn.quantize(x), jnp.float32),
        "stage_activation -> dequantize": lambda x: jn.dequantize(
            jn.NVFP4Tensor(*jn.stage_activation(x)), jnp.float32),
        "fp8 rows -> values": lambda x: jn.fp8.quantize_rows(x).codes.astype(jnp.float32),
        "prepare fp8 -> values": lambda w: jn.prepare_weights(
            jax.vmap(jn.quantize)(w), "fp8").codes.astype(jnp.float32),
        "weights_fp8 -> values": lambda w: jn.fp8.weights_fp8(
            jax.vmap(jn.quantize)(w)).astype(jnp.float32),
    }
    for name, fn in programs.items():
        arg = w if "prepare" in name or "weights" in name else x
        assert elided_roundings(fn, arg) == [], name
        if arg is x:                     # float16 input (docs/usage.md: read as its values)
            assert elided_roundings(fn, x.astype(jnp.float16)) == [], name + " float16"


@pytest.mark.parametrize("activation", ["w4a16", "w4a4"])
@pytest.mark.parametrize("precision,layout", [("exact", "checkpoint"), ("exact", "sm90"),
                                              ("fp8", "checkpoint"), ("fp8", "fp8")])
@pytest.mark.parametrize("backend", ["reference", "ffi"])
def test_moe_layer_keeps_its_roundings(activation, precision, layout, backend):
    rng = np.random.default_rng(5)
    e, h, i = 4, 128, 128
    w = quantized(float_layer(rng, e=e, h=h, i=i, shared=True))
    c = jn.MoEConfig.deepseek_v4_pro(num_experts=e, top_k=2, hidden_size=h, intermediate_size=i,
                                     n_shared_experts=1, activation=activation,
                                     precision=precision)
    wl = w if layout == "checkpoint" else jn.prepare_weights(
        w, *(("fp8",) if layout == "fp8" else ()))
    x = jnp.asarray(rng.standard_normal((6, h)), jnp.bfloat16)
    assert elided_roundings(lambda x, w: jn.moe(x, w, c, backend=backend), x, wl) == []
    # the layer's gradient (straight-through roundings in the backward)
    assert elided_roundings(
        lambda x, w: jax.grad(lambda x: jn.moe(x, w, c, backend=backend)
                              .astype(jnp.float32).sum())(x),
        x.astype(jnp.float32), dataclasses.replace(wl), narrow=QUANTIZED) == []


@pytest.mark.parametrize("backend", ["reference", "ffi"])
def test_float16_through_every_entry_point_keeps_its_roundings(backend):
    """float16 activations (docs/usage.md, "float16 input") into the layer (both precisions),
    the router, the reference GEMM and its fused SwiGLU, and the fp8-mode GEMM."""
    rng = np.random.default_rng(6)
    e, h, i = 4, 128, 128
    w = quantized(float_layer(rng, e=e, h=h, i=i, shared=True))
    x16 = jnp.asarray(rng.standard_normal((6, h)), jnp.float16)
    for activation in ("w4a16", "w4a4"):
        for precision in ("exact", "fp8"):
            c = jn.MoEConfig.deepseek_v4_pro(num_experts=e, top_k=2, hidden_size=h,
                                             intermediate_size=i, n_shared_experts=1,
                                             activation=activation, precision=precision)
            assert elided_roundings(lambda x, w: jn.moe(x, w, c, backend=backend), x16, w) == [], \
                (activation, precision)
    assert elided_roundings(lambda x, w: jn.route(x, w, c), x16, w) == []
    gx, gw, gs = _gemm_inputs()
    gx = gx.astype(jnp.float16)
    assert elided_roundings(lambda x, w, s: jn.grouped_gemm(x, w, s, backend=backend,
                                                            precision="fp8"), gx, gw, gs) == []
    assert elided_roundings(lambda x, w, s: jn.reference.grouped_gemm_swiglu(
        x, jn.layout.pair_gate_up(w), s, limit=1.0), gx, gw, gs) == []


def test_qwix_conversions_keep_their_roundings():
    """from_qwix (traced: its e4m3 exactness test and the block scales a consumer widens) and
    to_qwix to bfloat16 scales (its exactness test reads the rounded scale)."""
    qwix = pytest.importorskip("qwix")
    from jax_nvfp4.maths import qwix_interop as qi  # noqa: PLC0415
    rng = np.random.default_rng(68)
    w = jnp.asarray(rng.standard_normal((2, 64, 32)), jnp.float32)
    q = qwix.quantize(w, "nvfp4", channelwise_axes=(0, 2), tiled_axes={1: 16})
    assert elided_roundings(qi.from_qwix, q) == []
    assert elided_roundings(lambda q: jn.dequantize(qi.from_qwix(q)), q) == []
    t = jax.vmap(lambda v: jn.quantize(v, jnp.float32(2.0 ** -7)))(jnp.swapaxes(w, 1, 2))
    assert elided_roundings(lambda t: qi.to_qwix(t, dtype=jnp.bfloat16).scale, t) == []
