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


# ----------------------------------------------------------------------------- NVFP4 quantizer and MoE

def quantize64(x, global_scale=None):
    """NVFP4 quantization of float32 rows ``x [..., K]`` in numpy + ml_dtypes, one global scale for
    the whole array: ``(values e2m1 * block scale float64 [..., K], global_scale float)``.

    The format's definition, in float32 where it rounds: ``gs = amax / 2688`` (dynamic; at least
    2^-126, 1 for no finite nonzero value) or the static one; ``y = x / gs``; block scale
    ``e4m3(min(amax_block(y) / 6, 448))``; code ``e2m1(clip(y / scale, -6, 6))``, nearest even."""
    x = np.asarray(x, np.float32)
    if global_scale is None:
        a = np.abs(x[np.isfinite(x)])
        amax = np.float32(a.max()) if a.size else np.float32(0)
        gs = np.float32(amax / np.float32(2688)) if amax > 0 else np.float32(1)
        gs = max(gs, np.float32(2.0**-126))
    else:
        gs = np.float32(global_scale)
    y = (x / gs).astype(np.float32)
    blocks = y.reshape(y.shape[:-1] + (-1, 16))
    amax_b = np.abs(blocks).max(-1, keepdims=True)
    scale = np.minimum((amax_b / np.float32(6)).astype(np.float32), np.float32(448))
    scale = scale.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale > 0, blocks / np.where(scale > 0, scale, 1), 0).astype(np.float32)
    codes = np.clip(q, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float64)
    return (codes * scale.astype(np.float64)).reshape(x.shape), float(gs)


def bf16_64(a) -> np.ndarray:
    """float64 values rounded to bfloat16 (through float32, as the layer's rows are)."""
    return np.asarray(a, np.float64).astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def dequant_stack64(t) -> np.ndarray:
    """float64 weights of a checkpoint-layout NVFP4Tensor ``[G, N, K]`` or ``[N, K]`` whose global
    scale is ``[G]``/``[]`` or ``[G, 2]``/``[2]`` (gate rows, then up rows)."""
    w = dequant64(t.data, t.scales)
    gs = np.asarray(t.global_scale, np.float64)
    if gs.shape[-1:] == (2,) and gs.ndim == w.ndim - 1:
        half = w.shape[-2] // 2
        w[..., :half, :] *= gs[..., 0, None, None]
        w[..., half:, :] *= gs[..., 1, None, None]
        return w
    return w * gs.reshape(gs.shape + (1, 1))


def route64(x, router, bias, cfg, table=None, token_ids=None):
    """float64 routing: ``(ids [T, top_k], weights [T, top_k])`` of MoEConfig ``cfg``."""
    logits = np.asarray(x, np.float64) @ np.asarray(router, np.float64).T
    if cfg.scoring_func == "sqrtsoftplus":
        s = np.sqrt(np.logaddexp(0, logits))
    elif cfg.scoring_func == "sigmoid":
        s = 1 / (1 + np.exp(-logits))
    else:
        s = np.exp(logits - logits.max(1, keepdims=True))
        s /= s.sum(1, keepdims=True)
    if table is not None:
        ids = np.asarray(table)[np.asarray(token_ids)]
    else:
        choice = s + (0 if bias is None else np.asarray(bias, np.float64))
        if cfg.n_group > 1:
            g = choice.reshape(len(choice), cfg.n_group, -1)
            keep = np.argsort(-np.sort(g, -1)[..., -2:].sum(-1), 1, kind="stable")[:, :cfg.topk_group]
            mask = np.zeros(g.shape[:2], bool)
            np.put_along_axis(mask, keep, True, 1)
            choice = np.where(np.repeat(mask, g.shape[-1], 1), choice, -np.inf)
        ids = np.argsort(-choice, 1, kind="stable")[:, :cfg.top_k]
    w = np.take_along_axis(s, ids, 1)
    if cfg.norm_topk_prob:
        w = w / w.sum(1, keepdims=True)
    return ids, w * cfg.routed_scaling_factor


def swiglu64(h, limit):
    """SwiGLU of the halves ``[gate | up]`` of ``h`` (float64), the clamp first when ``limit``."""
    gate, up = np.split(h, 2, -1)
    if limit is not None:
        gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
    with np.errstate(over="ignore"):
        return gate / (1 + np.exp(-gate)) * up


