"""Where the FP8 mode's API time goes: ``grouped_gemm(precision="fp8")`` on a bf16 lhs against the
same call on rows quantized beforehand (``fp8.quantize_rows(x, k_order="kernel")``: the GEMM
custom call alone) and the quantizer's custom call alone, the same two calls on weights prepared
as e4m3 (``prepare_weights(w, "fp8")``), beside the exact mode on sm90 weights,
on the bench's shapes (``jax_nvfp4.bench``: 48 experts, log-normal group sizes), timed as the
bench times (back-to-back calls, median of 5), the four in turn for ``--rounds`` rounds (the
median of the rounds reported, each round kept in the JSON): at decode sizes one bench call's
fp8 and exact rows moved by up to 0.04 ms between calls.

    python tools/lab/fp8_api_split.py [--cases L1-192,L1-1536] [--rounds 3] [--out split.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import jax

from jax_nvfp4 import fp8, gemm, prepare
from jax_nvfp4.bench import gemm as bench
from jax_nvfp4.bench.common import time_ms


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="L1-192,L1-1536,L1-6144,L1-24576,L2-192,L2-6144")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    shapes = {"L1": (7168, 6144), "L2": (3072, 7168)}
    ffi8 = jax.jit(lambda x, w, s: gemm.grouped_gemm(x, w, s, backend="ffi", precision="fp8"))
    ffi = jax.jit(lambda x, w, s: gemm.grouped_gemm(x, w, s, backend="ffi"))
    quant = jax.jit(lambda x: fp8.quantize_rows(x, k_order="kernel", backend="ffi"))
    rows_out = []
    for case in a.cases.split(","):
        layer, rows = case.split("-")
        k, n = shapes[layer]
        x, rhs, sizes = bench.make_case(int(rows), k, n, seed=bench.case_seed(layer, int(rows)))
        q = quant(x)
        rhs_sm90 = jax.jit(prepare.prepare_weights)(rhs)
        rhs_fp8 = jax.jit(lambda w: prepare.prepare_weights(w, "fp8"))(rhs)
        runs = {"exact_sm90_ms": (ffi, (x, rhs_sm90, sizes)), "fp8_api_ms": (ffi8, (x, rhs, sizes)),
                "fp8_prequantized_ms": (ffi8, (q, rhs, sizes)), "quantizer_ms": (quant, (x,)),
                "prepared_api_ms": (ffi8, (x, rhs_fp8, sizes)),
                "prepared_prequantized_ms": (ffi8, (q, rhs_fp8, sizes))}
        samples = {name: [] for name in runs}
        for _ in range(a.rounds):
            for name, (f, args) in runs.items():
                samples[name].append(time_ms(f, *args))
        r = {"case": case, **{name: statistics.median(v) for name, v in samples.items()},
             "rounds": samples}
        rows_out.append(r)
        print(f"{case:9s} fp8 API {r['fp8_api_ms']:.3f}  prequantized {r['fp8_prequantized_ms']:.3f}  "
              f"quantizer {r['quantizer_ms']:.3f}  exact sm90 {r['exact_sm90_ms']:.3f}  "
              f"prepared API {r['prepared_api_ms']:.3f}  prepared prequantized "
              f"{r['prepared_prequantized_ms']:.3f} ms", flush=True)
        del rhs, rhs_sm90, rhs_fp8
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                       "results": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
