"""Per-kernel device time of the whole MoE layer, from a profiler trace: what each XLA fusion and
custom-call kernel of one jitted layer call costs on the GPU (bench_layer's per-GPU V4-Pro shard:
48 experts, top-6, H 7168, I 3072, sm90-prepared weights, real routing from a random router).

    python tools/lab/layer_profile.py [--tokens 1024,4096] [--activations w4a4,w4a16] [--json F]

Unlike layer_breakdown.py (each stage jitted alone), this times the layer as XLA compiled it,
fusions across stage boundaries included. Prints one table per case: kernel name, calls per layer,
microseconds per layer, share of the summed kernel time; the sum and the layer's wall-clock median
last (their difference is launch gaps and host time).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import os
import tempfile

import jax
import jax.numpy as jnp

from jax_nvfp4 import prepare
from jax_nvfp4.bench.common import random_layer, run_info, time_ms, write_json
from jax_nvfp4.bench.layer import layer_config
from jax_nvfp4.moe import moe as moe_layer


def kernel_times(f, args, iters, gaps=None):
    """{kernel name: (calls, total ns)} over ``iters`` calls of f(*args), from the device planes.
    ``gaps``: a dict that receives {(stream, kernel before, kernel after): total idle ns} between
    consecutive kernels of each stream (the launch gaps, and any wait for the host)."""
    jax.block_until_ready(f(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(iters):
                out = f(*args)
            jax.block_until_ready(out)
        paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            raise RuntimeError(f"no xplane.pb written under {d}")
        data = jax.profiler.ProfileData.from_file(paths[0])
    acc = collections.defaultdict(lambda: [0, 0])
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            evs = sorted(line.events, key=lambda e: e.start_ns)
            for ev in evs:
                a = acc[ev.name]
                a[0] += 1
                a[1] += ev.duration_ns
            if gaps is not None:
                for prev, nxt in zip(evs, evs[1:]):
                    idle = nxt.start_ns - (prev.start_ns + prev.duration_ns)
                    key = (line.name, prev.name[:60], nxt.name[:60])
                    gaps[key] = gaps.get(key, 0) + idle
    if not acc:     # say what the trace held instead (CPU runs, a renamed plane or line)
        print("no GPU stream events; planes:", {p.name: [l.name for l in p.lines] for p in data.planes})
    return dict(acc)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1024,4096")
    ap.add_argument("--activations", default="w4a4,w4a16")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--small", action="store_true", help="CPU-sized shapes (no device planes)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    experts, hidden, inter = (8, 128, 64) if a.small else (48, 7168, 3072)
    base = layer_config(experts, hidden, inter, 6, "w4a4")
    weights = prepare.prepare_weights(random_layer(base, seed=0), "sm90")
    results = []
    for t in (int(v) for v in a.tokens.split(",")):
        x = jax.random.normal(jax.random.key(t), (t, hidden), jnp.bfloat16)
        for activation in a.activations.split(","):
            cfg = dataclasses.replace(base, activation=activation)
            f = jax.jit(lambda x, w, cfg=cfg: moe_layer(x, w, cfg))
            wall = time_ms(f, x, weights, target_s=0.25, repeats=5)
            gaps = {}
            k = kernel_times(f, (x, weights), a.iters, gaps)
            rows = sorted(((name, c / a.iters, ns / a.iters / 1e3) for name, (c, ns) in k.items()),
                          key=lambda r: -r[2])
            total = sum(r[2] for r in rows)
            print(f"\n## {activation}, {t} tokens: layer {wall:.3f} ms wall, kernels {total / 1e3:.3f} ms")
            print("| kernel | calls | us | share |\n|---|---|---|---|")
            for name, calls, us in rows:
                print(f"| {name[:90]} | {calls:g} | {us:.1f} | {us / total:.1%} |")
            top = sorted(gaps.items(), key=lambda kv: -kv[1])[:8]
            print(f"idle between kernels, per call: {sum(gaps.values()) / a.iters / 1e3:.1f} us "
                  "(a call's last kernel to the next call's first included); largest:")
            for (stream, before, after), ns in top:
                print(f"  {ns / a.iters / 1e3:7.1f} us  {stream}: {before} -> {after}")
            results.append({"tokens": t, "activation": activation, "layer_ms": wall,
                            "kernels_ms": total / 1e3,
                            "kernels": [{"name": n, "calls": c, "us": u} for n, c, u in rows]})
    if a.json:
        write_json(a.json, {**run_info(), "results": results})


if __name__ == "__main__":
    main()
