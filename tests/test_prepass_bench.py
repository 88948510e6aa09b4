"""tools/lab/prepass_bench.py (the GPU W4A4 pre-pass microbenchmark) runs on the CPU at tiny sizes,
writes its JSON, and every decode it times equals the former select decode bit for bit."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_prepass_bench_cpu_smoke(tmp_path):
    out = tmp_path / "prepass.json"
    r = subprocess.run([sys.executable, str(ROOT / "tools/lab/prepass_bench.py"), "--cpu-smoke",
                        "--samples", "2", "--sample-ms", "1", "--cases", "16x64,8x32",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["platform"] == "cpu"
    rows = res["rows"]
    assert {(x["m"], x["k"]) for x in rows} == {(16, 64), (8, 32)}
    assert {x["decode"] for x in rows} == {"select", "bits", "bits_stack", "select_shift",
                                           "bits_bf16", "lut", "f4_bitcast"}
    for x in rows:
        assert x["equals_select"] and x["ms"] > 0
        assert x["bytes"] == x["m"] * x["k"] // 2 + x["m"] * x["k"] // 16 + 2 * x["m"] * x["k"]
    assert "bits" in r.stdout and "wrote" in r.stdout
