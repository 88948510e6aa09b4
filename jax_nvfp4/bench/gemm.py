"""Benchmark of the grouped NVFP4 GEMM on DeepSeek-V4-Pro per-GPU shapes against JAX and
PyTorch peers.

    python -m jax_nvfp4.bench [--out docs] [--cases L1-192,L2-6144] [--impls w4a16,ragged_dot]
    python -m jax_nvfp4.bench --small      # CPU-sized case and timing: a smoke test only

Per case (48 experts, skewed random group sizes) it times (``--impls``, default all):

- jax_nvfp4, exact mode: W4A16 and W4A4 (the custom call) with checkpoint-layout weights and with
  weights prepared once, outside the timed call, in the sm90 layout (``w4a16``, ``w4a4``,
  ``w4a16_sm90``, ``w4a4_sm90``; :func:`jax_nvfp4.prepare_weights`);
- jax_nvfp4, fp8 compute mode (``precision="fp8"``): on checkpoint-layout weights
  (``w4a16_fp8``, ``w4a4_fp8``) and on weights prepared once as e4m3
  (``w4a16_fp8_prepared``, ``w4a4_fp8_prepared``: ``jn.prepare_weights(w, "fp8")``, one byte
  per weight). W4A4 rows take the NVFP4-quantized tokens; the calls quantize the activations
  to e4m3 themselves (in the timed call);
- JAX peers on bf16 weights: ``jax.lax.ragged_dot``, XLA dequantize + ragged_dot
  (``dequant_ragged_dot``, NVFP4 weights), the Pallas Mosaic-GPU ragged_dot (``pallas_mgpu``,
  best of a few tile configs);
- uniform batched GEMMs (cuBLAS through XLA): ``cublas_fp8_uniform`` (e4m3 x e4m3, float32
  accumulation, bf16 output, no scales) and ``cublas_bf16_uniform``: ``dot_general`` with a
  batch dimension on the same rows split evenly over the experts (``[G, ceil(rows / G), K] x
  [G, K, N]``). They ignore the raggedness (no group sizes, every expert's tile full), so they
  are a bound, not a like-for-like peer;
- tokamax's ``ragged_dot`` (default configuration) on the bf16 weights (``tokamax_bf16``) and on
  int4 weights made from them by qwix (``tokamax_int4``), where tokamax imports (else skipped, with
  the reason printed; never a dependency): :mod:`jax_nvfp4.bench.tokamax_peers`;
- PyTorch's grouped GEMMs on the same group sizes, where ``import torch`` works and it has a
  CUDA device (else skipped, with the reason printed; torch is not a jax_nvfp4 dependency):
  ``torch_fp8_grouped`` (``torch._scaled_grouped_mm``, e4m3 operands, row-wise float32 scales)
  and ``torch_bf16_grouped`` (``torch._grouped_mm``); details in :mod:`jax_nvfp4.bench.torch_peers`.
  Their timed call is the GEMM alone (operands already e4m3: no activation quantization), timed
  by CUDA events.

It prints median ms, TFLOP/s (of the case's rows, also for the uniform peers), weight GB/s
(weight bytes per element: NVFP4 0.5625, e4m3 1, bf16 2: :data:`WEIGHT_BYTES`) and % of the
floor (max of NVFP4 weight bytes / 4.05 TB/s and FLOPs / 711 TFLOP/s, the HBM bandwidth and
dense bf16 rate measured on an H200) and writes JSON: ``bench.json`` (the
:func:`jax_nvfp4.bench.common.run_info` header, ``experts``, ``complete`` and the ``results``
rows), rewritten after every case with ``"complete": false`` until the last case is done, so a
run stopped part way (a time limit) keeps the cases it measured; then a PNG plot
(``tools/bench/bench_log_to_json.py`` turns the printed log of a run into the same layout).
``--check`` also prints relative differences: the exact kernels against ragged_dot, the fp8 mode
against the exact one, the prepared fp8 weights against the checkpoint-layout ones (equal or
nearly), the torch peers against the fp8 mode and ragged_dot.
"""

