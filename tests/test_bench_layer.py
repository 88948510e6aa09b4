"""jax_nvfp4.bench_layer (the layer vs its GEMMs) on CPU at tiny sizes: the JSON it writes, that the
overhead share comes from the measured numbers, and that what it times is the layer's own work
(the GEMMs on the layer's routed rows; one device's expert-parallel share)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as jn
from jax_nvfp4 import bench_layer, sharding
from jax_nvfp4.bench_ep import random_layer
from jax_nvfp4.moe import row_ladder
from conftest import cpu_devices

TINY = ["--small", "--tokens", "16", "--ep-tokens", "32", "--target-s", "0.001", "--repeats", "1"]


@pytest.fixture(autouse=True)
def _cpu():
    with jax.default_device(cpu_devices(1)[0]):
        yield


def test_runs_and_writes_the_json(tmp_path):
    meta = bench_layer.main(TINY + ["--out", str(tmp_path), "--unfused"])
    saved = json.loads((tmp_path / "bench_layer.json").read_text())
    assert saved["results"] == meta["results"]
    for key in ("gpu", "driver", "jax", "backend", "layout", "results", "expert_parallel"):
        assert key in saved, key
    assert saved["jax"] == jax.__version__ and saved["layout"] == "sm90"
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
            assert r[k] > 0, k                     # 16 <= --small's reference limit of 48
        assert r["fused_swiglu"] is True
        assert r["gemm_ms"] == pytest.approx(r["gemm1_ms"] + r["gemm2_ms"])
        assert r["overhead_share"] == pytest.approx((r["layer_ms"] - r["gemm_ms"]) / r["layer_ms"])
    (ep,) = [e for e in saved["expert_parallel"] if e["activation"] == "w4a4"]
    assert ep["experts"] == 8 * 4 and ep["local_experts"] == 8 and ep["rows"] == 32 * 6
    assert ep["ratio"] == pytest.approx(ep["share_ms"] / (ep["single_ms"] / 4))
    cap = sharding.device_capacity(32, 6, 4, sharding.DEFAULT_CAPACITY_FACTOR)
    assert ep["own_rows"] <= ep["rows_run"] and ep["rows_run"] in row_ladder(cap, 32 * 6)


def test_fp8_precision_runs_on_checkpoint_weights(tmp_path):
    """--precision fp8: the layer and its GEMMs in the FP8 mode, on checkpoint-layout weights by
    default (the FP8 CUDA kernel reads that layout); the GEMMs timed are the layer's (fp8 ones)."""
    meta = bench_layer.main(["--small", "--tokens", "16", "--activations", "w4a16", "--inter", "128",
                             "--ep-tokens", "0", "--hlo-tokens", "0", "--reference-max-tokens", "0",
                             "--precision", "fp8", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_layer.json").read_text())
    assert saved["layout"] == "checkpoint" and saved["precision"] == "fp8"
    (r,) = meta["results"]
    assert r["precision"] == "fp8" and r["layer_ms"] > 0 and r["gemm_ms"] > 0
    cfg = bench_layer.layer_config(8, 128, 128, 6, "w4a16", "fp8")
    w = bench_layer.random_layer(cfg, seed=0, device=jax.devices("cpu")[0])
    x = jax.random.normal(jax.random.key(2), (16, 128), jnp.bfloat16)
    token_of, sizes = jax.jit(bench_layer._routed_rows, static_argnums=2)(x, w, cfg)
    for g, a in bench_layer.gemm_cases(x, token_of, sizes, w, cfg, "ffi"):
        assert "jax_nvfp4_grouped_gemm_fp8" in g.lower(*a).as_text()


def test_overhead_share_is_computed_from_the_measured_numbers(tmp_path, monkeypatch):
    """With the timer replaced, every derived number follows from what was 'measured'."""
    fake = {"layer": 10.0, "gemm1": 3.0, "gemm2": 2.0, "reference": 99.0, "single": 80.0,
            "share": 12.0, "share_all_rows": 30.0, "routing": 1.5, "routing_slice": 0.25}
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
    for e in meta["expert_parallel"]:
        assert e["single_ms_over_ep"] == 20.0 and e["ratio"] == 0.6
        assert e["share_all_rows_ms"] == 30.0 and e["route_ms"] == 1.5
        assert e["route_slice_ms"] == 0.25


def _tiny_layer(experts, seed=0):
    cfg = bench_layer.layer_config(experts, 128, 64, 6, "w4a4")
    return cfg, jn.prepare_weights(random_layer(cfg, seed=seed))


@pytest.mark.parametrize("activation", ["w4a4", "w4a16"])
def test_the_timed_gemms_are_the_layers(activation):
    """The GEMMs timed alone, on the rows and group sizes the layer's routing made, give the
    layer's output once weighted and summed per token (float32 tokens: no final rounding)."""
    cfg, w = _tiny_layer(8)
    cfg = dataclasses.replace(cfg, activation=activation)
    x = jax.random.normal(jax.random.key(1), (24, 128), jnp.float32)
    token_of, sizes = jax.jit(bench_layer._routed_rows, static_argnums=2)(x, w, cfg)
    ids, rw = jn.route(x, w, cfg)
    np.testing.assert_array_equal(np.asarray(sizes), np.bincount(np.asarray(ids).ravel(),
                                                                 minlength=8))
    (g1, a1), (g2, a2) = bench_layer.gemm_cases(x, token_of, sizes, w, cfg, "ffi")
    assert a1[0].shape == (24 * 6, 128) and a2[0].shape == (24 * 6, 64)
    y = np.asarray(g2(*a2), np.float64)
    s2 = bench_layer.gemm_inputs(x, token_of, sizes, w, cfg, "ffi")[3]
    assert (s2 is None) == (activation == "w4a16")
    if s2 is not None:                              # the layer applies each row's own scale
        y *= np.asarray(s2, np.float64)[:, None]
    order = np.argsort(np.asarray(ids).ravel(), kind="stable")
    wts = np.asarray(rw, np.float64).ravel()[order]
    got = np.zeros((24, 128))
    np.add.at(got, np.asarray(token_of), y * wts[:, None])
    want = np.asarray(jax.jit(lambda x, w: jn.moe(x, w, cfg))(x, w), np.float64)   # one compile
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_device_shares_add_up_to_the_layer():
    """local_weights + local_routed_experts, outside shard_map (as the benchmark times device 0):
    the devices' shares sum to the one-device layer (routed experts only, no shared expert)."""
    ep, local = 4, 4
    cfg, w = _tiny_layer(ep * local, seed=2)
    x = jax.random.normal(jax.random.key(3), (40, 128), jnp.float32)
    want = np.asarray(jax.jit(lambda x, w: jn.moe(x, w, cfg))(x, w), np.float64)   # one compile
    # the device index traced (as under shard_map): one compile for the four devices
    share = jax.jit(lambda x, wl, d: sharding.local_routed_experts(
        x, wl, cfg, device_index=d, devices=ep))
    parts = [np.asarray(share(x, bench_layer.local_weights(w, d * local, local), jnp.int32(d)),
                        np.float64) for d in range(ep)]
    for d in range(ep):
        assert np.abs(parts[d]).max() > 0, d
    np.testing.assert_allclose(sum(parts), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("cf", [sharding.DEFAULT_CAPACITY_FACTOR, None])
def test_timed_share_is_device_zeros_share(cf):
    """device_share (what the benchmark times: device 0 routes its token slice, the other
    slices' decisions come in as an input) equals device 0's share with all tokens routed on
    it, bit for bit; the slice it routes is T / ep tokens (40 / 4)."""
    ep, local = 4, 4
    cfg, w = _tiny_layer(ep * local, seed=4)
    x = jax.random.normal(jax.random.key(5), (40, 128), jnp.float32)
    mine = bench_layer.local_weights(w, 0, local)
    ids, rw = jn.route(x, w, cfg)
    want = jax.jit(lambda x, wl: sharding.local_routed_experts(
        x, wl, cfg, device_index=0, devices=ep, capacity_factor=cf))(x, mine)
    f = jax.jit(lambda x, wl, i, r: bench_layer.device_share(x, wl, cfg, i, r, ep=ep,
                                                             backend="auto", capacity_factor=cf))
    got = f(x, mine, ids, rw)
    assert np.abs(np.asarray(want)).max() > 0
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # the slice's decisions are the ones used: wrong ones given for it change nothing
    assert np.array_equal(np.asarray(f(x, mine, ids.at[:10].set(0), rw.at[:10].set(0.0))),
                          np.asarray(want))
    assert " f32[10,16]{1,0} dot(" in f.lower(x, mine, ids, rw).compile().as_text()


def test_help_and_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        bench_layer.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())   # argparse wraps lines
    assert "GPU" in text and "(default: 32,256,1024,4096)" in text and "--reference-max-tokens" in text
    for bad in (["--tokens", "8,x"], ["--tokens", "0"], ["--activations", "w8a8"],
                ["--experts", "0"]):
        with pytest.raises(SystemExit):
            bench_layer.main(TINY + bad)
