"""Generate docs/benchmarks.md from the committed benchmark JSON files in docs/.

    python tools/bench/benchmarks_md.py            # rewrite docs/benchmarks.md
    python tools/bench/benchmarks_md.py --check    # exit 1 if docs/benchmarks.md differs

One section per JSON: where it ran (GPU, driver, jax, as the JSON records them), the command that
writes that JSON, and a table of its numbers. Needs only the standard library.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
OUT = DOCS / "benchmarks.md"


def _ms(v, digits=3):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def _where(d):
    """'GPU (driver D), jax J' from a benchmark JSON's header."""
    gpu = d.get("gpu") or d.get("device") or "?"
    if d.get("devices", 1) > 1:
        gpu = f"{d['devices']} x {gpu}"
    driver = f" (driver {d['driver']})" if d.get("driver") else ""
    return f"{gpu}{driver}, jax {d.get('jax', '?')}"


def gemm_table(d):
    """Median ms per case (rows) and implementation (columns), with the floor."""
    impls = list(dict.fromkeys(r["impl"] for r in d["results"]))
    cases = list(dict.fromkeys(r["case"] for r in d["results"]))
    ms = {(r["case"], r["impl"]): r["ms"] for r in d["results"]}
    floor = {r["case"]: r["floor_ms"] for r in d["results"]}
    return _table(["case", "floor"] + impls,
                  [[c, _ms(floor[c])] + [_ms(ms.get((c, i))) for i in impls] for c in cases])


def layer_table(d):
    rows = [[r["tokens"], r["rows"], r["activation"], _ms(r["layer_ms"]),
             _ms(r.get("layer_unfused_ms")), _ms(r["gemm1_ms"]), _ms(r["gemm2_ms"]),
             f"{100 * r['overhead_share']:.0f}%", _ms(r.get("reference_ms"), 1)]
            for r in d["results"]]
    return _table(["tokens", "rows", "activation", "layer", "layer unfused", "gemm1", "gemm2",
                   "overhead share", "reference backend"], rows)


def sweep_table(d):
    """Median ms per case (rows) and implementation or configuration (columns) of a
    tools/lab/cutlass_fp8_sweep.py JSON (its rows with ``ms``; the ``value`` rows are its checks)."""
    rows = [r for r in d["results"] if "ms" in r]
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    cases = list(dict.fromkeys(r["case"] for r in rows))
    ms = {(r["case"], r["impl"]): r["ms"] for r in rows}
    return _table(["case"] + impls, [[c] + [_ms(ms.get((c, i))) for i in impls] for c in cases])


SWEEP_COMMAND = ("python -P tools/lab/cutlass_fp8_sweep.py --cases L1-192,L1-1536,L1-6144,L1-24576,"
                 "L2-6144,L2-24576 --target-s 0.15")
BREAKDOWN_COMMAND = "python -P tools/lab/fp8_prep_breakdown.py --cases L1-24576,L2-24576"


def ep_share_table(d):
    rows = [[r["tokens"], r["activation"], f"{r['ep']} ({r['local_experts']} of {r['experts']})",
             r["own_rows"], r["rows_run"], _ms(r["share_ms"]), _ms(r["share_all_rows_ms"]),
             _ms(r["single_ms_over_ep"]), f"{r['ratio']:.2f}"]
            for r in d["expert_parallel"]]
    return _table(["tokens", "activation", "ep (experts)", "own rows", "rows run",
                   "device 0's share", "share, all rows", "one-device layer / ep", "ratio"], rows)


def ep_table(d):
    rows = []
    for r in d["results"]:
        a, b = r.get("psum", {}), r.get("psum_scatter", {})
        rel = max(a.get("max_rel_diff", 0.0), b.get("max_rel_diff", 0.0))
        rows.append([r["tokens"], _ms(r["single_ms"]), _ms(a.get("ms")),
                     _ms(a.get("collective_ms")), _ms(b.get("ms")), _ms(b.get("collective_ms")),
                     f"{rel:.1e}",
                     a.get("within_rtol", True) and b.get("within_rtol", True)])
    ep = d["ep"]
    return _table(["tokens", "one device", f"ep={ep} psum", "psum alone", f"ep={ep} psum_scatter",
                   "psum_scatter alone", "max rel diff", "within rtol"], rows)


def accuracy_table(d):
    rows = [[r["kind"], r["case"], r["activation"], f"{r['fp8_vs_exact']:.4f}",
             f"{r['exact_vs_unquantized']:.4f}", f"{r['fp8_vs_unquantized']:.4f}",
             f"{r['ratio']:.3f}"] for r in d["results"]]
    return _table(["kind", "case", "activation", "fp8 vs exact", "exact vs unquantized",
                   "fp8 vs unquantized", "ratio"], rows)


