"""Benchmark of the grouped NVFP4 GEMM on DeepSeek-V4-Pro per-GPU shapes against JAX peers.

    python -m jax_nvfp4.bench [--out docs] [--cases L1-192,L2-6144] [--impls w4a16,ragged_dot]
    python -m jax_nvfp4.bench --small      # CPU-sized case and timing: a smoke test only

Per case (48 experts, skewed random group sizes) it times: jax_nvfp4 W4A16 and W4A4 (the custom
call) with checkpoint-layout weights and with weights prepared once, outside the timed call, in the
sm90 layout (``w4a16_sm90``, ``w4a4_sm90``; :func:`jax_nvfp4.prepare_weights`),
``jax.lax.ragged_dot`` on bf16 weights, XLA dequantize + ragged_dot, and the Pallas Mosaic-GPU
ragged_dot on bf16 weights (best of a few tile configs), and the fp8 compute mode
(``w4a16_fp8``, ``w4a4_fp8``: ``precision="fp8"``, checkpoint-layout weights). It prints median ms,
TFLOP/s, weight GB/s and % of the floor (max of weight bytes / 4.05 TB/s and FLOPs / 711
TFLOP/s, the HBM bandwidth and dense bf16 rate measured on an H200), writes JSON and a PNG plot.
"""

from __future__ import annotations

import argparse
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

import jax_nvfp4 as jn
from jax_nvfp4.bench_common import run_info, time_ms, write_json

EXPERTS = 48
LAYERS = {"L1": (7168, 6144), "L2": (3072, 7168)}          # (K, N) per expert
ROWS = (192, 1536, 6144, 24576)
HBM_BYTES_PER_S = 4.05e12
BF16_FLOPS = 711e12
IMPLS = ("w4a16", "w4a16_sm90", "w4a4", "w4a4_sm90", "w4a16_fp8", "w4a4_fp8", "ragged_dot",
         "dequant_ragged_dot", "pallas_mgpu")
NVFP4_IMPLS = ("w4a16", "w4a16_sm90", "w4a4", "w4a4_sm90", "w4a16_fp8", "w4a4_fp8",
               "dequant_ragged_dot")                                          # 4.5-bit weights
FP8_IMPLS = ("w4a16_fp8", "w4a4_fp8")
"""The fp8 compute mode (``precision="fp8"``): e4m3 rounding of both operands, not the exact GEMM."""


def skewed_group_sizes(rows, groups, seed):
    """Random group sizes summing to ``rows``, skewed (log-normal weights), some possibly 0."""
    rng = np.random.default_rng(seed)
    p = np.exp(rng.normal(0.0, 1.0, groups))
    return rng.multinomial(rows, p / p.sum()).astype(np.int32)


def floor_ms(rows, k, n, groups=EXPERTS):
    weight_bytes = groups * n * k * 0.5625
    flops = 2.0 * rows * k * n
    return max(weight_bytes / HBM_BYTES_PER_S, flops / BF16_FLOPS) * 1e3


SMALL = dict(layers={"S1": (128, 256)}, rows=(40,), experts=4, target_s=0.001, repeats=1)
"""``--small``: CPU-sized cases and timing (a smoke test of the benchmark, not a measurement)."""


def make_case(rows, k, n, seed, experts=EXPERTS):
    """bf16 ``[rows, k]`` tokens, NVFP4 weights ``[experts, n, k]``, skewed int32 group sizes."""
    key = jax.random.key(seed)
    k1, k2 = jax.random.split(key)
    w = jax.random.normal(k1, (experts, n, k), jnp.bfloat16)
    rhs = jax.jit(jax.vmap(jn.quantize))(w)
    del w
    x = jax.random.normal(k2, (rows, k), jnp.bfloat16)
    sizes = jnp.asarray(skewed_group_sizes(rows, experts, seed))
    return x, rhs, sizes


