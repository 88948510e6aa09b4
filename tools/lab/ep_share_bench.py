"""One device's share of an ep-way expert-parallel MoE layer, simulated on one device, beside 1/ep
of the one-device layer with all experts.

    python3 -P tools/lab/ep_share_bench.py [--ep 8] [--tokens 8192] [--json PATH] [--small]

bench_layer's per-GPU V4-Pro shard (``--experts`` of ``--experts x --ep`` experts, top-6, H 7168,
I 3072, no shared expert, sm90 weights), ``--tokens`` tokens routed over all experts, only this
device's experts' rows computed. The share is :func:`device_share`, what
:func:`jax_nvfp4.moe_expert_parallel` runs on device 0 except its two collectives: device 0
routes its own ``ceil(T / ep)`` tokens (``sharding.route_token_slice``, timed), and the
all-gather that would bring the other devices' routing decisions is replaced by an input holding
them (computed once, untimed; the real all-gather moves ``T * top_k * 8`` bytes); then
``sharding.local_routed_experts`` on those decisions; the combine is not timed. ``route_ms`` is
the router over all T tokens (what every device ran before the token slice), ``route_slice_ms``
over device 0's slice. Lab code: it calls internals of jax_nvfp4.layer.sharding and jax_nvfp4.moe.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import jax_nvfp4 as jn
from jax_nvfp4.layer import sharding
from jax_nvfp4.bench.common import random_layer, run_info, time_ms, write_json
from jax_nvfp4.bench.layer import layer_config
from jax_nvfp4.layer.moe import row_ladder

SMALL = dict(experts=8, hidden=128, inter=64, ep=4, tokens=64, target_s=0.02, repeats=3)


def local_weights(weights: jn.MoEWeights, start, count):
    """Experts ``start .. start + count`` of the routed experts (the router stays whole): what one
    device holds under expert parallelism (:func:`jax_nvfp4.shard_moe_weights`)."""
    cut = lambda v: None if v is None else jax.tree.map(  # noqa: E731
        lambda a: a[start:start + count], v)
    return dataclasses.replace(weights, **{f: cut(getattr(weights, f))
                                           for f in ("w13", "w2", "w13_input_scale",
                                                     "w2_input_scale")})


def device_share(x, weights, config, ids_all, rw_all, *, ep, backend="auto",
                 capacity_factor=sharding.DEFAULT_CAPACITY_FACTOR):
    """Device 0's share of the ep-way layer on one device: its token slice routed here, the other
    slices' decisions taken from ``ids_all`` / ``rw_all`` (int32 / float32 ``[T, top_k]``,
    :func:`jax_nvfp4.route` of all tokens, standing in for the all-gather), then its experts'
    rows. ``weights``: device 0's experts, the whole router. Returns float32 ``[T, H]``, equal to
    ``local_routed_experts(x, weights, ..., device_index=0)``."""
    ids, rw = sharding.route_token_slice(x, weights, config, device_index=0, devices=ep)
    routing = tuple(jax.lax.dynamic_update_slice_in_dim(full, mine, 0, 0)
                    for full, mine in ((ids_all, ids), (rw_all, rw)))
    return sharding.local_routed_experts(x, weights, config, device_index=0, devices=ep,
                                         backend=backend, capacity_factor=capacity_factor,
                                         routing=routing)


def check_share(x, weights, mine, config, ids, rw, ep):
    """device_share equals device 0's share with all tokens routed on it, bit for bit."""
    want = jax.jit(lambda x, wl: sharding.local_routed_experts(
        x, wl, config, device_index=0, devices=ep))(x, mine)
    got = jax.jit(lambda x, wl, i, r: device_share(x, wl, config, i, r, ep=ep))(x, mine, ids, rw)
    return bool(np.array_equal(np.asarray(got), np.asarray(want)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help=f"CPU-sized: {SMALL}")
    ap.add_argument("--experts", type=int, default=48, help="experts per device")
    ap.add_argument("--ep", type=int, default=8, help="devices (experts in all: experts x ep)")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=3072)
    ap.add_argument("--precision", choices=("exact", "fp8"), default="exact")
    ap.add_argument("--activations", default="w4a4,w4a16")
    ap.add_argument("--target-s", type=float, default=0.25)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default=None)
    if ap.parse_known_args(argv)[0].small:
        ap.set_defaults(**SMALL)
    a = ap.parse_args(argv)
    dev = jax.devices()[0]
    total = a.experts * a.ep
    base = layer_config(total, a.hidden, a.inter, a.top_k, "w4a4", a.precision)
    weights = random_layer(base, seed=a.seed, device=dev)
    if a.precision == "exact":
        weights = jn.prepare_weights(weights)
    mine = local_weights(weights, 0, a.experts)
    t = a.tokens
    x = jax.random.normal(jax.random.key(a.seed + t), (t, a.hidden), jnp.bfloat16)
    ids, rw = jax.jit(jn.route, static_argnums=2)(x, weights, base)   # the gathered decisions
    own = int((np.asarray(ids) < a.experts).sum())
    cf = sharding.DEFAULT_CAPACITY_FACTOR
    ladder = row_ladder(sharding.device_capacity(t, a.top_k, a.ep, cf), t * a.top_k)
    timing = dict(target_s=a.target_s, repeats=a.repeats)
    route_ms = time_ms(jax.jit(lambda x, w: jn.route(x, w, base)), x, weights, **timing)
    route_slice_ms = time_ms(jax.jit(lambda x, w: sharding.route_token_slice(
        x, w, base, device_index=0, devices=a.ep)), x, weights, **timing)
    rows = []
    for act in a.activations.split(","):
        cfg = dataclasses.replace(base, activation=act)
        single_ms = time_ms(jax.jit(lambda x, w, cfg=cfg: jn.moe(x, w, cfg)), x, weights, **timing)
        share = jax.jit(lambda x, w, i, r, cfg=cfg: device_share(x, w, cfg, i, r, ep=a.ep))
        all_rows = jax.jit(lambda x, w, i, r, cfg=cfg: device_share(x, w, cfg, i, r, ep=a.ep,
                                                                    capacity_factor=None))
        share_ms = time_ms(share, x, mine, ids, rw, **timing)
        all_rows_ms = time_ms(all_rows, x, mine, ids, rw, **timing)
        r = {"tokens": t, "activation": act, "precision": a.precision, "experts": total,
             "ep": a.ep, "local_experts": a.experts, "own_rows": own, "rows": t * a.top_k,
             "rows_run": next(n for n in ladder if n >= own), "capacity_factor": cf,
             "single_ms": single_ms, "single_ms_over_ep": single_ms / a.ep,
             "share_ms": share_ms, "share_all_rows_ms": all_rows_ms,
             "ratio": share_ms / (single_ms / a.ep), "route_ms": route_ms,
             "route_slice_ms": route_slice_ms,
             "share_equals_device_0": check_share(x, weights, mine, cfg, ids, rw, a.ep)}
        rows.append(r)
        print(f"T={t} {act:5s}: one device of {a.ep} ({own} own rows of {t * a.top_k}, runs "
              f"{r['rows_run']}): {share_ms:8.3f} ms (all rows: {all_rows_ms:8.3f}); one device, "
              f"{total} experts: {single_ms:8.3f} ms, /{a.ep} = {single_ms / a.ep:7.3f}; ratio "
              f"{r['ratio']:.2f}; routing {route_ms:.3f} ms (all tokens), {route_slice_ms:.3f} "
              f"ms (the slice); share equals device 0's: {r['share_equals_device_0']}", flush=True)
    if a.json:
        write_json(a.json, {**run_info(dev), "results": rows})
    return rows


if __name__ == "__main__":
    main()
