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
