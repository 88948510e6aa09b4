"""Expert parallelism on the GPUs of one host (2-8): equal to the layer on one GPU.

tests/test_sharding.py covers the sharding logic on 8 CPU devices; this runs the CUDA kernels
under ``shard_map`` with more local experts than a GEMM CTA has threads (a lookup bug of the mma kernel once
gave NaN there, found only by the 2-GPU benchmark), at decode (v1) and prefill (v2) row counts,
for both combines, both weight layouts and with or without ``capacity_factor``. Skipped without at least 2 GPUs (with
``JAX_NVFP4_REQUIRE_GPU=1`` a machine with no GPU fails, one with a single GPU skips).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as jn
from jax_nvfp4 import _extension
from conftest import gpu_devices, skip_or_fail

H, I, TOP_K = 128, 64, 6
LOCAL_EXPERTS = 160          # > 128 threads of v1's CTA at token tiles 16-64


@pytest.fixture(scope="module")
def gpus():
    devs = gpu_devices()
    if not devs:
        skip_or_fail("no GPU: expert parallelism on GPUs is not exercised")
    if not (_extension.available() and _extension.has_cuda()):
        skip_or_fail("the extension was built without the CUDA handler")
    if len(devs) < 2:
        pytest.skip(f"needs 2 or more GPUs, have {len(devs)}")
    return devs


def _layer(e, seed):
    r = np.random.default_rng(seed)
    w = jn.quantize_moe(r.normal(size=(e, H)) * H ** -0.5,
                        r.normal(size=(e, 2 * I, H)) * H ** -0.5,
                        r.normal(size=(e, H, I)) * I ** -0.5,
                        router_bias=r.normal(size=e) * 0.01,
                        shared_w13=r.normal(size=(2 * I, H)) * H ** -0.5,
                        shared_w2=r.normal(size=(H, I)) * I ** -0.5)
    return w, r


@pytest.mark.parametrize("layout", ["checkpoint", "sm90"])
@pytest.mark.parametrize("rows_per_expert", [3, 24], ids=["decode", "prefill"])
def test_expert_parallel_on_gpus_equals_one_gpu(gpus, layout, rows_per_expert):
    ep = len(gpus)
    e = LOCAL_EXPERTS * ep
    t = -(-rows_per_expert * e // TOP_K) // ep * ep           # divisible by ep (psum_scatter)
    cfg = jn.MoEConfig.deepseek_v4_pro(num_experts=e, top_k=TOP_K, hidden_size=H,
                                       intermediate_size=I, activation="w4a16")
    w, r = _layer(e, seed=rows_per_expert)
    if layout == "sm90":
        w = jn.prepare_weights(w, "sm90")
    x = jnp.asarray(r.normal(size=(t, H)), jnp.float32)
    one = jax.device_put((x, w), gpus[0])
    ref = np.asarray(jax.jit(lambda x, w: jn.moe(x, w, cfg))(*one))
    assert np.isfinite(ref).all()
    mesh = jax.make_mesh((ep,), ("ep",), devices=gpus)
    ws = jn.shard_moe_weights(w, mesh)
    scale = float(np.abs(ref).max())
    # capacity_factor: None (all rows), 1.25 (the default: the first size where the local rows
    # fit), 0.05 (a long ladder of sizes, each device on a larger one)
    for combine in ("psum", "psum_scatter"):
        for cf in (None, 1.25, 0.05):
            f = jax.jit(lambda x, w, c=combine, cf=cf: jn.moe_expert_parallel(
                x, w, cfg, mesh, combine=c, capacity_factor=cf))
            out = np.asarray(f(x, ws))
            assert np.isfinite(out).all(), (combine, cf)
            np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * scale, err_msg=f"{combine} {cf}")
