"""Expert parallelism (jax_nvfp4.layer.sharding) on 8 CPU devices: equal to the single-device layer,
and both within the float64 MoE oracle of tests/oracles.py (``assert_oracle``).

``moe_expert_parallel`` must give :func:`jax_nvfp4.moe`'s answer up to the float32 order of the
final sum (per-device partial sums, then psum), whatever the number of devices, combine,
activation mode, routing flavour or backend; route only each device's token slice and gather
the decisions (bit for bit the former replicated router's answer); move only the combine and
those decisions over the wire (one all-reduce or one reduce-scatter, one all-gather of int32
[T, 2 top_k], never the weights); and reject bad arguments with errors naming them. The last
test runs the layer across 2 processes x 4 CPU devices.
"""

import dataclasses
import functools
import os
import re
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nvfp4 as jn
from jax_nvfp4 import _extension
from jax_nvfp4.layer import sharding
from jax_nvfp4.layer.moe import routed_experts, row_ladder, shared_expert
from conftest import cpu_devices, QUANTIZE, QUANTIZE_STACK
from oracles import moe64, rel_err

E, H, I = 16, 128, 64
HERE = os.path.dirname(os.path.abspath(__file__))

needs_ffi = pytest.mark.skipif(not _extension.available(),
                               reason="the jax_nvfp4 extension (CPU FFI handler) is not built")
# The custom call when it is built (the case that matters); otherwise the pure-jnp reference, so
# that the sharding logic is still tested on a machine without the extension.
BACKEND = "ffi" if _extension.available() else "reference"


@pytest.fixture(scope="module", autouse=True)
def _eight_cpu_devices():
    """Every test here runs on the 8 CPU devices, on GPU machines too (tests/test_sharding_gpus.py
    is the GPU version)."""
    with jax.default_device(cpu_devices(8)[0]):
        yield


# ----------------------------------------------------------------------------- helpers


def _normal(r, shape, std):
    return (r.normal(size=shape) * std).astype(np.float32)


def _quantize_halves(gate, up):
    """w13 whose gate and up halves carry different global scales: global_scale [..., 2]."""
    batch = gate.ndim == 3
    q = QUANTIZE_STACK if batch else QUANTIZE
    g, u = q(jnp.asarray(gate)), q(jnp.asarray(up))
    ax = 1 if batch else 0
    return jn.NVFP4Tensor(jnp.concatenate([g.data, u.data], ax),
                          jnp.concatenate([g.scales, u.scales], ax),
                          jnp.stack([g.global_scale, u.global_scale], -1))


def _swiglu64(h, limit):
    gate, up = np.split(h, 2, axis=-1)
    if limit is not None:
        gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
    return gate / (1 + np.exp(-gate)) * up


def make_layer(r, *, num_experts=E, top_k=4, t=32, scoring_func="sqrtsoftplus", n_group=1,
               topk_group=1, shared=True, activation="w4a4", activation_scale="dynamic",
               per_half=False, hash_vocab=0, bias=None, swiglu_limit=10.0):
    """A random V4-shaped layer, quantized, plus float32 tokens x [t, H] (and token ids)."""
    e = num_experts
    cfg = jn.MoEConfig(num_experts=e, top_k=top_k, hidden_size=H, intermediate_size=I,
                       scoring_func=scoring_func, n_group=n_group, topk_group=topk_group,
                       routed_scaling_factor=2.5, swiglu_limit=swiglu_limit,
                       n_shared_experts=int(shared), activation=activation,
                       activation_scale=activation_scale)
    router = _normal(r, (e, H), 0.3)
    # gate and up at different magnitudes, so their global scales differ when split
    gate, up = _normal(r, (e, I, H), 0.08), _normal(r, (e, I, H), 0.03)
    w2 = _normal(r, (e, H, I), 0.08)
    sgate, sup, sw2 = _normal(r, (I, H), 0.08), _normal(r, (I, H), 0.03), _normal(r, (H, I), 0.08)
    x = _normal(r, (t, H), 1.0)
    router_bias = _normal(r, (e,), 0.05) if bias is None else np.asarray(bias, np.float32)
    hash_table = token_ids = None
    if hash_vocab:
        hash_table = np.stack([r.permutation(e)[:top_k] for _ in range(hash_vocab)]).astype(np.int32)
        token_ids = r.integers(0, hash_vocab, size=(t,)).astype(np.int32)
    w = jn.quantize_moe(router, np.concatenate([gate, up], 1), w2, router_bias=router_bias,
                        shared_w13=np.concatenate([sgate, sup], 0) if shared else None,
                        shared_w2=sw2 if shared else None, hash_table=hash_table)
    if per_half:
        kw = dict(w13=_quantize_halves(gate, up))
        if shared:
            kw["shared_w13"] = _quantize_halves(sgate, sup)
        w = dataclasses.replace(w, **kw)
        assert w.w13.global_scale.shape == (e, 2)
        assert not np.allclose(w.w13.global_scale[:, 0], w.w13.global_scale[:, 1])
    if activation == "w4a4" and activation_scale == "static":
        # calibration-like constants, distinct per expert (catches local/global index mix-ups);
        # factors < 1 make some activations saturate, the same on one device and on many.
        d13 = np.concatenate([gate, up], 1).astype(np.float64)   # calibrated on float weights
        amax_x = np.abs(x).max()
        act = _swiglu64(np.einsum("th,enh->etn", x.astype(np.float64), d13), swiglu_limit)
        w13_in = amax_x / 2688 * r.uniform(0.8, 1.3, e)
        w2_in = np.abs(act).max(axis=(1, 2)) / 2688 * r.uniform(0.8, 1.3, e)
        kw = dict(w13_input_scale=jnp.asarray(w13_in, jnp.float32),
                  w2_input_scale=jnp.asarray(w2_in, jnp.float32))
        if shared:
            ds13 = np.concatenate([sgate, sup], 0).astype(np.float64)
            sact = _swiglu64(x.astype(np.float64) @ ds13.T, swiglu_limit)
            kw["shared_w13_input_scale"] = jnp.float32(amax_x / 2688 * 1.1)
            kw["shared_w2_input_scale"] = jnp.float32(np.abs(sact).max() / 2688 * 0.9)
        w = dataclasses.replace(w, **kw)
    return cfg, w, x, token_ids


def ep_mesh(ep, axis_type=AxisType.Explicit, name="ep"):
    return jax.make_mesh((ep,), (name,), axis_types=(axis_type,), devices=cpu_devices(ep))


def single(x, w, cfg, token_ids=None, backend=BACKEND):
    f = jax.jit(lambda x, w, tok: jn.moe(x, w, cfg, token_ids=tok, backend=backend))
    return np.asarray(f(x, w, token_ids))


def ep_fn(cfg, mesh, combine, backend=BACKEND, **kw):
    return jax.jit(lambda x, w, tok: jn.moe_expert_parallel(
        x, w, cfg, mesh, combine=combine, token_ids=tok, backend=backend, **kw))


def run_ep(x, w, cfg, mesh, combine, token_ids=None, backend=BACKEND, **kw):
    ws = jn.shard_moe_weights(w, mesh)
    out = ep_fn(cfg, mesh, combine, backend, **kw)(x, ws, token_ids)
    return out


def default_ladder(t, k, ep):
    """The row counts each device may run by default (moe_expert_parallel's capacity_factor)."""
    return row_ladder(sharding.device_capacity(t, k, ep, sharding.DEFAULT_CAPACITY_FACTOR), t * k)