def ep_command(d):
    c = d["config"]
    cf = c.get("capacity_factor")
    tokens = ",".join(str(r["tokens"]) for r in d["results"])
    return (f"python -m jax_nvfp4.bench.ep --ep {d['ep']} --tokens {tokens} --activation "
            f"{c['activation']} --layout {c['layout']} --capacity-factor "
            f"{'none' if cf is None else cf}")


IMPL_NOTES = {
    "w4a16_fp8_prepared": "`*_fp8_prepared`: `precision=\"fp8\"` on weights prepared once as "
                          "e4m3 (`jn.prepare_weights(w, \"fp8\")`, 1 byte per weight against "
                          "NVFP4's 0.5625)",
    "cublas_fp8_uniform": "`cublas_*_uniform`: XLA `dot_general` with a batch dimension (cuBLAS) "
                          "on the same rows split evenly over the experts, e4m3 (no scales) or "
                          "bf16: it ignores the raggedness, a bound rather than a like-for-like "
                          "peer",
    "torch_fp8_grouped": "`torch_*_grouped`: PyTorch's grouped GEMMs on the same group sizes "
                         "(`torch._scaled_grouped_mm`, e4m3 with row-wise scales; "
                         "`torch._grouped_mm`, bf16), the GEMM alone (operands already e4m3), "
                         "timed by CUDA events",
}
"""What a column of a grouped GEMM table means, for the implementations that need a word (keyed by
the first of a family; shown in a section whose JSON has that implementation or its family)."""
IMPL_FAMILIES = {"w4a4_fp8_prepared": "w4a16_fp8_prepared",
                 "cublas_bf16_uniform": "cublas_fp8_uniform",
                 "torch_bf16_grouped": "torch_fp8_grouped"}


def impl_notes(d):
    """The notes (:data:`IMPL_NOTES`) on the implementations in a grouped GEMM JSON, as one
    sentence each (empty if none)."""
    have = {IMPL_FAMILIES.get(r["impl"], r["impl"]) for r in d["results"]}
    return " ".join(f"{IMPL_NOTES[i]}." for i in IMPL_NOTES if i in have)


def gemm_command(d, impls_flag):
    impls = ",".join(dict.fromkeys(r["impl"] for r in d["results"]))
    return "python -m jax_nvfp4.bench" + (f" --impls {impls}" if impls_flag else "")


def layer_command(d, unrecorded=""):
    """The ``python -m jax_nvfp4.bench.layer`` command of a layer JSON: the flags its header and
    rows record (precision, a layout other than the precision's default, tokens, activations,
    ``--reference-max-tokens 0`` where no row timed the reference backend, a target_s other than
    0.25, repeats other than 5), then ``unrecorded`` (flags the JSON does not record, such as ``--hlo-tokens``)."""
    flags = []
    precision = d.get("precision", "exact")
    if precision != "exact":
        flags.append(f"--precision {precision}")
    if d.get("layout") not in (None, {"exact": "sm90", "fp8": "fp8"}[precision]):
        flags.append(f"--layout {d['layout']}")
    flags.append("--tokens " + ",".join(str(t) for t in dict.fromkeys(
        r["tokens"] for r in d["results"])))
    flags.append("--activations " + ",".join(dict.fromkeys(r["activation"]
                                                          for r in d["results"])))
    if all(r.get("reference_ms") is None for r in d["results"]):
        flags.append("--reference-max-tokens 0")
    if unrecorded:
        flags.append(unrecorded)
    target_s = d.get("timing", {}).get("target_s", 0.25)
    if target_s != 0.25:
        flags.append(f"--target-s {target_s}")
    repeats = d.get("timing", {}).get("repeats", 5)
    if repeats != 5:
        flags.append(f"--repeats {repeats}")
    return " ".join(["python -m jax_nvfp4.bench.layer", *flags])


SHOW_NOTES = {"bench-h200-fp8-prepared.json"}
"""The JSON files whose ``notes`` the document shows (the run they describe: a JSON parsed from a
benchmark's log by tools/bench/bench_log_to_json.py); the others' notes stay in the JSON."""


def run_notes(d, name):
    """What a JSON says of its own run: that it did not complete (``"complete": false``: a
    benchmark stopped part way), and its ``notes`` where ``name`` is in :data:`SHOW_NOTES`; empty
    if neither."""
    said = []
    if d.get("complete") is False:
        said.append("The run did not complete (`\"complete\": false`): a dash is a row it did "
                    "not measure.")
    if name in SHOW_NOTES and d.get("notes"):
        said.append(f"Notes: {d['notes']}")
    return " ".join(said)