from __future__ import annotations

import argparse
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

import jax_nvfp4 as jn
from jax_nvfp4.bench.common import rowwise_e4m3, run_info, time_ms, write_json
from jax_nvfp4.bench.tokamax_peers import TOKAMAX_IMPLS, tokamax_peers
from jax_nvfp4.bench.torch_peers import TORCH_IMPLS, torch_peers

EXPERTS = 48
LAYERS = {"L1": (7168, 6144), "L2": (3072, 7168)}          # (K, N) per expert
ROWS = (192, 1536, 6144, 24576)
HBM_BYTES_PER_S = 4.05e12
BF16_FLOPS = 711e12
IMPLS = ("w4a16", "w4a16_sm90", "w4a4", "w4a4_sm90", "w4a16_fp8", "w4a4_fp8",
         "w4a16_fp8_prepared", "w4a4_fp8_prepared", "ragged_dot", "dequant_ragged_dot",
         "pallas_mgpu", "cublas_fp8_uniform", "cublas_bf16_uniform") + TORCH_IMPLS + TOKAMAX_IMPLS
NVFP4_IMPLS = ("w4a16", "w4a16_sm90", "w4a4", "w4a4_sm90", "w4a16_fp8", "w4a4_fp8",
               "dequant_ragged_dot")                                          # 4.5-bit weights
FP8_IMPLS = ("w4a16_fp8", "w4a4_fp8", "w4a16_fp8_prepared", "w4a4_fp8_prepared")
"""The fp8 compute mode (``precision="fp8"``): e4m3 rounding of both operands, not the exact GEMM."""
FP8_PREPARED = {"w4a16_fp8_prepared": "w4a16_fp8", "w4a4_fp8_prepared": "w4a4_fp8"}
"""The fp8 mode on weights prepared once as e4m3, and its row on checkpoint-layout weights (the
same numbers)."""
UNIFORM_IMPLS = ("cublas_fp8_uniform", "cublas_bf16_uniform")
"""Batched GEMMs on an even split of the rows over the experts: a bound, not the ragged GEMM."""
WEIGHT_BYTES = {**{i: 0.5625 for i in NVFP4_IMPLS},
                **{i: 1.0 for i in ("w4a16_fp8_prepared", "w4a4_fp8_prepared",
                                    "cublas_fp8_uniform", "torch_fp8_grouped")},
                **{i: 2.0 for i in ("ragged_dot", "pallas_mgpu", "cublas_bf16_uniform",
                                    "torch_bf16_grouped", "tokamax_bf16")},
                "tokamax_int4": 0.5 + 2 / 128}
"""Bytes per weight element each implementation reads: NVFP4 (4 bits + an e4m3 scale per 16),
e4m3, bf16, int4 (a bf16 scale per 128)."""


def skewed_group_sizes(rows, groups, seed):
    """Random group sizes summing to ``rows``, skewed (log-normal weights), some possibly 0."""
    rng = np.random.default_rng(seed)
    p = np.exp(rng.normal(0.0, 1.0, groups))
    return rng.multinomial(rows, p / p.sum()).astype(np.int32)