def assert_close(out, ref, what=""):
    out, ref = np.asarray(out), np.asarray(ref)
    assert out.dtype == np.float32 and out.shape == ref.shape, (out.dtype, out.shape, ref.shape)
    assert np.all(np.isfinite(out)), what
    scale = float(np.abs(ref).max())
    assert scale > 1e-3, f"degenerate reference output {what}"
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * scale, err_msg=what)


ORACLE_TOL = {"w4a16": 1e-3, "w4a4": 1e-3}
"""Relative L2 error of the layer against the float64 oracle (oracles.moe64), per activation.
Typically the layer has the oracle's bf16 rows and NVFP4 codes and differs by float32
accumulation only: 1.1e-7 to 1.7e-7 in ~60 calls here. Where a float32 intermediate and its
float64 value straddle a rounding boundary, a bf16 row element is one step off, or under W4A4 a
requantized code: 1.6e-4 measured (test_all_tokens_on_one_device, W4A16), 3.9e-6
(test_skewed_routing_default_is_exact); 1e-3 leaves 6x. A 1% error of the static down GEMM
measured 7.9e-3; a doubled scale or a lost expert contribution is far larger."""


def assert_oracle(out, w, cfg, x, token_ids=None, what=""):
    """``out`` against the float64 MoE oracle of tests/oracles.py (not against the layer itself:
    a combine or scale that is wrong the same way on one device and on many shows here). The
    oracle's float64 routing must pick the layer's experts (else the comparison is meaningless)."""
    ref64, ids = moe64(x, w, cfg, token_ids)
    got_ids, _ = jn.route(jnp.asarray(x), w, cfg, token_ids)
    # the same experts per token (their slot order may differ where two scores tie in float32)
    np.testing.assert_array_equal(np.sort(np.asarray(got_ids), 1), np.sort(ids, 1),
                                  err_msg=f"routing {what}")
    err = rel_err(out, ref64)
    assert err <= ORACLE_TOL[cfg.activation], (what, err)


def check_both_combines(cfg, w, x, ep, token_ids=None, backend=BACKEND, ref=None,
                        axis_type=AxisType.Explicit, oracle_w=None):
    """Both combines on ``ep`` devices against the single-device layer ``ref`` and against the
    float64 oracle of ``oracle_w`` (default ``w``; the checkpoint-layout weights when ``w`` is
    prepared)."""
    ref = single(x, w, cfg, token_ids, backend) if ref is None else ref
    oracle_w = w if oracle_w is None else oracle_w
    mesh = ep_mesh(ep, axis_type)
    outs = {}
    # both combines in one jit: one compile instead of two (each output keeps its own sharding)
    both = jax.jit(lambda x, w, tok: {c: jn.moe_expert_parallel(
        x, w, cfg, mesh, combine=c, token_ids=tok, backend=backend)
        for c in ("psum", "psum_scatter")})(x, jn.shard_moe_weights(w, mesh), token_ids)
    for combine in ("psum", "psum_scatter"):
        out = both[combine]
        if combine == "psum_scatter":                      # token-sharded along the axis
            assert out.sharding.spec[0] == "ep" or ep == 1, out.sharding
            assert out.addressable_shards[0].data.shape == (x.shape[0] // ep, H)
        else:
            assert out.sharding.is_fully_replicated, out.sharding
        assert_close(out, ref, f"ep={ep} combine={combine} backend={backend}")
        outs[combine] = np.asarray(out)
        assert_oracle(out, oracle_w, cfg, x, token_ids, f"ep={ep} combine={combine}")
    return ref, outs


def route_counts(x, w, cfg, token_ids=None):
    ids, _ = jn.route(jnp.asarray(x), w, cfg, token_ids)
    return np.bincount(np.asarray(ids).reshape(-1), minlength=cfg.num_experts)


# ----------------------------------------------------------------------------- equality


_MODES = ["w4a16", "w4a4-dynamic", "w4a4-static"]


@functools.lru_cache(maxsize=None)
def _mode_case(mode):
    """One layer + single-device answer per activation mode, shared by the ep values."""
    activation, _, scale = mode.partition("-")
    cfg, w, x, _ = make_layer(np.random.default_rng(1000 + _MODES.index(mode)),
                              activation=activation, activation_scale=scale or "dynamic")
    return cfg, w, x, single(x, w, cfg)


@pytest.mark.parametrize("mode", _MODES)
@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_equals_single_device(ep, mode):
    cfg, w, x, ref = _mode_case(mode)
    check_both_combines(cfg, w, x, ep, ref=ref)


@pytest.mark.parametrize("ep", [2, 8])
def test_equals_single_device_reference_backend(ep, rng):
    cfg, w, x, _ = make_layer(rng, top_k=6, t=16)
    check_both_combines(cfg, w, x, ep, backend="reference")


@needs_ffi
def test_ffi_and_reference_backends_agree(rng):
    """Sanity: the two backends give the same EP answer (both compared to moe elsewhere)."""
    cfg, w, x, _ = make_layer(rng, activation="w4a16")
    mesh = ep_mesh(4)
    a = run_ep(x, w, cfg, mesh, "psum", backend="ffi")
    b = run_ep(x, w, cfg, mesh, "psum", backend="reference")
    scale = float(np.abs(np.asarray(b)).max())
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4 * scale)


def test_expert_with_no_tokens(rng):
    bias = _normal(rng, (E,), 0.05)
    bias[[3, 12]] = -1e4                               # experts 3 and 12 never chosen
    cfg, w, x, _ = make_layer(rng, bias=bias)
    counts = route_counts(x, w, cfg)
    assert counts[3] == 0 and counts[12] == 0, counts
    for ep in (4, 8):
        check_both_combines(cfg, w, x, ep)


@pytest.mark.parametrize("activation", ["w4a4", "w4a16"])
def test_all_tokens_on_one_device(activation, rng):
    """A huge bias on device 1's four experts: every token's top-4 lives on device 1 of 4."""
    bias = _normal(rng, (E,), 0.05)
    bias[4:8] += 1e3
    cfg, w, x, _ = make_layer(rng, top_k=4, bias=bias, activation=activation)
    counts = route_counts(x, w, cfg)
    assert np.all(counts[4:8] == x.shape[0]) and counts.sum() == counts[4:8].sum(), counts
    check_both_combines(cfg, w, x, 4)
    # also without the shared expert: then the other devices add exactly nothing
    cfg2, w2, x2, _ = make_layer(rng, top_k=4, bias=bias, activation=activation, shared=False)
    check_both_combines(cfg2, w2, x2, 4)


@pytest.mark.parametrize("t,ep", [(30, 4), (5, 8)])
def test_shared_expert_token_count_not_divisible(t, ep, rng):
    """The shared expert runs once in total on padded token slices; T % ep != 0 (psum)."""
    cfg, w, x, _ = make_layer(rng, t=t)
    ref = single(x, w, cfg)
    out = run_ep(x, w, cfg, ep_mesh(ep), "psum")
    assert_close(out, ref, f"T={t} ep={ep}")


def test_shared_expert_counted_once(rng):
    """The shared expert's contribution, isolated: with vs without it, EP and single agree."""
    cfg, w, x, _ = make_layer(rng)
    cfg0 = dataclasses.replace(cfg, n_shared_experts=0)
    w0 = dataclasses.replace(w, shared_w13=None, shared_w2=None)
    mesh = ep_mesh(8)
    # with and without the shared expert in one jit each (one compile instead of two)
    with_, without = jax.jit(lambda x, w, w0: (
        jn.moe_expert_parallel(x, w, cfg, mesh, backend=BACKEND),
        jn.moe_expert_parallel(x, w0, cfg0, mesh, backend=BACKEND)))(
        x, jn.shard_moe_weights(w, mesh), jn.shard_moe_weights(w0, mesh))
    d_ep = np.asarray(with_) - np.asarray(without)
    one, one0 = jax.jit(lambda x, w, w0: (jn.moe(x, w, cfg, backend=BACKEND),
                                          jn.moe(x, w0, cfg0, backend=BACKEND)))(x, w, w0)
    d_1 = np.asarray(one) - np.asarray(one0)
    assert np.abs(d_1).max() > 1e-2                    # the shared expert matters here
    np.testing.assert_allclose(d_ep, d_1, rtol=1e-4, atol=1e-5 * np.abs(d_1).max())


