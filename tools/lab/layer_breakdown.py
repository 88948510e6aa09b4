"""Where the MoE layer's time goes beyond its GEMMs: each stage of `jax_nvfp4.moe` jitted alone on
materialized inputs (bench_layer's per-GPU V4-Pro shard: 48 experts, top-6, H 7168, I 3072, sm90
weights), beside the whole layer.

    python tools/lab/layer_breakdown.py [--tokens 1024,4096] [--small]

Stages: route (router + top-k), sort (argsort, bincount, inverse permutation), in1 (the gate/up GEMM
input: bf16 gather, or per-token NVFP4 quantization + gather), gemm1 (float32 out), act (SwiGLU,
times the row scale for W4A4, then bf16 or per-row NVFP4), gemm2, combine (gather back and weighted
sum over the k slots); with paired (prepared) weights also the fused gate/up GEMM + SwiGLU and the
down GEMM's input made from its output, the two that replace gemm1 + act in the layer (not summed). The stages' sum is an upper bound of the layer (fusion across stage
boundaries is lost); a stage far above its bytes at ~3.3 TB/s is the one to fuse or rewrite.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp

from jax_nvfp4 import gemm, prepare
from jax_nvfp4.moe import moe as moe_layer, swiglu
from jax_nvfp4.bench.common import random_layer, time_ms
from jax_nvfp4.bench.layer import layer_config
from jax_nvfp4.dispatch import dispatch_rows_dynamic
from jax_nvfp4.routing import route


def _gemm_lhs(rows, activation):
    """The layer's exact-mode GEMM input and row scales: for W4A4 its dispatch custom call (the
    bf16 values of each row's NVFP4 quantization, and the rows' scales), else bf16 rows."""
    if activation == "w4a4":
        return dispatch_rows_dynamic(rows)
    return rows.astype(jnp.bfloat16), None


def stages(x, weights, cfg):
    """(name, jitted fn, args) per stage, each fed the previous stages' materialized outputs."""
    t = x.shape[0]
    k = cfg.top_k
    f_route = jax.jit(lambda x, w: route(x, w, cfg))
    ids, rw = f_route(x, weights)

    @jax.jit
    def f_sort(ids):
        key = ids.reshape(-1)
        order = jnp.argsort(key, stable=True)
        sizes = jnp.bincount(key, length=cfg.num_experts).astype(jnp.int32)
        inv = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
        return (order // k).astype(jnp.int32), sizes, inv

    token_of, sizes, inv = f_sort(ids)

    @jax.jit
    def f_in1(x, token_of):
        if cfg.activation == "w4a4":          # the values of each token's quantization, gathered
            lhs, s = _gemm_lhs(x, "w4a4")
            return lhs[token_of], s[token_of]
        return x[token_of].astype(jnp.bfloat16), None

    lhs1, s1 = f_in1(x, token_of)
    f_g1 = jax.jit(lambda a, w, s: gemm.grouped_gemm(a, w, s, out_dtype=jnp.float32))
    h = f_g1(lhs1, weights.w13, sizes)

    @jax.jit
    def f_act(h, s1):
        act = swiglu(h if s1 is None else h * s1[:, None], cfg.swiglu_limit)
        return _gemm_lhs(act, cfg.activation)

    lhs2, s2 = f_act(h, s1)
    f_g2 = jax.jit(lambda a, w, s, s2: (lambda y: y if s2 is None else y * s2[:, None])(
        gemm.grouped_gemm(a, w, s, out_dtype=jnp.float32)))
    y = f_g2(lhs2, weights.w2, sizes, s2)

    @jax.jit
    def f_comb(y, inv, rw):
        ys = jnp.take(y, inv, axis=0, mode="fill", fill_value=0)
        return jnp.sum(ys.reshape(t, k, -1) * rw.reshape(t, k, 1), axis=1)

    out = [("route", f_route, (x, weights)), ("sort", f_sort, (ids,)),
           ("in1", f_in1, (x, token_of)), ("gemm1", f_g1, (lhs1, weights.w13, sizes)),
           ("act", f_act, (h, s1)), ("gemm2", f_g2, (lhs2, weights.w2, sizes, s2)),
           ("combine", f_comb, (y, inv, rw))]
    if getattr(weights, "w13_paired", False):
        # the fused gate/up GEMM + SwiGLU (what the layer runs on these weights), then the down
        # GEMM's input made from its output: these two replace gemm1 + act
        w4a4 = cfg.activation == "w4a4"
        f_fused = jax.jit(lambda a, w, s, rs: gemm.grouped_gemm_swiglu(
            a, w, s, row_scale=rs, limit=cfg.swiglu_limit,
            out_dtype=jnp.float32 if w4a4 else jnp.bfloat16))
        act = f_fused(lhs1, weights.w13, sizes, s1)
        f_req = jax.jit(lambda act: _gemm_lhs(act, cfg.activation))
        out += [("fused_gemm1_act", f_fused, (lhs1, weights.w13, sizes, s1)),
                ("act_from_fused", f_req, (act,))]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1024,4096")
    ap.add_argument("--small", action="store_true", help="CPU smoke test sizes")
    a = ap.parse_args(argv)
    experts, hidden, inter = (8, 128, 64) if a.small else (48, 7168, 3072)
    tokens = (16,) if a.small else tuple(int(v) for v in a.tokens.split(","))
    timing = dict(target_s=0.02, repeats=3) if a.small else dict(target_s=0.25, repeats=5)
    base = layer_config(experts, hidden, inter, 6, "w4a4")
    weights = prepare.prepare_weights(random_layer(base, seed=0), "sm90")
    print(f"{jax.devices()[0].device_kind}; w13 paired: {getattr(weights, 'w13_paired', False)}")
    for t in tokens:
        x = jax.random.normal(jax.random.key(t), (t, hidden), jnp.bfloat16)
        for activation in ("w4a4", "w4a16"):
            cfg = dataclasses.replace(base, activation=activation)
            layer_ms = time_ms(jax.jit(lambda x, w, cfg=cfg: moe_layer(x, w, cfg)), x, weights, **timing)
            parts = [(name, time_ms(f, *args, **timing)) for name, f, args in stages(x, weights, cfg)]
            total = sum(ms for name, ms in parts if name not in ("fused_gemm1_act", "act_from_fused"))
            gemms = sum(ms for name, ms in parts if name.startswith("gemm"))
            print(f"T {t} {activation}: layer {layer_ms:.3f} ms; stages sum {total:.3f} (gemms "
                  f"{gemms:.3f}, rest {total - gemms:.3f}): "
                  + ", ".join(f"{name} {ms:.3f}" for name, ms in parts), flush=True)


if __name__ == "__main__":
    main()
