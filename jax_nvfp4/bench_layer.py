"""Benchmark of the whole MoE layer against its two grouped GEMMs (issue 24).

    python -m jax_nvfp4.bench_layer [--out bench-layer-out] [--tokens 32,256,1024,4096]
                                    [--precision exact|fp8] [--unfused]

``--precision fp8`` runs the layer's GEMMs in the FP8 mode (``MoEConfig.precision``) on
checkpoint-layout weights (what its CUDA kernel reads) unless ``--layout`` says otherwise.

Needs a GPU for meaningful numbers; on a CPU it runs at small sizes (``--small``) as a smoke test.

Per-GPU DeepSeek-V4-Pro shard: 48 routed experts, top-6, H 7168, I 3072, SwiGLU limit 10, no
shared expert (it is two more GEMMs of the same kind), random NVFP4 weights prepared once in the
sm90 layout (:func:`jax_nvfp4.prepare_weights`), bf16 tokens routed by a random router (real
routing: uneven group sizes). For each token count and activation (W4A4 dynamic, W4A16) it times,
in one run:

- ``layer_ms``: the jitted layer (:func:`jax_nvfp4.moe`); with sm90 weights (prepared, so gate/up
  rows paired) and exact precision it runs the gate/up GEMM and SwiGLU as one fused call
  (``fused_swiglu``); ``--unfused`` also times the same layer on unpaired sm90 weights
  (``layer_unfused_ms``, the unfused path) in the same run;
- ``gemm1_ms`` / ``gemm2_ms``: each grouped GEMM alone, called as the layer calls it (same lhs kind:
  bf16 rows, for W4A4 the values of their NVFP4 quantization, which the layer's dispatch writes;
  the group sizes the layer's routing produced), on the same routed rows: the gate/up GEMM with
  float32 output, the down GEMM with the layer's rows (bf16, ``MoEConfig.row_dtype``);
- ``overhead_share = (layer_ms - gemm1_ms - gemm2_ms) / layer_ms``: routing, dispatch, SwiGLU,
  requantization and combine;
- ``reference_ms``: the layer on the pure-jnp reference backend, for scale (slow: XLA's
  ``ragged_dot`` in float32; only up to ``--reference-max-tokens``).

Then one device's share of an ``--ep``-way expert-parallel layer (``--experts`` of ``--experts x
--ep`` experts, ``--ep-tokens`` tokens routed over all of them, only this device's experts' rows
computed) on one device, beside 1/ep of the one-device layer with all experts. The share is
:func:`device_share`, what :func:`jax_nvfp4.moe_expert_parallel` runs on device 0 except its two
collectives, simulated on one GPU: device 0 routes its own ``ceil(T / ep)`` tokens
(:func:`jax_nvfp4.sharding.route_token_slice`, timed), and the all-gather that would bring the
other devices' routing decisions is replaced by an input holding them (computed once, untimed;
the real all-gather moves ``T * top_k * 8`` bytes); then
:func:`jax_nvfp4.sharding.local_routed_experts` on those decisions; the combine is not timed.
``route_ms`` is the router over all T tokens (what every device ran before the token slice),
``route_slice_ms`` over device 0's slice. Writes ``bench_layer.json``,
``bench_layer.png`` (matplotlib optional) and the compiled HLO of the layer at ``--hlo-tokens``
(which kernels it runs) under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from . import gemm, layout, moe_params, sharding
from .bench import _driver_version, time_ms
from .bench_ep import random_layer
from .dispatch import dispatch_rows_dynamic
from .formats import NVFP4Tensor
from .moe import (_fused_path, _round_rows, _row_global_scale, _swiglu_paired, moe, row_dtype,
                  row_ladder, sort_rows, swiglu)
from .quantization import quantize
from .routing import route

ACTIVATIONS = ("w4a4", "w4a16")
SMALL = dict(tokens="16,48", experts=8, hidden=128, inter=64, ep=4, ep_tokens=64,
             reference_max_tokens=48, hlo_tokens=16, target_s=0.02, repeats=3)
"""``--small``: CPU-sized defaults (options given explicitly still win)."""


def layer_config(experts, hidden, inter, top_k, activation, precision="exact"):
    """The benchmarked layer: V4-Pro routing and SwiGLU, no shared expert; ``precision`` its
    GEMMs' compute mode ("exact" or "fp8")."""
    return moe_params.MoEConfig.deepseek_v4_pro(
        num_experts=experts, top_k=top_k, hidden_size=hidden, intermediate_size=inter,
        n_shared_experts=0, activation=activation, precision=precision)


