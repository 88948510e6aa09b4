"""Predicted HBM bytes of the prepared-weights kernel's tile walks (issue 48): a model, not a measurement.

The persistent grid (132 CTAs) takes schedule indices L = b, b + 132, ... (find_tile); each tile reads,
per 128-k stage, its weight box (128 rows x 128 bytes) and its activation rows (rows x 128 bytes). The
model runs the CTAs in lockstep (every tile as long as any other: one stage per CTA per step) through an
LRU cache of the L2's size at 16 KiB-block granularity, and counts the misses: the bytes from HBM. It
ignores the L2's two partitions, its hashing and its replacement policy, and the activations' and
output's own traffic beyond the misses, so it ranks walks; the absolute numbers are a rough guide
(Nsight Compute measured ~7 GB of DRAM reads+writes for the token-tile-major walk at L1 24576 rows).

    python tools/lab/fp8_prepared/l2_walk_model.py [--rows 6144,24576] [--l2-mib 50]
"""

from __future__ import annotations

import argparse
from collections import OrderedDict


def tiles(sizes, n_tiles, bt, walk):
    """The schedule: (group, n-tile, token tile, rows) per index L (find_tile's order for `walk`)."""
    out = []
    for g, s in enumerate(sizes):
        tg = (s + bt - 1) // bt
        for local in range(tg * n_tiles):
            if walk == 0:
                nt, tt = local % n_tiles, local // n_tiles
            elif walk == 1:
                nt, tt = local // tg, local % tg
            else:
                nb0 = local // (walk * tg) * walk
                bw = min(walk, n_tiles - nb0)
                rem = local - nb0 * tg
                tt, nt = rem // bw, nb0 + rem % bw
            out.append((g, nt, tt, min(bt, s - tt * bt)))
    return out


def hbm_bytes(sizes, n, k, walk, bt=128, ctas=132, l2_bytes=50 << 20):
    sched = tiles(sizes, (n + 127) // 128, bt, walk)
    kt_n = k // 128
    per_cta = [sched[b::ctas] for b in range(ctas)]
    cache, cap, miss = OrderedDict(), l2_bytes // 16384, 0
    steps = max(len(p) for p in per_cta) * kt_n
    for step in range(steps):
        i, kt = divmod(step, kt_n)
        for p in per_cta:
            if i >= len(p):
                continue
            g, nt, tt, rows = p[i]
            for key, nbytes in ((("w", g, nt, kt), 16384), (("a", g, tt, kt), rows * 128)):
                if key in cache:
                    cache.move_to_end(key)
                else:
                    miss += nbytes
                    cache[key] = True
                    if len(cache) > cap:
                        cache.popitem(last=False)
    return miss


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="6144,24576")
    ap.add_argument("--l2-mib", type=int, default=50)
    ap.add_argument("--walks", default="0,1,4,8,16")
    a = ap.parse_args(argv)
    from jax_nvfp4.bench import gemm as bench

    for layer, (k, n) in {"L1": (7168, 6144), "L2": (3072, 7168)}.items():
        for rows in map(int, a.rows.split(",")):
            sizes = [int(s) for s in bench.skewed_group_sizes(rows, bench.EXPERTS, bench.case_seed(layer, rows))]
            wbytes = bench.EXPERTS * n * k
            cols = []
            for w in map(int, a.walks.split(",")):
                b = hbm_bytes(sizes, n, k, w, l2_bytes=a.l2_mib << 20)
                name = {0: "t", 1: "n"}.get(w, f"s{w}")
                cols.append(f"{name} {b / 1e9:.2f} GB ({b / wbytes:.2f}x weights)")
            print(f"{layer} {rows:6d}: " + "  ".join(cols), flush=True)


if __name__ == "__main__":
    main()