def test_hash_routed_layer(rng):
    cfg, w, x, tok = make_layer(rng, hash_vocab=50, top_k=4)
    counts = route_counts(x, w, cfg, tok)
    assert (counts > 0).sum() >= 8, counts             # spread over several devices
    ref = single(x, w, cfg, tok)
    for ep in (2, 8):
        check_both_combines(cfg, w, x, ep, token_ids=tok, ref=ref)


@pytest.mark.parametrize("backend", ["reference", BACKEND])
def test_hash_routed_out_of_range_ids_nan_rows_like_one_device(rng, backend):
    """Issue 23, item 7: traced ids outside the vocabulary or table entries outside [0, E)
    make only their token's row NaN, on 8 devices as on one; concrete ones are ValueErrors."""
    cfg, w, x, tok = make_layer(rng, hash_vocab=50, top_k=4, shared=False)
    tok = tok.copy()
    tok[2], tok[11] = 50, -1
    good_table = np.asarray(w.hash_table)
    table = good_table.copy()
    table[tok[20], 0] = cfg.num_experts + 3
    w = dataclasses.replace(w, hash_table=jnp.asarray(table))
    bad = np.isin(np.arange(len(tok)), [2, 11]) | (tok == tok[20])
    ref = single(x, w, cfg, tok, backend)
    np.testing.assert_array_equal(np.isnan(ref).all(1), bad)
    out = np.asarray(run_ep(x, w, cfg, ep_mesh(8), "psum", tok, backend))
    np.testing.assert_array_equal(np.isnan(out).all(1), bad)
    assert_close(out[~bad], ref[~bad], f"backend={backend}")
    mesh = ep_mesh(8)
    with pytest.raises(ValueError, match=r"weights.hash_table: expert ids must lie in \[0, 16\)"):
        jn.moe_expert_parallel(x, w, cfg, mesh, token_ids=np.abs(tok) % 50, backend=backend)
    w = dataclasses.replace(w, hash_table=jnp.asarray(good_table))
    with pytest.raises(ValueError, match=r"token_ids: expected ids in \[0, 50\)"):
        jn.moe_expert_parallel(x, w, cfg, mesh, token_ids=tok, backend=backend)


def test_grouped_topk_v3_style(rng):
    cfg, w, x, _ = make_layer(rng, scoring_func="sigmoid", n_group=4, topk_group=2, top_k=4,
                              swiglu_limit=None)
    ref = single(x, w, cfg)
    for ep in (4, 8):
        check_both_combines(cfg, w, x, ep, ref=ref)


@pytest.mark.parametrize("mode", ["w4a4-dynamic", "w4a4-static", "w4a16"])
def test_w13_gate_up_different_global_scales(mode, rng):
    activation, _, scale = mode.partition("-")
    cfg, w, x, _ = make_layer(rng, per_half=True, activation=activation,
                              activation_scale=scale or "dynamic")
    check_both_combines(cfg, w, x, 4)


def test_auto_axis_type_mesh(rng):
    cfg, w, x, _ = make_layer(rng)
    _, outs = check_both_combines(cfg, w, x, 4, axis_type=AxisType.Auto)
    # unsharded weights are fine on an Auto mesh (jit moves them)
    out = ep_fn(cfg, ep_mesh(4, AxisType.Auto), "psum")(x, w, None)
    assert_close(out, outs["psum"])


def test_two_axis_mesh(rng):
    """A ("dp", "ep") = (2, 4) mesh: experts split on "ep", the layer replicated over "dp"."""
    cfg, w, x, _ = make_layer(rng)
    ref = single(x, w, cfg)
    mesh = jax.make_mesh((2, 4), ("dp", "ep"), axis_types=(AxisType.Explicit,) * 2,
                         devices=cpu_devices(8))
    ws = jn.shard_moe_weights(w, mesh)
    assert ws.w13.data.addressable_shards[0].data.shape[0] == E // 4
    for combine in ("psum", "psum_scatter"):
        f = ep_fn(cfg, mesh, combine)
        out = f(x, ws, None)
        assert_close(out, ref, combine)
        hlo = f.lower(x, ws, None).compile().as_text()
        op = "all-reduce" if combine == "psum" else "reduce-scatter"
        assert _count_ops(hlo, op) == 1 and _gathered(hlo) == [("s32", (32, 2 * cfg.top_k))]
        # reduced over "ep" only: explicit groups, iota groups, or the mesh spelling (jax 0.11)
        assert re.search(r"replica_groups=(\{\{0,1,2,3\},\{4,5,6,7\}\}|\[2,4\]<=\[8\]|"
                         r"mesh\['dp'=2,\s*'ep'=4\]\s*\{'ep'\})", hlo), hlo[-2000:]


def test_independent_of_device_count(rng):
    """ep=2 and ep=8 (and ep=1) give the same numbers, checked directly."""
    cfg, w, x, _ = make_layer(rng, top_k=6)
    outs = {ep: np.asarray(run_ep(x, w, cfg, ep_mesh(ep), "psum")) for ep in (1, 2)}
    mesh = ep_mesh(8)
    both = jax.jit(lambda x, w: {c: jn.moe_expert_parallel(x, w, cfg, mesh, combine=c,
                                                           backend=BACKEND)
                                 for c in ("psum", "psum_scatter")})(     # one compile for ep=8
        x, jn.shard_moe_weights(w, mesh))
    outs[8] = np.asarray(both["psum"])
    scale = np.abs(outs[1]).max()
    np.testing.assert_allclose(outs[2], outs[8], rtol=1e-5, atol=1e-5 * scale)
    np.testing.assert_allclose(outs[1], outs[8], rtol=1e-5, atol=1e-5 * scale)
    scat = np.asarray(both["psum_scatter"])
    np.testing.assert_allclose(scat, outs[2], rtol=1e-5, atol=1e-5 * scale)


def test_bfloat16_input(rng):
    """bf16 x: the output is bf16 and within one bf16 rounding of the single-device answer."""
    cfg, w, x, _ = make_layer(rng)
    xb = jnp.asarray(x, jnp.bfloat16)
    ref = np.asarray(jax.jit(lambda x, w: jn.moe(x, w, cfg, backend=BACKEND))(xb, w), np.float32)
    out = run_ep(xb, w, cfg, ep_mesh(4), "psum_scatter")
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=1e-2,
                               atol=1e-2 * np.abs(ref).max())