def case_seed(layer, rows, layers=LAYERS, all_rows=ROWS):
    """The seed of case ``(layer, rows)``: its index in the full list of cases, so that a case's data
    (tokens, weights, group sizes) is the same whichever cases a run selects."""
    cases = [(lay, r) for lay in layers for r in all_rows]
    if (layer, rows) not in cases:
        raise ValueError(f"(layer, rows): expected one of {cases}, got {(layer, rows)!r}")
    return cases.index((layer, rows))


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
    """``(fns, wb, rhs_fp8)`` on one case: ``fns`` name -> (jitted fn, args) for each
    implementation but the Pallas and torch ones; ``wb`` the bf16 weights ``[G, K, N]`` and
    ``rhs_fp8`` the :class:`jax_nvfp4.Fp8Weights` ``[G, N, K]`` they also run on.

    ``x`` bf16 ``[R, K]``, ``rhs`` NVFP4 ``[G, N, K]`` (checkpoint layout), ``sizes`` int32
    ``[G]``. Each output is bf16 ``[R, N]``, except the uniform peers' (:func:`uniform_fns`):
    bf16 ``[G, ceil(R / G), N]``. Weight preparation and the tokens' NVFP4 quantization (W4A4)
    happen here, once, outside the timed calls.
    """
    fns = {}
    ffi = jax.jit(lambda a, w, s: jn.grouped_gemm(a, w, s, backend="ffi"))
    xq = jax.jit(jn.quantize)(x)
    rhs_sm90 = jax.jit(jn.prepare_weights)(rhs)       # load-time cost: not timed
    rhs_fp8 = jax.jit(functools.partial(jn.prepare_weights, layout="fp8"))(rhs)
    fns["w4a16"] = (ffi, (x, rhs, sizes))
    fns["w4a16_sm90"] = (ffi, (x, rhs_sm90, sizes))
    fns["w4a4"] = (ffi, (xq, rhs, sizes))
    fns["w4a4_sm90"] = (ffi, (xq, rhs_sm90, sizes))
    ffi8 = jax.jit(lambda a, w, s: jn.grouped_gemm(a, w, s, backend="ffi", precision="fp8"))
    fns["w4a16_fp8"] = (ffi8, (x, rhs, sizes))            # the fp8 kernel reads checkpoint weights
    fns["w4a4_fp8"] = (ffi8, (xq, rhs, sizes))
    fns["w4a16_fp8_prepared"] = (ffi8, (x, rhs_fp8, sizes))        # e4m3 weights, read as they lie
    fns["w4a4_fp8_prepared"] = (ffi8, (xq, rhs_fp8, sizes))

    def dequant_bf16(w):                                  # [G, N, K] -> [G, K, N] bf16
        return jnp.swapaxes(jn.dequantize(w, jnp.bfloat16), 1, 2)

    wb = jax.jit(dequant_bf16)(rhs)
    fns["ragged_dot"] = (jax.jit(lambda a, w, s: jax.lax.ragged_dot(
        a, w, s, preferred_element_type=jnp.float32).astype(jnp.bfloat16)), (x, wb, sizes))
    fns["dequant_ragged_dot"] = (jax.jit(lambda a, w, s: jax.lax.ragged_dot(
        a, dequant_bf16(w), s, preferred_element_type=jnp.float32).astype(jnp.bfloat16)),
        (x, rhs, sizes))
    fns.update(uniform_fns(x, rhs_fp8, wb))
    return fns, wb, rhs_fp8