def impl_fns(x, rhs, sizes):
    """name -> (fn, args) for each implementation on one case."""
    fns = {}
    ffi = jax.jit(lambda a, w, s: jn.grouped_gemm(a, w, s, backend="ffi"))
    xq = jax.jit(jn.quantize)(x)
    rhs_sm90 = jax.jit(jn.prepare_weights)(rhs)       # load-time cost: not timed
    fns["w4a16"] = (ffi, (x, rhs, sizes))
    fns["w4a16_sm90"] = (ffi, (x, rhs_sm90, sizes))
    fns["w4a4"] = (ffi, (xq, rhs, sizes))
    fns["w4a4_sm90"] = (ffi, (xq, rhs_sm90, sizes))
    ffi8 = jax.jit(lambda a, w, s: jn.grouped_gemm(a, w, s, backend="ffi", precision="fp8"))
    fns["w4a16_fp8"] = (ffi8, (x, rhs, sizes))            # the fp8 kernel reads checkpoint weights
    fns["w4a4_fp8"] = (ffi8, (xq, rhs, sizes))

    def dequant_bf16(w):                                  # [G, N, K] -> [G, K, N] bf16
        return jnp.swapaxes(jn.dequantize(w, jnp.bfloat16), 1, 2)

    wb = jax.jit(dequant_bf16)(rhs)
    fns["ragged_dot"] = (jax.jit(lambda a, w, s: jax.lax.ragged_dot(
        a, w, s, preferred_element_type=jnp.float32).astype(jnp.bfloat16)), (x, wb, sizes))
    fns["dequant_ragged_dot"] = (jax.jit(lambda a, w, s: jax.lax.ragged_dot(
        a, dequant_bf16(w), s, preferred_element_type=jnp.float32).astype(jnp.bfloat16)),
        (x, rhs, sizes))
    return fns, wb


def pallas_best(x, wb, sizes, log, **timing):
    """Best median ms of the Pallas Mosaic-GPU ragged_dot over a few tile configs (or None)."""
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    except Exception as e:  # noqa: BLE001
        log(f"  pallas_mgpu unavailable: {e}")
        return None, None
    n = wb.shape[2]
    best, best_cfg = None, None
    for bm, bn, steps, gbn in [(64, 128, 4, 1), (128, 128, 4, 2), (64, 256, 4, 1),
                               (128, 256, 3, 1), (192, 128, 4, 2)]:
        if n % (bn * gbn):
            continue
        f = jax.jit(functools.partial(ragged_dot_mgpu.ragged_dot, block_m=bm, block_n=bn,
                                      block_k=64, max_concurrent_steps=steps, grid_block_n=gbn))
        try:
            ms = time_ms(lambda a, w, s: f(a, w, group_sizes=s), x, wb, sizes, **timing)
        except Exception as e:  # noqa: BLE001
            log(f"  pallas_mgpu {bm}x{bn}x64 steps{steps} gbn{gbn}: {type(e).__name__}")
            continue
        if best is None or ms < best:
            best, best_cfg = ms, f"{bm}x{bn}x64 steps{steps} gbn{gbn}"
    return best, best_cfg


