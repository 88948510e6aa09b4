"""Benchmark of the whole MoE layer against its two grouped GEMMs.

    python -m jax_nvfp4.bench.layer [--out bench-layer-out] [--tokens 32,256,1024,4096]
                                    [--precision exact|fp8|auto] [--unfused]

``--precision fp8`` runs the layer's GEMMs in the FP8 mode (``MoEConfig.precision``) on weights
prepared once as e4m3 (``--layout fp8``, the default there: :func:`jax_nvfp4.prepare_weights`
with ``"fp8"``, one byte per weight, read by the CUDA kernel as they lie); ``--layout
checkpoint`` times the mode on the NVFP4 checkpoint-layout weights instead (decoded in the
kernel). ``--precision exact`` takes the NVFP4 layouts only (default sm90). ``--precision auto``
(default layout checkpoint) lets each token count pick its mode (:meth:`jax_nvfp4.MoEConfig.for_tokens`);
each row's ``precision`` is the mode that ran, and its GEMMs are timed in that mode.

Needs a GPU for meaningful numbers; on a CPU it runs at small sizes (``--small``) as a smoke test.

Per-GPU DeepSeek-V4-Pro shard: 48 routed experts, top-6, H 7168, I 3072, SwiGLU limit 10, no
shared expert (it is two more GEMMs of the same kind), random NVFP4 weights
(:func:`jax_nvfp4.bench.common.random_layer`) prepared once in ``--layout``
(:func:`jax_nvfp4.prepare_weights`), bf16 tokens routed by a random router (real routing: uneven
group sizes). For each token count and activation (W4A4 dynamic, W4A16) it times, in one run:

- ``layer_ms``: the jitted layer, :func:`jax_nvfp4.moe`; ``fused_swiglu`` says whether its
  compiled program calls the fused gate/up GEMM + SwiGLU (sm90 weights, exact precision).
  ``--unfused`` also times the same layer on the same sm90 bytes with the gate/up rows unpaired
  (``layer_unfused_ms``: no fused call);
- ``gemm1_ms`` / ``gemm2_ms``: each grouped GEMM alone on the same rows: the layer's routing
  (:func:`jax_nvfp4.route`), the routed rows in a stable order by expert and the group sizes
  (``jnp.argsort``, ``jnp.bincount``), :func:`jax_nvfp4.grouped_gemm` on an lhs of the kind the
  layer's kernels read: bf16 rows for W4A16, for W4A4 the bf16 values of each row's NVFP4
  quantization (its dynamic global scale applied to the output); in the FP8 mode gemm1's rows
  quantized by :func:`jax_nvfp4.ops.fp8.quantize_rows` beforehand (the layer does it in its
  dispatch) and gemm2's bf16 rows quantized in the call (as in the layer). gemm1 is the
  gate/up GEMM with float32 output (also where the layer fuses the SwiGLU into it: the same
  weight bytes and products);
  gemm2 the down GEMM on the SwiGLU rows in the layer's row dtype (bf16), bf16 output;
- ``overhead_share = (layer_ms - gemm1_ms - gemm2_ms) / layer_ms``: routing, dispatch, SwiGLU,
  requantization and combine (less what the fused SwiGLU saves);
- ``reference_ms``: the layer on the pure-jnp reference backend, for scale (slow: XLA's
  ``ragged_dot`` in float32; only up to ``--reference-max-tokens``).

Writes ``bench_layer.json``, ``bench_layer.png`` (matplotlib optional) and the compiled HLO of the
layer at ``--hlo-tokens`` (which kernels it runs) under ``--out``. One device's share of the
expert-parallel layer is timed by ``tools/lab/ep_share_bench.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_nvfp4 as jn
from jax_nvfp4.bench.common import random_layer, run_info, time_ms, write_json
from jax_nvfp4.layer.moe import call_config, gate_up_dtype

ACTIVATIONS = ("w4a4", "w4a16")
LAYOUTS = (*jn.LAYOUTS, jn.Fp8Weights.layout)
"""``--layout``: the NVFP4 byte layouts and ``"fp8"`` (weights prepared as e4m3, fp8 mode only)."""
DEFAULT_LAYOUT = {"exact": "sm90", "fp8": jn.Fp8Weights.layout, "auto": "checkpoint"}
"""``--layout``'s default per ``--precision``: each mode's fastest weights (auto: the layout both
modes read)."""
SMALL = dict(tokens="16,48", experts=8, hidden=128, inter=64, reference_max_tokens=48,
             hlo_tokens=16, target_s=0.02, repeats=3)
"""``--small``: CPU-sized defaults (options given explicitly still win)."""


def layer_config(experts, hidden, inter, top_k, activation, precision="exact"):
    """The benchmarked layer: V4-Pro routing and SwiGLU, no shared expert; ``precision`` its
    GEMMs' compute mode ("exact" or "fp8")."""
    return jn.MoEConfig.deepseek_v4_pro(
        num_experts=experts, top_k=top_k, hidden_size=hidden, intermediate_size=inter,
        n_shared_experts=0, activation=activation, precision=precision)


