"""Benchmark and check of the expert-parallel MoE layer on the devices present.

    python -m jax_nvfp4.bench.ep [--tokens 256,8192] [--ep 8] [--capacity-factor 1.25|none]
        [--out bench-ep-out]

DeepSeek-V4-Pro layer shapes (H 7168, I 3072, 384 experts, top-6, one shared expert) with random
NVFP4 weights. Per token count it runs the layer on one device (:func:`jax_nvfp4.moe`, all
experts there) and on ``--ep`` devices (:func:`jax_nvfp4.moe_expert_parallel`, E/ep experts
each) with both combines, and prints:

- max |EP - single| over the output, against the bound for float32 summation-order rounding
  (float32 tokens, so the output is float32 and not rounded to bf16): ``--rtol`` times the
  largest output magnitude, per token row;
- median ms of the whole layer, of the collective alone (the same psum / psum_scatter on a
  float32 ``[T, H]`` per device, what the layer's combine moves) and the collective's share.

On CPU, use small shapes (``--experts 16 --hidden 256 --inter 128``) and 8 host devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``); ``--platform cpu`` picks those on a
machine whose default backend is a GPU.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nvfp4 as jn
from jax_nvfp4.bench.common import random_layer, run_info, time_ms, write_json

COMBINES = jn.options.COMBINES
"""The combines of :func:`jax_nvfp4.moe_expert_parallel` timed and checked (all of them)."""
DEFAULT_CAPACITY_FACTOR = inspect.signature(jn.moe_expert_parallel).parameters[
    "capacity_factor"].default
"""The layer's own default ``capacity_factor``."""


def collective_fn(mesh, combine, axis_name="ep"):
    """The layer's combine alone: psum / psum_scatter of a float32 [T, H] per device."""
    out_spec = P() if combine == "psum" else P(axis_name)

    def body(part):
        part = part[0]
        if combine == "psum":
            return jax.lax.psum(part, axis_name)
        return jax.lax.psum_scatter(part, axis_name, scatter_dimension=0, tiled=True)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis_name), out_specs=out_spec))


def _capacity_factor(text):
    return None if text.lower() == "none" else float(text)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jax_nvfp4.bench.ep",
                                description=__doc__.splitlines()[0],
                                epilog="Needs a GPU for meaningful numbers (the custom call's CUDA handler); "
                                       "--platform cpu runs on 8 CPU devices as a functional "
                                       "check only.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tokens", default="256,8192", help="comma list of token counts T")
    p.add_argument("--ep", type=int, default=None, help="devices on the expert axis (default all)")
    p.add_argument("--platform", choices=("cpu", "gpu"), default=None,
                   help="whose devices to use (default: JAX's default backend)")
    p.add_argument("--experts", type=int, default=384, help="routed experts E")
    p.add_argument("--hidden", type=int, default=7168, help="H")
    p.add_argument("--inter", type=int, default=3072, help="I")
    p.add_argument("--activation", choices=("w4a4", "w4a16"), default="w4a4", help="GEMM inputs")
    p.add_argument("--layout", choices=jn.LAYOUTS, default="sm90",
                   help="weight layout (sm90: prepared once at load time, the fast path)")
    p.add_argument("--rtol", type=float, default=1e-5,
                   help="bound on |EP - single| relative to the row's largest |output|")
    p.add_argument("--capacity-factor", type=_capacity_factor,
                   default=DEFAULT_CAPACITY_FACTOR,
                   help="moe_expert_parallel's capacity_factor (default: the layer's, "
                        f"{DEFAULT_CAPACITY_FACTOR}; 'none': all rows on every device)")
    p.add_argument("--out", default=None, help="folder for bench_ep.json")
    return p


def _measure_combine(combine, config, mesh, ep, xr, sharded, ref, row_max, args, timer) -> dict:
    """Times moe_expert_parallel with one combine and its collective alone, and compares the
    output with the single-device layer's ``ref`` (relative to each row's largest |output|)."""
    t = xr.shape[0]
    f = jax.jit(lambda x, w: jn.moe_expert_parallel(
        x, w, config, mesh, combine=combine, capacity_factor=args.capacity_factor))
    out = np.asarray(f(xr, sharded))
    diff = np.abs(out - ref)
    rel = float((diff / row_max).max())         # NaN anywhere -> NaN -> not ok
    ok = rel <= args.rtol
    ms = timer(f, xr, sharded)
    part = jax.device_put(jnp.ones((ep, t, config.hidden_size), jnp.float32),
                          NamedSharding(mesh, P("ep")))
    ms_coll = timer(collective_fn(mesh, combine), part)
    print(f"  ep={ep} {combine:12s}: {ms:8.3f} ms, collective alone {ms_coll:7.3f} ms "
          f"({100 * ms_coll / ms:4.1f}%), max |EP - single| {diff.max():.2e} "
          f"(max rel {rel:.1e}, "
          f"{'OK' if ok else 'FAIL'} at rtol {args.rtol:g})", flush=True)
    return {"ms": round(ms, 4), "collective_ms": round(ms_coll, 4),
            "collective_share": round(ms_coll / ms, 3), "max_abs_diff": float(diff.max()),
            "max_rel_diff": rel, "within_rtol": ok}


