"""Time the FP8 mode's activation quantization on the GPU (what jax_nvfp4.grouped_gemm runs
before the fp8 custom call), each variant with the kernel k order and the transposed scales as
gemm._fp8_ffi runs it, jitted, median of repeated runs:

- library: fp8.quantize_activations_fp8 (on a CUDA GPU its float route, elsewhere the exact one);
- exact: the integer route forced (what the CPU runs);
- float-ref: a plain float quantizer (float abs-max, ``x * 2^-p``; not exact for subnormal inputs
  on the CPU), the speed of two reads and one write;
- custom-call: fp8.quantize_kernel_order_ffi, the quantizer's custom call (one pass, what
  jax_nvfp4.grouped_gemm runs now; its CPU handler with --cpu-smoke).

Prints whether each variant's codes and scales equal the library's, on the timed data (normal
bf16) and on every bf16 bit pattern (the exact route must match there too; the float reference
need not, on the CPU).

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


VARIANTS = {
    "library": fp8.quantize_activations_fp8,
    "exact": lambda x: fp8._quantize_activations(x, "exact"),
    "float-ref": quantize_float,
}


def as_ffi_calls(q):
    """The quantizer as gemm._fp8_ffi runs it: codes in the kernel k order, scales [K/128, M]."""
    return jax.jit(lambda x: (lambda c, s: (fp8.to_kernel_k_order(c), s.T))(*q(x)))


def same(a, b):
    """(codes, scales) pairs equal byte for byte."""
    return all(np.array_equal(np.asarray(u).view(np.uint8), np.asarray(v).view(np.uint8))
               for u, v in zip(a, b))


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
    if a.cpu_smoke:
        jax.config.update("jax_platforms", "cpu")
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()})")
    fns = {name: as_ffi_calls(q) for name, q in VARIANTS.items()}
    fns["custom-call"] = jax.jit(lambda x: fp8.quantize_kernel_order_ffi(x, scales_transposed=True)[:2])
    ok = True
    patterns = jnp.asarray(np.arange(1 << 16, dtype=np.uint16).view(jnp.bfloat16).reshape(64, 1024))
    res = {name: f(patterns) for name, f in fns.items()}
    eq = {name: same(res[name], res["library"]) for name in ("exact", "float-ref", "custom-call")}
    print(f"every bf16 pattern: exact == library: {eq['exact']}, "
          f"float-ref == library: {eq['float-ref']}, custom-call == library: {eq['custom-call']}")
    ok &= eq["exact"] and eq["custom-call"]
    shapes = ([(64, 256)] if a.cpu_smoke
              else [(192, 7168), (6144, 7168), (24576, 7168), (24576, 3072)])
    for m, k in shapes:
        x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
        res = {name: f(x) for name, f in fns.items()}
        row = [f"{name} {time_ms(f, x):.3f} ms" for name, f in fns.items()]
        eq = {name: same(res[name], res["library"]) for name in ("exact", "float-ref", "custom-call")}
        ok &= all(eq.values())
        print(f"{m}x{k}: " + ", ".join(row) + f"; == library: exact {eq['exact']}, float-ref "
              f"{eq['float-ref']}, custom-call {eq['custom-call']}  (bytes {m * k * 3 / 1e6:.0f} MB)")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