@pytest.mark.parametrize("mode", ["w4a4-dynamic"])   # (the row-scale path; the other modes: test_moe)
def test_prepared_sm90_weights(mode, rng):
    """Weights from jax_nvfp4.prepare_weights (sm90 layout, paired gate/up rows) through the
    8-device layer: the layout and w13_paired travel with the weights, the shards are the
    prepared experts, every device runs the fused gate/up + SwiGLU call (capacity path, both
    combines), the answer is the single-device fused layer's up to the combine's summation
    order, and the checkpoint-layout (unfused) layer's within tests/test_moe.py's tolerances."""
    activation, _, scale = mode.partition("-")
    cfg, w, x, _ = make_layer(rng, per_half=True, activation=activation,
                              activation_scale=scale or "dynamic")
    p = jn.prepare_weights(w)
    mesh = ep_mesh(8)
    ps = jn.shard_moe_weights(p, mesh)
    assert ps.w13_paired and jax.tree.structure(ps) == jax.tree.structure(p)
    for name in ("w13", "w2", "shared_w13", "shared_w2"):
        assert getattr(ps, name).layout == "sm90", name
    for d, shard in enumerate(ps.w13.data.addressable_shards):   # each device: its experts
        rows = shard.index[0]
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(p.w13.data)[rows])
        assert np.asarray(shard.data).shape[0] == E // 8, d
    ref = single(x, p, cfg)
    unfused = single(x, w, cfg)
    # fused vs unfused: measured 0.0 here (the same float32 SwiGLU values on the CPU); a float32
    # ulp of the fused epilogue's SwiGLU may still move one bf16 element or W4A4 code (ORACLE_TOL)
    tol = ORACLE_TOL[activation]
    assert rel_err(ref, unfused) <= tol
    for combine in ("psum", "psum_scatter"):                 # (lowered only: no compile)
        text = ep_fn(cfg, mesh, combine).lower(x, ps, None).as_text()
        assert "jax_nvfp4_grouped_gemm_glu" in text or BACKEND != "ffi", combine
    # both combines in one jit: one compile each for the prepared and the unfused weights
    f = jax.jit(lambda x, w: [jn.moe_expert_parallel(x, w, cfg, mesh, combine=c, backend=BACKEND)
                              for c in ("psum", "psum_scatter")])
    unfused = jax.jit(lambda x, w: [jn.moe_expert_parallel(x, w, cfg, mesh, combine=c,
                                                           backend=BACKEND)
                                    for c in ("psum", "psum_scatter")])(
        x, jn.shard_moe_weights(w, mesh))
    for combine, got, other in zip(("psum", "psum_scatter"), f(x, ps), unfused):
        got = np.asarray(got)
        assert_close(got, ref, f"sm90 combine={combine}")
        assert rel_err(got, np.asarray(other)) <= tol
        assert_oracle(got, w, cfg, x, what=f"sm90 combine={combine}")
        assert_oracle(other, w, cfg, x, what=f"unfused combine={combine}")


def test_fused_swiglu_hash_routed_layer(rng):
    """A hash-routed layer with paired weights on 2 and 8 devices (capacity path, both
    combines) equals its single-device fused answer, and the unfused layer's within tolerance."""
    cfg, w, x, tok = make_layer(rng, hash_vocab=50, top_k=4, per_half=True)
    p = jn.prepare_weights(w)
    ref = single(x, p, cfg, tok)
    assert rel_err(ref, single(x, w, cfg, tok)) <= ORACLE_TOL[cfg.activation]   # measured 0.0
    for ep in (2, 8):
        check_both_combines(cfg, p, x, ep, token_ids=tok, ref=ref, oracle_w=w)


# ----------------------------------------------------------------------------- placement / HLO


