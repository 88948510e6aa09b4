"""Lab: what the 256-token configuration's split tail tiles cost, and which kernel runs them best.

At the layer's prefill sizes (4096 tokens x top-6 over 48 experts: ~512 rows per group, binomial
spread) about half the groups end with a short remainder (1-60 rows) past their full 256-row tiles;
the launcher runs those on the 128-token wgmma kernel after the 256-token one, each remainder
streaming its expert's whole weight once more. This times, on the layer's group sizes:

- ``full``: the 256-token configuration on all rows (its split tail included);
- ``head``: the same configuration on the rows it keeps (no remainders, so no tail kernel);
- the tail rows alone (group sizes = the remainders) on each configuration that can run them:
  wgmma 128 (what the split runs), wgmma 64 / 32, mma_ws 16, mma 16 / 32.

``full - head`` is what the tail costs in the split; the tail rows alone bound what another
kernel would. Run on the GPU from the repo root (the installed jax_nvfp4):
``python3 tools/lab/tail_kernel_bench.py [--json PATH] [--tokens 4096]``.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jax_nvfp4 import gemm, prepare, quantization
from jax_nvfp4.bench.gemm import EXPERTS
from jax_nvfp4.bench.common import run_info, time_ms, write_json
from jax_nvfp4.kernel_config import KernelConfig

C256 = KernelConfig("wgmma", 256, 5, 2)
TAIL_CONFIGS = (KernelConfig("wgmma", 128, 8, 1), KernelConfig("wgmma", 64, 12, 1),
                KernelConfig("wgmma", 32, 20, 1), KernelConfig("mma_ws", 16, 8, 1),
                KernelConfig("mma", 16, 4, 1), KernelConfig("mma", 32, 5, 1))


def split_sizes(sizes: np.ndarray, rem_max: int = 128):
    """(head, tail) rows per group: the 256-token call's and the remainders of at most rem_max."""
    full = (sizes // 256) * 256
    rem = sizes - full
    head = np.where(rem > rem_max, sizes, full)
    return head.astype(np.int32), (sizes - head).astype(np.int32)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--top-k", type=int, default=6)
    args = p.parse_args(argv)
    rows = args.tokens * args.top_k
    rng = np.random.default_rng(args.tokens)
    sizes = rng.multinomial(rows, np.ones(EXPERTS) / EXPERTS).astype(np.int32)
    head, tail = split_sizes(sizes)
    print(f"rows {rows}: groups {sizes.min()}..{sizes.max()}, tails in {int((tail > 0).sum())} "
          f"groups, {int(tail.sum())} rows (max {int(tail.max())})", flush=True)
    results = []
    key = jax.random.key(0)
    for label, n, k in (("L1", 6144, 7168), ("L2", 7168, 3072)):
        w = jax.random.normal(key, (EXPERTS, n, k), jnp.bfloat16)
        rhs = prepare.prepare_weights(jax.jit(jax.vmap(quantization.quantize))(w))
        del w
        x = jax.random.normal(jax.random.key(rows), (rows, k), jnp.bfloat16)

        def fn(cfg):
            return jax.jit(lambda x, w, s: gemm.grouped_gemm(x, w, s, backend="ffi", kernel=cfg,
                                                             out_dtype=jnp.bfloat16))

        f256 = fn(C256)
        r = dict(case=label, rows=rows, tail_rows=int(tail.sum()), tail_groups=int((tail > 0).sum()))
        r["full"] = time_ms(f256, x, rhs, jnp.asarray(sizes))
        r["head"] = time_ms(f256, x[:int(head.sum())], rhs, jnp.asarray(head))
        xt = x[:max(int(tail.sum()), 1)]
        ref = None
        for cfg in TAIL_CONFIGS:
            name = f"tail {cfg.family} {cfg.token_tile}"
            try:
                f = fn(cfg)
                y = f(xt, rhs, jnp.asarray(tail))
            except Exception as e:  # a configuration this build or shape cannot run
                print(f"{label} {name}: {type(e).__name__}: {str(e)[:120]}")
                continue
            y = np.asarray(y.astype(jnp.float32))
            ref = y if ref is None else ref
            r[name] = time_ms(f, xt, rhs, jnp.asarray(tail))
            r[name + " max_abs_diff"] = float(np.max(np.abs(y - ref)))
        print(label, {a: (round(b, 4) if isinstance(b, float) else b) for a, b in r.items()},
              flush=True)
        results.append(r)
    if args.json:
        write_json(args.json, {**run_info(), "results": results})


if __name__ == "__main__":
    main()
