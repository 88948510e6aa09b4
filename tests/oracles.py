"""Oracles written independently of jax_nvfp4: ml_dtypes casts and float64 numpy."""

import ml_dtypes
import numpy as np


def decode_e2m1_bytes(data) -> np.ndarray:
    """uint8 [..., K/2] -> float64 [..., K] through ml_dtypes' float4_e2m1fn (low nibble first)."""
    d = np.asarray(data).astype(np.uint8)
    codes = np.stack([d & 0xF, d >> 4], axis=-1).reshape(d.shape[:-1] + (2 * d.shape[-1],))
    return codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)


def decode_e4m3(scales) -> np.ndarray:
    """float8_e4m3fn (or its bytes) -> float64 through ml_dtypes."""
    s = np.asarray(scales)
    if s.dtype != ml_dtypes.float8_e4m3fn:
        s = s.astype(np.uint8).view(ml_dtypes.float8_e4m3fn)
    return s.astype(np.float64)


def dequant64(data, scales, global_scale=None) -> np.ndarray:
    """float64 NVFP4 dequantization: e2m1 * e4m3 block scale (* global scale on leading axes)."""
    v = decode_e2m1_bytes(data)
    s = decode_e4m3(scales)
    v = (v.reshape(v.shape[:-1] + (v.shape[-1] // 16, 16)) * s[..., None]).reshape(v.shape)
    if global_scale is not None:
        g = np.asarray(global_scale, np.float64)
        v = v * g.reshape(g.shape + (1,) * (v.ndim - g.ndim))
    return v


def grouped_gemm64(a, w, alpha, group_sizes) -> np.ndarray:
    """float64 grouped GEMM: a [M, K], w [G, N, K], alpha [G]; negative sizes 0, sum clamped."""
    m, n = a.shape[0], w.shape[1]
    out = np.zeros((m, n))
    start = 0
    for g, size in enumerate(np.asarray(group_sizes)):
        end = min(start + max(int(size), 0), m)
        out[start:end] = alpha[g] * (a[start:end] @ w[g].T)
        start = end
    return out


def rel_err(x, ref) -> float:
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    if not np.all(np.isfinite(x)):
        return float("inf")
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(x - ref) / (den if den > 0 else 1.0))


def paired_source_rows(n: int) -> np.ndarray:
    """For the paired gate/up order of 2I = n rows: the stored (gate rows, then up rows) row that
    each physical row holds, written out from its definition (rows 16b+i, i < 8: gate 8b+i;
    rows 16b+8+i: up 8b+i)."""
    half = n // 2
    src = np.empty(n, np.int64)
    for p in range(n):
        b, i = divmod(p, 16)
        src[p] = 8 * b + i if i < 8 else half + 8 * b + (i - 8)
    return src


def gate_up64(a, w, alpha, group_sizes, row_scale=None) -> np.ndarray:
    """float64 gate/up GEMM of *stored-order* weights: a [M, K], w [G, 2I, K] (gate rows then up
    rows, without global scales), alpha [G, 2] (gate, up) factors, row_scale [M] or None ->
    [M, 2I] (gate | up) scaled per half and per row; rows past the groups 0."""
    m, n = a.shape[0], w.shape[1]
    out = np.zeros((m, n))
    start = 0
    for g, size in enumerate(np.asarray(group_sizes)):
        end = min(start + max(int(size), 0), m)
        h = a[start:end] @ w[g].T
        h[:, :n // 2] *= alpha[g][0]
        h[:, n // 2:] *= alpha[g][1]
        if row_scale is not None:
            h = h * np.asarray(row_scale)[start:end, None]
        out[start:end] = h
        start = end
    return out


def grouped_gemm_swiglu64(a, w, alpha, group_sizes, row_scale=None, limit=None) -> np.ndarray:
    """:func:`gate_up64` followed by silu(min(gate, L)) * clip(up, -L, L) (rows past the groups 0)."""
    h = gate_up64(a, w, alpha, group_sizes, row_scale)
    gate, up = np.split(h, 2, axis=-1)
    if limit is not None:
        gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
    with np.errstate(over="ignore"):
        return gate / (1 + np.exp(-gate)) * up
