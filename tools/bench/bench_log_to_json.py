"""Turn the printed log of ``python -m jax_nvfp4.bench`` into its JSON layout (``bench.json``),
for a run that did not write its JSON (stopped by a time limit before jax_nvfp4.bench wrote it
after every case, or its output folder lost).

    python tools/bench/bench_log_to_json.py LOG --driver 580.159.04 [--notes TEXT] [--out FILE]

Needs only the standard library (runs anywhere; jax_nvfp4 need not import). What it writes, key by
key, against what jax_nvfp4.bench writes:

- ``gpu``, ``platform``, ``jax``: from the log's first line (``device: NVIDIA H200 (gpu), jax
  0.11.2``); ``driver``: ``--driver`` (the log does not print it);
- ``experts``: ``--experts``, default 48 (the benchmark's), or 4 where every case is a ``--small``
  one (layer ``S1``): the log does not print it;
- ``complete``: true where the log has the final table (printed once every case is done), else
  false: the run was cut, and its last case may lack rows;
- ``results``: one row per measured line (``  L1 rows 6144     w4a16_fp8_prepared       1.096 ms
  493.9 TFLOP/s   1929.3 GB/s   69.5% of floor``): ``case``, ``impl``, ``ms``, ``tflops``,
  ``weight_gbs``, ``pct_of_floor`` as printed (ms with 3 decimals, where the JSON has 4; the
  others as the JSON rounds them), ``floor_ms`` recomputed as jax_nvfp4.bench computes it
  (:func:`floor_ms`, from the case's layer K, N, its rows and ``experts``, rounded to 4
  decimals) and checked against the printed % of floor. The rows' ``config`` (the Pallas tile,
  the uniform split, the torch call's details) is not printed, so it is left out;
- added: ``parsed_from`` (the log's file name) and ``notes`` (``--notes``, where given).

Lines that are no measured row (``check`` lines, warnings, skipped peers) are ignored.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

EXPERTS = 48
SMALL_EXPERTS = 4
LAYERS = {"L1": (7168, 6144), "L2": (3072, 7168)}          # (K, N) per expert: jax_nvfp4.bench.gemm
SMALL_LAYERS = {"S1": (128, 256)}                          # its --small layer
HBM_BYTES_PER_S = 4.05e12
BF16_FLOPS = 711e12
"""The constants of jax_nvfp4.bench.gemm (tests/test_bench.py checks that they agree)."""

DEVICE = re.compile(r"^device: (?P<gpu>.+) \((?P<platform>[^()]+)\), jax (?P<jax>\S+)\s*$")
ROW = re.compile(r"^  (?P<case>(?P<layer>\S+) rows (?P<rows>\d+))\s+(?P<impl>\w+)\s+"
                 r"(?P<ms>\S+) ms\s+(?P<tflops>\S+) TFLOP/s\s+(?P<gbs>\S+) GB/s\s+"
                 r"(?P<pct>\S+)% of floor\s*$")
FINAL_TABLE = re.compile(r"^case\s+\w")


def floor_ms(rows, k, n, groups=EXPERTS):
    """jax_nvfp4.bench.gemm.floor_ms: the larger of the NVFP4 weight bytes at 4.05 TB/s and the FLOPs
    at 711 TFLOP/s, in ms."""
    weight_bytes = groups * n * k * 0.5625
    flops = 2.0 * rows * k * n
    return max(weight_bytes / HBM_BYTES_PER_S, flops / BF16_FLOPS) * 1e3


def parse(text, driver, notes=None, experts=None, layers=None, source=None):
    """The bench JSON (a dict) of a printed log ``text``; see the module's docstring. ``layers``:
    case layer -> (K, N), default jax_nvfp4.bench.gemm's and its --small one. Raises ValueError on a
    log without the device line or any measured row, a layer not in ``layers``, or a printed %
    of floor that the recomputed floor does not give (a wrong ``experts``)."""
    layers = {**LAYERS, **SMALL_LAYERS, **(layers or {})}
    lines = text.splitlines()
    device = [m for m in map(DEVICE.match, lines) if m]
    if len(device) != 1:
        raise ValueError(f"expected one 'device: ...' line, found {len(device)}")
    rows = [m for m in map(ROW.match, lines) if m]
    if not rows:
        raise ValueError("no measured rows ('  L1 rows 192  impl  0.350 ms ...') in the log")
    unknown = sorted({m["layer"] for m in rows} - set(layers))
    if unknown:
        raise ValueError(f"layers {unknown} have no known (K, N): pass --layer NAME=K,N")
    if experts is None:
        small = all(m["layer"] in SMALL_LAYERS for m in rows)
        experts = SMALL_EXPERTS if small else EXPERTS
    results = []
    for m in rows:
        k, n = layers[m["layer"]]
        ms, pct = float(m["ms"]), float(m["pct"])
        floor = floor_ms(int(m["rows"]), k, n, experts)
        # the printed ms has 3 decimals: the floor's % from it is within that rounding
        if ms > 0 and abs(100 * floor / ms - pct) > 0.06 + pct * (0.0006 / ms + 1e-3):
            raise ValueError(f"{m['case']} {m['impl']}: printed {pct}% of floor, but the floor "
                             f"of {experts} experts, K {k}, N {n} is {floor:.4f} ms, "
                             f"{100 * floor / ms:.1f}% of {ms} ms: wrong --experts or layer?")
        results.append({"case": m["case"], "impl": m["impl"], "ms": ms,
                        "tflops": float(m["tflops"]), "weight_gbs": float(m["gbs"]),
                        "floor_ms": round(floor, 4), "pct_of_floor": pct})
    complete = any(FINAL_TABLE.match(ln) for ln in lines)
    d = device[0]
    meta = {"gpu": d["gpu"], "platform": d["platform"], "driver": driver, "jax": d["jax"],
            "experts": experts, "complete": complete}
    if source:
        meta["parsed_from"] = source
    if notes:
        meta["notes"] = notes
    meta["results"] = results
    return meta


def _layer(spec):
    try:
        name, kn = spec.split("=")
        k, n = (int(v) for v in kn.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=K,N, got {spec!r}") from None
    return name, (k, n)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log", help="the printed output of python -m jax_nvfp4.bench")
    p.add_argument("--driver", required=True,
                   help="the NVIDIA driver version of the run (the log does not print it)")
    p.add_argument("--notes", default=None, help="a note stored as the JSON's 'notes'")
    p.add_argument("--experts", type=int, default=None,
                   help=f"experts per case (default {EXPERTS}, or {SMALL_EXPERTS} for a --small "
                        "log)")
    p.add_argument("--layer", type=_layer, action="append", default=[],
                   help="NAME=K,N: a layer the log's cases use beyond L1, L2, S1 (repeatable)")
    p.add_argument("--out", default=None, help="JSON file to write (default: print it)")
    args = p.parse_args(argv)
    with open(args.log) as fh:
        text = fh.read()
    try:
        meta = parse(text, args.driver, args.notes, args.experts, dict(args.layer),
                     source=os.path.basename(args.log))
    except ValueError as e:
        p.error(str(e))
    out = json.dumps(meta, indent=1)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(out)
        cases = len(dict.fromkeys(r["case"] for r in meta["results"]))
        print(f"wrote {args.out}: {len(meta['results'])} rows, {cases} cases, complete "
              f"{str(meta['complete']).lower()}", file=sys.stderr)
    else:
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