def main(argv=None):
    p = argparse.ArgumentParser(description="grouped NVFP4 GEMM benchmark (DeepSeek-V4 shapes)",
                                epilog="Needs a GPU for meaningful numbers (the custom call's CUDA handler); "
                                       "on CPU it runs the C++ handler, far slower.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="bench-out", help="folder for bench.json and bench.png")
    p.add_argument("--cases", default="", help="comma list like L1-192,L2-6144 (default all)")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma list of {IMPLS}")
    p.add_argument("--check", action="store_true", help="also check jax_nvfp4 vs ragged_dot")
    p.add_argument("--small", action="store_true",
                   help=f"CPU-sized cases and timing, a smoke test: {SMALL}")
    args = p.parse_args(argv)
    small = SMALL if args.small else {}
    layers, all_rows = small.get("layers", LAYERS), small.get("rows", ROWS)
    experts = small.get("experts", EXPERTS)
    timing = {k: small[k] for k in ("target_s", "repeats") if k in small}
    impls = [s for s in args.impls.split(",") if s]
    unknown = [i for i in impls if i not in IMPLS]
    if unknown:
        p.error(f"--impls: unknown {unknown}; expected a comma list of {IMPLS}")
    cases = [(layer, rows) for layer in layers for rows in all_rows]
    if args.cases:
        want = set(args.cases.split(","))
        cases = [c for c in cases if f"{c[0]}-{c[1]}" in want]
    os.makedirs(args.out, exist_ok=True)
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}", flush=True)
    results = []
    for ci, (layer, rows) in enumerate(cases):
        k, n = layers[layer]
        case = f"{layer} rows {rows}"
        x, rhs, sizes = make_case(rows, k, n, seed=ci, experts=experts)
        fns, wb = impl_fns(x, rhs, sizes)
        if args.check:
            got = fns["w4a16"][0](*fns["w4a16"][1]).astype(jnp.float32)
            want = fns["ragged_dot"][0](*fns["ragged_dot"][1]).astype(jnp.float32)
            rel = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
            print(f"  check {case}: rel err w4a16 vs ragged_dot {rel:.2e}", flush=True)
            got_sm90 = fns["w4a16_sm90"][0](*fns["w4a16_sm90"][1]).astype(jnp.float32)
            rel = float(jnp.linalg.norm(got_sm90 - want) / jnp.linalg.norm(want))
            print(f"  check {case}: rel err w4a16_sm90 vs ragged_dot {rel:.2e}", flush=True)
            got_fp8 = fns["w4a16_fp8"][0](*fns["w4a16_fp8"][1]).astype(jnp.float32)
            rel = float(jnp.linalg.norm(got_fp8 - got) / jnp.linalg.norm(got))
            print(f"  check {case}: rel diff w4a16_fp8 vs w4a16 {rel:.2e} (e4m3 rounding)",
                  flush=True)
        for impl in impls:
            extra = None
            if impl == "pallas_mgpu":
                ms, extra = pallas_best(x, wb, sizes, print, **timing)
                if ms is None:
                    continue
            else:
                f, a = fns[impl]
                ms = time_ms(f, *a, **timing)
            flops = 2.0 * rows * k * n
            wbytes = experts * n * k * (0.5625 if impl in NVFP4_IMPLS else 2.0)
            floor = floor_ms(rows, k, n, experts)
            r = {"case": case, "impl": impl, "ms": round(ms, 4),
                 "tflops": round(flops / ms / 1e9, 1), "weight_gbs": round(wbytes / ms / 1e6, 1),
                 "floor_ms": round(floor, 4), "pct_of_floor": round(100 * floor / ms, 1)}
            if extra:
                r["config"] = extra
            results.append(r)
            print(f"  {case:16s} {impl:20s} {ms:9.3f} ms {r['tflops']:7.1f} TFLOP/s "
                  f"{r['weight_gbs']:8.1f} GB/s {r['pct_of_floor']:6.1f}% of floor", flush=True)
        del x, rhs, wb, fns
    meta = dict(run_info(dev), experts=experts, results=results)
    write_json(os.path.join(args.out, "bench.json"), meta)
    _plot(results, os.path.join(args.out, "bench.png"))
    print(f"\n{'case':16s} " + " ".join(f"{i:>18s}" for i in impls))
    for layer, rows in cases:
        case = f"{layer} rows {rows}"
        row = {r["impl"]: r["ms"] for r in results if r["case"] == case}
        print(f"{case:16s} " + " ".join(f"{row.get(i, float('nan')):15.3f} ms" for i in impls))
    return results


def _plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    cases = list(dict.fromkeys(r["case"] for r in results))
    impls = list(dict.fromkeys(r["impl"] for r in results))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / max(1, len(impls))
    for j, impl in enumerate(impls):
        ms = [next((r["ms"] for r in results if r["case"] == c and r["impl"] == impl), np.nan)
              for c in cases]
        ax.bar(np.arange(len(cases)) + j * width, ms, width, label=impl)
    floors = [next(r["floor_ms"] for r in results if r["case"] == c) for c in cases]
    ax.scatter(np.arange(len(cases)) + 0.4 - width / 2, floors, marker="_", s=400, c="k",
               label="floor", zorder=3)
    ax.set_yscale("log")
    ax.set_xticks(np.arange(len(cases)) + 0.4 - width / 2, cases, rotation=20)
    ax.set_ylabel("median ms (log)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
