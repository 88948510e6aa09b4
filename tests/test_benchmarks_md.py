"""docs/benchmarks.md is what tools/bench/benchmarks_md.py generates from the committed JSON files,
so the document cannot drift from the numbers."""

import importlib.util
import json
import pathlib
import shutil

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("benchmarks_md",
                                                  ROOT / "tools/bench/benchmarks_md.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_benchmarks_md_is_the_generated_one():
    gen = _generator()
    assert (ROOT / "docs/benchmarks.md").read_text() == gen.render(ROOT / "docs")
    assert gen.main(["--check"]) == 0


def test_the_tables_follow_the_json(tmp_path):
    """A number changed in a JSON file changes the document (the check can fail)."""
    gen = _generator()
    for name in {s[1] for s in gen.SECTIONS}:
        shutil.copy(ROOT / "docs" / name, tmp_path / name)
    d = json.loads((tmp_path / "bench-h200.json").read_text())
    row = next(r for r in d["results"] if r["case"] == "L1 rows 192" and r["impl"] == "w4a16")
    row["ms"] = 123.4567
    (tmp_path / "bench-h200.json").write_text(json.dumps(d))
    text = gen.render(tmp_path)
    assert text != gen.render(ROOT / "docs")
    line = next(ln for ln in text.splitlines() if ln.startswith("| L1 rows 192 |"))
    assert line.split(" | ")[2] == "123.457"          # case, floor, then w4a16


def test_new_implementations_get_their_notes(tmp_path):
    """A grouped GEMM JSON with the fp8-prepared, uniform cuBLAS and torch rows: their columns,
    and a note on each family (the uniform peers: a bound); none in the committed documents'
    sections without those rows."""
    gen = _generator()
    for name in {s[1] for s in gen.SECTIONS}:
        shutil.copy(ROOT / "docs" / name, tmp_path / name)
    d = json.loads((tmp_path / "bench-h200-fp8-api.json").read_text())
    base = next(r for r in d["results"] if r["impl"] == "w4a16_fp8")
    for impl in ("w4a4_fp8_prepared", "cublas_bf16_uniform", "torch_fp8_grouped"):
        d["results"].append(dict(base, impl=impl))             # placeholder rows for the test
    (tmp_path / "bench-h200-fp8-api.json").write_text(json.dumps(d))
    text = gen.render(tmp_path)
    section = text.split("## Grouped GEMM, FP8 compute mode\n")[1].split("\n## ")[0]
    for impl in ("w4a4_fp8_prepared", "cublas_bf16_uniform", "torch_fp8_grouped"):
        assert f" {impl} |" in section, impl
    assert "e4m3 (`jn.prepare_weights(w, \"fp8\")`, 1 byte per weight" in section
    assert "a bound rather than a like-for-like peer" in section
    assert "`torch._scaled_grouped_mm`" in section
    committed = gen.render(ROOT / "docs").split("## Grouped GEMM, FP8 compute mode\n")[1]
    assert "torch._scaled_grouped_mm" not in committed.split("\n## ")[0]


def test_the_fp8_prepared_sections():
    """The grouped GEMM JSON parsed from the log of a cut run (tools/bench/bench_log_to_json.py):
    its peers' columns, a dash for the rows its last case lacks, the word that the run did not
    complete and its notes; the layer on weights prepared as e4m3, with the command that wrote
    it."""
    text = _generator().render(ROOT / "docs")
    gemm = text.split("## Grouped GEMM, FP8 compute mode on weights prepared as e4m3")[1]
    gemm = gemm.split("\n## ")[0]
    assert "`bench-h200-fp8-prepared.json`" in gemm
    assert "The run did not complete" in gemm and "Notes: Parsed from the log" in gemm
    last = next(ln for ln in gemm.splitlines() if ln.startswith("| L2 rows 24576 |"))
    assert last.endswith("| - | - | - | - |")                      # no cublas / torch rows
    header = next(ln for ln in gemm.splitlines() if ln.startswith("| case |"))
    assert header.split(" | ")[-4:] == ["cublas_fp8_uniform", "cublas_bf16_uniform",
                                        "torch_fp8_grouped", "torch_bf16_grouped |"]
    layer = text.split("## MoE layer, FP8 compute mode on weights prepared as e4m3")[1]
    layer = layer.split("\n## ")[0]
    assert ("command: `python -m jax_nvfp4.bench.layer --precision fp8 --tokens 4096,1024,256 "
            "--activations w4a4,w4a16 --reference-max-tokens 0 --hlo-tokens 0 --target-s 0.15`"
            in layer)
    assert "| 4096 | 24576 | w4a4 | 5.533 |" in layer
    assert "did not complete" not in text.split("## Grouped GEMM, FP8 compute mode on")[0]
