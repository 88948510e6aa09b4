"""Where the FP8 mode's API time goes at prefill: the activation quantizer's custom call alone (bf16
and NVFP4 activations), the grouped GEMM on already-quantized rows (Fp8Rows in the kernel k order:
no quantizer), the whole API call, PyTorch's grouped e4m3 GEMM, and a device copy of the bf16
activations (the HBM floor of one read + one write), all in one run.

    python -P tools/lab/fp8_prep_breakdown.py [--cases L1-24576,L2-24576] [--out DIR]

Writes DIR/fp8_prep_breakdown.json and prints the table (median ms, the bench's timing).
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

import jax_nvfp4 as jn
from jax_nvfp4.bench.common import run_info, time_ms
from jax_nvfp4.bench.gemm import LAYERS, case_seed, make_case
from jax_nvfp4.bench.torch_peers import torch_peers
from jax_nvfp4.ops import fp8


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="L1-6144,L1-24576,L2-6144,L2-24576")
    p.add_argument("--out", default="breakdown-out")
    p.add_argument("--configs", default="", help="comma list of cutlass_fp8 token_tile/cluster/raster "
                   "names as in tools/lab/cutlass_fp8_sweep.py (default: the heuristic's)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows_out = []
    meta = dict(run_info(jax.devices()[0]), results=rows_out)
    configs = {f"{c.family}_{c.token_tile}_s{c.stages}_c{c.cluster}_r{c.raster}": c
               for c in jn.kernel_config.kernel_configs() if c.family == "cutlass_fp8"}
    chosen = [configs[n] for n in args.configs.split(",") if n] or [None]
    for spec in args.cases.split(","):
        layer, rows = spec.split("-")
        rows = int(rows)
        k, n = LAYERS[layer]
        case = f"{layer} rows {rows}"
        x, rhs, sizes = make_case(rows, k, n, seed=case_seed(layer, rows))
        xq = jax.jit(jn.quantize)(x)
        w8 = jax.jit(lambda w: jn.prepare_weights(w, "fp8"))(rhs)
        res = {}
        res["copy_bf16_x"] = time_ms(jax.jit(lambda a: a * jnp.bfloat16(1.5)), x)
        for act, a in (("w4a16", x), ("w4a4", xq)):
            res[f"quantize_{act}"] = time_ms(jax.jit(lambda a: fp8.kernel_lhs(a, use_ffi=True, scales_transposed=True)), a)
            rows8 = jax.jit(lambda a: jn.fp8.quantize_rows(a, "kernel", backend="ffi"))(a)
            for c in chosen:
                tag = "" if c is None else f"_{c.token_tile}_c{c.cluster}_r{c.raster}"
                f = jax.jit(lambda r, w, s, c=c: jn.grouped_gemm(r, w, s, backend="ffi", precision="fp8", kernel=c))
                res[f"gemm_only_{act}{tag}"] = time_ms(f, rows8, w8, sizes)
                g = jax.jit(lambda a, w, s, c=c: jn.grouped_gemm(a, w, s, backend="ffi", precision="fp8", kernel=c))
                res[f"api_{act}{tag}"] = time_ms(g, a, w8, sizes)
        for impl, (ms, _, _) in torch_peers(x, w8, None, sizes, ["torch_fp8_grouped"]).items():
            res[impl] = ms
        for impl, ms in res.items():
            rows_out.append({"case": case, "impl": impl, "ms": round(ms, 4)})
            print(f"  {case:16s} {impl:40s} {ms:8.3f} ms", flush=True)
        with open(os.path.join(args.out, "fp8_prep_breakdown.json"), "w") as fh:
            json.dump(meta, fh, indent=1)
        del x, xq, rhs, w8


if __name__ == "__main__":
    main()