def _gemm_in64(a, cfg, static_scale):
    """A GEMM input as the layer feeds it: ``(values [R, K], row factor [R])``: bf16 rows (W4A16),
    NVFP4 rows with one dynamic global scale per row (W4A4 dynamic: applied after the GEMM), or
    with the static scale (its factor 1 here, the values carry it)."""
    if cfg.activation == "w4a16":
        return bf16_64(a), np.ones(len(a))
    if static_scale is not None:
        v, gs = quantize64(np.asarray(a, np.float32), static_scale)
        return v * gs, np.ones(len(a))
    rows = [quantize64(np.asarray(r, np.float32)[None]) for r in a]
    return (np.concatenate([v for v, _ in rows]) if rows else np.zeros_like(a),
            np.array([gs for _, gs in rows]))


def mlp64(a, w13, w2, cfg, s1=None, s2=None):
    """One expert (or the shared MLP) on rows ``a [R, H]`` as the layer computes it, in float64:
    gate/up GEMM of the quantized (or bf16) input, SwiGLU, the row dtype's rounding, down GEMM of
    the requantized activation, its product rounded to the row dtype, then its row factor."""
    rows = bf16_64 if cfg.row_dtype == "bfloat16" else (lambda v: v)
    v, f = _gemm_in64(a, cfg, s1)
    act = rows(swiglu64((v @ w13.T) * f[:, None], cfg.swiglu_limit))
    v, f = _gemm_in64(act, cfg, s2)
    return rows(v @ w2.T) * f[:, None]


def moe64(x, w, cfg, token_ids=None):
    """float64 MoE layer of MoEWeights ``w`` (checkpoint layout, unpaired) on float32 ``x [T, H]``:
    ``(out [T, H], ids [T, top_k])``. Each routed copy goes through :func:`mlp64` and is added
    (scatter-add: a hash table may pick one expert twice) with its routing weight; plus the shared
    MLP. Exact precision only."""
    assert cfg.precision == "exact" and not w.w13_paired and w.w13.layout == "checkpoint"
    x = np.asarray(x, np.float32)
    ids, rw = route64(x, w.router_weight, w.router_bias, cfg,
                      None if w.hash_table is None else np.asarray(w.hash_table), token_ids)
    static = cfg.activation == "w4a4" and cfg.activation_scale == "static"
    w13, w2 = dequant_stack64(w.w13), dequant_stack64(w.w2)
    out = np.zeros(x.shape)
    for e in range(cfg.num_experts):
        tok, slot = np.nonzero(ids == e)
        if len(tok):
            s1, s2 = ((float(w.w13_input_scale[e]), float(w.w2_input_scale[e])) if static
                      else (None, None))
            np.add.at(out, tok, rw[tok, slot, None] * mlp64(x[tok], w13[e], w2[e], cfg, s1, s2))
    if w.shared_w13 is not None:
        s1, s2 = ((float(w.shared_w13_input_scale), float(w.shared_w2_input_scale)) if static
                  else (None, None))
        out += mlp64(x, dequant_stack64(w.shared_w13), dequant_stack64(w.shared_w2), cfg, s1, s2)
    return out, ids


def float_layer64(x, f, ids, rw, limit) -> np.ndarray:
    """The MoE layer on unquantized float weights in float64, routed by ``ids, rw [T, top_k]``:
    ``f`` holds ``w13 [E, 2I, H]``, ``w2 [E, H, I]``, ``sw13``, ``sw2`` (the shared MLP), each MLP
    a SwiGLU with the clamp ``limit``."""
    x64 = np.asarray(x, np.float64)

    def mlp(a, w13, w2):
        gate, up = np.split(a @ w13.T, 2, axis=-1)
        gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
        return (gate / (1 + np.exp(-gate)) * up) @ w2.T

    out = mlp(x64, f["sw13"], f["sw2"])
    for e in range(len(f["w13"])):
        tok, slot = np.nonzero(ids == e)
        out[tok] += rw[tok, slot, None] * mlp(x64[tok], f["w13"][e], f["w2"][e])
    return out