def test_shard_moe_weights_placement(rng):
    cfg, w, x, _ = make_layer(rng, hash_vocab=10, activation_scale="static")
    mesh = ep_mesh(8)
    ws = jn.shard_moe_weights(w, mesh)
    for name in ("w13", "w2"):
        t = getattr(ws, name)
        for leaf in (t.data, t.scales, t.global_scale):
            assert leaf.sharding.spec[0] == "ep"
            assert leaf.addressable_shards[0].data.shape[0] == E // 8
    for leaf in (ws.w13_input_scale, ws.w2_input_scale):
        assert leaf.sharding.spec[0] == "ep" and leaf.addressable_shards[0].data.shape == (2,)
    for leaf in (ws.router_weight, ws.router_bias, ws.hash_table, ws.shared_w13.data,
                 ws.shared_w2.scales, ws.shared_w13_input_scale):
        assert leaf.sharding.is_fully_replicated
    # values are untouched
    for a, b in zip(jax.tree.leaves(w), jax.tree.leaves(ws)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _gathered(hlo: str):
    """(dtype, shape) of each all-gather's result in compiled HLO text."""
    return [(d, tuple(int(v) for v in dims.split(","))) for d, dims in
            re.findall(r"=\s*(\w+)\[([\d,]+)\]\{[^}]*\}\s+all-gather(?:-start)?\(", hlo)]


def _count_ops(hlo: str, op: str) -> int:
    """Instructions with opcode ``op`` (or its async ``-start`` form) in compiled HLO text."""
    return len(re.findall(rf"=\s*\S+\s+{op}(?:-start)?\(", hlo)) + \
        len(re.findall(rf"=\s*\([^=]*\)\s+{op}(?:-start)?\(", hlo))


@needs_ffi
def test_rows_hint_counts_local_rows(rng, monkeypatch):
    """Under EP each device's GEMMs see more rows than its own (the smallest row count of its
    ladder that holds them, or all T*k rows; the others lie past the groups); the kernel-choice
    hint is the expected local share, ceil(T*k*L/E), in every branch. Single device: no hint.
    (The hint only feeds the heuristic at trace time; the lowered call carries its choice.)"""
    hints = []
    choose = jn.kernel_config.choose

    def spy(m, n, k, groups, **kw):
        hints.append(kw.get("rows_hint", 0))
        return choose(m, n, k, groups, **kw)

    monkeypatch.setattr(jn.kernel_config, "choose", spy)
    cfg, w, x, _ = make_layer(rng)
    t, k = x.shape[0], cfg.top_k
    for ep in (2, 4, 8):
        mesh = ep_mesh(ep)
        want = -(-t * k * (E // ep) // E)
        for kw, n in (({}, len(default_ladder(t, k, ep))), ({"capacity_factor": None}, 1)):
            hints.clear()
            ep_fn(cfg, mesh, "psum", **kw).lower(x, jn.shard_moe_weights(w, mesh), None)
            # the routed L1 and L2 GEMMs of each row count, and the shared expert's (hint 0)
            assert hints.count(want) >= 2 * n and set(hints) <= {want, 0}, (ep, kw, hints)
    hints.clear()
    jax.jit(lambda x, w: jn.moe(x, w, cfg, backend="ffi")).lower(x, w)
    assert hints and set(hints) == {0}


@pytest.mark.parametrize("backend", [pytest.param("ffi", marks=needs_ffi), "reference"])
def test_compiled_hlo_collectives(backend, rng):
    cfg, w, x, _ = make_layer(rng)
    mesh = ep_mesh(4)
    ws = jn.shard_moe_weights(w, mesh)
    ref = single(x, w, cfg, backend=backend)
    for combine, op in (("psum", "all-reduce"), ("psum_scatter", "reduce-scatter")):
        compiled = ep_fn(cfg, mesh, combine, backend).lower(x, ws, None).compile()
        hlo = compiled.as_text()
        counts = {o: _count_ops(hlo, o) for o in
                  ("all-reduce", "reduce-scatter", "all-gather", "all-to-all",
                   "collective-permute")}
        want = {"all-reduce": 0, "reduce-scatter": 0, "all-gather": 1, "all-to-all": 0,
                "collective-permute": 0, op: 1}
        assert counts == want, (combine, counts)
        assert _gathered(hlo) == [("s32", (x.shape[0], 2 * cfg.top_k))]   # routing only
        ncall = hlo.count(f'custom_call_target="{_extension.TARGET}"')
        if backend == "ffi":                           # 2 routed per row count + 2 shared
            assert ncall == 2 * len(default_ladder(x.shape[0], cfg.top_k, 4)) + 2, ncall
        else:
            assert ncall == 0
        assert_close(compiled(x, ws, None), ref, combine)


# ----------------------------------------------------------------------------- capacity

def test_device_capacity_is_the_documented_ceiling():
    """``ceil(capacity_factor * T * top_k / devices)``, at least 1; None (all rows) without a
    factor or for a symbolic T; a factor that is not a finite number > 0 is refused."""
    cap = sharding.device_capacity
    assert cap(100, 4, 8, 1.25) == 63                   # 62.5 rounds up
    assert cap(64, 2, 8, 1.0) == 16 and cap(64, 2, 8, 2) == 32      # exact: no extra row
    assert cap(3, 1, 8, 0.5) == 1                       # 0.1875 -> the one-row minimum
    assert cap(100, 4, 8, None) is None
    assert cap(jax.export.symbolic_shape("t")[0], 4, 8, 1.25) is None
    for bad in (0, -1.0, float("nan"), float("inf"), True, "1.25"):
        with pytest.raises(ValueError, match="capacity_factor: expected a finite number > 0"):
            cap(100, 4, 8, bad)



def _local_rows(x, w, cfg, ep, token_ids=None):
    """Routed (token, expert) rows per device: what the capacity is compared with."""
    return route_counts(x, w, cfg, token_ids).reshape(ep, -1).sum(1)


# 8 devices in every mode, 4 in the two quick ones (the static W4A4 layer's eight capacity
# variants in one jit take minutes of CPU)
@pytest.mark.parametrize("ep,mode", [(8, m) for m in _MODES] + [(4, "w4a16"), (4, "w4a4-dynamic")])
def test_capacity_gives_the_uncapped_answer(ep, mode):
    """capacity_factor only changes how many rows a device runs, never the result: with room to
    spare (every device takes the short path), too small (every device falls back to all rows)
    and in between (some of each), the output equals the uncapped EP run (bit for bit with the
    custom call, whose rows are independent) and the single-device layer."""
    cfg, w, x, ref = _mode_case(mode)
    mesh = ep_mesh(ep)
    ws = jn.shard_moe_weights(w, mesh)
    t, k = x.shape[0], cfg.top_k
    local = _local_rows(x, w, cfg, ep)
    share = t * k / ep
    lo, hi = local.min() / share, local.max() / share
    assert hi > lo, local                  # routing uneven enough for a mixed case
    mixed = (lo + hi) / 2
    cfs = (hi + 0.5, mixed, 0.1)
    # every (combine, capacity_factor) layer in one jit: one compile instead of eight
    cases = [(c, cf) for c in ("psum", "psum_scatter") for cf in (None,) + cfs]
    outs = dict(zip(cases, jax.jit(lambda x, w: [jn.moe_expert_parallel(
        x, w, cfg, mesh, combine=c, backend=BACKEND, capacity_factor=cf)
        for c, cf in cases])(x, ws)))
    for combine in ("psum", "psum_scatter"):
        base = np.asarray(outs[combine, None])
        for cf in cfs:
            cap = int(np.ceil(cf * share))
            short = local <= cap
            assert {hi + 0.5: short.all(), mixed: short.any() and not short.all(),
                    0.1: not short.any()}[cf], (cf, cap, local)
            out = outs[combine, cf]
            assert_close(out, ref, f"ep={ep} {combine} capacity_factor={cf:.2f}")
            if BACKEND == "ffi":
                np.testing.assert_array_equal(np.asarray(out), base, err_msg=f"{combine} cf={cf}")


@needs_ffi
def _gemm_rows(hlo):
    """Row counts M of the grouped-GEMM custom calls in compiled HLO text."""
    calls = re.findall(r"= \((?:f32|bf16)\[(\d+),\d+\]\{1,0\}, u8\[\d+\]\{0\}\) custom-call\(", hlo)
    return sorted({int(m) for m in calls})


@needs_ffi
def test_capacity_runs_fewer_rows(rng):
    """The GEMMs take ceil(cf * T * k / ep) rows, twice that, ... and all T * k (every branch is
    compiled; a conditional picks one per device)."""
    cfg, w, x, _ = make_layer(rng)
    t, k, ep = x.shape[0], cfg.top_k, 4
    mesh = ep_mesh(ep)
    f = jax.jit(lambda x, w: jn.moe_expert_parallel(x, w, cfg, mesh, backend="ffi",
                                                    capacity_factor=1.5))
    hlo = f.lower(x, jn.shard_moe_weights(w, mesh)).compile().as_text()
    cap = int(np.ceil(1.5 * t * k / ep))
    assert row_ladder(cap, t * k) == (48, 96, 128) == (cap, 2 * cap, t * k)
    assert _gemm_rows(hlo) == [t // ep, cap, 2 * cap, t * k]   # shared expert: T/ep rows
    assert "conditional(" in hlo or "conditional-start(" in hlo


@needs_ffi
@pytest.mark.parametrize("ep", [2, 8])
def test_default_runs_about_the_own_rows(ep, rng):
    """By default (no capacity_factor given) a device's GEMMs, and so the dispatch, SwiGLU,
    requantization and combine around them, run 1.25x its even share of the rows when its own
    rows fit, not all T * k of them."""
    cfg, w, x, _ = make_layer(rng)
    t, k = x.shape[0], cfg.top_k
    mesh = ep_mesh(ep)
    hlo = ep_fn(cfg, mesh, "psum", "ffi").lower(x, jn.shard_moe_weights(w, mesh), None) \
        .compile().as_text()
    ladder = default_ladder(t, k, ep)
    assert ladder[0] == int(np.ceil(1.25 * t * k / ep)) < t * k and ladder[-1] == t * k
    assert _gemm_rows(hlo) == sorted({t // ep, *ladder})


def test_row_ladder():
    assert row_ladder(30, 192) == (30, 60, 120, 192)
    assert row_ladder(48, 96) == (48, 96)
    assert row_ladder(100, 96) == (96,) and row_ladder(1, 1) == (1,)
    for cap, rows in ((1, 1000), (7, 49152), (7680, 49152)):
        lad = row_ladder(cap, rows)
        assert lad[0] == min(cap, rows) and lad[-1] == rows
        assert all(b == 2 * a for a, b in zip(lad[:-2], lad[1:-1])) and lad[-1] <= 2 * lad[-2]


def test_capacity_with_everything_on_one_device(rng):
    """All tokens routed to one device's experts: it falls back to all rows, the others take
    the short path with no local rows at all; still the single-device answer."""
    bias = _normal(rng, (E,), 0.05)
    bias[4:8] += 1e3
    cfg, w, x, _ = make_layer(rng, top_k=4, bias=bias)
    ref = single(x, w, cfg)
    mesh = ep_mesh(4)
    out = jax.jit(lambda x, w: jn.moe_expert_parallel(x, w, cfg, mesh, backend=BACKEND,
                                                      capacity_factor=1.25))(
        x, jn.shard_moe_weights(w, mesh))
    assert_close(out, ref, "skewed, capacity_factor=1.25")


def _skewed_layer(routing, activation, rng):
    """16 experts, top-4, T 32 on 8 devices (2 experts each): every token picks both experts of
    one device (device 1 by bias, device 0 by hash table), which gets 4x its even share."""
    if routing == "hash":
        cfg, w, x, tok = make_layer(rng, hash_vocab=40, activation=activation)
        table = np.stack([np.concatenate([[0, 1], 2 + rng.permutation(E - 2)[:2]])
                          for _ in range(40)]).astype(np.int32)
        return cfg, dataclasses.replace(w, hash_table=jnp.asarray(table)), x, tok, 0
    bias = _normal(rng, (E,), 0.05)
    bias[2:4] += 1e3
    cfg, w, x, _ = make_layer(rng, bias=bias, activation=activation)
    return cfg, w, x, None, 1


@pytest.mark.parametrize("routing", ["score", "hash"])
@pytest.mark.parametrize("activation", ["w4a4", "w4a16"])
def test_skewed_routing_default_is_exact(routing, activation, rng):
    """One device receives 4x its share (the largest row count but one of its ladder), the
    others less (the smallest or the next): by default still the single-device answer with both
    combines, and with the custom call bit for bit the all-rows answer (capacity_factor=None)."""
    cfg, w, x, tok, hot = _skewed_layer(routing, activation, rng)
    t, k, ep = x.shape[0], cfg.top_k, 8
    local = _local_rows(x, w, cfg, ep, tok)
    ladder = default_ladder(t, k, ep)
    rung = [next(i for i, n in enumerate(ladder) if n >= r) for r in local]
    assert local[hot] == 2 * t and rung[hot] == len(ladder) - 2, (local, ladder)
    assert max(r for d, r in enumerate(rung) if d != hot) < rung[hot], (local, ladder)
    ref, outs = check_both_combines(cfg, w, x, ep, token_ids=tok)
    if BACKEND == "ffi":
        mesh = ep_mesh(ep)
        ws = jn.shard_moe_weights(w, mesh)
        all_rows = jax.jit(lambda x, w, tok: {c: ep_fn(cfg, mesh, c, capacity_factor=None)(
            x, w, tok) for c in ("psum", "psum_scatter")})(x, ws, tok)   # one compile
        for combine in ("psum", "psum_scatter"):
            np.testing.assert_array_equal(outs[combine], np.asarray(all_rows[combine]),
                                          err_msg=combine)


# ----------------------------------------------------------------------------- token-slice routing


def replicated_router_ep(cfg, mesh, combine, backend=BACKEND, axis_name="ep",
                         capacity_factor=sharding.DEFAULT_CAPACITY_FACTOR):
    """The former moe_expert_parallel, kept here as the bit-exact reference: every device routes
    all T tokens itself (replicated router), then the same local experts, shared-expert slice
    and combine."""
    def f(x, w, tok):
        t, h = x.shape
        ep = mesh.shape[axis_name]
        tslice = -(-t // ep)
        tok = jnp.zeros((t,), jnp.int32) if tok is None else jnp.asarray(tok)

        def body(x, w, tok):
            idx = jax.lax.axis_index(axis_name)
            out = sharding.local_routed_experts(x, w, cfg, device_index=idx, devices=ep,
                                                token_ids=tok, backend=backend,
                                                capacity_factor=capacity_factor)
            if w.shared_w13 is not None:
                xp = jnp.pad(x, ((0, tslice * ep - t), (0, 0)))
                mine = jax.lax.dynamic_slice_in_dim(xp, idx * tslice, tslice)
                part = shared_expert(mine, w, cfg, backend=backend)
                out = out + jax.lax.dynamic_update_slice_in_dim(
                    jnp.zeros((tslice * ep, h), jnp.float32), part, idx * tslice, 0)[:t]
            if combine == "psum":
                return jax.lax.psum(out, axis_name).astype(x.dtype)
            return jax.lax.psum_scatter(out, axis_name, scatter_dimension=0,
                                        tiled=True).astype(x.dtype)

        specs = sharding.weight_specs(w, axis_name)
        return jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P()),
                             out_specs=P() if combine == "psum" else P(axis_name))(x, w, tok)
    return jax.jit(f)


def assert_equals_replicated_router(cfg, w, x, tok, combines=("psum", "psum_scatter"), **kw):
    mesh = ep_mesh(8, AxisType.Auto)
    ws = jn.shard_moe_weights(w, mesh)
    # the new and the old layer, every combine, in one jit: one compile instead of four
    outs = jax.jit(lambda x, w, tok: [(ep_fn(cfg, mesh, c, **kw)(x, w, tok),
                                       replicated_router_ep(cfg, mesh, c, **kw)(x, w, tok))
                                      for c in combines])(x, ws, tok)
    for combine, (new, old) in zip(combines, outs):
        new, old = np.asarray(new), np.asarray(old)
        assert np.abs(old).max() > 1e-3, combine
        np.testing.assert_array_equal(new, old, err_msg=combine)


@pytest.mark.parametrize("routing", ["score", "hash"])
@pytest.mark.parametrize("activation", ["w4a4", "w4a16"])
def test_token_slice_routing_equals_replicated_router_skewed(routing, activation, rng):
    """Each device routes T/8 tokens and gathers the decisions: bit for bit the replicated
    router's layer, both combines, under the skew that sends one device 4x its share (its
    capacity ladder's second-largest rung)."""
    cfg, w, x, tok, _ = _skewed_layer(routing, activation, rng)
    assert_equals_replicated_router(cfg, w, x, tok)


@pytest.mark.parametrize("routing", ["score", "grouped", "hash"])
def test_token_slice_routing_equals_replicated_router_t_not_multiple(routing, rng):
    """T = 30 on 8 devices (slices of 4, the last one half padding), psum: bit for bit."""
    kw = dict(hash_vocab=40) if routing == "hash" else (
        dict(n_group=4, topk_group=2, scoring_func="sigmoid") if routing == "grouped" else {})
    cfg, w, x, tok = make_layer(rng, t=30, **kw)
    assert_equals_replicated_router(cfg, w, x, tok, combines=("psum",))


@pytest.mark.parametrize("routing", ["score", "hash"])
def test_route_token_slice_pieces_are_route(routing, rng):
    """The 8 slices' decisions, concatenated and cut to T, are route()'s, bit for bit."""
    cfg, w, x, tok = make_layer(rng, t=30, hash_vocab=40 if routing == "hash" else 0)
    ids, rw = jax.jit(lambda x, w, tok: jn.route(x, w, cfg, tok))(x, w, tok)
    f = jax.jit(lambda x, w, tok, d: sharding.route_token_slice(
        x, w, cfg, device_index=d, devices=8, token_ids=tok))
    parts = [f(x, w, tok, jnp.int32(d)) for d in range(8)]
    assert parts[0][0].shape == (4, cfg.top_k) and parts[0][1].dtype == jnp.float32
    np.testing.assert_array_equal(np.concatenate([p[0] for p in parts])[:30], np.asarray(ids))
    np.testing.assert_array_equal(
        np.concatenate([np.asarray(p[1]) for p in parts])[:30].view(np.uint32),
        np.asarray(rw).view(np.uint32))


@pytest.mark.parametrize("routing", ["score", "hash"])
def test_router_runs_on_the_token_slice_only(routing, rng):
    """The compiled layer's router matmul has ceil(T / 8) rows, not T (T = 30: 4 rows)."""
    cfg, w, x, tok = make_layer(rng, t=30, hash_vocab=40 if routing == "hash" else 0)
    mesh = ep_mesh(8)
    hlo = ep_fn(cfg, mesh, "psum").lower(x, jn.shard_moe_weights(w, mesh), tok) \
        .compile().as_text()
    router = re.findall(rf"= f32\[(\d+),{cfg.num_experts}\]\{{1,0\}} dot\(", hlo)
    assert router and set(router) == {"4"}, router
    assert _gathered(hlo) == [("s32", (32, 2 * cfg.top_k))]


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "1.5"])
def test_error_capacity_factor(bad, rng):
    cfg, w, x, _ = make_layer(rng, shared=False)
    with pytest.raises(ValueError, match=r"capacity_factor: expected a finite number > 0"):
        jn.moe_expert_parallel(x, w, cfg, ep_mesh(2), capacity_factor=bad)


def test_error_routed_experts_capacity(rng):
    cfg, w, x, _ = make_layer(rng, shared=False)
    ids, rw = jn.route(jnp.asarray(x), w, cfg)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match=r"capacity: expected a static int >= 1"):
            routed_experts(jnp.asarray(x), ids, rw, w, cfg, capacity=bad)


# ----------------------------------------------------------------------------- gradients


def _grad_x(f, x, w, ct):
    """jit(grad) of ``sum(ct * f(x, w))`` wrt x, compiled: (gradient, compiled HLO text)."""
    g = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w) * ct)))
    compiled = g.lower(jnp.asarray(x), w).compile()
    return compiled(jnp.asarray(x), w), compiled.as_text()


