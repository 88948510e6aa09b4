"""Where the prepared-fp8 API time goes beyond the kernel: ``grouped_gemm(precision="fp8")`` on
prepared e4m3 weights with a bf16 lhs, the same call on rows quantized beforehand
(``fp8.quantize_rows(x, k_order="kernel")``), and the quantizer alone, on the bench's cases (same
seeds, same timing as the bench); the compiled HLO of the bf16-lhs call is written beside it.

    python tools/lab/fp8_prepared/api_profile.py --out DIR [--cases L1-6144,L1-24576]
"""

from __future__ import annotations

import argparse
import functools
import os

import jax

import jax_nvfp4 as jn
from jax_nvfp4 import bench, fp8
from jax_nvfp4.bench_common import time_ms


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="L1-6144,L1-24576,L2-6144")
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    shapes = {"L1": (7168, 6144), "L2": (3072, 7168)}
    ffi8 = jax.jit(lambda x, w, s: jn.grouped_gemm(x, w, s, backend="ffi", precision="fp8"))
    quant = jax.jit(lambda x: fp8.quantize_rows(x, k_order="kernel", backend="ffi"))
    for case in a.cases.split(","):
        layer, rows = case.split("-")
        k, n = shapes[layer]
        x, rhs, sizes = bench.make_case(int(rows), k, n, seed=bench.case_seed(layer, int(rows)))
        w8 = jax.jit(functools.partial(jn.prepare_weights, layout="fp8"))(rhs)
        del rhs
        q = quant(x)
        with open(os.path.join(a.out, f"hlo_{case}.txt"), "w") as f:
            f.write(ffi8.lower(x, w8, sizes).compile().as_text())
        t = {"api": time_ms(ffi8, x, w8, sizes), "prequantized": time_ms(ffi8, q, w8, sizes),
             "quantizer": time_ms(quant, x)}
        print(f"{case:9s} " + "  ".join(f"{k} {v:.3f}" for k, v in t.items()) + " ms", flush=True)


if __name__ == "__main__":
    main()
