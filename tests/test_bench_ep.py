"""jax_nvfp4.bench.ep (the expert-parallel benchmark and check) on 8 CPU devices, small shapes.

The benchmark is also the check that the multi-GPU layer equals the one-device layer, so it must
fail loudly when they differ; these tests run it end to end and feed it a wrong layer.
"""

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as jn
from jax_nvfp4.bench import ep as bench_ep
from jax_nvfp4.bench.common import random_layer
from conftest import gpu_devices

SMALL = ["--experts", "16", "--hidden", "128", "--inter", "64", "--platform", "cpu"]


@pytest.fixture(autouse=True)
def _short_timing(monkeypatch):
    """The real timer, but one short repeat per call: these tests check what is measured and
    written, not the numbers (the CLI's 5 x 0.25 s per timed call was most of their cost)."""
    monkeypatch.setattr(bench_ep, "time_ms", functools.partial(bench_ep.time_ms, target_s=0.001,
                                                               repeats=1))


def needs_devices(n):
    # tests/conftest.py gives 8 CPU devices (on GPU machines too); SMALL runs on them
    return pytest.mark.skipif(jax.device_count("cpu") < n,
                              reason=f"needs {n} CPU devices, have {jax.device_count('cpu')}")


@pytest.mark.slow
@needs_devices(8)
def test_runs_both_combines_and_writes_json(tmp_path):
    meta = bench_ep.main(SMALL + ["--tokens", "24,20", "--ep", "8", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_ep.json").read_text())
    assert saved["results"] == meta["results"] and saved["ep"] == 8
    for key in ("gpu", "platform", "driver", "jax", "devices", "config"):
        assert key in saved, key
    assert bench_ep.DEFAULT_CAPACITY_FACTOR == 1.25     # the layer's documented default
    assert saved["config"]["capacity_factor"] == bench_ep.DEFAULT_CAPACITY_FACTOR   # the layer's
    by_t = {r["tokens"]: r for r in meta["results"]}
    for combine in bench_ep.COMBINES:
        r = by_t[24][combine]
        assert r["within_rtol"] and r["max_rel_diff"] <= 1e-5
        assert r["ms"] > 0 and r["collective_ms"] > 0
        assert all(math.isfinite(r[k]) for k in ("ms", "collective_ms", "max_abs_diff"))
    assert "psum" in by_t[20] and "psum_scatter" not in by_t[20]   # 20 tokens do not split 8 ways


@pytest.mark.slow
@needs_devices(2)
def test_capacity_factor_is_passed_and_checked(tmp_path):
    meta = bench_ep.main(SMALL + ["--tokens", "24", "--ep", "2", "--capacity-factor", "1.5",
                                  "--out", str(tmp_path)])
    assert meta["config"]["capacity_factor"] == 1.5
    for combine in bench_ep.COMBINES:
        assert meta["results"][0][combine]["within_rtol"]
    assert bench_ep._capacity_factor("none") is None and bench_ep._capacity_factor("2") == 2.0


@needs_devices(2)
def test_a_wrong_expert_parallel_layer_fails(monkeypatch):
    real = jn.moe_expert_parallel

    def off_by_a_bit(x, w, config, mesh, **kw):
        out = real(x, w, config, mesh, **kw)
        return out + 1e-3 * jnp.abs(out).max()

    monkeypatch.setattr(jn, "moe_expert_parallel", off_by_a_bit)
    with pytest.raises(SystemExit, match="differs from the single-device layer"):
        bench_ep.main(SMALL + ["--tokens", "16", "--ep", "2"])


def test_random_layer_is_a_sane_nvfp4_layer():
    c = jn.MoEConfig.deepseek_v4_pro(num_experts=4, top_k=2, hidden_size=128, intermediate_size=64)
    w = random_layer(c, seed=3)
    assert w.w13.shape == (4, 128, 128) and w.w2.shape == (4, 128, 64)
    assert w.shared_w13.shape == (128, 128) and w.shared_w2.shape == (128, 64)
    for t, fan_in in ((w.w13, 128), (w.w2, 64)):
        d = np.asarray(jn.dequantize(t))
        assert np.isfinite(d).all()
        # Gaussian with std fan_in^-0.5, through 4-bit rounding
        assert 0.85 < d.std() * fan_in ** 0.5 < 1.15
    again = random_layer(c, seed=3)
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), w, again)))


@pytest.mark.slow
def test_random_layer_does_not_depend_on_experts_per_call():
    """Each expert has its own key: the same bytes whatever the experts per quantize_moe call
    (here 3 + 1 against all 4 in one call)."""
    c = jn.MoEConfig.deepseek_v4_pro(num_experts=4, top_k=2, hidden_size=128, intermediate_size=64)
    w = random_layer(c, seed=3)
    again = random_layer(c, seed=3, experts_per_call=3)
    assert all(jax.tree.leaves(jax.tree.map(
        lambda a, b: bool(jnp.all(a.view(jnp.uint8) == b.view(jnp.uint8))
                          if a.dtype.itemsize == 1 else jnp.all(a == b)), w, again)))


def test_bad_arguments_are_named():
    with pytest.raises(SystemExit):
        bench_ep.main(SMALL + ["--ep", "3"])          # 16 experts do not split over 3
    with pytest.raises(SystemExit):
        bench_ep.main(SMALL + ["--ep", "9"])          # only 8 devices
    if not gpu_devices():
        with pytest.raises(SystemExit):
            bench_ep.main(SMALL + ["--platform", "gpu"])  # the last --platform wins: none here
