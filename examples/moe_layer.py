"""A small DeepSeek-V4-shaped NVFP4 MoE layer: quantize, run jitted, compare with bf16, time it.

Runs on CPU (the C++ handler) or GPU (the CUDA handler), whichever JAX uses by default.
    python examples/moe_layer.py [--tokens 64] [--experts 8] [--hidden 512] [--inter 256]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_nvfp4 as jn


def bf16_layer(x, f, config):
    """The same layer with bf16 weights (the unquantized baseline), float32 math."""
    ids, rw = jn.route(x, jn.MoEWeights(router_weight=f["router"], router_bias=f["bias"],
                                        w13=None, w2=None), config)
    xs = x.astype(jnp.float32)
    out = jnp.zeros_like(xs)
    for j in range(config.top_k):
        w13 = f["w13"][ids[:, j]].astype(jnp.float32)          # [T, 2I, H]
        w2 = f["w2"][ids[:, j]].astype(jnp.float32)
        h = jnp.einsum("th,tnh->tn", xs, w13)
        a = jn.swiglu(h, config.swiglu_limit)
        out = out + rw[:, j, None] * jnp.einsum("ti,thi->th", a, w2)
    h = xs @ f["sw13"].astype(jnp.float32).T
    return out + jn.swiglu(h, config.swiglu_limit) @ f["sw2"].astype(jnp.float32).T


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=256)
    args = p.parse_args()
    e, h, i, t = args.experts, args.hidden, args.inter, args.tokens
    config = jn.MoEConfig.deepseek_v4_pro(num_experts=e, hidden_size=h, intermediate_size=i)
    keys = jax.random.split(jax.random.key(0), 7)
    f = dict(router=jax.random.normal(keys[0], (e, h)) * h ** -0.5,
             bias=jax.random.normal(keys[1], (e,)) * 0.01,
             w13=(jax.random.normal(keys[2], (e, 2 * i, h)) * h ** -0.5).astype(jnp.bfloat16),
             w2=(jax.random.normal(keys[3], (e, h, i)) * i ** -0.5).astype(jnp.bfloat16),
             sw13=(jax.random.normal(keys[4], (2 * i, h)) * h ** -0.5).astype(jnp.bfloat16),
             sw2=(jax.random.normal(keys[5], (h, i)) * i ** -0.5).astype(jnp.bfloat16))
    weights = jn.quantize_moe(f["router"], f["w13"], f["w2"], router_bias=f["bias"],
                              shared_w13=f["sw13"], shared_w2=f["sw2"])
    x = jax.random.normal(keys[6], (t, h), jnp.bfloat16)
    ref = np.asarray(jax.jit(bf16_layer, static_argnums=2)(x, f, config), np.float64)
    info = jn.extension_info()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; extension built: "
          f"{info.built} (CUDA handler: {info.cuda}, archs {info.cuda_archs})")
    print(f"layer: {e} experts, top-{config.top_k}, H={h}, I={i}, {t} tokens")
    for act in ("w4a16", "w4a4"):
        c = jn.MoEConfig.deepseek_v4_pro(num_experts=e, hidden_size=h, intermediate_size=i,
                                         activation=act)
        f_moe = jax.jit(lambda x, w: jn.moe(x, w, c))
        out = f_moe(x, weights).block_until_ready()
        n = 5
        t0 = time.perf_counter()
        for _ in range(n):
            out = f_moe(x, weights)
        out.block_until_ready()
        ms = (time.perf_counter() - t0) / n * 1e3
        o = np.asarray(out, np.float64)
        rel = np.linalg.norm(o - ref) / np.linalg.norm(ref)
        cos = (o * ref).sum() / np.linalg.norm(o) / np.linalg.norm(ref)
        print(f"{act:6s}: rel L2 error vs bf16 layer {rel:.4f}, cosine {cos:.5f}, {ms:.2f} ms/call")
    if h % 128 == 0 and i % 64 == 0:
        # Once at load time: the byte layout the Hopper kernels decode faster (same bytes, same math).
        prepared = jn.prepare_weights(weights)
        c = jn.MoEConfig.deepseek_v4_pro(num_experts=e, hidden_size=h, intermediate_size=i)
        a = np.asarray(jax.jit(lambda x, w: jn.moe(x, w, c))(x, weights), np.float64)
        b = np.asarray(jax.jit(lambda x, w: jn.moe(x, w, c))(x, prepared), np.float64)
        print(f"w4a16 with prepare_weights (layout {prepared.w13.layout!r}): max |difference| to the "
              f"checkpoint layout {np.abs(a - b).max():.3g}")


if __name__ == "__main__":
    main()
