"""The SwiGLU-epilogue custom call ("jax_nvfp4_grouped_gemm_glu") on the GPU: checked against a float64
numpy oracle on sampled rows, and timed beside the plain call followed by the SwiGLU in XLA (what the
unfused layer runs), on the gate/up GEMM's shapes (48 experts, N = 2I = 6144, K = 7168).

    python tools/gpu/glu_check.py [--small]

Random weight bytes (every e2m1 code; block scales in [2^-3, 2^1]) in the checkpoint and sm90 layouts;
bf16 activations; the kernel family is the heuristic's for each row count.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jax_nvfp4.ops import gemm, prepare
from jax_nvfp4.config import kernel_config, options
from jax_nvfp4.maths.formats import NVFP4Tensor

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def call(x, w, alpha2, sizes, row_scale, limit, out_dtype, glu=True):
    m, k = x.shape
    g, n = w.data.shape[:2]
    cfg = kernel_config.resolve(None, m, n, k, g, rhs_layout=w.layout)
    args = (x, jnp.zeros((0,), jnp.float8_e4m3fn), w.data, w.scales)
    attrs = dict(rhs_layout=np.int32(options.LAYOUT_CODES[w.layout]), **cfg.attributes())
    if glu:
        out_t = jax.ShapeDtypeStruct((m, n // 2), out_dtype)
        ws_t = jax.ShapeDtypeStruct((gemm.workspace_bytes(g, 2 * k),), jnp.uint8)
        return jax.ffi.ffi_call("jax_nvfp4_grouped_gemm_glu", (out_t, ws_t))(
            *args, alpha2, sizes, row_scale, glu_limit=np.float32(limit), **attrs)[0]
    out_t = jax.ShapeDtypeStruct((m, n), jnp.float32)
    ws_t = jax.ShapeDtypeStruct((gemm.workspace_bytes(g, k),), jnp.uint8)
    return jax.ffi.ffi_call("jax_nvfp4_grouped_gemm", (out_t, ws_t))(*args, alpha2, sizes, **attrs)[0]


def unfused(x, w, alpha, sizes, limit):
    """The unfused layer's way: plain GEMM to float32 [M, N] (paired rows), then SwiGLU in XLA."""
    h = call(x, w, alpha, sizes, None, limit, jnp.float32, glu=False)
    m, n = h.shape
    hp = h.reshape(m, n // 16, 2, 8)
    gate = jnp.minimum(hp[:, :, 0].reshape(m, n // 2), limit)
    up = jnp.clip(hp[:, :, 1].reshape(m, n // 2), -limit, limit)
    return (jax.nn.silu(gate) * up).astype(jnp.bfloat16)


def time_ms(f, *a, reps=20):
    jax.block_until_ready(f(*a))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*a))
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def oracle_rows(x, data, scales, alpha2, sizes, row_scale, limit, rows):
    """float64 out[r] for the given rows (checkpoint-layout bytes)."""
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    out = {}
    for r in rows:
        g = int(np.searchsorted(bounds, r, side="right") - 1)
        codes = np.stack([data[g] & 15, data[g] >> 4], -1).reshape(data.shape[1], -1)
        s = scales[g].view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        wg = E2M1[codes] * np.repeat(s, 16, axis=1)
        h = wg @ x[r]
        hp = h.reshape(-1, 2, 8)
        gate = hp[:, 0].reshape(-1) * alpha2[2 * g] * row_scale[r]
        up = hp[:, 1].reshape(-1) * alpha2[2 * g + 1] * row_scale[r]
        gate = np.minimum(gate, limit)
        up = np.clip(up, -limit, limit)
        out[r] = gate / (1 + np.exp(-gate)) * up
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="small shapes (CPU smoke test; compute-sanitizer on the GPU)")
    a = ap.parse_args(argv)
    g, n, k = (4, 128, 128) if a.small else (48, 6144, 7168)
    row_counts = (8, 64, 300) if a.small else (192, 1536, 6144, 24576)
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8)
    scales = rng.integers(0x20, 0x41, (g, n, k // 16), dtype=np.uint8)   # e4m3 2^-4 .. 2^1
    w_ck = NVFP4Tensor(jnp.asarray(data), jnp.asarray(scales).view(jnp.float8_e4m3fn),
                       jnp.ones((g,), jnp.float32))
    w_sm = prepare.prepare_weights(w_ck, "sm90")
    alpha2 = rng.uniform(0.5, 2.0, 2 * g).astype(np.float32)
    limit = 10.0
    print(f"{jax.devices()[0].device_kind}; G {g}, N {n}, K {k}")
    worst = 0.0
    for m in row_counts:
        sizes = np.full(g, m // g, np.int64)
        sizes[: m - sizes.sum()] += 1
        x = (rng.standard_normal((m, k)) * 0.05).astype(ml_dtypes.bfloat16)
        row_scale = rng.uniform(0.5, 2.0, m).astype(np.float32)
        xj, rsj, sj, aj = (jnp.asarray(x), jnp.asarray(row_scale), jnp.asarray(sizes, jnp.int32),
                           jnp.asarray(alpha2))
        rows = sorted(set(rng.integers(0, m, 6).tolist()) | {0, m - 1})
        ref = oracle_rows(x.astype(np.float64), data, scales, alpha2.astype(np.float64), sizes,
                          row_scale.astype(np.float64), limit, rows)
        for name, w in (("checkpoint", w_ck), ("sm90", w_sm)):
            out = np.asarray(jax.jit(lambda x, w, a, s, rs: call(x, w, a, s, rs, limit, jnp.float32))(
                xj, w, aj, sj, rsj))
            err = max(float(np.max(np.abs(out[r] - ref[r])) / (np.max(np.abs(ref[r])) + 1e-30))
                      for r in rows)
            worst = max(worst, err)
            cfg = kernel_config.resolve(None, m, n, k, g, rhs_layout=w.layout)
            line = f"rows {m:6d} {name:10s} {cfg.family}/{cfg.token_tile}: max rel err {err:.2e}"
            if not a.small:
                ones = jnp.ones((m,), jnp.float32)
                a1 = jnp.asarray(alpha2[::2])
                t_plain = time_ms(jax.jit(lambda x, w, a, s: call(x, w, a, s, None, limit, jnp.float32,
                                                                   glu=False)), xj, w, a1, sj)
                t_unf = time_ms(jax.jit(lambda x, w, a, s: unfused(x, w, a, s, limit)), xj, w, a1, sj)
                t_glu = time_ms(jax.jit(lambda x, w, a, s, rs: call(x, w, a, s, rs, limit, jnp.bfloat16)),
                                xj, w, aj, sj, ones)
                t_glu32 = time_ms(jax.jit(lambda x, w, a, s, rs: call(x, w, a, s, rs, limit, jnp.float32)),
                                  xj, w, aj, sj, ones)
                line += (f"; ms: plain f32 {t_plain:.3f}, plain + XLA SwiGLU {t_unf:.3f}, "
                         f"fused bf16 {t_glu:.3f}, fused f32 {t_glu32:.3f}")
            print(line, flush=True)
    print(f"worst max rel err {worst:.2e}")
    if worst > 1e-4:
        raise SystemExit("FAILED: the fused epilogue disagrees with the float64 oracle")


if __name__ == "__main__":
    main()
