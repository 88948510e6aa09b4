"""jax_nvfp4.bench.layer (the layer vs its GEMMs) on CPU at tiny sizes: the JSON it writes, that the
overhead share comes from the measured numbers, and that the GEMMs it times alone are the layer's
(on the layer's routed rows, they make the layer's output)."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as jn
from jax_nvfp4.bench import layer as bench_layer
from jax_nvfp4.bench.common import random_layer
from conftest import cpu_devices

TINY = ["--small", "--tokens", "16", "--target-s", "0.001", "--repeats", "1"]


@pytest.fixture(autouse=True)
def _cpu():
    with jax.default_device(cpu_devices(1)[0]):
        yield


@pytest.mark.slow
def test_runs_and_writes_the_json(tmp_path):
    meta = bench_layer.main(TINY + ["--out", str(tmp_path), "--unfused"])
    saved = json.loads((tmp_path / "bench_layer.json").read_text())
    assert saved["results"] == meta["results"]
    for key in ("gpu", "platform", "driver", "jax", "backend", "extension", "layout", "results"):
        assert key in saved, key
    assert saved["jax"] == jax.__version__ and saved["layout"] == "sm90"
    assert saved["extension"]["built"] is True and saved["backend"] == "auto"
    for act in ("w4a4", "w4a16"):                  # --small: the HLO at 16 tokens
        hlo = (tmp_path / f"layer_hlo_T16_{act}.txt").read_text()
        assert "custom-call" in hlo
        assert "jax_nvfp4_grouped_gemm_glu" in hlo    # sm90 weights: the fused SwiGLU path
    rows = saved["results"]
    assert [(r["tokens"], r["activation"]) for r in rows] == [(16, "w4a4"), (16, "w4a16")]
    for r in rows:
        assert r["rows"] == 16 * 6
        for k in ("layer_ms", "layer_unfused_ms", "gemm_ms", "gemm1_ms", "gemm2_ms",
                  "reference_ms"):
            assert math.isfinite(r[k]) and r[k] > 0, k   # 16 <= --small's reference limit of 48
        assert r["fused_swiglu"] is True
        assert r["gemm_ms"] == pytest.approx(r["gemm1_ms"] + r["gemm2_ms"])
        assert r["overhead_share"] == pytest.approx((r["layer_ms"] - r["gemm_ms"]) / r["layer_ms"])
        assert 1 <= r["experts_with_rows"] <= 8 and r["max_group"] <= 16


def test_fp8_precision_runs_on_prepared_weights(tmp_path):
    """--precision fp8: the layer and its GEMMs in the FP8 mode, on weights prepared as e4m3 by
    default (--layout fp8); the GEMMs timed are the layer's (fp8 ones, on the prepared weights:
    rhs_layout 2 in the lowered call)."""
    meta = bench_layer.main(["--small", "--tokens", "16", "--activations", "w4a16", "--inter", "128",
                             "--hlo-tokens", "0", "--reference-max-tokens", "0",
                             "--precision", "fp8", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_layer.json").read_text())
    assert saved["layout"] == "fp8" and saved["precision"] == "fp8"
    (r,) = meta["results"]
    assert r["precision"] == "fp8" and r["layer_ms"] > 0 and r["gemm_ms"] > 0
    assert r["fused_swiglu"] is False              # the fused call is exact precision only
    cfg = bench_layer.layer_config(8, 128, 128, 6, "w4a16", "fp8")
    w = jn.prepare_weights(random_layer(cfg, seed=0, device=jax.devices("cpu")[0]), "fp8")
    assert isinstance(w.w13, jn.Fp8Weights) and isinstance(w.w2, jn.Fp8Weights)
    x = jax.random.normal(jax.random.key(2), (16, 128), jnp.bfloat16)
    token_of, sizes = jax.jit(bench_layer.routed_rows, static_argnums=2)(x, w, cfg)
    for g, a in bench_layer.gemm_cases(x, token_of, sizes, w, cfg, "ffi"):
        text = g.lower(*a).as_text()
        assert jn._extension.TARGET in text and "rhs_layout = 2 : i32" in text


@pytest.mark.slow
def test_auto_precision_rows_say_the_mode_that_ran(tmp_path):
    """--precision auto: checkpoint weights by default; each token count runs, and its row
    records, the mode MoEConfig.for_tokens picks (8 experts, top-6: exact at 16 tokens, fp8 at
    64)."""
    meta = bench_layer.main(["--small", "--tokens", "16,64", "--activations", "w4a16", "--inter",
                             "128", "--hlo-tokens", "0", "--reference-max-tokens", "0",
                             "--precision", "auto", "--out", str(tmp_path)])
    assert meta["layout"] == "checkpoint" and meta["precision"] == "auto"
    assert [(r["tokens"], r["precision"]) for r in meta["results"]] == [(16, "exact"), (64, "fp8")]


def test_overhead_share_is_computed_from_the_measured_numbers(tmp_path, monkeypatch):
    """With the timer replaced, every derived number follows from what was 'measured'."""
    fake = {"layer": 10.0, "gemm1": 3.0, "gemm2": 2.0, "reference": 99.0}
    seen = []

    def timer(f, *args, **kw):
        seen.append(f.__name__)
        return fake[f.__name__]

    monkeypatch.setattr(bench_layer, "time_ms", timer)
    meta = bench_layer.main(TINY + ["--tokens", "16,20", "--reference-max-tokens", "16",
                                    "--out", str(tmp_path)])
    assert seen.count("layer") == 4 and seen.count("reference") == 2
    for r in meta["results"]:
        assert r["gemm_ms"] == 5.0 and r["overhead_ms"] == 5.0 and r["overhead_share"] == 0.5
        assert r["reference_ms"] == (99.0 if r["tokens"] == 16 else None)


def _tiny_layer(experts, inter=64, precision="exact", layout="sm90", seed=0):
    cfg = bench_layer.layer_config(experts, 128, inter, 6, "w4a4", precision)
    return cfg, jn.prepare_weights(random_layer(cfg, seed=seed), layout)


@pytest.mark.parametrize("activation,precision,layout", [
    ("w4a4", "exact", "sm90"), ("w4a16", "exact", "sm90"),
    pytest.param("w4a4", "exact", "checkpoint", marks=pytest.mark.slow),
    ("w4a4", "fp8", "checkpoint"), ("w4a16", "fp8", "fp8")])
def test_the_timed_gemms_are_the_layers(activation, precision, layout):
    """The GEMMs timed alone, on the rows and group sizes the layer's routing made, give the
    layer's output once their rows are scaled, weighted and summed per token (float32 tokens: no
    final rounding): sm90 weights (the layer fuses the SwiGLU), checkpoint weights (it does not)
    and the FP8 mode on checkpoint-layout and on prepared e4m3 weights."""
    cfg, w = _tiny_layer(8, inter=128 if precision == "fp8" else 64, precision=precision,
                         layout=layout)
    cfg = dataclasses.replace(cfg, activation=activation)
    x = jax.random.normal(jax.random.key(1), (24, 128), jnp.float32)
    token_of, sizes = jax.jit(bench_layer.routed_rows, static_argnums=2)(x, w, cfg)
    ids, rw = jn.route(x, w, cfg)
    np.testing.assert_array_equal(np.asarray(sizes), np.bincount(np.asarray(ids).ravel(),
                                                                 minlength=8))
    (g1, a1), (g2, a2) = bench_layer.gemm_cases(x, token_of, sizes, w, cfg)
    assert a1[0].shape == (24 * 6, 128) and a2[0].shape == (24 * 6, cfg.intermediate_size)
    y = np.asarray(g2(*a2), np.float64)
    s2 = bench_layer.gemm_inputs(x, token_of, sizes, w, cfg)[3]
    assert (s2 is None) == (activation == "w4a16")
    if s2 is not None:                              # the layer applies each row's own scale
        y *= np.asarray(s2, np.float64)[:, None]
    order = np.argsort(np.asarray(ids).ravel(), kind="stable")
    wts = np.asarray(rw, np.float64).ravel()[order]
    got = np.zeros((24, 128))
    np.add.at(got, np.asarray(token_of), y * wts[:, None])
    want = np.asarray(jax.jit(lambda x, w: jn.moe(x, w, cfg))(x, w), np.float64)   # one compile
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_help_and_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        bench_layer.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())   # argparse wraps lines
    assert "GPU" in text and "(default: 32,256,1024,4096)" in text and "--reference-max-tokens" in text
    assert "fp8 with --precision fp8" in text       # the fp8 mode's default layout
    for bad in (["--tokens", "8,x"], ["--tokens", "0"], ["--activations", "w8a8"],
                ["--experts", "0"], ["--layout", "fp8"]):          # e4m3 weights: fp8 mode only
        with pytest.raises(SystemExit):
            bench_layer.main(TINY + bad)