SECTIONS = [
    ("Grouped GEMM against JAX peers", "bench-h200.json",
     "Median ms per call, 48 experts, skewed random group sizes, bf16 output; floor: the larger "
     "of weight bytes at 4.05 TB/s and FLOPs at 711 TFLOP/s. Plot: `bench-h200.png`.",
     lambda d: gemm_command(d, False), gemm_table),
    ("Grouped GEMM, FP8 compute mode", "bench-h200-fp8-api.json",
     "Median ms per call, as above; `*_fp8`: `precision=\"fp8\"` on checkpoint-layout weights.",
     lambda d: gemm_command(d, True), gemm_table),
    ("Grouped GEMM, FP8 compute mode on weights prepared as e4m3, with cuBLAS and PyTorch peers",
     "bench-h200-fp8-prepared.json",
     "Median ms per call, as above; `*_fp8`: `precision=\"fp8\"` on checkpoint-layout weights.",
     lambda d: gemm_command(d, True), gemm_table),
    ("MoE layer against its grouped GEMMs", "bench-layer-h200.json",
     "Median ms; per-GPU DeepSeek-V4-Pro shard (48 experts, top-6, H 7168, I 3072, no shared "
     "expert), sm90 weights; gemm1 / gemm2: each grouped GEMM alone on the layer's routed rows. "
     "Plot: `bench-layer-h200.png`.",
     lambda d: "python -m jax_nvfp4.bench.layer", layer_table),
    ("One device's share of the expert-parallel layer", "bench-layer-h200.json",
     "Median ms; device 0 of the ep-way layer simulated on one GPU, beside 1/ep of the "
     "one-device layer with all experts.",
     lambda d: "python tools/lab/ep_share_bench.py", ep_share_table),
    ("MoE layer, FP8 compute mode on weights prepared as e4m3",
     "bench-layer-h200-fp8-prepared.json",
     "Median ms; the same per-GPU shard, `precision=\"fp8\"` on the weights prepared once as e4m3 "
     "(`jn.prepare_weights(w, \"fp8\")`, the bench_layer default with `--precision fp8`); "
     "gemm1 / gemm2: each grouped GEMM alone, in the fp8 mode, on the layer's routed rows.",
     lambda d: layer_command(d, "--hlo-tokens 0"), layer_table),
]
SECTIONS += [
    ("FP8 compute mode on weights prepared as e4m3: cutlass_fp8 against wgmma_fp8_prepared, cuBLAS "
     "and PyTorch", "bench-h100-cutlass-fp8-sweep.json",
     "Median ms per call in one run, the bench's cases (48 experts, skewed group sizes); each "
     "configuration named `family_tile_sStages_cCluster_rRaster` (kernel= given explicitly), "
     "`heuristic_prepared` the call without `kernel=`, `wgmma_fp8` the in-kernel mode on NVFP4 "
     "checkpoint weights; `cublas_fp8_uniform_bf16out`: cuBLAS's batched e4m3 GEMM on an even split "
     "of the rows, bf16 written by the GEMM (a bound: no raggedness); `torch_fp8_grouped`: "
     "`torch._scaled_grouped_mm` (GEMM only, no activation quantization). Before: "
     "`wgmma_fp8_prepared`; after: `cutlass_fp8_128_s5_c1_r1` (128 x 192 cooperative tiles walked "
     "along M), the heuristic's from 64 rows per group.", lambda d: SWEEP_COMMAND, sweep_table),
    ("FP8 mode at prefill: where the API call's time goes", "bench-h100-fp8-prep-breakdown.json",
     "Median ms in one run, the heuristic's configuration: `quantize_*` the activation quantizer's "
     "custom call alone (bf16 or NVFP4 rows to e4m3 codes and chunk scales), `gemm_only_*` the "
     "grouped GEMM on rows already quantized (`jn.fp8.quantize_rows(x, \"kernel\")`), `api_*` "
     "`grouped_gemm(x, w8, sizes, precision=\"fp8\")` (both), `copy_bf16_x` one read and one "
     "write of the bf16 activations (the HBM floor of a pass over them), `torch_fp8_grouped` "
     "PyTorch's GEMM alone.", lambda d: BREAKDOWN_COMMAND, sweep_table),
    ("MoE layer, FP8 compute mode on e4m3-prepared weights (cutlass_fp8), H100",
     "bench-layer-h100-fp8-cutlass.json",
     "Median ms; the per-GPU shard as above, W4A4, `precision=\"fp8\"` on weights prepared as "
     "e4m3 (the heuristic's 128 x 192 `cutlass_fp8` tile); gemm1 writes the layer's bf16 "
     "`[rows, 2I]`, gemm2 reads the e4m3 rows the dispatch call writes. The exact mode on sm90 "
     "weights in the same run: the next section (1.44x at 4096 tokens). Before the dispatch call "
     "wrote the fp8 operand and the gate/up GEMM bf16 (the previous H100 run, 128 x 192 tile): "
     "4.492 ms at 4096 tokens against 5.835 exact (1.30x), 1.742 at 1024 against 2.262.",
     lambda d: layer_command(d, "--hlo-tokens 0"), layer_table),
    ("MoE layer, exact mode on sm90 weights, H100 (the run of the section above)",
     "bench-layer-h100-exact-sm90.json",
     "Median ms; the same shard, W4A4, `precision=\"exact\"` on weights in the sm90 layout.",
     lambda d: layer_command(d, "--hlo-tokens 0"), layer_table),
    ("MoE layer, FP8 compute mode on e4m3-prepared weights against the exact mode, H200",
     "bench-layer-h200-fp8-cutlass.json",
     "Median ms; the per-GPU shard as above, `precision=\"fp8\"` on weights prepared as e4m3, "
     "the dispatch call writing both GEMMs' e4m3 inputs. The exact mode on sm90 weights in the "
     "same run: the next section (W4A4: 1.43x at 1024 tokens, 1.45x at 4096).",
     lambda d: layer_command(d, "--hlo-tokens 0"), layer_table),
    ("MoE layer, exact mode on sm90 weights, H200 (the run of the section above)",
     "bench-layer-h200-exact-sm90.json",
     "Median ms; the same shard, `precision=\"exact\"` on weights in the sm90 layout.",
     lambda d: layer_command(d, "--hlo-tokens 0"), layer_table),
    ("Whole DeepSeek-V4-Pro layer on one GPU (384 experts), FP8 mode on e4m3-prepared weights",
     "bench-layer-h200-v4pro-8192-fp8.json",
     "Median ms; 384 routed experts, top-6, H 7168, I 3072, 8192 tokens; on the same warm machine "
     "as the exact mode's row below (1.41x).",
     lambda d: layer_command(d, "--experts 384 --hlo-tokens 0"), layer_table),
    ("Whole DeepSeek-V4-Pro layer on one GPU (384 experts), exact mode on sm90 weights",
     "bench-layer-h200-v4pro-8192-exact.json",
     "Median ms; as above, `precision=\"exact\"`.",
     lambda d: layer_command(d, "--experts 384 --hlo-tokens 0"), layer_table),
    ("Grouped GEMM, both modes, against PyTorch's and cuBLAS's FP8 GEMMs (one run)",
     "bench-h200-fp8-peers.json",
     "Median ms per call, as above; `*_sm90`: the exact mode on sm90 weights; `*_fp8`: the fp8 "
     "mode on checkpoint-layout weights; `*_fp8_prepared`: on e4m3-prepared weights (the "
     "heuristic's kernel: `cutlass_fp8` from 64 rows per group), activation quantization "
     "included; `torch_fp8_grouped`: `torch._scaled_grouped_mm` (the GEMM alone); "
     "`cublas_fp8_uniform`: cuBLAS's batched e4m3 GEMM on an even split of the rows (a bound: "
     "no raggedness).",
     lambda d: gemm_command(d, True) + " --cases " + ",".join(
         dict.fromkeys(r["case"].replace(" rows ", "-") for r in d["results"])), gemm_table),
]
SECTIONS += [
    (f"Expert-parallel layer, {name}", f"bench-ep-h200x2-{name}.json",
     "Median ms; DeepSeek-V4-Pro layer (384 experts, top-6, one shared expert); max rel diff: "
     "max |EP - one device| over the row's largest |output|.", ep_command, ep_table)
    for name in ("w4a16", "w4a4", "w4a4-capacity1.25")]
