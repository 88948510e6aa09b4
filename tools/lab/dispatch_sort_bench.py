"""The layer's dispatch sort on the GPU: the stable order of the routed rows by expert, its inverse
permutation and the group sizes, three ways (all give the same three arrays; checked here):

- argsort: ``jnp.argsort(key, stable=True)`` (a (key, index) pair sort), ``bincount``, the inverse
  by a scatter (what jax_nvfp4.moe ran first);
- packed: one int32 sort of ``key * R + index`` (a single-operand sort: XLA:GPU may run it as a CUB
  radix sort), the index and key unpacked, sizes from the sorted keys, the inverse by a scatter;
- counting: a counting sort (one-hot prefix sums over the experts), no sort at all;
- rank: every pair of rows compared (a row's position: the rows with a smaller key and those
  before it with its key), two R x R reductions;
- library: what ``jax_nvfp4.moe.sort_rows`` picks at that size.

Then the router's top-k at the same token counts: ``lax.top_k`` against the pairwise ranking of
``jax_nvfp4.routing.top_k_ids`` (the same indices; checked here).

    python tools/lab/dispatch_sort_bench.py [--cpu-smoke]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jax_nvfp4.bench.common import time_ms
from jax_nvfp4.moe import rank_sort_rows, sort_rows
from jax_nvfp4.routing import top_k_ids


def by_argsort(key, groups):
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=groups)
    inv = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return order, inv, sizes


def by_packed_sort(key, groups):
    r = key.shape[0]
    packed = jnp.sort(key * r + jnp.arange(r, dtype=key.dtype))
    order = packed % r
    sizes = jnp.searchsorted(packed // r, jnp.arange(groups + 1, dtype=key.dtype), side="left")
    sizes = jnp.diff(sizes)
    inv = jnp.zeros_like(order).at[order].set(jnp.arange(r, dtype=order.dtype))
    return order, inv, sizes


def by_counting(key, groups):
    r = key.shape[0]
    onehot = (key[:, None] == jnp.arange(groups, dtype=key.dtype)[None, :]).astype(jnp.int32)
    sizes = jnp.sum(onehot, axis=0)
    starts = jnp.cumsum(sizes) - sizes
    rank = jnp.sum(jnp.cumsum(onehot, axis=0) * onehot, axis=1) - 1
    inv = starts[key] + rank
    order = jnp.zeros_like(inv).at[inv].set(jnp.arange(r, dtype=inv.dtype))
    return order, inv, sizes


def lax_top_k(choice, k):
    return jax.lax.top_k(choice, k)[1].astype(jnp.int32)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true")
    a = ap.parse_args(argv)
    cases = [(16, 6, 8)] if a.cpu_smoke else [(32, 6, 48), (256, 6, 48), (1024, 6, 48), (4096, 6, 48),
                                               (8192, 6, 384)]
    timing = dict(target_s=0.02, repeats=3) if a.cpu_smoke else dict(target_s=0.2, repeats=5)
    rng = np.random.default_rng(0)
    for t, k, e in cases:
        ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
        key = jnp.asarray(np.where(ids < e // 8 * 7, ids, e).reshape(-1))   # some rows non-local
        groups = e + 1
        want = [np.asarray(v) for v in jax.jit(by_argsort, static_argnums=1)(key, groups)]
        row = []
        methods = [("argsort", by_argsort), ("packed", by_packed_sort), ("counting", by_counting),
                   ("library", sort_rows)]
        if t * k <= 8192:
            methods.append(("rank", rank_sort_rows))
        for name, f in methods:
            fj = jax.jit(f, static_argnums=1)
            got = [np.asarray(v) for v in fj(key, groups)]
            same = all(np.array_equal(g, w) for g, w in zip(got, want))
            row.append(f"{name} {time_ms(fj, key, groups, **timing):.4f} ms{'' if same else ' DIFFERS'}")
        print(f"T {t} k {k} E {e} (R {t * k}): " + ", ".join(row), flush=True)
    for t, k, e in cases:
        choice = jnp.asarray(rng.standard_normal((t, e)).astype(np.float32))
        choice = choice.at[:, 1].set(choice[:, 2])                 # ties go to the lower index
        want = np.asarray(jax.jit(lax_top_k, static_argnums=1)(choice, k))
        row = []
        for name, f in (("lax.top_k", lax_top_k), ("top_k_ids", top_k_ids)):
            fj = jax.jit(f, static_argnums=1)
            same = np.array_equal(np.asarray(fj(choice, k)), want)
            row.append(f"{name} {time_ms(fj, choice, k, **timing):.4f} ms{'' if same else ' DIFFERS'}")
        print(f"top-k T {t} k {k} E {e} ({t * e * e} compares): " + ", ".join(row), flush=True)


if __name__ == "__main__":
    main()
