"""Lab: the 256-token wgmma tile with each group's short remainder on the 128-token kernel.

The 256-token tile always runs N = 256 wgmmas, so a group's last, partial tile costs a full
tile's tensor work. This times, on the same rows and group sizes (it simulated the split before
the launcher made it; docs/archive/perf-log-layer.md has both runs):

- ``t256``: the 256-token configuration alone (cluster 2; since the split went into the kernel,
  it runs its groups' short last tiles on the 128-token kernel itself);
- ``t128``: the 128-token configuration alone (its last tile runs N = 32/64/128);
- ``split``: per group, the rows of its full 256-row tiles (and a remainder over 128 rows, kept as
  one more 256 tile) on the 256-token configuration, then the remainder of at most 128 rows on the
  128-token one: two grouped GEMMs in one jitted function, each with its own setup and tail
  kernels (a kernel-side split shares them).

Also checks that the split's rows equal the unsplit call's (max abs difference printed).

Run on the GPU from the repo root (the installed jax_nvfp4):
``python3 tools/lab/split_tile_bench.py [--json PATH]``.
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

C256 = KernelConfig("wgmma", 256, 5, 2)
C128 = KernelConfig("wgmma", 128, 8, 1)


def split_sizes(sizes: np.ndarray, rem_max: int = 128):
    """(a, b): rows per group for the 256-token call and for the 128-token call."""
    full = (sizes // 256) * 256
    rem = sizes - full
    keep = rem > rem_max
    a = np.where(keep, sizes, full)
    return a.astype(np.int32), (sizes - a).astype(np.int32)


def split_rows(sizes, a):
    """Row indices (into the sorted rows) of the two calls' inputs."""
    start = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    ia = np.concatenate([np.arange(s, s + n) for s, n in zip(start, a)] + [np.zeros(0, np.int64)])
    ib = np.concatenate([np.arange(s + n, s + g) for s, n, g in zip(start, a, sizes)]
                        + [np.zeros(0, np.int64)])
    return ia.astype(np.int32), ib.astype(np.int32)


def case(name, x, w, sizes_np, log, out_dtype=jnp.bfloat16):
    sizes = jnp.asarray(sizes_np)
    a, b = split_sizes(sizes_np)
    ia, ib = split_rows(sizes_np, a)
    xa, xb = x[jnp.asarray(ia)], x[jnp.asarray(ib)]

    def one(cfg):
        return jax.jit(lambda x, w, s: gemm.grouped_gemm(x, w, s, backend="ffi", kernel=cfg,
                                                         out_dtype=out_dtype))

    @jax.jit
    def split(xa, xb, w, sa, sb):
        ya = gemm.grouped_gemm(xa, w, sa, backend="ffi", kernel=C256, out_dtype=out_dtype)
        yb = gemm.grouped_gemm(xb, w, sb, backend="ffi", kernel=C128, out_dtype=out_dtype)
        return ya, yb

    f256, f128 = one(C256), one(C128)
    sa, sb = jnp.asarray(a), jnp.asarray(b)
    y128 = f128(x, w, sizes)
    ya, yb = split(xa, xb, w, sa, sb)
    rows = int(sizes_np.sum())
    ys = jnp.zeros_like(y128[:rows]).at[jnp.asarray(ia)].set(ya).at[jnp.asarray(ib)].set(yb)
    diff = float(jnp.max(jnp.abs(ys.astype(jnp.float32) - y128[:rows].astype(jnp.float32))))
    t256 = time_ms(f256, x, w, sizes)
    t128 = time_ms(f128, x, w, sizes)
    tsplit = time_ms(split, xa, xb, w, sa, sb)
    r = dict(case=name, rows=rows, t256=t256, t128=t128, split=tsplit, rows_a=int(a.sum()),
             rows_b=int(b.sum()), max_group=int(sizes_np.max()), max_abs_diff=diff)
    log(f"{name:24s} rows {rows:6d} (a {r['rows_a']:6d} b {r['rows_b']:5d}): 256 {t256:.3f}  128 "
        f"{t128:.3f}  split {tsplit:.3f} ms  ({tsplit / min(t256, t128):.3f} of the best)  "
        f"diff {diff:g}")
    return r


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--rows", default="6144,12288,24576")
    args = p.parse_args(argv)
    results = []
    key = jax.random.key(0)
    for label, n, k in (("L1", 6144, 7168), ("L2", 7168, 3072)):
        w = jax.random.normal(key, (EXPERTS, n, k), jnp.bfloat16)
        rhs = prepare.prepare_weights(jax.jit(jax.vmap(quantization.quantize))(w))
        del w
        for rows in (int(r) for r in args.rows.split(",")):
            x = jax.random.normal(jax.random.key(rows), (rows, k), jnp.bfloat16)
            for seed in (0, 1):
                sizes = skewed_group_sizes(rows, EXPERTS, seed)
                results.append(case(f"{label} lognormal s{seed}", x, rhs, sizes, print))
            # the layer's routing at rows / 6 tokens: near-even groups (binomial around the mean)
            rng = np.random.default_rng(rows)
            sizes = rng.multinomial(rows, np.ones(EXPERTS) / EXPERTS).astype(np.int32)
            results.append(case(f"{label} even", x, rhs, sizes, print))
    if args.json:
        write_json(args.json, {**run_info(), "results": results})


if __name__ == "__main__":
    main()
