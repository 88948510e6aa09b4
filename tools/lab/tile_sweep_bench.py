"""Lab: the wgmma token-tile configurations over rows per group (the heuristic's thresholds).

For L1 (K 7168, N 6144) and L2 (K 3072, N 7168) sm90 weights, 48 groups, rows = 48 x avg with
log-normal (the bench's) and even (multinomial) group sizes: the 64-, 128- and 256-token
configurations timed on the same rows. Run on the GPU from the repo root:
``python3 tools/lab/tile_sweep_bench.py [--json PATH]``.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jax_nvfp4 import gemm, prepare, quantization
from jax_nvfp4.bench.gemm import EXPERTS, skewed_group_sizes
from jax_nvfp4.bench.common import run_info, time_ms, write_json
from jax_nvfp4.kernel_config import KernelConfig

CONFIGS = {64: KernelConfig("wgmma", 64, 12, 1), 128: KernelConfig("wgmma", 128, 8, 1),
           256: KernelConfig("wgmma", 256, 5, 2)}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--avg", default="32,64,96,128,192,256")
    p.add_argument("--tiles", default="64,128,256", help="token tiles to time (of 64,128,256)")
    p.add_argument("--target-s", type=float, default=0.1, help="seconds per timing sample")
    p.add_argument("--repeats", type=int, default=3, help="timing samples (median taken)")
    args = p.parse_args(argv)
    tiles = {int(t) for t in args.tiles.split(",")}
    fns = {t: jax.jit(lambda x, w, s, c=c: gemm.grouped_gemm(x, w, s, backend="ffi", kernel=c))
           for t, c in CONFIGS.items() if t in tiles}
    results = []
    for label, n, k in (("L1", 6144, 7168), ("L2", 7168, 3072)):
        w = jax.random.normal(jax.random.key(0), (EXPERTS, n, k), jnp.bfloat16)
        rhs = prepare.prepare_weights(jax.jit(jax.vmap(quantization.quantize))(w))
        del w
        for avg in (int(a) for a in args.avg.split(",")):
            rows = avg * EXPERTS
            x = jax.random.normal(jax.random.key(rows), (rows, k), jnp.bfloat16)
            even = np.random.default_rng(rows).multinomial(rows, np.ones(EXPERTS) / EXPERTS)
            for sizes_name, sizes in (("lognormal", skewed_group_sizes(rows, EXPERTS, 0)),
                                      ("even", even.astype(np.int32))):
                s = jnp.asarray(sizes)
                ms = {t: time_ms(f, x, rhs, s, target_s=args.target_s, repeats=args.repeats) for t, f in fns.items()
                      if not (t == 64 and avg > 128)}
                best = min(ms, key=ms.get)
                results.append(dict(case=label, avg=avg, rows=rows, sizes=sizes_name,
                                    ms={str(t): v for t, v in ms.items()}, best=best))
                print(f"{label} avg {avg:4d} {sizes_name:9s} " + "  ".join(
                    f"{t}: {v:.3f}" for t, v in ms.items()) + f"  best {best}", flush=True)
    if args.json:
        write_json(args.json, {**run_info(), "results": results})


if __name__ == "__main__":
    main()