_NO_CAP = {"capacity_factor": None}
# (layout, combine, moe_expert_parallel kwargs, T): for each activation both combines, both
# layouts, with and without capacity; once a T the 8 devices do not divide (padded slices).
_GRAD_CASES = {"w4a16": [("checkpoint", "psum", {}, 16), ("sm90", "psum_scatter", _NO_CAP, 16)],
               "w4a4": [("checkpoint", "psum_scatter", {}, 16), ("sm90", "psum", _NO_CAP, 13)]}


@pytest.mark.parametrize("activation", ["w4a16", "w4a4"])
def test_grad_wrt_x_equals_single_device(activation, rng):
    """jax.grad wrt x through the 8-device layer equals the single-device layer's gradient
    (checked against a float64 oracle in tests/test_moe.py), through the experts and the router
    (whose decisions are all-gathered as int32 bits): both combines, with and without capacity,
    checkpoint and prepared (paired, fused forward) weights, T not divisible by the devices. x
    is replicated, so its cotangent is the devices' summed: one all-reduce of [T, H] in all."""
    cfg, w, x, _ = make_layer(rng, activation=activation, t=16, top_k=2)
    layouts = {"checkpoint": w, "sm90": jn.prepare_weights(w)}
    ct = _normal(rng, x.shape, 1.0)
    mesh = ep_mesh(8)
    for layout, combine, kw, t in _GRAD_CASES[activation]:
        weights = layouts[layout]
        what = f"{layout} combine={combine} {kw} T={t}"
        ref, _ = _grad_x(lambda x, w: jn.moe(x, w, cfg, backend=BACKEND), x[:t], weights, ct[:t])
        got, hlo = _grad_x(lambda x, w: jn.moe_expert_parallel(
            x, w, cfg, mesh, combine=combine, backend=BACKEND, **kw), x[:t],
            jn.shard_moe_weights(weights, mesh), ct[:t])
        assert_close(got, ref, what)
        # forward: the decisions' all-gather; backward: the routing weights' reduce-scatter
        # ([S, top_k]), x's all-reduce, and the combine's transpose (psum: nothing moves,
        # psum_scatter: an all-gather of the output's cotangent)
        gathers = 1 + (combine == "psum_scatter")
        assert _count_ops(hlo, "all-reduce") == 1 and _count_ops(hlo, "all-gather") == gathers, \
            what
        assert re.search(rf"f32\[{t},{H}\]\S* all-reduce(-start)?\(", hlo), what