def routed_rows(x, weights, config):
    """The layer's routed rows: ``(token_of, sizes)``, int32 ``[T * top_k]`` the token of each
    (token, expert) row in a stable order by expert, and int32 ``[E]`` the rows per expert."""
    ids, _ = jn.route(x, weights, config)
    key = ids.reshape(-1)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=config.num_experts).astype(jnp.int32)
    return (order // config.top_k).astype(jnp.int32), sizes


def gemm_lhs(rows, config, backend="auto"):
    """A grouped GEMM's lhs of the kind the layer's kernel reads, from float ``[R, K]`` rows, and
    the float32 ``[R]`` scales to apply to its output rows (W4A4) or None (W4A16).

    W4A16: the rows in bf16. W4A4: each row quantized to NVFP4 with its own dynamic global scale
    (:func:`jax_nvfp4.quantize` per row), the bf16 values ``e2m1 * block scale`` (exact in bf16),
    and the global scales. FP8 mode: those bf16 rows quantized by
    :func:`jax_nvfp4.ops.fp8.quantize_rows` in the kernel's k order, as the layer's dispatch call
    writes both GEMMs' inputs.
    """
    if config.activation == "w4a4":
        q = jax.vmap(jn.quantize)(rows)
        unit = jn.NVFP4Tensor(q.data, q.scales, jnp.ones_like(q.global_scale))
        lhs, row_scale = jn.dequantize(unit, jnp.bfloat16), q.global_scale
    else:
        lhs, row_scale = rows.astype(jnp.bfloat16), None
    if config.precision == "fp8":
        lhs = jn.fp8.quantize_rows(lhs, k_order="kernel",
                                   backend="reference" if backend == "reference" else "auto")
    return lhs, row_scale


def _scaled(out, row_scale):
    """float32 ``out`` times each row's scale (none: 1), as the layer widens a GEMM's output."""
    out = out.astype(jnp.float32)
    return out if row_scale is None else out * row_scale[:, None]


def swiglu_rows(lhs1, s1, weights, sizes, config, backend="auto"):
    """The down GEMM's input rows: the SwiGLU of the gate/up GEMM's output, float32 ``[R, I]``
    holding row-dtype (bf16) values. Paired gate/up weights (``weights.w13_paired``) in exact
    precision take :func:`jax_nvfp4.grouped_gemm_swiglu` (the fused call); else
    :func:`jax_nvfp4.grouped_gemm` then :func:`jax_nvfp4.swiglu` (on the paired columns put back
    in gate | up order by :func:`jax_nvfp4.ops.reference.split_paired`)."""
    row_dtype = jnp.dtype(config.row_dtype)
    if weights.w13_paired and config.precision == "exact":
        act = jn.grouped_gemm_swiglu(lhs1, weights.w13, sizes, row_scale=s1,
                                     limit=config.swiglu_limit, out_dtype=row_dtype,
                                     backend=backend)
        return act.astype(jnp.float32)
    h = _scaled(jn.grouped_gemm(lhs1, weights.w13, sizes, out_dtype=gate_up_dtype(config),
                                backend=backend, precision=config.precision), s1)
    if weights.w13_paired:
        h = jnp.concatenate(jn.reference.split_paired(h), axis=-1)
    return jn.swiglu(h, config.swiglu_limit).astype(row_dtype).astype(jnp.float32)


def gemm_inputs(x, token_of, sizes, weights, config, backend="auto"):
    """``(lhs1, s1, lhs2, s2)``: the two grouped GEMMs' inputs on the routed rows ``x[token_of]``
    (:func:`gemm_lhs`), the second made from the first GEMM's output (:func:`swiglu_rows`)."""
    @jax.jit
    def inputs(x, token_of, weights, sizes):
        lhs1, s1 = gemm_lhs(x[token_of], config, backend)
        lhs2, s2 = gemm_lhs(swiglu_rows(lhs1, s1, weights, sizes, config, backend), config,
                            backend)
        return lhs1, s1, lhs2, s2

    return inputs(x, token_of, weights, sizes)


def gemm_cases(x, token_of, sizes, weights, config, backend="auto"):
    """The two grouped GEMMs alone on the same rows: ``(gemm1, args1), (gemm2, args2)``, jitted.
    gemm1: gate/up, ``[R, 2I]`` out in the layer's dtype for it
    (:func:`jax_nvfp4.layer.moe.gate_up_dtype`: float32, bf16 in the fp8 mode); gemm2: down, ``[R, H]``
    in the row dtype (bf16).
    Their output rows are before the W4A4 row scales (:func:`gemm_inputs`' s1, s2)."""
    lhs1, _, lhs2, _ = gemm_inputs(x, token_of, sizes, weights, config, backend)

    def gemm1(lhs, w, sizes):
        return jn.grouped_gemm(lhs, w, sizes, out_dtype=gate_up_dtype(config), backend=backend,
                               precision=config.precision)

    def gemm2(lhs, w, sizes):
        return jn.grouped_gemm(lhs, w, sizes, out_dtype=jnp.dtype(config.row_dtype),
                               backend=backend, precision=config.precision)

    return ((jax.jit(gemm1), (lhs1, weights.w13, sizes)),
            (jax.jit(gemm2), (lhs2, weights.w2, sizes)))


FUSED_TARGET = jn.gemm.GLU_TARGET
"""The custom call of :func:`jax_nvfp4.grouped_gemm_swiglu`, as it appears in a lowered program."""


def run_layer_cases(args, dev, log=print):
    """The per-GPU shard: layer, its GEMMs and the reference, per token count and activation."""
    results = []
    base = layer_config(args.experts, args.hidden, args.inter, args.top_k, "w4a4", args.precision)
    weights = random_layer(base, seed=args.seed, device=dev)
    if args.layout != "checkpoint":
        with jax.default_device(dev):
            weights = jn.prepare_weights(weights, args.layout)
    unfused = None
    if args.unfused and weights.w13_paired:
        # The same sm90 bytes with the stored gate/up row order: the layer's unfused path.
        with jax.default_device(dev):
            unfused = dataclasses.replace(weights, w13=jn.layout.unpair_gate_up(weights.w13),
                                          w13_paired=False)
    timing = dict(target_s=args.target_s, repeats=args.repeats)
    backend = args.backend
    for t in args.tokens:
        x = jax.device_put(jax.random.normal(jax.random.key(args.seed + t), (t, args.hidden),
                                             jnp.bfloat16), dev)
        token_of, sizes = jax.jit(routed_rows, static_argnums=2)(x, weights, base)
        rows = int(np.asarray(sizes).sum())
        for activation in args.activations:
            cfg = dataclasses.replace(base, activation=activation)
            ran = call_config(cfg, t, weights, backend)   # precision="auto": the mode this count runs

            def layer(x, w, cfg=cfg):
                return jn.moe(x, w, cfg, backend=backend)

            layer_ms = time_ms(jax.jit(layer), x, weights, **timing)
            unfused_ms = None if unfused is None else time_ms(jax.jit(layer), x, unfused, **timing)
            if t == args.hlo_tokens:   # which kernels the layer runs
                path = os.path.join(args.out, f"layer_hlo_T{t}_{activation}.txt")
                with open(path, "w") as fh:
                    fh.write(jax.jit(layer).lower(x, weights).compile().as_text())
            fused = FUSED_TARGET in jax.jit(layer).lower(x, weights).as_text()
            (g1, a1), (g2, a2) = gemm_cases(x, token_of, sizes, weights, ran, backend)
            gemm1_ms = time_ms(g1, *a1, **timing)
            gemm2_ms = time_ms(g2, *a2, **timing)
            del a1, a2
            gemm_ms = gemm1_ms + gemm2_ms
            r = {"tokens": t, "rows": rows, "activation": activation, "precision": ran.precision,
                 "layer_ms": layer_ms, "fused_swiglu": fused,
                 "layer_unfused_ms": unfused_ms,
                 "gemm_ms": gemm_ms, "gemm1_ms": gemm1_ms, "gemm2_ms": gemm2_ms,
                 "overhead_ms": layer_ms - gemm_ms,
                 "overhead_share": (layer_ms - gemm_ms) / layer_ms,
                 "experts_with_rows": int((np.asarray(sizes) > 0).sum()),
                 "max_group": int(np.asarray(sizes).max()), "reference_ms": None}
            if t <= args.reference_max_tokens:
                def reference(x, w, cfg=cfg):
                    return jn.moe(x, w, cfg, backend="reference")
                try:
                    r["reference_ms"] = time_ms(jax.jit(reference), x, weights,
                                                target_s=args.target_s,
                                                repeats=min(3, args.repeats))
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


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m jax_nvfp4.bench.layer",
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
    p.add_argument("--layout", choices=LAYOUTS, default=None,
                   help="weights prepared once at load time (jax_nvfp4.prepare_weights): sm90 or "
                        "checkpoint (NVFP4), or fp8 (e4m3, one byte per weight; --precision fp8 "
                        "only); default: sm90 with --precision exact, fp8 with --precision fp8")
    p.add_argument("--unfused", action="store_true",
                   help="also time the layer without the fused gate/up + SwiGLU call (the same "
                        "sm90 weights with gate/up rows unpaired): layer_unfused_ms")
    p.add_argument("--precision", choices=jn.options.LAYER_PRECISIONS, default="exact",
                   help="the layer's GEMM compute mode (MoEConfig.precision; auto: per token count)")
    p.add_argument("--backend", choices=("auto", "ffi", "reference"), default="auto",
                   help="grouped GEMM backend of the timed layer")
    p.add_argument("--reference-max-tokens", type=int, default=256,
                   help="time the reference-backend layer only up to this many tokens (0: never; "
                        "it is slow: float32 ragged_dot over every expert)")
    p.add_argument("--hlo-tokens", type=int, default=1024,
                   help="write the compiled HLO of the layer at this token count (one of "
                        "--tokens; 0: none) to layer_hlo_T<tokens>_<activation>.txt")
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
    for name in ("experts", "top_k", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    if args.top_k > args.experts:
        p.error(f"--top-k {args.top_k} > --experts {args.experts}")
    if args.layout is None:
        args.layout = DEFAULT_LAYOUT[args.precision]
    if args.layout == jn.Fp8Weights.layout and args.precision != "fp8":
        p.error(f"--layout {args.layout}: weights prepared as e4m3 serve --precision fp8 only, "
                f"got --precision {args.precision}")
    dev = jax.devices()[0]
    ext = jn.extension_info()
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, backend "
          f"{args.backend} (extension built: {ext.built}, CUDA handler: {ext.cuda}), "
          f"{args.layout} layout, {args.precision} precision", flush=True)
    if dev.platform != "gpu":
        print("note: not a GPU; these numbers only check that the benchmark runs", flush=True)
    os.makedirs(args.out, exist_ok=True)
    print(f"per-GPU shard: {args.experts} experts, top-{args.top_k}, H {args.hidden}, "
          f"I {args.inter}", flush=True)
    results = run_layer_cases(args, dev)
    meta = {**run_info(dev), "backend": args.backend,
            "extension": {"built": ext.built, "cuda": ext.cuda},
            "layout": args.layout, "precision": args.precision,
            "config": {"experts": args.experts, "top_k": args.top_k, "hidden": args.hidden,
                       "inter": args.inter, "swiglu_limit": 10.0, "shared_experts": 0},
            "timing": {"target_s": args.target_s, "repeats": args.repeats, "stat": "median ms"},
            "results": results}
    write_json(os.path.join(args.out, "bench_layer.json"), meta)
    print("\n| tokens | rows | activation | layer ms | unfused layer ms | gemm1 ms | gemm2 ms | "
          "overhead | reference ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ref = "-" if r["reference_ms"] is None else f"{r['reference_ms']:.3f}"
        unf = "-" if r["layer_unfused_ms"] is None else f"{r['layer_unfused_ms']:.3f}"
        print(f"| {r['tokens']} | {r['rows']} | {r['activation']} | {r['layer_ms']:.3f} | "
              f"{unf} | {r['gemm1_ms']:.3f} | {r['gemm2_ms']:.3f} | "
              f"{100 * r['overhead_share']:.0f}% | {ref} |")
    try:
        _plot(results, os.path.join(args.out, "bench_layer.png"))
    except Exception as e:  # noqa: BLE001 - the JSON and the table are already out
        print(f"no plot: {type(e).__name__}: {e}")
    print(f"done in {time.perf_counter() - start:.0f} s")
    return meta


def _plot(results, path):
    try:
        import matplotlib  # noqa: PLC0415 - optional (the bench extra)
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
