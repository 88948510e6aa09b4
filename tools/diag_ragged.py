"""Diagnostic: does XLA's ragged_dot honour float32 / Precision.HIGHEST on this platform?"""
import jax, jax.numpy as jnp, numpy as np
rng = np.random.default_rng(0)
for (m, k, n, g) in [(77, 128, 48, 4), (288, 128, 128, 8), (288, 64, 128, 8)]:
    a = rng.integers(-8, 8, (m, k)).astype(np.float32) / 4          # exact in bf16
    w = rng.integers(-8, 8, (g, k, n)).astype(np.float32) / 8
    sizes = np.diff(np.sort(np.concatenate([[0, m], rng.integers(0, m, g - 1)]))).astype(np.int32)
    ref = np.zeros((m, n)); s = 0
    for i, c in enumerate(sizes):
        ref[s:s + c] = a[s:s + c].astype(np.float64) @ w[i]; s += c
    for prec in [jax.lax.Precision.HIGHEST, None]:
        out = jax.jit(lambda a, w, s: jax.lax.ragged_dot(a, w, s, precision=prec,
                      preferred_element_type=jnp.float32))(a, w, jnp.asarray(sizes))
        out = np.asarray(out, np.float64)
        print(m, k, n, g, prec, "max abs err", np.abs(out - ref).max(), "rel", np.linalg.norm(out - ref) / np.linalg.norm(ref))
    a2 = rng.standard_normal((m, k)).astype(np.float32)
    out = jax.jit(lambda a, w, s: jax.lax.ragged_dot(a, w, s, precision=jax.lax.Precision.HIGHEST,
                  preferred_element_type=jnp.float32))(a2, w, jnp.asarray(sizes))
    ref2 = np.zeros((m, n)); s = 0
    for i, c in enumerate(sizes):
        ref2[s:s + c] = a2[s:s + c].astype(np.float64) @ w[i]; s += c
    print("  gaussian lhs rel", np.linalg.norm(np.asarray(out, np.float64) - ref2) / np.linalg.norm(ref2))

# The MoE layer's reference vs ffi backends on this platform, piece by piece.
import jax_nvfp4 as jn
from jax_nvfp4.moe import routed_experts
E, H, I, T = 8, 128, 64, 48
f = dict(router=rng.standard_normal((E, H)) * 0.1, w13=rng.standard_normal((E, 2 * I, H)) * 0.05,
         w2=rng.standard_normal((E, H, I)) * 0.05)
w = jn.quantize_moe(f["router"], f["w13"], f["w2"])
x = jnp.asarray(rng.standard_normal((T, H)).astype(np.float32))
for act in ["w4a16", "w4a4"]:
    c = jn.MoEConfig.deepseek_v4_pro(num_experts=E, hidden_size=H, intermediate_size=I,
                                     n_shared_experts=0, activation=act)
    outs = {b: np.asarray(jax.jit(lambda x, w: jn.moe(x, w, c, backend=b))(x, w), np.float64)
            for b in ["reference", "ffi"]}
    eager = np.asarray(jn.moe(x, w, c, backend="reference"), np.float64)
    d = lambda p, q: np.linalg.norm(p - q) / np.linalg.norm(q)
    print(act, "moe ref vs ffi", d(outs["reference"], outs["ffi"]), "eager ref vs ffi", d(eager, outs["ffi"]))
    ids, rw = jn.route(x, w, c)
    sizes = jnp.bincount(ids.reshape(-1), length=E).astype(jnp.int32)
    order = jnp.argsort(ids.reshape(-1), stable=True)
    xs = x[order // c.top_k].astype(jnp.bfloat16)
    for b in ["reference", "ffi"]:
        g = jax.jit(lambda a, ww, s: jn.grouped_gemm(a, ww, s, out_dtype=jnp.float32, backend=b))
        outs[b] = np.asarray(g(xs, w.w13, sizes), np.float64)
    print("  L1 gemm ref vs ffi", d(outs["reference"], outs["ffi"]))