def _routed_rows(x, weights, config):
    """The layer's dispatch (as :func:`jax_nvfp4.moe.routed_experts` does it): the token of each
    routed row, rows sorted by expert, and the group sizes."""
    ids, _ = route(x, weights, config)
    order, _, sizes = sort_rows(ids.reshape(-1), weights.w13.data.shape[0])
    return order // ids.shape[1], sizes


def _gemm_lhs(rows, activation, precision="exact", backend="auto"):
    """A GEMM input as the layer makes it, and the row scales to apply to the output (or None):
    bf16 rows (W4A16); for W4A4 (dynamic) the values e2m1 * block scale of each row's NVFP4
    quantization as bf16 with the rows' scales, made by the layer's dispatch
    (:func:`jax_nvfp4.dispatch.dispatch_rows_dynamic`: the GEMMs then time the kernels alone), or
    for precision "fp8" the NVFP4 codes."""
    if activation == "w4a4":
        if precision != "fp8":
            return dispatch_rows_dynamic(rows, backend="reference" if backend == "reference"
                                         else "auto")
        s = _row_global_scale(rows)
        q = jax.vmap(quantize)(rows, s)
        return NVFP4Tensor(q.data, q.scales, jnp.float32(1.0)), s
    return rows.astype(jnp.bfloat16), None


def _gemm(lhs, w, sizes, backend, precision="exact", out_dtype=jnp.float32):
    return gemm.grouped_gemm(lhs, w, sizes, out_dtype=out_dtype, backend=backend,
                             precision=precision)


def gemm_inputs(x, token_of, sizes, weights, config, backend):
    """The two grouped GEMMs' inputs as the layer makes them: ``(lhs1, s1, lhs2, s2)``, the
    dispatched token rows and SwiGLU of the first GEMM's output, each quantized per row for W4A4
    (``s1``/``s2`` its float32 ``[rows]`` scales, applied to the GEMM's output; None for W4A16).
    Paired gate/up weights (``weights.w13_paired``) take the SwiGLU on the paired columns."""
    glu = _swiglu_paired if weights.w13_paired else swiglu
    @jax.jit
    def inputs(x, token_of, w13, sizes):
        lhs1, s1 = _gemm_lhs(x[token_of], config.activation, config.precision, backend)
        h = _gemm(lhs1, w13, sizes, backend, config.precision)
        act = _round_rows(glu(h if s1 is None else h * s1[:, None], config.swiglu_limit), config)
        lhs2, s2 = _gemm_lhs(act, config.activation, config.precision, backend)
        return lhs1, s1, lhs2, s2

    return inputs(x, token_of, weights.w13, sizes)


def gemm_cases(x, token_of, sizes, weights, config, backend):
    """The two grouped GEMMs as the layer calls them (same lhs kind, the layer's rows and group
    sizes; gemm2 writes the layer's bf16 rows): ``(gemm1, args1), (gemm2, args2)``. gemm1 is the
    plain gate/up GEMM
    (float32 ``[rows, 2I]`` out) also when the layer runs the fused gate/up + SwiGLU call on
    paired weights (same weight bytes and products): the overhead share then counts what the
    fusion saves against it."""
    lhs1, _, lhs2, _ = gemm_inputs(x, token_of, sizes, weights, config, backend)

    def gemm1(lhs, w, sizes):
        return _gemm(lhs, w, sizes, backend, config.precision)

    def gemm2(lhs, w, sizes):   # out in the layer's row dtype (bf16), as the layer calls it
        return _gemm(lhs, w, sizes, backend, config.precision, out_dtype=row_dtype(config))

    return ((jax.jit(gemm1), (lhs1, weights.w13, sizes)),
            (jax.jit(gemm2), (lhs2, weights.w2, sizes)))


def local_weights(weights: moe_params.MoEWeights, start, count):
    """Experts ``start .. start + count`` of the routed experts (the router stays whole): what one
    device holds under expert parallelism (:func:`jax_nvfp4.shard_moe_weights`)."""
    cut = lambda v: None if v is None else jax.tree.map(  # noqa: E731
        lambda a: a[start:start + count], v)
    return dataclasses.replace(weights, **{f: cut(getattr(weights, f))
                                           for f in ("w13", "w2", "w13_input_scale",
                                                     "w2_input_scale")})


