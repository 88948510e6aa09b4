"""Expert parallelism: a small V4-shaped NVFP4 MoE layer with its experts split over devices.

Shards the routed experts over a 1-D "ep" mesh (jax_nvfp4.shard_moe_weights), runs
jax_nvfp4.moe_expert_parallel jitted with both combines (psum -> replicated output,
psum_scatter -> output sharded on tokens) and compares it with the single-device
jax_nvfp4.moe. On CPU it asks for 8 host devices (unless a GPU/TPU platform is requested
through JAX_PLATFORMS), so it runs on a laptop:

    python examples/expert_parallel.py [--tokens 64] [--experts 16] [--ep 8]
"""

import os

_platforms = os.environ.get("JAX_PLATFORMS", "").lower()
if not any(p in _platforms for p in ("cuda", "gpu", "rocm", "tpu")):
    # must happen before JAX starts its backends; only affects the CPU platform
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

if not any(p in _platforms for p in ("cuda", "gpu", "rocm", "tpu")):
    try:
        jax.config.update("jax_num_cpu_devices", 8)
    except (AttributeError, RuntimeError):   # older jax, or backends already up: XLA_FLAGS did it
        pass

import jax_nvfp4 as jn  # noqa: E402


def time_call(f, *args, n=5):
    """Seconds per call of an already-compiled f (after one warm-up call).

    Each call is waited for: with several multi-device calls in flight, XLA:CPU's collectives
    can starve on a small machine's thread pool (the all-reduce rendezvous then aborts).
    """
    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    for _ in range(n):
        jax.block_until_ready(f(*args))
    return (time.perf_counter() - t0) / n


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64, help="tokens T (default 64)")
    p.add_argument("--experts", type=int, default=16, help="routed experts E (default 16)")
    p.add_argument("--ep", type=int, default=None,
                   help="devices on the expert axis (default: the most devices that divide E)")
    p.add_argument("--hidden", type=int, default=256, help="H (default 256)")
    p.add_argument("--inter", type=int, default=128, help="I (default 128)")
    p.add_argument("--activation", choices=("w4a4", "w4a16"), default="w4a4")
    p.add_argument("--iters", type=int, default=5, help="timed calls per variant")
    args = p.parse_args()

    ndev = jax.device_count()
    e, h, i, t = args.experts, args.hidden, args.inter, args.tokens
    ep = args.ep or max(d for d in range(1, ndev + 1) if e % d == 0)
    if ep > ndev:
        p.error(f"--ep {ep}: only {ndev} devices")
    if e % ep:
        p.error(f"--experts {e} must be divisible by --ep {ep}")

    config = jn.MoEConfig.deepseek_v4_pro(num_experts=e, hidden_size=h, intermediate_size=i,
                                          top_k=min(6, e), activation=args.activation)
    keys = jax.random.split(jax.random.key(0), 7)
    normal = lambda k, shape, fan_in: jax.random.normal(k, shape) * fan_in ** -0.5  # noqa: E731
    weights = jn.quantize_moe(
        normal(keys[0], (e, h), h), normal(keys[1], (e, 2 * i, h), h), normal(keys[2], (e, h, i), i),
        router_bias=jax.random.normal(keys[3], (e,)) * 0.01,
        shared_w13=normal(keys[4], (2 * i, h), h), shared_w2=normal(keys[5], (h, i), i))
    # float32 tokens, so the outputs are not rounded to bf16 and the comparison shows the
    # float32 summation-order difference only (bf16 x works the same way)
    x = jax.random.normal(keys[6], (t, h), jnp.float32)

    print(f"jax {jax.__version__}, {ndev} {jax.devices()[0].platform} devices; "
          f"extension built: {jn.extension_info().built}")
    print(f"layer: {e} experts (top-{config.top_k}) + shared expert, H={h}, I={i}, {t} tokens, "
          f"{args.activation}; expert axis: {ep} devices, {e // ep} experts each")

    single = jax.jit(lambda x, w: jn.moe(x, w, config))
    ref = np.asarray(single(x, weights))
    print(f"single device     : {time_call(single, x, weights, n=args.iters) * 1e3:8.2f} ms/call")

    mesh = jax.make_mesh((ep,), ("ep",), devices=jax.devices()[:ep])
    sharded = jn.shard_moe_weights(weights, mesh)
    per_dev = sharded.w13.data.addressable_shards[0].data.shape
    print(f"w13 data on each device: {per_dev} of {weights.w13.data.shape}")
    for combine in ("psum", "psum_scatter"):
        if combine == "psum_scatter" and t % ep:
            print(f"{combine:12s}: skipped (T={t} not divisible by {ep})")
            continue
        f = jax.jit(lambda x, w, c=combine: jn.moe_expert_parallel(x, w, config, mesh, combine=c))
        out = f(x, sharded)
        diff = float(np.abs(np.asarray(out) - ref).max())
        ms = time_call(f, x, sharded, n=args.iters) * 1e3
        print(f"ep={ep} {combine:12s}: {ms:8.2f} ms/call, max |EP - single| = {diff:.2e} "
              f"(output max {np.abs(ref).max():.3f}), output sharding {out.sharding.spec}")


if __name__ == "__main__":
    main()
