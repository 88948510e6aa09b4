"""The FP8 mode's configurations on the bench's cases, in one run: every compiled configuration of
the families that read fp8-prepared weights (wgmma_fp8_prepared, cutlass_fp8), W4A16 and W4A4, the
in-kernel mode on checkpoint weights (wgmma_fp8, the heuristic's tile), beside PyTorch's grouped e4m3
GEMM and cuBLAS's uniform batched e4m3 GEMM (bf16 output) on the same machine. Each cutlass_fp8 output
is checked against wgmma_fp8_prepared's (the same operands: within the FP8 mode's chunk bound).

    python -P tools/lab/cutlass_fp8_sweep.py [--cases L1-6144,L2-24576] [--out DIR]

Writes DIR/cutlass_fp8_sweep.json (rows: case, impl, ms) and prints a table (median ms, the bench's
timing: 1 s... of back-to-back calls per sample).
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import jax_nvfp4 as jn
from jax_nvfp4.bench.gemm import LAYERS, ROWS, case_seed, make_case, uniform_rows
from jax_nvfp4.bench.common import rowwise_e4m3, run_info, time_ms
from jax_nvfp4.bench.torch_peers import torch_peers

PREPARED = [c for c in jn.kernel_config.kernel_configs()
            if c.family in ("wgmma_fp8_prepared", "cutlass_fp8")]


def name(c):
    return f"{c.family}_{c.token_tile}_s{c.stages}_c{c.cluster}_r{c.raster}"


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="")
    p.add_argument("--out", default="sweep-out")
    p.add_argument("--target-s", type=float, default=0.25)
    p.add_argument("--configs", default="", help="comma list of config names (default all), e.g. "
                   "cutlass_fp8_128_s6_c1_r1,wgmma_fp8_prepared_128_s6_c1_r0")
    args = p.parse_args(argv)
    configs = [c for c in PREPARED if not args.configs or name(c) in args.configs.split(",")]
    cases = [(lay, r) for lay in LAYERS for r in ROWS]
    if args.cases:
        want = set(args.cases.split(","))
        cases = [c for c in cases if f"{c[0]}-{c[1]}" in want]
    os.makedirs(args.out, exist_ok=True)
    timing = dict(target_s=args.target_s)
    rows_out = []
    meta = dict(run_info(jax.devices()[0]), results=rows_out)
    for layer, rows in cases:
        k, n = LAYERS[layer]
        case = f"{layer} rows {rows}"
        x, rhs, sizes = make_case(rows, k, n, seed=case_seed(layer, rows))
        xq = jax.jit(jn.quantize)(x)
        w8 = jax.jit(lambda w: jn.prepare_weights(w, "fp8"))(rhs)
        res = {}
        outs = {}
        for c in configs:
            f = jax.jit(lambda a, w, s, c=c: jn.grouped_gemm(a, w, s, backend="ffi", precision="fp8", kernel=c))
            for act, a in (("w4a16", x), ("w4a4", xq)):
                res[f"{act}_{name(c)}"] = time_ms(f, a, w8, sizes, **timing)
            outs[name(c)] = np.asarray(f(x, w8, sizes), np.float32)
        f = jax.jit(lambda a, w, s: jn.grouped_gemm(a, w, s, backend="ffi", precision="fp8"))
        res["w4a16_wgmma_fp8"] = time_ms(f, x, rhs, sizes, **timing)
        res["w4a16_heuristic_prepared"] = time_ms(f, x, w8, sizes, **timing)
        g = rhs.data.shape[0]
        a8 = jax.jit(lambda v: uniform_rows(rowwise_e4m3(v)[0], g))(x)
        wl = jax.jit(lambda w: w.logical_codes())(w8)
        dims = (((2,), (2,)), ((0,), (0,)))
        uni = jax.jit(lambda a, w: jax.lax.dot_general(a, w, dims, preferred_element_type=jnp.bfloat16))
        res["cublas_fp8_uniform_bf16out"] = time_ms(uni, a8, wl, **timing)
        for impl, (ms, _, _) in torch_peers(x, w8, None, sizes, ["torch_fp8_grouped"], **timing).items():
            res[impl] = ms
        ref = outs[name(configs[0])]
        scale = float(np.max(np.abs(ref))) + 1e-30
        for nm, o in outs.items():
            d = float(np.max(np.abs(o - ref)) / scale)
            print(f"  {case} {nm}: max |diff| / max |ref| against {name(configs[0])} = {d:.2e}", flush=True)
            rows_out.append({"case": case, "impl": f"diff_{nm}", "value": d})
        for impl, ms in res.items():
            rows_out.append({"case": case, "impl": impl, "ms": round(ms, 4)})
            print(f"  {case:16s} {impl:44s} {ms:8.3f} ms", flush=True)
        with open(os.path.join(args.out, "cutlass_fp8_sweep.json"), "w") as fh:
            json.dump(meta, fh, indent=1)
        del x, xq, rhs, w8, outs
    print("\nsummary (ms)")
    impls = sorted({r["impl"] for r in rows_out if "ms" in r})
    for impl in impls:
        line = " ".join(f"{next((r['ms'] for r in rows_out if r['impl'] == impl and r['case'] == f'{la} rows {ro}'), float('nan')):7.3f}"
                        for la, ro in cases)
        print(f"{impl:44s} {line}")
    print("cases: " + " ".join(f"{la}-{ro}" for la, ro in cases))


if __name__ == "__main__":
    main()
