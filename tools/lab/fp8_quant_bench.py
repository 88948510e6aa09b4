"""Time the FP8 mode's activation quantization on the GPU (what jax_nvfp4.grouped_gemm runs
before the fp8 custom call): the library's quantizer and a float-arithmetic one (not exact for subnormal inputs on the CPU;
the speed of light of one read and one write), each with the kernel k order and the transposed
scales, jitted, median of repeated runs. Checks that both give the same codes on normal data.

    python tools/lab/fp8_quant_bench.py [--cpu-smoke]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_nvfp4 import fp8
from jax_nvfp4.fp8 import CHUNK, _pow2


def quantize_float(x):
    m, k = x.shape
    xf = x.astype(jnp.float32).reshape(m, k // CHUNK, CHUNK)
    amax = jnp.max(jnp.abs(xf), -1)
    bits = jax.lax.bitcast_convert_type(amax, jnp.uint32)
    e = ((bits >> 23) & 0xFF).astype(jnp.int32)
    p = jnp.maximum(e - 135 + ((bits & 0x7FFFFF) > 0x600000).astype(jnp.int32), -126)
    q = (xf * _pow2(-p)[..., None]).astype(jnp.float8_e4m3fn)
    return q.reshape(m, k), _pow2(p)


def time_ms(f, x, reps=25):
    jax.block_until_ready(f(x))
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true")
    a = ap.parse_args(argv)
    shapes = [(64, 256)] if a.cpu_smoke else [(192, 7168), (6144, 7168), (24576, 7168), (24576, 3072)]
    for m, k in shapes:
        x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
        row = []
        res = {}
        for name, q in (("library", fp8.quantize_activations_fp8), ("float", quantize_float)):
            f = jax.jit(lambda x, q=q: (lambda c, s: (fp8.to_kernel_k_order(c), s.T))(*q(x)))
            res[name] = f(x)
            row.append(f"{name} {time_ms(f, x):.3f} ms")
        same = bool(np.array_equal(np.asarray(res["library"][0]).view(np.uint8),
                                   np.asarray(res["float"][0]).view(np.uint8)))
        print(f"{m}x{k}: " + ", ".join(row) + f"; library == float: {same}  (bytes {m * k * 3 / 1e6:.0f} MB)")
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
