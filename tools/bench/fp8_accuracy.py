"""Accuracy of the fp8 compute mode (precision="fp8") against the exact mode and the unquantized
computation, on the benchmark's GEMM shapes and a routed MoE layer (CPU is enough).

    python tools/bench/fp8_accuracy.py [--rows 256] [--groups 4] [--out docs/fp8-accuracy.json]

(jax_nvfp4 installed, or PYTHONPATH=. from the repository root.)

GEMMs (jax_nvfp4.bench.gemm's L1: K 7168, N 6144; L2: K 3072, N 7168; Gaussian weights and inputs,
skewed group sizes): relative L2 difference of fp8 to exact, for W4A16 (bf16 inputs) and W4A4
(inputs quantized to NVFP4), and each mode's error against the float64 product of the unquantized
operands. MoE: a DeepSeek-V4-style layer (sqrt-softplus routing, SwiGLU limit 10, one shared
expert; Gaussian weights and tokens), both activation kinds, each mode's error against the float64
layer on the original float weights (same routing), and fp8 vs exact.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_nvfp4 as jn
from jax_nvfp4.bench import gemm as bench

LAYERS = {"L1": (7168, 6144), "L2": (3072, 7168)}          # (K, N), as in jax_nvfp4.bench.gemm


def rel(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def gemm_rows(layer, rows, groups, backend, seed):
    """The GEMM measurements of one bench shape: a list of result dicts."""
    k, n = LAYERS[layer]
    rng = np.random.default_rng(seed)
    wf = rng.standard_normal((groups, n, k), dtype=np.float32)
    rhs = jax.jit(jax.vmap(jn.quantize))(jnp.asarray(wf))
    sizes = bench.skewed_group_sizes(rows, groups, seed)
    x = rng.standard_normal((rows, k), dtype=np.float32)
    x16 = jnp.asarray(x, jnp.bfloat16)
    xq = jn.quantize(jnp.asarray(x))
    run = jax.jit(lambda a, w, s, p: jn.grouped_gemm(a, w, s, backend=backend, precision=p,
                                                     out_dtype=jnp.float32), static_argnums=3)
    # float64 product of the unquantized operands (bf16 inputs for W4A16: the mode's input)
    ref = np.zeros((rows, n))
    x64 = {"w4a16": np.asarray(x16, np.float64), "w4a4": x.astype(np.float64)}
    out = []
    for act, lhs in (("w4a16", x16), ("w4a4", xq)):
        start = 0
        for g, size in enumerate(sizes):
            ref[start:start + size] = x64[act][start:start + size] @ wf[g].astype(np.float64).T
            start += size
        exact = np.asarray(run(lhs, rhs, jnp.asarray(sizes), "exact"))
        fast = np.asarray(run(lhs, rhs, jnp.asarray(sizes), "fp8"))
        out.append(dict(kind="gemm", case=f"{layer} K {k} N {n} rows {rows}", activation=act,
                        fp8_vs_exact=rel(fast, exact), exact_vs_unquantized=rel(exact, ref),
                        fp8_vs_unquantized=rel(fast, ref)))
    return out


def moe_rows(tokens, hidden, inter, experts, top_k, backend, seed):
    """The MoE layer measurements (both activation kinds): a list of result dicts."""
    rng = np.random.default_rng(seed)
    router = rng.standard_normal((experts, hidden)) * hidden**-0.5
    w13 = rng.standard_normal((experts, 2 * inter, hidden)) * hidden**-0.5
    w2 = rng.standard_normal((experts, hidden, inter)) * inter**-0.5
    sw13 = rng.standard_normal((2 * inter, hidden)) * hidden**-0.5
    sw2 = rng.standard_normal((hidden, inter)) * inter**-0.5
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    w = jn.quantize_moe(router, w13, w2, shared_w13=sw13, shared_w2=sw2)
    out = []
    for act in ("w4a16", "w4a4"):
        cfg = jn.MoEConfig.deepseek_v4_pro(num_experts=experts, top_k=top_k, hidden_size=hidden,
                                           intermediate_size=inter, activation=act)
        ids, rw = jn.route(jnp.asarray(x), w, cfg)
        ids, rw = np.asarray(ids), np.asarray(rw, np.float64)
        x64 = x.astype(np.float64)

        def mlp(a, g13, g2):
            h = a @ g13.T
            gate, up = np.split(h, 2, axis=-1)
            lim = cfg.swiglu_limit
            gate, up = np.minimum(gate, lim), np.clip(up, -lim, lim)
            return (gate / (1 + np.exp(-gate)) * up) @ g2.T

        ref = mlp(x64, sw13, sw2)
        for e in range(experts):
            tok, slot = np.nonzero(ids == e)
            if len(tok):
                ref[tok] += rw[tok, slot, None] * mlp(x64[tok], w13[e], w2[e])
        res = {}
        for prec in ("exact", "fp8"):
            c = jn.MoEConfig(**{**cfg.__dict__, "precision": prec})
            res[prec] = np.asarray(jax.jit(lambda x, w: jn.moe(x, w, c, backend=backend))(
                jnp.asarray(x), w))
        out.append(dict(kind="moe", case=f"MoE T {tokens} H {hidden} I {inter} E {experts} "
                        f"top-{top_k}", activation=act, fp8_vs_exact=rel(res["fp8"], res["exact"]),
                        exact_vs_unquantized=rel(res["exact"], ref),
                        fp8_vs_unquantized=rel(res["fp8"], ref)))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rows", type=int, default=256, help="GEMM rows per bench shape")
    p.add_argument("--groups", type=int, default=4, help="GEMM groups (experts)")
    p.add_argument("--layers", default="L1,L2", help=f"comma list of {tuple(LAYERS)}")
    p.add_argument("--moe", default="256,2048,1024,16,4",
                   help="MoE layer tokens,hidden,intermediate,experts,top_k ('' to skip)")
    p.add_argument("--backend", default="auto", choices=("auto", "ffi", "reference"),
                   help="grouped_gemm backend")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    layers = [s for s in args.layers.split(",") if s]
    bad = [s for s in layers if s not in LAYERS]
    if bad:
        p.error(f"--layers: unknown {bad}; expected a comma list of {tuple(LAYERS)}")
    results = []
    t0 = time.perf_counter()
    for i, layer in enumerate(layers):
        results += gemm_rows(layer, args.rows, args.groups, args.backend, args.seed + i)
    if args.moe:
        t, h, inter, e, k = (int(v) for v in args.moe.split(","))
        results += moe_rows(t, h, inter, e, k, args.backend, args.seed)
    print(f"{'case':38s} {'act':6s} {'fp8 vs exact':>13s} {'exact vs unq':>13s} "
          f"{'fp8 vs unq':>11s} {'ratio':>6s}")
    for r in results:
        r["ratio"] = r["fp8_vs_unquantized"] / r["exact_vs_unquantized"]
        print(f"{r['case']:38s} {r['activation']:6s} {r['fp8_vs_exact']:13.4f} "
              f"{r['exact_vs_unquantized']:13.4f} {r['fp8_vs_unquantized']:11.4f} {r['ratio']:6.3f}")
    dev = jax.devices()[0]
    meta = {"what": "relative L2 differences (||a - b|| / ||b||), Gaussian data",
            "backend": args.backend, "device": f"{dev.device_kind} ({dev.platform})",
            "jax": jax.__version__, "seed": args.seed, "rows": args.rows, "groups": args.groups,
            "seconds": round(time.perf_counter() - t0, 1), "results": results}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(meta, fh, indent=1)
            fh.write("\n")
    return results


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