SECTIONS.append(
    ("FP8 compute mode accuracy", "fp8-accuracy.json",
     "Relative L2 differences `||a - b|| / ||b||` on Gaussian data.",
     lambda d: (f"python tools/bench/fp8_accuracy.py --rows {d['rows']} --groups {d['groups']} "
                f"--seed {d['seed']} --backend {d['backend']}"), accuracy_table))


def render(docs=DOCS):
    """The text of docs/benchmarks.md, from the JSON files in ``docs``."""
    lines = ["# Benchmarks", "",
             "Generated by `python tools/bench/benchmarks_md.py` from the JSON files in docs/ "
             "(do not edit by hand).", ""]
    for title, name, what, command, table in SECTIONS:
        d = json.loads((docs / name).read_text())
        if table is ep_share_table and not d.get("expert_parallel"):
            continue
        if table is gemm_table and impl_notes(d):
            what = f"{what} {impl_notes(d)}"
        if run_notes(d, name):
            what = f"{what} {run_notes(d, name)}"
        lines += [f"## {title}", "",
                  f"{_where(d)}; `{name}`; command: `{command(d)}`.", "", what, ""]
        lines += table(d) + [""]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true",
                   help="compare with docs/benchmarks.md instead of writing it")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT} differs from what {__file__} generates: run it", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
