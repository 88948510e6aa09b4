"""Lab: the layer's dispatch gathers (rows of x, of e4m3 codes, of NVFP4 codes) as XLA runs them,
element by element in their own dtype or with the rows viewed as 32-bit words (a free bitcast).

Shapes: T tokens x H 7168, R = 6 T rows (top-6), the rows' tokens sorted by a random expert.
Run on the GPU: ``python3 tools/lab/row_gather_bench.py [--json PATH]`` (from the repo root; the
installed jax_nvfp4).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jax_nvfp4 import fp8
from jax_nvfp4.bench.common import run_info, time_ms, write_json

H = 7168


def as_words(a):
    """``[M, C]`` of a 1- or 2-byte dtype -> uint32 ``[M, C * itemsize / 4]`` (same bytes)."""
    per = 4 // a.dtype.itemsize
    return jax.lax.bitcast_convert_type(a.reshape(a.shape[0], -1, per), jnp.uint32)


def from_words(w, dtype):
    per = 4 // jnp.dtype(dtype).itemsize
    return jax.lax.bitcast_convert_type(w, dtype).reshape(w.shape[0], -1) if per > 1 else \
        jax.lax.bitcast_convert_type(w, dtype)


def variants():
    def elem(a, idx):
        return a[idx]

    def words(a, idx):
        return from_words(as_words(a)[idx], a.dtype)

    def elem_then_korder(a, idx):          # the fp8 layer today: gather e4m3, then the k order
        return fp8.to_kernel_k_order(a[idx])

    def korder_then_words(a, idx):         # k order on the T rows, then a word gather
        return from_words(as_words(fp8.to_kernel_k_order(a))[idx], a.dtype)

    return dict(elem=elem, words=words, elem_then_korder=elem_then_korder,
                korder_then_words=korder_then_words)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--tokens", default="1024,4096")
    args = p.parse_args(argv)
    results = []
    fns = {k: jax.jit(v) for k, v in variants().items()}
    for t in (int(s) for s in args.tokens.split(",")):
        rng = np.random.default_rng(t)
        ids = rng.integers(0, 48, (t * 6,))
        idx = jnp.asarray(np.argsort(ids, kind="stable") // 6, jnp.int32)
        x = jax.random.normal(jax.random.key(t), (t, H), jnp.bfloat16)
        arrays = dict(bf16_rows=x, e4m3_rows=x.astype(jnp.float8_e4m3fn),
                      nvfp4_codes=jax.random.bits(jax.random.key(1), (t, H // 2), jnp.uint8),
                      nvfp4_scales=x[:, ::16].astype(jnp.float8_e4m3fn))
        for name, a in arrays.items():
            ref = np.asarray(fns["elem"](a, idx).view(np.uint8) if a.dtype.itemsize == 1
                             else fns["elem"](a, idx))
            for v, f in fns.items():
                if "korder" in v and name != "e4m3_rows":
                    continue
                out = f(a, idx)
                if "korder" in v:
                    ok = bool(jnp.all(out == fns["elem_then_korder"](a, idx)))
                else:
                    got = np.asarray(out.view(jnp.uint8) if a.dtype.itemsize == 1 else out)
                    ok = bool(np.array_equal(got.view(np.uint8), ref.view(np.uint8)))
                ms = time_ms(f, a, idx)
                mb = out.size * out.dtype.itemsize / 1e6
                results.append(dict(tokens=t, array=name, variant=v, ms=ms, out_mb=mb, equal=ok))
                print(f"T={t:5d} {name:13s} {v:18s} {ms:7.3f} ms  {mb:7.1f} MB out  "
                      f"{mb / ms / 1e3:5.2f} TB/s written  equal={ok}")
    if args.json:
        write_json(args.json, {**run_info(), "results": results})


if __name__ == "__main__":
    main()
