"""Time the GPU W4A4 pre-pass alone: packed e2m1 codes + e4m3 block scales -> bf16 ``[M, K]``.

    python tools/lab/prepass_bench.py --out /tmp/prepass.json          # on the GPU
    python tools/lab/prepass_bench.py --cpu-smoke --out /tmp/p.json    # tiny sizes, on the CPU

This is what ``jax_nvfp4/ops/gemm.py`` runs before the W4A16 kernel for an NVFP4 lhs on the GPU
(``quantization.e2m1_scaled(..., jnp.bfloat16)``). Decodes compared, each jitted alone (``unpack``: how bytes become one code per element):

* ``select``: what the pre-pass ran before: the nibbles unpacked by a stack (a concatenate) and
  decoded with selects and float32 multiplies (the former ``formats.decode_e2m1``, reimplemented
  here);
* ``bits``: the library now, ``quantization.e2m1_scaled``: nibbles by a broadcast and a shift,
  each value's float32 bit pattern built with integer ops and one same-width uint32 -> float32
  bitcast;
* ``bits_stack``: the ``bits`` decode after the stack unpack (separates the two changes);
* ``select_shift``: the ``select`` decode after the shift unpack (the same);
* ``bits_bf16``: the ``bits`` construction as a bf16 pattern, multiplied by the scale in bf16
  (an alternative; the products are exact in bf16);
* ``lut``: ``jnp.take`` from the 16 float32 values (an alternative: a gather XLA may fuse);
* ``f4_bitcast``: the earlier uint8 -> float4_e2m1fn bitcast (not safe for compile-time
  constants, see tests/test_constants.py; here for the speed it had).

Per case and decode: the median ms of ``--samples`` samples (each the mean of back-to-back calls
filling ~``--sample-ms``, after a warm-up), bytes moved (codes ``M*K/2`` + scales ``M*K/16`` read,
bf16 ``2*M*K`` written), the implied GB/s, and whether the output equals ``select``'s bit for
bit. Prints a table and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

GPU_CASES = ((6144, 7168), (24576, 7168), (24576, 3072))
SMOKE_CASES = ((64, 256), (256, 128))
DECODES = ("select", "bits", "bits_stack", "select_shift", "bits_bf16", "lut", "f4_bitcast")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="path of the JSON results file to write")
    p.add_argument("--cpu-smoke", action="store_true",
                   help=f"run on the CPU at tiny sizes {SMOKE_CASES} (a check that it runs)")
    p.add_argument("--cases", default=None,
                   help="comma-separated MxK, e.g. 6144x7168,24576x3072 (default: "
                        + ",".join(f"{m}x{k}" for m, k in GPU_CASES) + ")")
    p.add_argument("--samples", type=int, default=25, help="timed samples per decode (>= 20)")
    p.add_argument("--sample-ms", type=float, default=20.0,
                   help="target wall time of one sample (back-to-back calls, one wait)")
    p.add_argument("--decodes", default=",".join(DECODES),
                   help="comma-separated subset of " + ",".join(DECODES) + " (with select)")
    args = p.parse_args(argv)
    if args.samples < 20 and not args.cpu_smoke:
        p.error("--samples: at least 20")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.cpu_smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))   # the repo root
    # imported once JAX_PLATFORMS and sys.path are set
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from jax_nvfp4.maths import quantization  # noqa: PLC0415
    from jax_nvfp4.maths.formats import (BLOCK_SIZE, E2M1_VALUES, NVFP4Tensor,  # noqa: PLC0415
                                   decode_e2m1, unpack_nibbles)

    def unpack_stack(data):
        """The former formats.unpack_nibbles."""
        codes = jnp.stack([data & 0xF, data >> 4], axis=-1)
        return codes.reshape(data.shape[:-1] + (data.shape[-1] * 2,))

    def decode_select(codes):
        """The former formats.decode_e2m1: shifts, masks, selects and float32 multiplies."""
        c = codes.astype(jnp.uint8)
        e = (c >> 1) & 3
        m = (c & 1).astype(jnp.float32)
        mag = jnp.where(e == 0, m, 2.0 + m) * jnp.where(e == 3, 2.0, jnp.where(e == 2, 1.0, 0.5))
        return jnp.where((c & 8) != 0, -mag, mag)

    def decode_bits_bf16(codes):
        c = codes.astype(jnp.uint16) & 0xF
        mag = c & 7
        bits = jnp.where(mag > 1, (mag << 6) + 0x3F00, mag * 0x3F00) | ((c & 8) << 12)
        return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)

    def decode_lut(codes):
        return jnp.take(jnp.asarray(E2M1_VALUES), codes.astype(jnp.int32) & 0xF, mode="clip")

    def decode_f4_bitcast(data):
        pairs = jax.lax.bitcast_convert_type(data, jnp.float4_e2m1fn)      # [..., K/2, 2]
        return pairs.reshape(data.shape[:-1] + (data.shape[-1] * 2,)).astype(jnp.float32)

    def scaled(vals, scales, ct=jnp.float32):
        k = vals.shape[-1]
        blocks = vals.reshape(vals.shape[:-1] + (k // BLOCK_SIZE, BLOCK_SIZE))
        return (blocks * scales.astype(ct)[..., None]).reshape(vals.shape).astype(jnp.bfloat16)

    decodes = {
        "select": lambda d, s: scaled(decode_select(unpack_stack(d)), s),
        "bits": lambda d, s: quantization.e2m1_scaled(NVFP4Tensor(d, s, jnp.float32(1.0)),
                                                      jnp.bfloat16),
        "bits_stack": lambda d, s: scaled(decode_e2m1(unpack_stack(d)), s),
        "select_shift": lambda d, s: scaled(decode_select(unpack_nibbles(d)), s),
        "bits_bf16": lambda d, s: scaled(decode_bits_bf16(unpack_nibbles(d)), s, jnp.bfloat16),
        "lut": lambda d, s: scaled(decode_lut(unpack_nibbles(d)), s),
        "f4_bitcast": lambda d, s: scaled(decode_f4_bitcast(d), s),
    }
    names = [n for n in args.decodes.split(",") if n]
    bad = [n for n in names if n not in decodes]
    if bad or "select" not in names:
        raise SystemExit(f"--decodes: expected a subset of {list(DECODES)} including 'select', "
                         f"got {args.decodes!r}")
    if args.cases:
        cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    else:
        cases = SMOKE_CASES if args.cpu_smoke else GPU_CASES
    for m, k in cases:
        if k % 32 or m <= 0:
            raise SystemExit(f"--cases: {m}x{k}: K must be a multiple of 32 and M > 0")

    device = jax.devices()[0]
    if not args.cpu_smoke and device.platform != "gpu":
        print(f"warning: timing on {device.platform}, not a GPU", file=sys.stderr)

    def time_one(f, *a):
        jax.block_until_ready(f(*a))                                   # compile + warm up
        for _ in range(3):
            jax.block_until_ready(f(*a))
        t0 = time.perf_counter()
        jax.block_until_ready(f(*a))
        one = time.perf_counter() - t0
        n = int(min(200, max(1, args.sample_ms * 1e-3 / max(one, 1e-7))))
        samples = []
        for _ in range(args.samples):
            t0 = time.perf_counter()
            out = None
            for _ in range(n):
                out = f(*a)
            jax.block_until_ready(out)
            samples.append((time.perf_counter() - t0) / n * 1e3)
        return statistics.median(samples), n

    rows = []
    for m, k in cases:
        k1, k2 = jax.random.split(jax.random.key(m * 100003 + k))
        data = jax.random.bits(k1, (m, k // 2), jnp.uint8)               # every code
        # finite scale bytes 0x00..0x7E (positive, subnormals included); no NaN so bits compare
        sbytes = jax.random.randint(k2, (m, k // BLOCK_SIZE), 0, 0x7F, jnp.int32)
        scales = jax.lax.bitcast_convert_type(sbytes.astype(jnp.uint8), jnp.float8_e4m3fn)
        data, scales = jax.block_until_ready(jax.device_put((data, scales), device))
        nbytes = m * k // 2 + m * k // BLOCK_SIZE + 2 * m * k
        ref = None
        for name in names:
            f = jax.jit(decodes[name])
            out = np.asarray(f(data, scales)).view(np.uint16)
            if ref is None:
                ref = out
            ms, calls = time_one(f, data, scales)
            rows.append(dict(m=m, k=k, decode=name, ms=ms, calls_per_sample=calls,
                             samples=args.samples, bytes=nbytes, gb_per_s=nbytes / ms * 1e-6,
                             equals_select=bool(np.array_equal(out, ref))))
            del out

    print(f"{'M':>6} {'K':>5}  {'decode':<12} {'ms':>9} {'GB/s':>8} {'vs select':>9}  bit-exact")
    base = {}
    for r in rows:
        if r["decode"] == "select":
            base[(r["m"], r["k"])] = r["ms"]
        speed = base[(r["m"], r["k"])] / r["ms"]
        print(f"{r['m']:>6} {r['k']:>5}  {r['decode']:<12} {r['ms']:>9.4f} {r['gb_per_s']:>8.1f} "
              f"{speed:>8.2f}x  {r['equals_select']}")
    result = dict(device=device.device_kind, platform=device.platform, jax=jax.__version__,
                  bytes_note="codes M*K/2 + scales M*K/16 read, bf16 2*M*K written",
                  rows=rows)
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {args.out}")
    if not all(r["equals_select"] for r in rows):
        raise SystemExit("a decode differs from 'select' (see the bit-exact column)")


if __name__ == "__main__":
    main()
