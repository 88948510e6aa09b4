"""Run by tests/test_gemm.py in a fresh process: the grouped GEMM inside an XLA command buffer
(CUDA graph) with custom calls captured, replayed with new inputs and new group sizes.

XLA_FLAGS is set by the parent before JAX starts. Prints "OK <max rel err>" or raises.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import jax_nvfp4 as jn
from oracles import dequant64, grouped_gemm64, rel_err

rng = np.random.default_rng(7)
g, n, k, m = 6, 256, 512, 600
w = jnp.asarray(rng.standard_normal((g, n, k)), jnp.float32)
rhs = jax.vmap(jn.quantize)(w)


@jax.jit
def step(x, sizes):
    # a fusion before and after the custom call, so the command buffer holds more than the call
    y = jn.grouped_gemm((x * 1.5).astype(jnp.bfloat16), rhs, sizes, out_dtype=jnp.float32,
                        backend="ffi")
    return y * 2.0


worst = 0.0
for it in range(4):                     # new buffers and group sizes every replay
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    sizes = rng.multinomial(m - 10 * it, np.ones(g) / g).astype(np.int32)
    out = np.asarray(step(x, jnp.asarray(sizes)))
    a64 = np.asarray((x * 1.5).astype(jnp.bfloat16), np.float64)
    ref = 2.0 * grouped_gemm64(a64, dequant64(rhs.data, rhs.scales),
                               np.asarray(rhs.global_scale, np.float64), sizes)
    worst = max(worst, rel_err(out, ref))
    assert rel_err(out, ref) <= 1e-5, (it, rel_err(out, ref))
print("OK", worst)
