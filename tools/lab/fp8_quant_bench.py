"""Time the FP8 mode's activation quantization on the GPU (what jax_nvfp4.grouped_gemm runs
before the fp8 custom call): the library's quantizer, the former one (float32 bit patterns reduced,
kept here for comparison) and a float-arithmetic one (not exact for subnormal inputs on the CPU;
the speed of light of one read and one write), each with the kernel k order and the transposed
scales, jitted, median of repeated runs. Checks that the library's codes equal the former's.

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
from jax_nvfp4.fp8 import CHUNK, _F32_ABS, _F32_SIGN, _f32_bits, _pow2


def quantize_u32(x):
    """The quantizer reducing float32 bit patterns (the former one), for comparison."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x: expected a floating-point array, got {x.dtype}")
    if x.ndim != 2:
        raise ValueError(f"x: expected [M, K], got shape {x.shape}")
    m, k = x.shape
    if k == 0 or k % CHUNK:
        raise ValueError(f"x: K={k}: precision='fp8' needs K to be a positive multiple of {CHUNK}")
    bits = _f32_bits(x).reshape(m, k // CHUNK, CHUNK)
    mag = bits & _F32_ABS
    # Ordering of non-negative float32 bit patterns as integers is that of their values, with
    # Inf and NaN above every finite value: the integer max is the float amax (subnormals too).
    amax = jnp.max(mag, axis=-1)                                         # [M, C] uint32
    e_max = (amax >> 23).astype(jnp.int32)
    f_max = amax & np.uint32(0x7FFFFF)
    p = jnp.maximum(e_max - 135 + (f_max > np.uint32(0x600000)).astype(jnp.int32), -126)
    nonfinite = e_max == 255
    p = jnp.where(nonfinite, 0, p)
    # y = x * 2^-p exactly, as a float32: normal x times a normal power of two (the product is
    # exact unless it is below 2^-126, where e4m3 rounds it to 0 anyway); a subnormal x is
    # F * 2^-149, i.e. float(F) * 2^(-149 - p), the factor a normal float32 whenever the result
    # can reach e4m3's 2^-10 (else 0).
    e_x = ((mag >> 23) & np.uint32(0xFF)).astype(jnp.int32)
    neg = (bits & _F32_SIGN) != 0
    xf = jax.lax.bitcast_convert_type(mag, jnp.float32)
    pc = p[..., None]
    y_normal = xf * _pow2(-pc)
    sub_e = -149 - pc
    y_sub = jnp.where(sub_e >= -126, (mag & np.uint32(0x7FFFFF)).astype(jnp.float32)
                      * _pow2(jnp.maximum(sub_e, -126)), 0.0)
    y = jnp.where(e_x == 0, y_sub, y_normal)
    y = jnp.where(neg, -y, y)
    codes = jnp.where(nonfinite[..., None], jnp.nan, y).astype(jnp.float8_e4m3fn)
    scales = jnp.where(nonfinite, jnp.float32(1.0), _pow2(p))
    return codes.reshape(m, k), scales


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
        for name, q in (("library", fp8.quantize_activations_fp8), ("former_u32", quantize_u32),
                        ("float", quantize_float)):
            f = jax.jit(lambda x, q=q: (lambda c, s: (fp8.to_kernel_k_order(c), s.T))(*q(x)))
            res[name] = f(x)
            row.append(f"{name} {time_ms(f, x):.3f} ms")
        same = bool(np.array_equal(np.asarray(res["library"][0]).view(np.uint8),
                                   np.asarray(res["former_u32"][0]).view(np.uint8)))
        print(f"{m}x{k}: " + ", ".join(row) + f"; library == former: {same}  (bytes {m * k * 3 / 1e6:.0f} MB)")
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