def run_layer_cases(args, backend, dev, log=print):
    """The per-GPU shard: layer, its GEMMs and the reference, per token count and activation."""
    results = []
    base = layer_config(args.experts, args.hidden, args.inter, args.top_k, "w4a4", args.precision)
    weights = random_layer(base, seed=args.seed, device=dev)
    if args.layout != "checkpoint":
        with jax.default_device(dev):
            weights = layout.prepare_weights(weights, args.layout)
    unfused = None
    if args.unfused and weights.w13_paired:
        # The same sm90 bytes with the stored gate/up row order: the layer's unfused path.
        with jax.default_device(dev):
            unfused = dataclasses.replace(weights, w13=layout.unpair_gate_up(weights.w13),
                                          w13_paired=False)
    timing = dict(target_s=args.target_s, repeats=args.repeats)
    for t in args.tokens:
        x = jax.device_put(jax.random.normal(jax.random.key(args.seed + t), (t, args.hidden),
                                             jnp.bfloat16), dev)
        token_of, sizes = jax.jit(_routed_rows, static_argnums=2)(x, weights, base)
        rows = int(np.asarray(sizes).sum())
        for activation in args.activations:
            cfg = dataclasses.replace(base, activation=activation)

            def layer(x, w, cfg=cfg):
                return moe(x, w, cfg, backend=backend)

            layer_ms = time_ms(jax.jit(layer), x, weights, **timing)
            unfused_ms = None if unfused is None else time_ms(jax.jit(layer), x, unfused, **timing)
            if t == args.hlo_tokens:   # which kernels the layer runs: the fusion work's map
                path = os.path.join(args.out, f"layer_hlo_T{t}_{activation}.txt")
                with open(path, "w") as fh:
                    fh.write(jax.jit(layer).lower(x, weights).compile().as_text())
            (g1, a1), (g2, a2) = gemm_cases(x, token_of, sizes, weights, cfg, backend)
            gemm1_ms = time_ms(g1, *a1, **timing)
            gemm2_ms = time_ms(g2, *a2, **timing)
            del a1, a2
            gemm_ms = gemm1_ms + gemm2_ms
            r = {"tokens": t, "rows": rows, "activation": activation, "precision": args.precision,
                 "layer_ms": layer_ms, "fused_swiglu": _fused_path(weights, cfg),
                 "layer_unfused_ms": unfused_ms,
                 "gemm_ms": gemm_ms, "gemm1_ms": gemm1_ms, "gemm2_ms": gemm2_ms,
                 "overhead_ms": layer_ms - gemm_ms,
                 "overhead_share": (layer_ms - gemm_ms) / layer_ms,
                 "experts_with_rows": int((np.asarray(sizes) > 0).sum()),
                 "max_group": int(np.asarray(sizes).max()), "reference_ms": None}
            if t <= args.reference_max_tokens:
                def reference(x, w, cfg=cfg):
                    return moe(x, w, cfg, backend="reference")
                try:
                    r["reference_ms"] = time_ms(jax.jit(reference), x, weights,
                                              target_s=args.target_s, repeats=min(3, args.repeats))
                except Exception as e:  # noqa: BLE001 - e.g. out of memory: say so, go on
                    r["reference_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            results.append(r)
            ref = "-" if r["reference_ms"] is None else f"{r['reference_ms']:.3f}"
            unf = "" if unfused_ms is None else f" (unfused {unfused_ms:8.3f} ms)"
            log(f"  T={t:5d} rows={rows:6d} {activation:5s}: layer {layer_ms:8.3f} ms{unf}, gemm1 "
                f"{gemm1_ms:7.3f} + gemm2 {gemm2_ms:7.3f}, overhead "
                f"{100 * r['overhead_share']:5.1f}%, reference {ref} ms", flush=True)
    del weights, unfused
    return results


def device_share(x, weights, config, ids_all, rw_all, *, ep, backend,
                 capacity_factor=sharding.DEFAULT_CAPACITY_FACTOR):
    """Device 0's share of the ep-way layer on one device (see the module docstring): its token
    slice routed here, the other slices' decisions taken from ``ids_all`` / ``rw_all`` (int32 /
    float32 ``[T, top_k]``, :func:`jax_nvfp4.route` of all tokens, standing in for the
    all-gather), then its experts' rows. ``weights``: device 0's experts, the whole router.
    Returns float32 ``[T, H]``, equal to ``local_routed_experts(x, weights, ..., device_index=0)``.
    """
    ids, rw = sharding.route_token_slice(x, weights, config, device_index=0, devices=ep)
    routing = tuple(jax.lax.dynamic_update_slice_in_dim(full, mine, 0, 0)
                    for full, mine in ((ids_all, ids), (rw_all, rw)))
    return sharding.local_routed_experts(x, weights, config, device_index=0, devices=ep,
                                         backend=backend, capacity_factor=capacity_factor,
                                         routing=routing)


def run_expert_parallel(args, backend, dev, log=print):
    """One device's share of the ep-way layer vs 1/ep of the one-device layer, per activation."""
    out = []
    total = args.experts * args.ep
    base = layer_config(total, args.hidden, args.inter, args.top_k, "w4a4", args.precision)
    weights = random_layer(base, seed=args.seed + 1, device=dev)
    if args.layout != "checkpoint":
        with jax.default_device(dev):
            weights = layout.prepare_weights(weights, args.layout)
    mine = local_weights(weights, 0, args.experts)
    t = args.ep_tokens
    x = jax.device_put(jax.random.normal(jax.random.key(args.seed + t), (t, args.hidden),
                                         jnp.bfloat16), dev)
    ids, rw = jax.jit(route, static_argnums=2)(x, weights, base)   # the gathered decisions
    own = int((np.asarray(ids) < args.experts).sum())
    cap = sharding.device_capacity(t, args.top_k, args.ep, sharding.DEFAULT_CAPACITY_FACTOR)
    ladder = row_ladder(cap, t * args.top_k)
    timing = dict(target_s=args.target_s, repeats=args.repeats)
    def routing(x, w):
        return route(x, w, base)

    def routing_slice(x, w):
        return sharding.route_token_slice(x, w, base, device_index=0, devices=args.ep)

    route_ms = time_ms(jax.jit(routing), x, weights, **timing)
    route_slice_ms = time_ms(jax.jit(routing_slice), x, weights, **timing)
    for activation in args.activations:
        cfg = dataclasses.replace(base, activation=activation)

        def single(x, w, cfg=cfg):
            return moe(x, w, cfg, backend=backend)

        def share(x, w, ids, rw, cfg=cfg, cf=sharding.DEFAULT_CAPACITY_FACTOR):
            return device_share(x, w, cfg, ids, rw, ep=args.ep, backend=backend,
                                capacity_factor=cf)

        single_ms = time_ms(jax.jit(single), x, weights, **timing)
        share_ms = time_ms(jax.jit(share), x, mine, ids, rw, **timing)
        def share_all_rows(x, w, ids, rw):
            return share(x, w, ids, rw, cf=None)

        all_rows_ms = time_ms(jax.jit(share_all_rows), x, mine, ids, rw, **timing)
        r = {"tokens": t, "activation": activation, "precision": args.precision, "experts": total,
             "ep": args.ep,
             "local_experts": args.experts, "own_rows": own, "rows": t * args.top_k,
             "rows_run": next(n for n in ladder if n >= own),
             "capacity_factor": sharding.DEFAULT_CAPACITY_FACTOR,
             "single_ms": single_ms, "single_ms_over_ep": single_ms / args.ep,
             "share_ms": share_ms, "share_all_rows_ms": all_rows_ms,
             "ratio": share_ms / (single_ms / args.ep), "route_ms": route_ms,
             "route_slice_ms": route_slice_ms}
        out.append(r)
        log(f"  T={t} {activation:5s}: one device of {args.ep} ({own} own rows of "
            f"{t * args.top_k}, runs {r['rows_run']}): {share_ms:8.3f} ms (all rows: "
            f"{all_rows_ms:8.3f}); one device, {total} experts: {single_ms:8.3f} ms, /{args.ep} = {single_ms / args.ep:7.3f}; "
            f"ratio {r['ratio']:.2f}; routing alone {route_ms:.3f} ms (all tokens), "
            f"{route_slice_ms:.3f} ms (the device's slice)", flush=True)
    return out


def _parser():
    p = argparse.ArgumentParser(
        description="MoE layer vs its grouped GEMMs (DeepSeek-V4-Pro per-GPU shard). Needs a GPU "
                    "for meaningful numbers; --small runs CPU-sized shapes.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="bench-layer-out", help="folder for bench_layer.json/.png")
    p.add_argument("--small", action="store_true",
                   help="CPU-sized defaults: " + " ".join(f"--{k.replace('_', '-')} {v}"
                                                          for k, v in SMALL.items()))
    p.add_argument("--tokens", default="32,256,1024,4096", help="comma list of tokens per GPU")
    p.add_argument("--activations", default=",".join(ACTIVATIONS), help="comma list")
    p.add_argument("--experts", type=int, default=48, help="routed experts per GPU")
    p.add_argument("--top-k", type=int, default=6, help="experts per token")
    p.add_argument("--hidden", type=int, default=7168, help="H (model width)")
    p.add_argument("--inter", type=int, default=3072, help="I (expert width)")
    p.add_argument("--layout", choices=layout.LAYOUTS, default=None,
                   help="weight layout (sm90: prepared once at load time; default sm90, checkpoint "
                        "with --precision fp8, whose CUDA kernel reads that layout)")
    p.add_argument("--unfused", action="store_true",
                   help="also time the layer without the fused gate/up + SwiGLU call (the same "
                        "sm90 weights with gate/up rows unpaired): layer_unfused_ms")
    p.add_argument("--precision", choices=("exact", "fp8"), default="exact",
                   help="the layer's GEMM compute mode (MoEConfig.precision)")
    p.add_argument("--backend", choices=gemm.BACKENDS, default="auto",
                   help="grouped GEMM backend of the timed layer")
    p.add_argument("--reference-max-tokens", type=int, default=256,
                   help="time the reference-backend layer only up to this many tokens (0: never; "
                        "it is slow: float32 ragged_dot over every expert)")
    p.add_argument("--hlo-tokens", type=int, default=1024,
                   help="write the compiled HLO of the layer at this token count (one of "
                        "--tokens; 0: none) to layer_hlo_T<tokens>_<activation>.txt")
    p.add_argument("--ep", type=int, default=8,
                   help="expert-parallel part: devices (experts in all: --experts x --ep)")
    p.add_argument("--ep-tokens", type=int, default=8192,
                   help="expert-parallel part: tokens (0 skips the part)")
    p.add_argument("--target-s", type=float, default=0.25, help="seconds per timing sample")
    p.add_argument("--repeats", type=int, default=5, help="timing samples (median taken)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and tokens")
    return p


def main(argv=None):
    start = time.perf_counter()
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--small", action="store_true")
    p = _parser()
    if pre.parse_known_args(argv)[0].small:
        p.set_defaults(**SMALL)
    args = p.parse_args(argv)
    try:
        args.tokens = [int(v) for v in str(args.tokens).split(",") if v]
    except ValueError:
        p.error(f"--tokens: expected a comma list of ints, got {args.tokens!r}")
    if not args.tokens or min(args.tokens) < 1:
        p.error(f"--tokens: expected positive token counts, got {args.tokens}")
    args.activations = [a for a in args.activations.split(",") if a]
    bad = [a for a in args.activations if a not in ACTIVATIONS]
    if bad or not args.activations:
        p.error(f"--activations: unknown {bad}; expected a comma list of {ACTIVATIONS}")
    for name in ("experts", "top_k", "ep", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    if args.top_k > args.experts:
        p.error(f"--top-k {args.top_k} > --experts {args.experts}")
    if args.layout is None:
        args.layout = "checkpoint" if args.precision == "fp8" else "sm90"
    dev = jax.devices()[0]
    backend = gemm._resolve_backend(args.backend)
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, backend {backend}, "
          f"{args.layout} layout, {args.precision} precision", flush=True)
    if dev.platform != "gpu":
        print("note: not a GPU; these numbers only check that the benchmark runs", flush=True)
    os.makedirs(args.out, exist_ok=True)
    print(f"per-GPU shard: {args.experts} experts, top-{args.top_k}, H {args.hidden}, "
          f"I {args.inter}", flush=True)
    results = run_layer_cases(args, backend, dev)
    ep = []
    if args.ep_tokens > 0:
        print(f"expert parallelism: device 0 of {args.ep} ({args.experts} of "
              f"{args.experts * args.ep} experts), {args.ep_tokens} tokens", flush=True)
        ep = run_expert_parallel(args, backend, dev)
    meta = {"gpu": dev.device_kind, "platform": dev.platform, "driver": _driver_version(),
            "jax": jax.__version__, "backend": backend, "layout": args.layout,
            "precision": args.precision,
            "config": {"experts": args.experts, "top_k": args.top_k, "hidden": args.hidden,
                       "inter": args.inter, "swiglu_limit": 10.0, "shared_experts": 0},
            "timing": {"target_s": args.target_s, "repeats": args.repeats, "stat": "median ms"},
            "results": results, "expert_parallel": ep}
    with open(os.path.join(args.out, "bench_layer.json"), "w") as fh:
        json.dump(meta, fh, indent=1)
    print("\n| tokens | rows | activation | layer ms | unfused layer ms | gemm1 ms | gemm2 ms | "
          "overhead | reference ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ref = "-" if r["reference_ms"] is None else f"{r['reference_ms']:.3f}"
        unf = "-" if r["layer_unfused_ms"] is None else f"{r['layer_unfused_ms']:.3f}"
        print(f"| {r['tokens']} | {r['rows']} | {r['activation']} | {r['layer_ms']:.3f} | "
              f"{unf} | {r['gemm1_ms']:.3f} | {r['gemm2_ms']:.3f} | "
              f"{100 * r['overhead_share']:.0f}% | {ref} |")
    if ep:
        print(f"\n| EP tokens | activation | device 0 of {args.ep} ms | all rows ms | "
              f"1 device / {args.ep} ms | ratio | routing ms, all tokens | routing ms, slice |")
        print("|---|---|---|---|---|---|---|---|")
        for r in ep:
            print(f"| {r['tokens']} | {r['activation']} | {r['share_ms']:.3f} | "
                  f"{r['share_all_rows_ms']:.3f} | {r['single_ms_over_ep']:.3f} | "
                  f"{r['ratio']:.2f} | {r['route_ms']:.3f} | {r['route_slice_ms']:.3f} |")
    try:
        _plot(results, ep, os.path.join(args.out, "bench_layer.png"))
    except Exception as e:  # noqa: BLE001 - the JSON and the table are already out
        print(f"no plot: {type(e).__name__}: {e}")
    print(f"done in {time.perf_counter() - start:.0f} s")
    return meta


def _plot(results, ep, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(1, 2 if ep else 1, figsize=(12 if ep else 8, 4.5), squeeze=False)
    ax = axes[0, 0]
    labels = [f"{r['tokens']}\n{r['activation']}" for r in results]
    pos = np.arange(len(results))
    g1 = np.array([r["gemm1_ms"] for r in results])
    g2 = np.array([r["gemm2_ms"] for r in results])
    ov = np.array([max(r["overhead_ms"], 0.0) for r in results])
    ax.bar(pos, g1, label="gate/up GEMM")
    ax.bar(pos, g2, bottom=g1, label="down GEMM")
    ax.bar(pos, ov, bottom=g1 + g2, label="rest of the layer")
    for i, r in enumerate(results):
        ax.text(i, r["layer_ms"], f"{100 * r['overhead_share']:.0f}%", ha="center",
                va="bottom", fontsize=8)
    ax.set_xticks(pos, labels, fontsize=8)
    ax.set_ylabel("median ms")
    ax.set_yscale("log")
    ax.set_ylim(bottom=0.5 * min(g1.min(), g2.min()))   # log axes: else the lowest bar can vanish
    ax.set_title("MoE layer per GPU (label: overhead share)")
    ax.legend(fontsize=8)
    if ep:
        ax = axes[0, 1]
        pos = np.arange(len(ep))
        ax.bar(pos - 0.2, [r["share_ms"] for r in ep], 0.4, label="one device's share")
        ax.bar(pos + 0.2, [r["single_ms_over_ep"] for r in ep], 0.4, label="one-device layer / ep")
        ax.set_xticks(pos, [f"{r['tokens']} {r['activation']}" for r in ep], fontsize=8)
        ax.set_ylabel("median ms")
        ax.set_title(f"expert parallelism, ep={ep[0]['ep']}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