@pytest.mark.parametrize("activation", ["w4a16", "w4a4"])
def test_routed_experts_grad_replicated_x_in_shard_map(activation, rng):
    """The building block in one's own shard_map, x replicated as it comes in: each device's
    GEMM rows are its own dispatch of x (typed as varying although the sort's permutation is
    computed from device-varying keys), and a replicated x fed to a GEMM whole (W4A4 dynamic:
    quantized per token, then gathered) gets the devices' cotangents summed."""
    cfg, w, x, _ = make_layer(rng, activation=activation, t=16, top_k=2, shared=False)
    ct = _normal(rng, x.shape, 1.0)
    mesh = ep_mesh(8)

    def ep(x, w):
        def body(x, w):
            out = sharding.local_routed_experts(x, w, cfg, device_index=jax.lax.axis_index("ep"),
                                                devices=8, backend=BACKEND, capacity_factor=None)
            return jax.lax.psum(out, "ep")
        return jax.shard_map(body, mesh=mesh, in_specs=(P(), sharding.weight_specs(w)),
                             out_specs=P())(x, w)

    ref, _ = _grad_x(lambda x, w: jn.moe(x, w, cfg, backend=BACKEND), x, w, ct)
    got, _ = _grad_x(ep, x, jn.shard_moe_weights(w, mesh), ct)
    assert_close(got, ref, activation)


# ----------------------------------------------------------------------------- errors


def test_error_num_experts_not_divisible(rng):
    cfg, w, x, _ = make_layer(rng, num_experts=12, shared=False)
    mesh = ep_mesh(8)
    with pytest.raises(ValueError, match=r"num_experts=12.*8"):
        jn.moe_expert_parallel(x, w, cfg, mesh)
    with pytest.raises(ValueError, match=r"weights: 12 experts.*8"):
        jn.shard_moe_weights(w, mesh)


def test_error_unknown_combine(rng):
    cfg, w, x, _ = make_layer(rng, shared=False)
    with pytest.raises(ValueError, match=r"combine.*'all_to_all'"):
        jn.moe_expert_parallel(x, w, cfg, ep_mesh(2), combine="all_to_all")


def test_error_psum_scatter_tokens_not_divisible(rng):
    cfg, w, x, _ = make_layer(rng, t=30, shared=False)
    with pytest.raises(ValueError, match=r"x: .*psum_scatter.*T=30.*4"):
        jn.moe_expert_parallel(x, w, cfg, ep_mesh(4), combine="psum_scatter")


def test_error_axis_not_in_mesh(rng):
    cfg, w, x, _ = make_layer(rng, shared=False)
    mesh = ep_mesh(2)
    with pytest.raises(ValueError, match=r"axis_name: 'tp'"):
        jn.moe_expert_parallel(x, w, cfg, mesh, axis_name="tp")
    with pytest.raises(ValueError, match=r"axis_name: 'tp'"):
        jn.shard_moe_weights(w, mesh, axis_name="tp")


def test_error_hash_layer_without_token_ids(rng):
    cfg, w, x, _ = make_layer(rng, hash_vocab=10, shared=False)
    with pytest.raises(ValueError, match=r"token_ids"):
        jn.moe_expert_parallel(x, w, cfg, ep_mesh(2))


# ----------------------------------------------------------------------------- explicit mesh


def test_chained_psum_scatter_output_explicit_mesh(rng):
    cfg, w, x, _ = make_layer(rng, shared=False)
    mesh = ep_mesh(4)
    xs = jax.device_put(x, NamedSharding(mesh, P("ep")))   # like a psum_scatter output
    out = run_ep(xs, w, cfg, mesh, "psum")
    assert_close(out, single(x, w, cfg))


# ----------------------------------------------------------------------------- multi-process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


_NO_COLLECTIVES = re.compile(r"collective|gloo|mpi|not implemented|unimplemented", re.I)