def _print_table(results, ep):
    """The markdown table of the results."""
    print(f"\n| T | single (ms) | ep={ep} psum (ms) | psum alone | ep={ep} psum_scatter (ms) "
          f"| psum_scatter alone | max rel diff | ok |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        a, b = r.get("psum", {}), r.get("psum_scatter", {})
        rel = max(a.get("max_rel_diff", 0), b.get("max_rel_diff", 0))
        ok = a.get("within_rtol", True) and b.get("within_rtol", True)
        print(f"| {r['tokens']} | {r['single_ms']:.3f} | {a.get('ms', float('nan')):.3f} | "
              f"{a.get('collective_ms', float('nan')):.3f} | {b.get('ms', float('nan')):.3f} | "
              f"{b.get('collective_ms', float('nan')):.3f} | {rel:.1e} | {ok} |")


def _setup(p, args):
    """(devices, ep, token counts, MoEConfig) from the arguments; argparse errors for bad ones."""
    try:
        devices = jax.devices(args.platform) if args.platform else jax.devices()
    except RuntimeError as e:
        p.error(f"--platform {args.platform}: no such devices ({e})")
    ndev = len(devices)
    ep = args.ep or ndev
    if not 1 <= ep <= ndev:
        p.error(f"--ep {ep}: expected 1..{ndev} (devices present)")
    tokens = [int(t) for t in args.tokens.split(",") if t]
    config = jn.MoEConfig.deepseek_v4_pro(
        num_experts=args.experts, hidden_size=args.hidden, intermediate_size=args.inter,
        activation=args.activation)
    if config.num_experts % ep:
        p.error(f"--experts {config.num_experts} is not divisible by --ep {ep}")
    return devices, ep, tokens, config


def main(argv=None):
    p = _parser()
    args = p.parse_args(argv)

    devices, ep, tokens, config = _setup(p, args)
    ndev, dev0 = len(devices), devices[0]
    print(f"devices: {ndev} x {dev0.device_kind} ({dev0.platform}), jax {jax.__version__}; "
          f"layer E={config.num_experts} top-{config.top_k} H={config.hidden_size} "
          f"I={config.intermediate_size} +{config.n_shared_experts} shared, {config.activation}, "
          f"{args.layout} layout; ep={ep} ({config.num_experts // ep} experts/device), "
          f"capacity_factor {args.capacity_factor}", flush=True)

    # XLA:CPU runs each device's part of a collective on a shared thread pool: with several
    # multi-device calls in flight on a small machine the all-reduce rendezvous can starve and
    # abort, so on CPU every timed call is waited for.
    timer = functools.partial(time_ms, wait_each=dev0.platform == "cpu")
    weights = random_layer(config, device=dev0)
    if args.layout != "checkpoint":
        with jax.default_device(dev0):
            weights = jn.prepare_weights(weights, args.layout)
    mesh = jax.make_mesh((ep,), ("ep",), devices=devices[:ep])
    sharded = jn.shard_moe_weights(weights, mesh)
    single = jax.jit(lambda x, w: jn.moe(x, w, config))
    results = []
    for t in tokens:
        x = jax.device_put(jax.random.normal(jax.random.key(t), (t, config.hidden_size),
                                             jnp.float32), dev0)
        ref = np.asarray(single(x, weights))
        row_max = np.abs(ref).max(axis=1, keepdims=True) + 1e-30   # the bound is per token row
        ms_single = timer(single, x, weights)
        row = {"tokens": t, "single_ms": round(ms_single, 4)}
        print(f"T={t:6d} single device ({config.num_experts} experts): {ms_single:8.3f} ms",
              flush=True)
        xr = jax.device_put(x, NamedSharding(mesh, P()))
        for combine in COMBINES:
            if combine == "psum_scatter" and t % ep:
                print(f"  {combine}: skipped (T={t} not divisible by {ep})")
                continue
            row[combine] = _measure_combine(combine, config, mesh, ep, xr, sharded, ref, row_max,
                                            args, timer)
        results.append(row)
    meta = {**run_info(dev0), "devices": ndev, "ep": ep, "config": {
                "experts": config.num_experts, "top_k": config.top_k,
                "hidden": config.hidden_size, "inter": config.intermediate_size,
                "activation": config.activation, "layout": args.layout,
                "capacity_factor": args.capacity_factor},
            "results": results}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        write_json(os.path.join(args.out, "bench_ep.json"), meta)
    _print_table(results, ep)
    if not all(r.get(c, {}).get("within_rtol", True) for r in results for c in COMBINES):
        raise SystemExit("expert-parallel output differs from the single-device layer")
    return meta


if __name__ == "__main__":
    main()
