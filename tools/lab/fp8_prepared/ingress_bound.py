"""Lower bounds on the prepared-fp8 grouped GEMM's time from the SM ingress ceiling (issue 48).

Every operand byte a CTA multiplies crosses the L2 -> SM path into shared memory once per tile
(TMA multicast saves L2 reads, not ingress: each SM of the pair still receives every byte). For a
tile of T tokens x W weight rows and 128-deep k chunks that is (valid tokens + W) x 128 bytes per
chunk. The fp8 mode promotes each 128-k chunk into a float32 running sum with the token's chunk
scale, so a consumer thread holds the running sum and the chunk accumulator: that caps the tile
(65536 registers per SM). The bound is the ingress bytes over the measured ceiling
(wgmma_rate "copy only": 16 KiB bulk copies of L2-resident data, all 132 SMs, nothing else
running; and the same copies beside the consumer's mainloop, promoting as the fp8 mode's numerics
require, issued from all four SM sub-partitions), beside the
tensor floor and the HBM floor (weights and activation codes read once); the API adds the
activation quantizer (tools/lab/fp8_quant_chunks, measured).

    python tools/lab/fp8_prepared/ingress_bound.py [--out FILE.json]

numpy only; group sizes as jax_nvfp4/bench/gemm.py draws them (skewed_group_sizes, case_seed).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

EXPERTS = 48
LAYERS = {"L1": (7168, 6144), "L2": (3072, 7168)}  # (K, N) per expert, as jax_nvfp4/bench/gemm.py
ROWS = (192, 1536, 6144, 24576)
TARGETS_MS = {("L1", 6144): 0.66, ("L1", 24576): 1.75, ("L2", 6144): 0.33, ("L2", 24576): 0.88}
# (tokens, weight rows, consumer warpgroups, accumulator registers per consumer thread, note)
TILES = [
    (128, 128, 2, 64 + 64, "package: 2 warpgroups x m64, N = 128 tokens"),
    (128, 192, 3, 64 + 64, "3 consumer warpgroups (152 registers a thread: the register wall)"),
    (192, 128, 2, 96 + 96, "192-token tile"),
    (128, 256, 2, 128 + 64, "2 m64 blocks a warpgroup, one chunk accumulator shared by turns"),
]
# cuBLAS's tile, one accumulator of 320 x 128 (no promotion); a promoting kernel could hold it too with
# its chunk accumulator sliced along N (n32 wgmmas promoted in turn: 160 + 2 x 16 registers)
CUBLAS_TILE = (128, 320, 2, 160, "cuBLAS nvjet 320x128, cluster 1x2, one accumulator (no promotion)")
# measured on an H100 80GB HBM3 (2026-12-05, docs/archive/fp8-prepared-lab.md): SM ingress, TB/s
# (four machines of the kind; each number the highest seen, so the bounds are the optimistic ones)
INGRESS_ALONE_TBS = 9.20   # copies alone (7.71-9.20)
INGRESS_BESIDE_TBS = 8.71  # beside the two-warpgroup mainloop, promoting or not, copies issued by a warp
                           # on each of the four sub-partitions (8.62-8.71; one issuing warp: 6.0-7.2)
QUANTIZER_MS = {("L1", 6144): 0.061, ("L1", 24576): 0.197, ("L2", 6144): 0.027, ("L2", 24576): 0.088}
HBM_TBS = 4.8              # the H200's HBM3e peak (the targets' machine)
TENSOR_MAC_PER_CLK_SM = 4096  # e4m3 wgmma, dense
SMS = 132


def skewed_group_sizes(rows, groups, seed):
    rng = np.random.default_rng(seed)
    p = np.exp(rng.normal(0.0, 1.0, groups))
    return rng.multinomial(rows, p / p.sum()).astype(np.int64)


def case_seed(layer, rows):
    return [(lay, r) for lay in LAYERS for r in ROWS].index((layer, rows))


def tile_counts(sizes, k, n, t, w):
    """(ingress bytes, MACs issued) for token tiles of t and weight tiles of w."""
    chunks = k // 128
    wtiles = -(-n // w)
    full, rem = sizes // t, sizes % t
    tok_tiles = full + (rem > 0)
    act = (sizes * 128 * chunks * wtiles).sum()             # valid token rows only
    wgt = (tok_tiles * wtiles * w * 128 * chunks).sum()
    macs = (tok_tiles * t * wtiles * w * k).sum()
    return int(act + wgt), int(macs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clock-ghz", type=float, default=1.98, help="SM clock for the tensor floor")
    ap.add_argument("--out", help="write the table as JSON here")
    a = ap.parse_args()
    ceilings = {"alone": INGRESS_ALONE_TBS, "beside": INGRESS_BESIDE_TBS}
    rows_out = []
    print("API lower bound, ms = max(ingress bytes / ceiling, tensor floor, HBM floor) + quantizer, for the "
          f"ingress ceilings {ceilings} TB/s;\ntensor floor at {a.clock_ghz} GHz x {SMS} SMs; HBM {HBM_TBS} TB/s "
          "(H200); quantizer as measured on the H100")
    print(f"{'case':<10}{'TxW':<8}{'regs':>5}{'GB in':>7}{'tensor':>7}{'HBM':>6}{'quant':>6}"
          f"{'alone':>7}{'beside':>7}{'target':>7}")
    for (lay, r), target in TARGETS_MS.items():
        k, n = LAYERS[lay]
        sizes = skewed_group_sizes(r, EXPERTS, case_seed(lay, r))
        hbm = (EXPERTS * n * k + r * k) / (HBM_TBS * 1e12) * 1e3
        q = QUANTIZER_MS[(lay, r)]
        for t, w, wgs, regs, note in TILES + [CUBLAS_TILE]:
            b, macs = tile_counts(sizes, k, n, t, w)
            ten = macs / (TENSOR_MAC_PER_CLK_SM * SMS * a.clock_ghz * 1e9) * 1e3
            api = {c: max(b / (v * 1e12) * 1e3, ten, hbm) + q for c, v in ceilings.items()}
            rows_out.append(dict(case=f"{lay} rows {r}", tokens=t, weight_rows=w, consumer_warpgroups=wgs,
                                 acc_registers_per_thread=regs, note=note, ingress_gb=round(b / 1e9, 3),
                                 macs=macs, tensor_ms=round(ten, 4), hbm_ms=round(hbm, 4), quantizer_ms=q,
                                 **{f"api_bound_{c}_ms": round(v, 4) for c, v in api.items()},
                                 target_ms=target))
            print(f"{lay + ' ' + str(r):<10}{f'{t}x{w}':<8}{regs:>5}{b / 1e9:>7.2f}{ten:>7.3f}{hbm:>6.3f}{q:>6.3f}"
                  f"{api['alone']:>7.3f}{api['beside']:>7.3f}{target:>7.2f}  {note}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(ingress_tbs=ceilings, hbm_tbs=HBM_TBS, clock_ghz=a.clock_ghz, rows=rows_out), f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