def uniform_rows(x, groups):
    """``x`` ``[R, K]`` split evenly over ``groups``: ``[groups, ceil(R / groups), K]``, the last
    rows zero."""
    m = -(-x.shape[0] // groups)
    return jnp.pad(x, ((0, groups * m - x.shape[0]), (0, 0))).reshape(groups, m, x.shape[1])


def _batched(a, w, contract_w):
    """``a`` ``[G, M, K]`` times ``w`` (K on axis ``contract_w``), bf16 ``[G, M, N]`` written by
    the GEMM itself (cuBLAS accumulates in float32 inside): one XLA dot_general with a batch
    dimension (cuBLAS on a GPU). A float32 result converted in a second pass would time that pass
    too (about 20% at L1 24576 on an H100)."""
    dims = (((2,), (contract_w,)), ((0,), (0,)))
    return jax.lax.dot_general(a, w, dims, preferred_element_type=jnp.bfloat16)


def uniform_fns(x, rhs_fp8, wb):
    """The uniform batched peers: ``{"cublas_fp8_uniform": (fn, (a8, w8)),
    "cublas_bf16_uniform": (fn, (a16, wb))}``.

    The case's rows split evenly over the experts (:func:`uniform_rows`, ``[G, M, K]``): in e4m3
    (each row quantized on its own, :func:`jax_nvfp4.bench.common.rowwise_e4m3`, beforehand)
    against the prepared e4m3 weights ``[G, N, K]`` in the logical k order (K contiguous in both:
    the "TN" operands cuBLAS's FP8 GEMM takes), and in bf16 against ``wb`` ``[G, K, N]``. No
    scales are applied (the tensor-core time only): a bound for the ragged GEMMs, which these
    are not.
    """
    g = wb.shape[0]
    a8 = jax.jit(lambda v: uniform_rows(rowwise_e4m3(v)[0], g))(x)
    w8 = jax.jit(lambda w: w.logical_codes())(rhs_fp8)
    a16 = jax.jit(lambda v: uniform_rows(v, g))(x)
    return {"cublas_fp8_uniform": (jax.jit(lambda a, w: _batched(a, w, 2)), (a8, w8)),
            "cublas_bf16_uniform": (jax.jit(lambda a, w: _batched(a, w, 1)), (a16, wb))}


def uniform_ms(impl, f, args, log=print, **timing):
    """``(median ms, config)`` of a uniform peer (:func:`uniform_fns`), or ``(None, None)`` with
    the error logged where XLA cannot run it (a peer's failure never stops the benchmark)."""
    try:
        ms = time_ms(f, *args, **timing)
    except Exception as e:  # noqa: BLE001
        log(f"  {impl} skipped: {type(e).__name__}: {str(e)[:300]}")
        return None, None
    g, m = args[0].shape[:2]
    return ms, f"uniform split, {g} x {m} rows, no scales"      # a bound: say what it ran


def _rel(got, want):
    """Relative L2 difference ``||got - want|| / ||want||`` in float32 (JAX or numpy arrays)."""
    got, want = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def check_case(case, fns, torch_rows, log=print, tokamax_rows=None):
    """``--check``: log the relative differences of one case's implementations: the exact
    kernels against ragged_dot, the fp8 mode against the exact kernel, the prepared fp8 weights
    against the checkpoint-layout ones (the same numbers: 0 or float32 summation order), the
    torch peers (``torch_rows`` of :func:`jax_nvfp4.bench.torch_peers.torch_peers`) against the fp8
    mode and ragged_dot."""
    out = {name: fns[name][0](*fns[name][1]) for name in
           ("w4a16", "w4a16_sm90", "ragged_dot", "w4a16_fp8", "w4a4_fp8", *FP8_PREPARED)}
    for name in ("w4a16", "w4a16_sm90"):
        rel = _rel(out[name], out["ragged_dot"])
        log(f"  check {case}: rel err {name} vs ragged_dot {rel:.2e}")
    log(f"  check {case}: rel diff w4a16_fp8 vs w4a16 {_rel(out['w4a16_fp8'], out['w4a16']):.2e} "
        "(e4m3 rounding)")
    for prepared, base in FP8_PREPARED.items():
        log(f"  check {case}: rel diff {prepared} vs {base} {_rel(out[prepared], out[base]):.2e} "
            "(same numbers)")
    refs = {"torch_fp8_grouped": "w4a16_fp8", "torch_bf16_grouped": "ragged_dot"}
    for impl, (_, _, got) in torch_rows.items():
        log(f"  check {case}: rel diff {impl} vs {refs[impl]} {_rel(got, out[refs[impl]]):.2e}")
    for impl, (_, _, got) in (tokamax_rows or {}).items():     # int4: a requantization
        log(f"  check {case}: rel diff {impl} vs ragged_dot {_rel(got, out['ragged_dot']):.2e}")


def pallas_best(x, wb, sizes, log, **timing):
    """Best median ms of the Pallas Mosaic-GPU ragged_dot over a few tile configs (or None)."""
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # noqa: PLC0415 - GPU-only module
    except Exception as e:  # noqa: BLE001 - any import failure means: no Pallas peer
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
    p = argparse.ArgumentParser(prog="python -m jax_nvfp4.bench",
                                description="grouped NVFP4 GEMM benchmark (DeepSeek-V4 shapes)",
                                epilog="Needs a GPU for meaningful numbers (the custom call's CUDA handler); "
                                       "on CPU it runs the C++ handler, far slower.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="bench-out", help="folder for bench.json and bench.png")
    p.add_argument("--cases", default="", help="comma list like L1-192,L2-6144 (default all)")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma list of {IMPLS}")
    p.add_argument("--check", action="store_true",
                   help="also print relative differences: jax_nvfp4 vs ragged_dot, the fp8 mode "
                        "vs exact, prepared fp8 weights vs checkpoint-layout ones, torch peers")
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
    json_path = os.path.join(args.out, "bench.json")
    meta = dict(run_info(dev), experts=experts, complete=False, results=results)
    write_json(json_path, meta)            # rewritten after every case: a cut run keeps its rows
    for layer, rows in cases:
        k, n = layers[layer]
        case = f"{layer} rows {rows}"
        x, rhs, sizes = make_case(rows, k, n, seed=case_seed(layer, rows, layers, all_rows),
                                  experts=experts)
        fns, wb, rhs_fp8 = impl_fns(x, rhs, sizes)
        torch_rows = torch_peers(x, rhs_fp8, wb, sizes, impls, log=print, **timing)
        tokamax_rows = tokamax_peers(x, wb, sizes, impls, log=print, **timing)
        if args.check:
            check_case(case, fns, torch_rows, tokamax_rows=tokamax_rows)
        for impl in impls:
            extra = None
            if impl == "pallas_mgpu":
                ms, extra = pallas_best(x, wb, sizes, print, **timing)
                if ms is None:
                    continue
            elif impl in TORCH_IMPLS or impl in TOKAMAX_IMPLS:
                peers = torch_rows if impl in TORCH_IMPLS else tokamax_rows
                if impl not in peers:                          # skipped: the reason is printed
                    continue
                ms, extra, _ = peers[impl]
            elif impl in UNIFORM_IMPLS:
                ms, extra = uniform_ms(impl, *fns[impl], log=print, **timing)
                if ms is None:
                    continue
            else:
                f, a = fns[impl]
                ms = time_ms(f, *a, **timing)
            flops = 2.0 * rows * k * n
            wbytes = experts * n * k * WEIGHT_BYTES[impl]
            floor = floor_ms(rows, k, n, experts)
            r = {"case": case, "impl": impl, "ms": round(ms, 4),
                 "tflops": round(flops / ms / 1e9, 1), "weight_gbs": round(wbytes / ms / 1e6, 1),
                 "floor_ms": round(floor, 4), "pct_of_floor": round(100 * floor / ms, 1)}
            if extra:
                r["config"] = extra
            results.append(r)
            print(f"  {case:16s} {impl:20s} {ms:9.3f} ms {r['tflops']:7.1f} TFLOP/s "
                  f"{r['weight_gbs']:8.1f} GB/s {r['pct_of_floor']:6.1f}% of floor", flush=True)
        del x, rhs, wb, rhs_fp8, fns, torch_rows, tokamax_rows
        write_json(json_path, meta)                           # "complete": false so far
    meta["complete"] = True
    write_json(json_path, meta)
    _plot(results, os.path.join(args.out, "bench.png"))
    w = max(len(i) for i in impls + ["ms per call"])             # one column per impl
    print(f"\n{'case':16s} " + " ".join(f"{i:>{w}s}" for i in impls))
    for layer, rows in cases:
        case = f"{layer} rows {rows}"
        row = {r["impl"]: r["ms"] for r in results if r["case"] == case}
        print(f"{case:16s} " + " ".join(f"{row.get(i, float('nan')):{w - 3}.3f} ms" for i in impls))
    return results


def _plot(results, path):
    try:
        import matplotlib  # noqa: PLC0415 - optional (the bench extra)
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
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
