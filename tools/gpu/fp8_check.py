"""Lab check of the FP8-mode custom call (csrc/grouped_gemm_fp8_sm90.cu) straight through
jax.ffi, independent of jax_nvfp4's Python API: the operands of docs/design.md "FP8 mode" are built
in numpy (ml_dtypes casts), the call's output is compared with a float64 oracle of the same
arithmetic (and with the CPU handler), and on a GPU the kernel is timed beside the exact W4A16
kernels. Prints one line per case and writes JSON with --out.

    python tools/gpu/fp8_check.py --cases 192,1536,6144,24576 --out /tmp/fp8.json
    python tools/gpu/fp8_check.py --cpu-smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jax_nvfp4 import _extension
from jax_nvfp4.ops import gemm, prepare
from jax_nvfp4.config import kernel_config
from jax_nvfp4.maths import quantization

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def quantize_act(x):
    """Spec section 1 in numpy: codes (e4m3 [M, K]) and scales [M, K/128]."""
    m, k = x.shape
    xb = x.astype(np.float32).reshape(m, k // 128, 128)
    amax = np.abs(xb).max(-1)
    bits = amax.view(np.uint32)
    e = (bits >> 23) & 0xFF
    f = bits & 0x7FFFFF
    p = np.maximum(e.astype(np.int64) - 135 + (f > 0x600000), -126)
    s = np.ldexp(np.float32(1), p).astype(np.float32)
    q = (xb * np.ldexp(np.float32(1), -p)[..., None].astype(np.float32)).astype(ml_dtypes.float8_e4m3fn)
    bad = e == 255
    q[bad] = np.float32("nan")
    s[bad] = 1
    return q.reshape(m, k), s


def kernel_order(q):
    m, k = q.shape
    return q.reshape(m, k // 128, 4, 4, 2, 4).transpose(0, 1, 3, 4, 2, 5).reshape(m, k)


def weights_e4m3(data, scales):
    codes = np.stack([data & 0xF, data >> 4], -1).reshape(data.shape[:-1] + (-1,))
    sc = np.asarray(scales).astype(np.float32)
    v = E2M1[codes].astype(np.float32) * np.repeat(sc, 16, -1) * np.float32(0.125)
    return v.astype(ml_dtypes.float8_e4m3fn)


def oracle_rows(q, s, data, scales, alpha, sizes, rows):
    """float64 of spec section 3 for the given rows (exact products, exact chunk sums), and the
    same with absolute values (the scale a chunk-accumulation error is measured against)."""
    m, k = q.shape
    n = data.shape[1]
    ends = np.minimum(np.cumsum(np.maximum(sizes, 0)), m)
    out = np.zeros((len(rows), n))
    mag = np.zeros((len(rows), n))
    cache = {}
    for i, r in enumerate(rows):
        g = int(np.searchsorted(ends, r, side="right"))
        if g >= len(sizes):
            continue                                     # past the groups: 0
        if g not in cache:
            cache.clear()
            cache[g] = weights_e4m3(data[g], scales[g]).astype(np.float64).reshape(n, k // 128, 128)
        wf = cache[g]
        qf = q[r].astype(np.float64).reshape(k // 128, 128)
        part = np.einsum("ck,nck->nc", qf, wf)
        apart = np.einsum("ck,nck->nc", np.abs(qf), np.abs(wf))
        out[i] = (part * s[r]).sum(-1) * alpha[g] * 8
        mag[i] = (apart * s[r]).sum(-1) * abs(alpha[g]) * 8
    return out, mag


def call_fp8(q_kernel, s_t, rhs, alpha, sizes, out_dtype, config):
    m, k = q_kernel.shape
    g, n = rhs.data.shape[:2]
    out_t = jax.ShapeDtypeStruct((m, n), out_dtype)
    ws_t = jax.ShapeDtypeStruct((gemm.workspace_bytes(g, k),), jnp.uint8)
    out, _ = jax.ffi.ffi_call(_extension.TARGET, (out_t, ws_t))(
        q_kernel, s_t, rhs.data, rhs.scales, alpha, sizes, rhs_layout=np.int32(0), **config.attributes())
    return out


def time_ms(f, *args, repeats=7):
    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    n = int(min(50, max(3, 0.2 / max(time.perf_counter() - t0, 1e-6))))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            o = f(*args)
        jax.block_until_ready(o)
        samples.append((time.perf_counter() - t0) / n * 1e3)
    return statistics.median(samples)


def run_case(rows, k, n, groups, seed, device, do_time, tiles, check_rows=64, exact=True):
    rng = np.random.default_rng(seed)
    w = jax.random.normal(jax.random.key(seed), (groups, n, k), jnp.bfloat16)
    rhs = jax.jit(jax.vmap(quantization.quantize))(w)
    del w
    p = np.exp(rng.normal(0, 1, groups))
    sizes = rng.multinomial(rows, p / p.sum()).astype(np.int32)
    if groups > 2:
        sizes[1] = 0
    x = rng.standard_normal((rows, k)).astype(ml_dtypes.bfloat16)
    q, s = quantize_act(np.asarray(x))
    data, scales = np.asarray(rhs.data), np.asarray(rhs.scales)
    alpha = np.asarray(rhs.global_scale, np.float32)
    ends = np.cumsum(sizes)
    pick = np.unique(np.concatenate([np.minimum(ends[sizes > 0] - 1, rows - 1), np.minimum(ends, rows - 1),
                                     rng.choice(rows, min(rows, 24), replace=False)]))
    pick = rng.choice(pick, min(len(pick), check_rows), replace=False)
    ref, mag = oracle_rows(q, s, data, scales, alpha.astype(np.float64), sizes, pick)
    qk = jnp.asarray(kernel_order(q))
    st = jnp.asarray(np.ascontiguousarray(s.T))
    res = {"rows": rows, "k": k, "n": n, "groups": groups}
    put = lambda a: jax.device_put(a, device)  # noqa: E731
    args = [put(qk), put(st), jax.tree.map(put, rhs), put(jnp.asarray(alpha)), put(jnp.asarray(sizes))]
    cfgs = [kernel_config.choose(rows, n, k, groups, precision="fp8", arch=kernel_config.device_arch(device))]
    for t in tiles:
        c = next(c for c in kernel_config.kernel_configs() if c.family == "wgmma_fp8" and c.token_tile == t)
        if c not in cfgs:
            cfgs.append(c)
    for c in cfgs:
        f = jax.jit(lambda a, b, r, al, sz, c=c: call_fp8(a, b, r, al, sz, jnp.float32, c))
        out = np.asarray(f(*args), np.float64)[pick]
        err = (np.abs(out - ref) / np.maximum(mag, 1e-30)).max()
        rel = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)
        key = f"tile{c.token_tile}"
        res[key] = {"max_err_over_abs": float(err), "rel_l2": float(rel)}
        if do_time:
            fb = jax.jit(lambda a, b, r, al, sz, c=c: call_fp8(a, b, r, al, sz, jnp.bfloat16, c))
            res[key]["ms"] = time_ms(fb, *args)
    if do_time and exact:
        xb = put(jnp.asarray(x))
        ex = jax.jit(lambda a, r, sz: gemm.grouped_gemm(a, r, sz, backend="ffi"))
        res["exact_w4a16_ms"] = time_ms(ex, xb, args[2], args[4])
        rs = jax.jit(prepare.prepare_weights)(args[2])
        res["exact_w4a16_sm90_ms"] = time_ms(ex, xb, rs, args[4])
        # the activation quantization a caller pays on top (fused jnp, spec section 1 + k order)
        def quant(a):
            xf = a.astype(jnp.float32).reshape(rows, k // 128, 128)
            amax = jnp.max(jnp.abs(xf), -1)
            bits = jax.lax.bitcast_convert_type(amax, jnp.uint32)
            e = ((bits >> 23) & 0xFF).astype(jnp.int32)
            pp = jnp.maximum(e - 135 + ((bits & 0x7FFFFF) > 0x600000).astype(jnp.int32), -126)
            qq = (xf * jnp.exp2(-pp.astype(jnp.float32))[..., None]).astype(jnp.float8_e4m3fn)
            qq = qq.reshape(rows, k // 128, 4, 4, 2, 4).transpose(0, 1, 3, 4, 2, 5).reshape(rows, k)
            return qq, jnp.exp2(pp.astype(jnp.float32)).T
        res["quantize_ms"] = time_ms(jax.jit(quant), xb)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="192,1536,6144,24576", help="rows per case (L1 and L2 shapes)")
    ap.add_argument("--layers", default="L1,L2")
    ap.add_argument("--groups", type=int, default=48)
    ap.add_argument("--tiles", default="32,64,128", help="token tiles to run beside the heuristic's")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU handler")
    ap.add_argument("--small", action="store_true", help="tiny shapes on the default device, every --tiles, untimed")
    ap.add_argument("--out", default=None)
    ap.add_argument("--check-rows", type=int, default=64, help="rows checked against float64")
    ap.add_argument("--no-exact", action="store_true", help="time the FP8 kernel only")
    a = ap.parse_args(argv)
    shapes = {"L1": (7168, 6144), "L2": (3072, 7168)}
    if a.cpu_smoke or a.small:
        dev = jax.devices("cpu")[0] if a.cpu_smoke else jax.devices()[0]
        cases = [(40, 256, 192, 5), (7, 128, 128, 2), (700, 256, 128, 3)]
        tiles = [] if a.cpu_smoke else [int(t) for t in a.tiles.split(",") if t]
        results = [run_case(r, k, n, g, 0, dev, False, tiles) for r, k, n, g in cases]
    else:
        dev = jax.devices()[0]
        tiles = [int(t) for t in a.tiles.split(",") if t]
        results = []
        for lay in a.layers.split(","):
            k, n = shapes[lay]
            for rows in (int(r) for r in a.cases.split(",")):
                r = run_case(rows, k, n, a.groups, rows, dev, dev.platform == "gpu", tiles, a.check_rows,
                             not a.no_exact)
                r["layer"] = lay
                print(json.dumps(r), flush=True)
                results.append(r)
    for r in results:
        print(json.dumps(r))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": str(dev.device_kind), "jax": jax.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