def test_multi_process_two_by_four(tmp_path):
    """2 processes x 4 CPU devices (jax.distributed on localhost, gloo collectives)."""
    import _multiprocess_worker as worker  # noqa: PLC0415 - tests/ is on sys.path

    backends = ["ffi", "reference"] if _extension.available() else ["reference"]
    port = _free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(jn.__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([root] + [p for p in os.environ.get(
                   "PYTHONPATH", "").split(os.pathsep) if p]))
    procs, logs = [], []
    for i in range(2):
        log = open(tmp_path / f"log_{i}.txt", "w")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(HERE, "_multiprocess_worker.py"), "--process-id",
             str(i), "--num-processes", "2", "--local-devices", "4", "--port", str(port),
             "--out", str(tmp_path)] + [a for b in backends for a in ("--backend", b)],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=HERE))
    deadline = time.monotonic() + 150
    timed_out = False
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    errors = {i: (tmp_path / f"process_{i}.error").read_text()
              for i in range(2) if (tmp_path / f"process_{i}.error").exists()}
    out_logs = {i: (tmp_path / f"log_{i}.txt").read_text()[-3000:] for i in range(2)}
    if errors:
        text = "\n".join(errors.values())
        if _NO_COLLECTIVES.search(text.splitlines()[-1] if text.strip() else ""):
            pytest.skip(f"no CPU collectives across processes in this jaxlib: "
                        f"{text.strip().splitlines()[-1]}")
        pytest.fail(f"worker failed:\n{text}")
    codes = [p.returncode for p in procs]
    assert not timed_out, f"workers did not finish within 150 s; logs:\n{out_logs}"
    assert codes == [0, 0], f"worker exit codes {codes}; logs:\n{out_logs}"

    # the expected answer, computed here (one process, one device)
    cfg, w, x = worker.make_case()
    expected = {b: single(x, w, cfg, backend=b) for b in backends}
    seen = {"psum_scatter": set()}
    for i in range(2):
        res = np.load(tmp_path / f"process_{i}.npz")
        assert int(res["device_count"]) == 8 and int(res["process_count"]) == 2
        for b in backends:
            np.testing.assert_allclose(res[f"single_{b}"], expected[b], rtol=1e-6,
                                       atol=1e-6 * np.abs(expected[b]).max())
            for combine in ("psum", "psum_scatter"):
                rows = res[f"ep_{b}_{combine}_rows"]
                vals = res[f"ep_{b}_{combine}"]
                assert_close(vals, expected[b][rows], f"process {i} {b} {combine}")
                if combine == "psum":
                    assert set(rows.tolist()) == set(range(x.shape[0]))   # replicated
                else:
                    assert len(rows) == x.shape[0] // 2                 # 4 shards of T/8
                    seen["psum_scatter"] |= set(rows.tolist())
    # the two processes' token shards together cover every token
    assert seen["psum_scatter"] == set(range(x.shape[0]))



# ----------------------------------------------------------------------------- zero tokens


@pytest.mark.parametrize("precision", ["exact", "fp8"])
def test_zero_tokens(precision, rng):
    """x ``[0, H]`` (a serving batch that came out empty): ``[0, H]`` in x's dtype for both
    combines, with and without a capacity factor, exact and fp8, as ``moe`` gives; its gradient
    is ``[0, H]`` too."""
    if precision == "fp8":      # fp8: H, I multiples of 128
        i = 128
        cfg = jn.MoEConfig(num_experts=E, top_k=4, hidden_size=H, intermediate_size=i,
                           n_shared_experts=1, precision="fp8")
        n = lambda *s: _normal(rng, s, 0.05)  # noqa: E731
        w = jn.quantize_moe(n(E, H), n(E, 2 * i, H), n(E, H, i), shared_w13=n(2 * i, H),
                            shared_w2=n(H, i))
    else:
        cfg, w, _, _ = make_layer(rng)
    mesh = ep_mesh(8)
    ws = jn.shard_moe_weights(w, mesh)
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jnp.zeros((0, H), dtype)
        np.testing.assert_array_equal(single(x, w, cfg).shape, (0, H))
        for combine in ("psum", "psum_scatter"):
            for cap in (sharding.DEFAULT_CAPACITY_FACTOR, None):
                out = ep_fn(cfg, mesh, combine, capacity_factor=cap)(x, ws, None)
                assert out.shape == (0, H) and out.dtype == dtype, (combine, cap, out.shape)
    g = jax.jit(jax.grad(lambda x, w: jn.moe_expert_parallel(x, w, cfg, mesh,
                                                             backend=BACKEND).sum()))(
        jnp.zeros((0, H), jnp.float32), ws)
    assert g.shape == (0, H)


@pytest.mark.parametrize("cap", [sharding.DEFAULT_CAPACITY_FACTOR, 0.3, None])
def test_nan_expert_touches_only_its_rows(cap, rng):
    """An expert whose weights hold a NaN (a NaN block scale) makes only the rows routed to it
    NaN, whichever row count each device runs (capacities that hold, and one too small for the
    skewed device, which then takes a larger size), as on one device; every other row is
    unchanged."""
    cfg, w, x, _ = make_layer(rng, t=16, top_k=2, shared=False)
    ids = np.asarray(jn.route(jnp.asarray(x), w, cfg)[0])
    bad_e = int(np.bincount(ids.reshape(-1), minlength=E).argmax())
    scales = np.asarray(w.w2.scales).view(np.uint8).copy()
    scales[bad_e] = 0x7F                                         # every block scale NaN
    wn = dataclasses.replace(w, w2=dataclasses.replace(w.w2, scales=jax.lax.bitcast_convert_type(
        jnp.asarray(scales), jnp.float8_e4m3fn)))
    hit = (ids == bad_e).any(axis=1)
    assert hit.any() and not hit.all()
    out = np.asarray(run_ep(x, wn, cfg, ep_mesh(8), "psum", capacity_factor=cap))
    assert np.isnan(out[hit]).all() and np.isfinite(out[~hit]).all()
    one = single(x, wn, cfg)
    np.testing.assert_array_equal(np.isnan(one), np.isnan(out))
    clean = np.asarray(run_ep(x, w, cfg, ep_mesh(8), "psum", capacity_factor=cap))
    np.testing.assert_array_equal(out[~hit], clean[~hit])


def test_float16_tokens_are_the_float32_layer_rounded_once(rng):
    """docs/usage.md: float16 x computes as the float32 x of the same values, rounded once."""
    cfg, w, x, _ = make_layer(rng, t=16)
    x16 = np.asarray(x, np.float16)
    mesh = ep_mesh(8)
    for combine in ("psum", "psum_scatter"):
        a = run_ep(jnp.asarray(x16), w, cfg, mesh, combine)
        b = run_ep(jnp.asarray(x16.astype(np.float32)), w, cfg, mesh, combine)
        assert a.dtype == jnp.float16
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16),
                                      np.asarray(b.astype(jnp.float16)).view(np.uint16))


def test_auto_precision_counts_the_global_tokens():
    """precision="auto" under expert parallelism decides from the global token count (as jn.moe
    would for the same x), not a device's share: 64 tokens over 8 devices (8 each) run fp8, bit
    for bit the expert-parallel layer pinned to fp8; 63 run exact."""
    r = np.random.default_rng(7)
    e, h, i = 8, 128, 128
    w = jn.quantize_moe(_normal(r, (e, h), 0.1), _normal(r, (e, 2 * i, h), 0.05),
                        _normal(r, (e, h, i), 0.05))
    c = jn.MoEConfig(num_experts=e, top_k=2, hidden_size=h, intermediate_size=i, precision="auto")
    devs = cpu_devices(8)
    mesh = jax.make_mesh((8,), ("ep",), axis_types=(AxisType.Explicit,), devices=devs)
    ws = jn.shard_moe_weights(w, mesh)
    for t, mode in ((64, "fp8"), (63, "exact")):
        x = jnp.asarray(_normal(r, (t, h), 1.0), jnp.bfloat16)
        run = jax.jit(lambda x, w, cc: jn.moe_expert_parallel(x, w, cc, mesh, backend=BACKEND),
                      static_argnums=2)
        got = np.asarray(run(x, ws, c), np.float32)
        want = np.asarray(run(x, ws, dataclasses.replace(c, precision=mode)), np.float32)
        np.testing.assert_array_equal(got, want, err_msg=str(t))
