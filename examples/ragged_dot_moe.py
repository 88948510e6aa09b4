"""A MaxText-style MoE block written against ragged_dot, run on NVFP4 weights by changing one line.

The block (top-k routing, tokens sorted by expert, three ragged_dots for gate, up and down, the
weighted combine) is the shape of MaxText's sparse-matmul MoE. Its weights are ``wi_0``, ``wi_1``
``[E, H, I]`` and ``wo`` ``[E, I, H]``, ragged_dot's ``[G, K, N]`` orientation. ``ragged_dot =
jax.lax.ragged_dot`` on bf16 weights is the baseline; ``ragged_dot = jax_nvfp4.ragged_dot`` on
NVFP4 weights (quantized here by qwix when it is installed, else by jax_nvfp4, then viewed as
``[G, K, N]`` by ``jn.ragged_rhs``) runs the grouped NVFP4 GEMM. With tokamax installed the same
block also runs through ``tokamax.ragged_dot(..., implementation=(jax_nvfp4.ragged_dot,))`` (a
sequence of implementations: the form every tokamax takes).

    python examples/ragged_dot_moe.py [--tokens 64] [--experts 8] [--hidden 512] [--inter 256]
"""

import argparse
import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np

import jax_nvfp4 as jn


def moe_block(x, router, wi_0, wi_1, wo, *, top_k, ragged_dot):
    """x ``[T, H]`` bf16 -> ``[T, H]`` bf16; weights in ragged_dot's ``[G, K, N]`` orientation."""
    t, _ = x.shape
    e = router.shape[1]
    logits = x.astype(jnp.float32) @ router                           # [T, E]
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits), top_k)   # [T, k]
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)                            # rows sorted by expert
    rows = x[order // top_k]                                          # [T k, H]
    group_sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    gate = ragged_dot(rows, wi_0, group_sizes)                        # [T k, I]
    up = ragged_dot(rows, wi_1, group_sizes)
    act = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(jnp.bfloat16)
    down = ragged_dot(act, wo, group_sizes)                           # [T k, H]
    unsorted = jnp.zeros_like(down).at[order].set(down)
    out = jnp.sum(unsorted.reshape(t, top_k, -1).astype(jnp.float32) * weights[..., None], axis=1)
    return out.astype(jnp.bfloat16)


def nvfp4_weights(w_gkn):
    """bf16 ``[G, K, N]`` -> ragged_dot's NVFP4 rhs ``[G, K, N]`` (blocks of 16 along K)."""
    if importlib.util.find_spec("qwix") is not None:
        import qwix  # noqa: PLC0415 - optional: the JAX ecosystem's quantizer
        q = qwix.quantize(w_gkn.astype(jnp.float32), "nvfp4", channelwise_axes=(0, 2),
                          tiled_axes={1: 16})
        return jn.ragged_rhs(q), "qwix"
    t = jax.vmap(jn.quantize)(jnp.swapaxes(w_gkn, 1, 2).astype(jnp.float32))   # [G, N, K]
    return jn.ragged_rhs(t), "jax_nvfp4"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=256)
    p.add_argument("--top-k", type=int, default=2)
    args = p.parse_args()
    t, e, h, i = args.tokens, args.experts, args.hidden, args.inter
    k = jax.random.split(jax.random.key(0), 5)
    router = jax.random.normal(k[0], (h, e)) * h ** -0.5
    wi_0 = (jax.random.normal(k[1], (e, h, i)) * h ** -0.5).astype(jnp.bfloat16)
    wi_1 = (jax.random.normal(k[2], (e, h, i)) * h ** -0.5).astype(jnp.bfloat16)
    wo = (jax.random.normal(k[3], (e, i, h)) * i ** -0.5).astype(jnp.bfloat16)
    x = jax.random.normal(k[4], (t, h), jnp.bfloat16)

    block = functools.partial(moe_block, top_k=args.top_k)
    ref = jax.jit(functools.partial(block, ragged_dot=jax.lax.ragged_dot))(x, router, wi_0, wi_1,
                                                                           wo)
    (q0, src), (q1, _), (q2, _) = nvfp4_weights(wi_0), nvfp4_weights(wi_1), nvfp4_weights(wo)
    # the one changed line: ragged_dot=jax_nvfp4.ragged_dot
    out = jax.jit(functools.partial(block, ragged_dot=jn.ragged_dot))(x, router, q0, q1, q2)
    a, b = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    rel = np.linalg.norm(a - b) / np.linalg.norm(b)
    cos = float(np.sum(a * b) / (np.linalg.norm(a) * np.linalg.norm(b)))
    print(f"MoE block: {e} experts, top-{args.top_k}, H={h}, I={i}, {t} tokens; NVFP4 weights "
          f"quantized by {src}")
    print(f"jax_nvfp4.ragged_dot vs jax.lax.ragged_dot (bf16 weights): rel L2 {rel:.4f}, "
          f"cosine {cos:.5f}")
    if importlib.util.find_spec("tokamax") is not None:
        import tokamax  # noqa: PLC0415 - optional
        via = functools.partial(tokamax.ragged_dot, implementation=(jn.ragged_dot,))
        out2 = jax.jit(functools.partial(block, ragged_dot=via))(x, router, q0, q1, q2)
        same = np.array_equal(np.asarray(out2), np.asarray(out))
        print(f"through tokamax.ragged_dot(..., implementation=(jax_nvfp4.ragged_dot,)): "
              f"{'the same bits' if same else 'DIFFERENT'}")
        if not same:
            raise SystemExit(1)
    if cos < 0.98:
        raise SystemExit(f"cosine {cos} below 0.98")


if __name__ == "__main__":
    main()
