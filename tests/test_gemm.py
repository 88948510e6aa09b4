"""The grouped GEMM custom call: one test class run on the CPU handler and on the CUDA handler.

The oracle is float64 numpy on the dequantized operands (tests/oracles.py), never our reference
alone. Rows past the groups must be exactly 0. The API allocates its output, so it cannot be
poisoned directly; instead a NaN-filled result of the same size is computed and freed just
before each call, so a reused buffer shows unwritten rows (and the CUDA self-test in
tools/bench/gemm_selftest.cu poisons its output explicitly).
"""

import functools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nvfp4 as jn
from jax_nvfp4 import _extension
from conftest import cpu_devices, gpu_devices, skip_or_fail, QUANTIZE, QUANTIZE_STACK
from oracles import dequant64, grouped_gemm64, rel_err

MMA16 = jn.kernel_config.KernelConfig("mma", 16, 4, 1)   # reads packed e2m1 activations


def platform_device(platform):
    if not _extension.available():
        pytest.fail("the jax_nvfp4 extension is not built (pip install . builds it)")
    if platform == "cpu":
        return jax.devices("cpu")[0]
    devs = gpu_devices()
    if not devs:
        skip_or_fail("no GPU: the CUDA handler is not exercised")
    if not _extension.has_cuda():
        skip_or_fail("the extension was built without the CUDA handler")
    return devs[0]


def make_problem(rng, m, n, k, sizes, w4a4):
    g = len(sizes)
    w = rng.standard_normal((g, n, k)).astype(np.float32) * rng.uniform(0.1, 10, (g, 1, 1))
    rhs = QUANTIZE_STACK(jnp.asarray(w))
    x = (rng.standard_normal((m, k)) * rng.uniform(0.5, 2, (m, 1))).astype(np.float32)
    if w4a4:
        lhs = QUANTIZE(jnp.asarray(x))
        a64 = dequant64(lhs.data, lhs.scales, lhs.global_scale)
    else:
        lhs = jnp.asarray(x, jnp.bfloat16)
        a64 = np.asarray(lhs, np.float64)
    ref = grouped_gemm64(a64, dequant64(rhs.data, rhs.scales),
                         np.asarray(rhs.global_scale, np.float64), sizes)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32), ref


BF16_OUT_TOL = 2.0**-8 + 1e-5
"""Relative L2 error of a bf16 output against the float64 oracle: rounding to bf16 (8 significant
bits, nearest) moves each element by at most 2^-8 of itself, so the L2 norm of the error by at
most 2^-8 of the norm; plus float32 accumulation. Measured 1.6e-3 (M 200, K 256, both backends,
W4A16 and W4A4)."""
F32_OUT_TOL = 1e-5
"""Relative L2 error of a float32 output against the float64 oracle: float32 accumulation of
exact products. Measured 3.7e-8 to 4.7e-8 at K 256; the CPU handler's sequential sum grows like
sqrt(K / 2) 2^-24, about 4e-6 at the K of 7168 in SHAPES."""


def out_tol(out_dtype) -> float:
    return F32_OUT_TOL if out_dtype == jnp.float32 else BF16_OUT_TOL


def poison(device, m, n, dtype):
    """Leave a freed NaN buffer of the output's size on the device (see module docstring)."""
    jax.device_put(jnp.full((m, n), jnp.nan, dtype), device).block_until_ready().delete()


def check_output(out, m, n, sizes, out_dtype, ref):
    """Shape, dtype, zero rows past the groups, and the float64 oracle; returns out as float64."""
    assert out.shape == (m, n) and out.dtype == out_dtype
    out = np.asarray(out, np.float64)
    total = min(sum(max(s, 0) for s in sizes), m)
    assert np.all(out[total:] == 0), "rows past the groups must be 0"
    assert rel_err(out, ref) <= out_tol(out_dtype)
    return out


def _many_groups(g, rows, seed):
    """g skewed group sizes (some 0) summing to rows."""
    r = np.random.default_rng(seed)
    p = np.exp(r.normal(0.0, 1.0, g))
    return [int(v) for v in r.multinomial(rows, p / p.sum())]


SHAPES = [  # (M, N, K, group sizes)
    (1, 8, 32, [1]),
    (37, 8, 96, [5, 0, 20]),                   # sum < M, empty group
    (300, 200, 160, [7, 0, 150, 1, 99]),       # sizes not a multiple of any tile
    (64, 136, 7168, [64, 0, 0, 0]),            # one group holds every row, K at the max
    (129, 7168, 64, [60, 69]),                 # N at the max
    (32768, 8, 32, [10000, 0, 22000, 700]),    # M at the max
    (200, 24, 64, list(np.diff(np.linspace(0, 190, 65).astype(int)))),  # G = 64
    # K % 64 == 0 with >= 16 rows per group: the WGMMA kernel's shapes (N tail, odd k-tile count,
    # several 128-row token tiles per group, sum of sizes < M)
    (700, 200, 320, [100, 0, 250, 3, 97, 0, 130, 20, 50]),
    (2048, 256, 1024, [900, 4, 0, 600, 300, 244]),
    # >= 128 rows per group on average: 256-token tiles (full, partial, and a group of < 32 rows)
    (3072, 256, 512, [1000, 0, 1500, 300, 200, 20]),
    # the same with 3 weight tiles of 128 (N tail): 256-token tiles run as 2-CTA clusters on pairs
    # of weight tiles, so the last pair has a spare tile that must store nothing
    (3072, 300, 256, [1000, 0, 1500, 300, 200, 20]),
    # more groups than a CTA has threads (v1: 128 at token tiles 16-64, 256 at 128): the tile ->
    # group lookup counts in rounds (a V4-Pro layer on one GPU has 384 experts)
    (1200, 128, 64, _many_groups(384, 1150, seed=1)),   # ~3 rows each: v1, token tile 16
    (15000, 8, 96, _many_groups(300, 14900, seed=2)),   # ~50 rows each, K % 64 != 0: v1, tile 64
    (10400, 128, 128, _many_groups(260, 10400, seed=3)),  # ~40 rows each: v2
]


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
class TestGroupedGemmHandler:
    @pytest.mark.parametrize("m,n,k,sizes", SHAPES)
    @pytest.mark.parametrize("w4a4", [False, True], ids=["w4a16", "w4a4"])
    @pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
    def test_against_float64(self, rng, platform, m, n, k, sizes, w4a4, out_dtype):
        dev = platform_device(platform)
        if platform == "cpu" and m * n * k > 2e9:
            pytest.skip("too slow for the scalar CPU handler")
        lhs, rhs, gs, ref = make_problem(rng, m, n, k, sizes, w4a4)
        lhs, rhs, gs = jax.device_put((lhs, rhs, gs), dev)
        poison(dev, m, n, out_dtype)
        f = jax.jit(lambda a, b, c: jn.grouped_gemm(a, b, c, out_dtype=out_dtype, backend="ffi"))
        check_output(f(lhs, rhs, gs), m, n, sizes, out_dtype, ref)

    def test_empty_and_clamped_groups(self, rng, platform):
        dev = platform_device(platform)
        for sizes in ([0, 0, 0], [-5, 30, 100], [200, -1, 7]):   # negative -> 0, sum clamped to M
            lhs, rhs, gs, ref = make_problem(rng, 50, 24, 64, sizes, False)
            out = jn.grouped_gemm(*jax.device_put((lhs, rhs, gs), dev), out_dtype=jnp.float32,
                                  backend="ffi")
            assert rel_err(out, ref) <= 1e-5

    def test_group_sizes_computed_in_jit_and_hlo_has_custom_call(self, rng, platform):
        dev = platform_device(platform)
        lhs, rhs, _, _ = make_problem(rng, 96, 40, 64, [0] * 6, False)
        expert = jnp.asarray(np.sort(rng.integers(0, 6, 96)).astype(np.int32))

        def f(a, b, e):
            sizes = jnp.bincount(e, length=6).astype(jnp.int32)   # on the device, in the jit
            return jn.grouped_gemm(a, b, sizes, out_dtype=jnp.float32, backend="ffi")

        args = jax.device_put((lhs, rhs, expert), dev)
        hlo = jax.jit(f).lower(*args).compile().as_text()
        assert "jax_nvfp4_grouped_gemm" in hlo                    # the handler, not the reference
        out = jax.jit(f)(*args)
        sizes = np.bincount(np.asarray(expert), minlength=6)
        ref = grouped_gemm64(np.asarray(lhs, np.float64), dequant64(rhs.data, rhs.scales),
                             np.asarray(rhs.global_scale, np.float64), sizes)
        assert rel_err(out, ref) <= 1e-5

    def test_handlers_agree_with_reference(self, rng, platform):
        dev = platform_device(platform)
        lhs, rhs, gs, want = make_problem(rng, 77, 48, 128, [10, 0, 50, 17], True)
        args = jax.device_put((lhs, rhs, gs), dev)
        ffi = jn.grouped_gemm(*args, out_dtype=jnp.float32, backend="ffi")
        ref = jn.grouped_gemm(*args, out_dtype=jnp.float32, backend="reference")
        # each against the float64 oracle (measured ~1e-7: float32 accumulation of exact
        # products), and each other (summation order only)
        assert rel_err(ffi, want) <= 1e-6 and rel_err(ref, want) <= 1e-6
        assert rel_err(ffi, ref) <= 1e-6

    def test_nan_block_scale_gives_nan(self, rng, platform):
        # e4m3 bytes 0x7f/0xff are NaN: the outputs that use that block are NaN, the rest finite
        # (the WGMMA kernel builds scales from bits and must special-case it).
        dev = platform_device(platform)
        lhs, rhs, gs, ref = make_problem(rng, 70, 136, 128, [40, 30], False)
        raw = np.asarray(rhs.scales).view(np.uint8).copy()
        raw[1, 5, 3] = 0xFF                                    # group 1, weight row 5, block 3
        bad = jn.NVFP4Tensor(rhs.data, jn.scales_from_bytes(jnp.asarray(raw)), rhs.global_scale)
        out = np.asarray(jn.grouped_gemm(*jax.device_put((lhs, bad, gs), dev),
                                         out_dtype=jnp.float32, backend="ffi"))
        nan = np.isnan(out)
        assert nan[40:70, 5].all() and nan.sum() == 30
        refb = jn.grouped_gemm(lhs, bad, gs, out_dtype=jnp.float32, backend="reference")
        np.testing.assert_array_equal(np.isnan(np.asarray(refb)), nan)
        assert rel_err(np.where(nan, 0, out), np.where(nan, 0, ref)) <= 1e-5

    @pytest.mark.parametrize("route", ["native", "via_bf16"])
    def test_w4a4_routes(self, rng, platform, route):
        # The GPU runs W4A4 as an exact bf16 dequantization of the activations + the W4A16 call
        # (platform_dependent picks it); both routes are checked here on either platform.
        dev = platform_device(platform)
        lhs, rhs, gs, ref = make_problem(rng, 150, 136, 320, [40, 0, 70, 30], True)
        lhs, rhs, gs = jax.device_put((lhs, rhs, gs), dev)
        f = dict(zip(("native", "via_bf16"),
                     jn.gemm._w4a4_routes(jnp.dtype(jnp.float32), MMA16, MMA16)))[route]
        alpha = lhs.global_scale * rhs.global_scale
        out = jax.jit(f)(lhs.data, lhs.scales, rhs.data, rhs.scales, alpha, gs)
        assert rel_err(out, ref) <= 1e-5

    def test_vmap_sequential_and_grad(self, rng, platform):
        dev = platform_device(platform)
        lhs, rhs, gs, _ = make_problem(rng, 16, 24, 64, [8, 8], False)
        lhs, rhs, gs = jax.device_put((lhs, rhs, gs), dev)
        stacked = jnp.stack([lhs, lhs * 2])
        out = jax.vmap(lambda a: jn.grouped_gemm(a, rhs, gs, out_dtype=jnp.float32,
                                                 backend="ffi"))(stacked)
        np.testing.assert_allclose(np.asarray(out[1]), 2 * np.asarray(out[0]), rtol=1e-6)
        # A float lhs is differentiable (tests/test_autodiff.py); an NVFP4 lhs is not.
        q = jn.quantize(lhs.astype(jnp.float32))
        with pytest.raises(NotImplementedError, match="no derivative"):
            jax.grad(lambda s: jn.grouped_gemm(jn.NVFP4Tensor(q.data, q.scales, s), rhs, gs,
                                               out_dtype=jnp.float32, backend="ffi").sum()
                     )(q.global_scale)


SM90_SHAPES = [  # (M, N, K, group sizes); the sm90 layout needs N % 128 == 0 and K % 64 == 0
    (1, 128, 64, [1]),
    (37, 128, 192, [5, 0, 20]),                # decode-sized (the GPU heuristic alone picks v1)
    (300, 256, 320, [7, 0, 150, 1, 99]),       # sizes not a multiple of any tile, empty group
    (50, 384, 128, [0, 0, 0]),                 # every group empty: all rows 0
    (60, 128, 256, [-5, 30, 100]),             # negative size counts as 0, sum clamped to M
    (200, 128, 64, list(np.diff(np.linspace(0, 190, 17).astype(int)))),  # G = 16
    (2048, 256, 1024, [900, 4, 0, 600, 300, 244]),   # several 128-row token tiles per group
    (3072, 256, 512, [1000, 0, 1500, 300, 200, 20]),  # >= 128 rows per group: 256-token tiles
    (3072, 384, 256, [1000, 0, 1500, 300, 200, 20]),  # the same, odd weight tiles: a cluster's spare
    (1200, 128, 64, _many_groups(384, 1150, seed=4)),   # G > threads per CTA (v1, tile 16)
]


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
class TestSm90Layout:
    """Weights from jax_nvfp4.prepare_weights (layout "sm90", custom-call attribute rhs_layout=1).

    CPU: the handler reads the layout natively and must give bitwise the checkpoint-layout
    result. CUDA: the usual kernel choice (mma for the decode-sized shapes, wgmma above; all read the
    layout for W4A16; tests/test_kernel_config.py forces each family); checked against
    float64 only, since the layouts sum the k-blocks in different orders on v1.
    """

    @pytest.mark.parametrize("m,n,k,sizes", SM90_SHAPES)
    @pytest.mark.parametrize("w4a4", [False, True], ids=["w4a16", "w4a4"])
    @pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
    def test_against_float64_and_checkpoint_layout(self, rng, platform, m, n, k, sizes, w4a4,
                                                   out_dtype):
        dev = platform_device(platform)
        if platform == "cpu" and m * n * k > 1e8:
            pytest.skip("too slow for the scalar CPU handler")
        lhs, rhs, gs, ref = make_problem(rng, m, n, k, sizes, w4a4)
        prepared = jn.prepare_weights(rhs)
        assert prepared.layout == "sm90"
        lhs, rhs, prepared, gs = jax.device_put((lhs, rhs, prepared, gs), dev)
        f = jax.jit(lambda a, b, c: jn.grouped_gemm(a, b, c, out_dtype=out_dtype, backend="ffi"))
        base = np.asarray(f(lhs, rhs, gs), np.float64) if platform == "cpu" else None
        poison(dev, m, n, out_dtype)
        out = check_output(f(lhs, prepared, gs), m, n, sizes, out_dtype, ref)
        if platform == "cpu":
            np.testing.assert_array_equal(out, base)

    @pytest.mark.parametrize("route", ["native", "via_bf16"])
    def test_w4a4_routes(self, rng, platform, route):
        dev = platform_device(platform)
        lhs, rhs, gs, ref = make_problem(rng, 150, 256, 320, [40, 0, 70, 30], True)
        lhs, prepared, gs = jax.device_put((lhs, jn.prepare_weights(rhs), gs), dev)
        f = dict(zip(("native", "via_bf16"),
                     jn.gemm._w4a4_routes(jnp.dtype(jnp.float32), MMA16, MMA16, "sm90")))[route]
        alpha = lhs.global_scale * prepared.global_scale
        args = (lhs.data, lhs.scales, prepared.data, prepared.scales, alpha, gs)
        if platform == "cuda" and route == "native":
            # neither kernel reads sm90 weights with packed e2m1 activations; grouped_gemm never
            # sends this (the GPU runs W4A4 via bf16), and the handler says so clearly.
            with pytest.raises(jax.errors.JaxRuntimeError, match="takes a bf16 lhs only"):
                jax.block_until_ready(jax.jit(f)(*args))
            return
        assert rel_err(jax.jit(f)(*args), ref) <= 1e-5

    def test_vmap_sequential(self, rng, platform):
        dev = platform_device(platform)
        lhs, rhs, gs, ref = make_problem(rng, 16, 128, 64, [8, 8], False)
        lhs, prepared, gs = jax.device_put((lhs, jn.prepare_weights(rhs), gs), dev)
        out = jax.vmap(lambda a: jn.grouped_gemm(a, prepared, gs, out_dtype=jnp.float32,
                                                 backend="ffi"))(jnp.stack([lhs, lhs * 2]))
        assert rel_err(out[0], ref) <= 1e-5
        np.testing.assert_allclose(np.asarray(out[1]), 2 * np.asarray(out[0]), rtol=1e-6)


class TestShardMap:
    def test_inside_shard_map_on_8_cpu_devices(self, rng):
        mesh = jax.make_mesh((8,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,),
                             devices=cpu_devices(8))
        sizes = [3, 0, 5, 2, 7, 1, 0, 4]                 # one group per device
        lhs, rhs, gs, ref = make_problem(rng, 8 * 8, 16, 64, [0] * 8, False)
        # Each device multiplies all 64 rows by its own expert: sizes[d] rows, the rest zero.
        x = lhs

        def local(a, b, s):
            return jn.grouped_gemm(a, b, s, out_dtype=jnp.float32, backend="ffi")

        f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("ep"), P("ep")),
                                  out_specs=P("ep")))
        out = np.asarray(f(x, rhs, jnp.asarray(sizes, jnp.int32))).reshape(8, 64, 16)
        w64 = dequant64(rhs.data, rhs.scales)
        a64 = np.asarray(x, np.float64)
        for d in range(8):
            exp = np.zeros((64, 16))
            exp[:sizes[d]] = float(rhs.global_scale[d]) * a64[:sizes[d]] @ w64[d].T
            assert rel_err(out[d], exp) <= 1e-5, f"device {d}"
        # The psum of the per-device results must see every device's output (the output is
        # typed varying; a bare ShapeDtypeStruct would silently give device 0's values).
        g = jax.jit(jax.shard_map(lambda a, b, s: jax.lax.psum(local(a, b, s), "ep"), mesh=mesh,
                                  in_specs=(P(), P("ep"), P("ep")), out_specs=P()))
        np.testing.assert_allclose(np.asarray(g(x, rhs, jnp.asarray(sizes, jnp.int32))),
                                   out.sum(0), rtol=1e-5, atol=1e-5)


    def test_sm90_weights_inside_shard_map(self, rng):
        """Prepared weights split on the expert axis keep their layout on every device."""
        mesh = jax.make_mesh((8,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,),
                             devices=cpu_devices(8))
        lhs, rhs, _, _ = make_problem(rng, 40, 128, 128, [0] * 8, False)
        sizes = jnp.asarray([5, 0, 9, 40, 1, 0, 7, 3], jnp.int32)
        f = jax.jit(jax.shard_map(
            lambda a, b, s: jn.grouped_gemm(a, b, s, out_dtype=jnp.float32, backend="ffi"),
            mesh=mesh, in_specs=(P(), P("ep"), P("ep")), out_specs=P("ep")))
        want = np.asarray(f(lhs, rhs, sizes))
        got = np.asarray(f(lhs, jn.prepare_weights(rhs), sizes))
        assert np.abs(want).max() > 0
        np.testing.assert_array_equal(got, want)
        # device d's [40, N] block: its expert's GEMM over its first sizes[d] rows (float64 oracle)
        w64 = dequant64(rhs.data, rhs.scales)
        gs64 = np.asarray(rhs.global_scale, np.float64)
        oracle = np.concatenate([grouped_gemm64(np.asarray(lhs, np.float64), w64[d:d + 1],
                                                gs64[d:d + 1], [int(sizes[d])]) for d in range(8)])
        assert rel_err(got, oracle) <= 1e-5


def test_cuda_graph_capture_and_replay():
    """The CUDA handler is declared command-buffer compatible: with custom calls captured into
    XLA's CUDA graphs, replays with new buffers and new device-side group sizes stay correct."""
    if not gpu_devices():
        skip_or_fail("no GPU: CUDA-graph capture is not exercised")
    if not _extension.has_cuda():
        skip_or_fail("the extension was built without the CUDA handler")
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
                        " --xla_gpu_graph_min_graph_size=1").strip()
    worker = os.path.join(os.path.dirname(__file__), "_command_buffer_worker.py")
    r = subprocess.run([sys.executable, "-P", worker], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


_MMA_WORKER = """
import jax, jax.numpy as jnp, numpy as np
import jax_nvfp4 as jn
rng = np.random.default_rng(0)
ckpt = jax.vmap(jn.quantize)(jnp.asarray(rng.standard_normal((2, 128, 64)), jnp.float32))
rhs = jn.prepare_weights(ckpt)
x = jnp.asarray(rng.standard_normal((8, 64)), jnp.bfloat16)
gs = jnp.asarray([3, 4], jnp.int32)
out = np.asarray(jn.grouped_gemm(x, rhs, gs, out_dtype=jnp.float32, backend="ffi"), np.float64)
w = np.asarray(jn.dequantize(ckpt, jnp.float32), np.float64)
xf = np.asarray(x.astype(jnp.float32), np.float64)
ref = np.zeros((8, 128))
ref[0:3] = xf[0:3] @ w[0].T
ref[3:7] = xf[3:7] @ w[1].T
print("W4A16 REL", np.abs(out - ref).max() / np.abs(ref).max())
xq = jn.quantize(x.astype(jnp.float32))
try:  # native W4A4 with sm90 weights, past the Python check, straight to the handler
    jax.block_until_ready(jn.gemm._grouped_gemm_op(
        xq.data, xq.scales, rhs.data, rhs.scales, rhs.global_scale, gs, jnp.dtype(jnp.float32),
        jn.kernel_config.KernelConfig("mma", 16, 4, 1), 1))
    print("W4A4 NO ERROR")
except jax.errors.JaxRuntimeError as e:
    print("W4A4 ERROR", e)
"""


def test_cuda_handler_sm90_under_mma_env():
    """JAX_NVFP4_KERNEL=mma (the documented override of the heuristic) with rhs_layout=1: the mma
    kernel reads the layout for a bf16 lhs (checked against float64), and the handler rejects a
    packed e2m1 lhs clearly."""
    if not gpu_devices():
        skip_or_fail("no GPU: the CUDA handler's mma/sm90 path is not exercised")
    if not _extension.has_cuda():
        skip_or_fail("the extension was built without the CUDA handler")
    env = dict(os.environ, JAX_NVFP4_KERNEL="mma")
    r = subprocess.run([sys.executable, "-P", "-c", _MMA_WORKER], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "W4A16 REL" in r.stdout, r.stdout[-2000:]
    rel = float(r.stdout.split("W4A16 REL")[1].split()[0])
    assert rel <= 1e-5, r.stdout[-2000:]
    assert "W4A4 ERROR" in r.stdout and "takes a bf16 lhs only" in r.stdout, r.stdout[-2000:]


class TestBadInput:
    def setup_method(self):
        rng = np.random.default_rng(0)
        self.lhs, self.rhs, self.gs, _ = make_problem(rng, 8, 16, 64, [4, 4], False)

    def test_errors_name_the_argument(self):
        lhs, rhs, gs = self.lhs, self.rhs, self.gs
        with pytest.raises(ValueError, match="lhs: expected dtype"):
            jn.grouped_gemm(lhs.astype(jnp.int32), rhs, gs, backend="ffi")
        with pytest.raises(ValueError, match="lhs: expected dtype"):
            jn.grouped_gemm(lhs.astype(jnp.float32), rhs, gs, backend="ffi")   # kernel takes bf16
        with pytest.raises(ValueError, match=r"lhs: expected \[M, K\]"):
            jn.grouped_gemm(lhs[None], rhs, gs, backend="ffi")
        with pytest.raises(ValueError, match="lhs: K=32"):
            jn.grouped_gemm(lhs[:, :32], rhs, gs, backend="ffi")
        with pytest.raises(ValueError, match="group_sizes: expected shape"):
            jn.grouped_gemm(lhs, rhs, gs[:1], backend="ffi")
        with pytest.raises(ValueError, match="group_sizes: expected int32"):
            jn.grouped_gemm(lhs, rhs, gs.astype(jnp.int64) if jax.config.x64_enabled
                            else gs.astype(jnp.float32), backend="ffi")
        with pytest.raises(ValueError, match="out_dtype"):
            jn.grouped_gemm(lhs, rhs, gs, out_dtype=jnp.float16, backend="ffi")
        with pytest.raises(ValueError, match="rhs: expected an NVFP4Tensor"):
            jn.grouped_gemm(lhs, jnp.ones((2, 16, 64)), gs, backend="ffi")
        bad = jn.NVFP4Tensor(rhs.data, rhs.scales, rhs.global_scale[:1])
        with pytest.raises(ValueError, match="rhs.global_scale"):
            jn.grouped_gemm(lhs, bad, gs, backend="ffi")
        bad = jn.NVFP4Tensor(rhs.data[..., :24], rhs.scales[..., :3], rhs.global_scale)
        with pytest.raises(ValueError, match="multiple of 32"):
            jn.grouped_gemm(lhs[:, :48], bad, gs, backend="ffi")
        empty = jn.NVFP4Tensor(rhs.data[:0], rhs.scales[:0], rhs.global_scale[:0])
        with pytest.raises(ValueError, match="rhs: expected at least one group"):
            jn.grouped_gemm(lhs, empty, gs[:0], backend="ffi")
        with pytest.raises(ValueError, match="backend"):
            jn.grouped_gemm(lhs, rhs, gs, backend="cutlass")
        for hint in (-1, 2.5, True, jnp.int32(3)):
            with pytest.raises(ValueError, match="rows_hint: expected a static int"):
                jn.grouped_gemm(lhs, rhs, gs, backend="ffi", rows_hint=hint)

    def test_rows_hint_steers_the_config_and_changes_nothing(self):
        # 200 rows in 2 groups: 100 per group picks the 64-token mma tile; a hint of 8 rows, 16.
        # The family is pinned to mma, which every device runs (on an sm_90 GPU the heuristic
        # would pick wgmma here, whose accumulation order differs).
        lhs, rhs, gs, _ = make_problem(np.random.default_rng(5), 200, 16, 64, [4, 4], False)
        f = lambda h: jax.jit(lambda a: jn.grouped_gemm(a, rhs, gs, out_dtype=jnp.float32,  # noqa: E731
                                                       backend="ffi", rows_hint=h, kernel="mma"))
        assert "token_tile = 16 : i32" in f(8).lower(lhs).as_text()
        assert "token_tile = 64 : i32" in f(None).lower(lhs).as_text()
        np.testing.assert_array_equal(np.asarray(f(8)(lhs)), np.asarray(f(None)(lhs)))

    def test_sm90_layout_errors(self, monkeypatch):
        lhs, rhs, gs = self.lhs, self.rhs, self.gs                 # rhs N = 16
        with pytest.raises(ValueError, match=r"rhs: layout 'sm90' needs .*got N = 16, K = 64"):
            jn.grouped_gemm(lhs, jn.NVFP4Tensor(rhs.data, rhs.scales, rhs.global_scale, "sm90"),
                            gs, backend="ffi")
        with pytest.raises(ValueError, match=r"rhs.layout: expected one of \('checkpoint', "
                                             r"'sm90'\), got 'SM90'"):
            jn.grouped_gemm(lhs, jn.NVFP4Tensor(rhs.data, rhs.scales, rhs.global_scale, "SM90"),
                            gs, backend="ffi")
        a4 = jn.quantize(lhs.astype(jnp.float32))
        with pytest.raises(ValueError, match="lhs.layout: expected 'checkpoint'"):
            jn.grouped_gemm(jn.NVFP4Tensor(a4.data, a4.scales, a4.global_scale, "sm90"), rhs, gs,
                            backend="ffi")

    @pytest.mark.parametrize("how", ["env", "argument"])
    def test_mma_rejects_sm90_weights_with_nvfp4_lhs(self, monkeypatch, how):
        rng = np.random.default_rng(1)
        lhs, rhs, gs, ref = make_problem(rng, 8, 128, 64, [4, 4], False)
        prepared = jn.prepare_weights(rhs)
        a4 = jn.quantize(lhs.astype(jnp.float32))
        if how == "env":
            monkeypatch.setenv("JAX_NVFP4_KERNEL", "mma")
        kw = {"kernel": "mma"} if how == "argument" else {}
        with pytest.raises(ValueError, match=r"rhs.layout: 'sm90' weights with an NVFP4 lhs .*"
                                             r"kernel 'mma' keeps W4A4 native"):
            jn.grouped_gemm(a4, prepared, gs, backend="ffi", **kw)
        with pytest.raises(ValueError, match=r"rhs.layout: 'sm90' weights with an NVFP4 lhs .*"
                                             r"kernel 'mma' keeps W4A4 native"):
            jn.grouped_gemm_swiglu(a4, prepared, gs, backend="ffi", **kw)
        # a bf16 lhs, the reference, and checkpoint weights still run
        out = jn.grouped_gemm(lhs, prepared, gs, out_dtype=jnp.float32, backend="ffi")
        assert rel_err(out, ref) <= 1e-5
        out = jn.grouped_gemm(lhs, prepared, gs, out_dtype=jnp.float32, backend="reference")
        assert rel_err(out, ref) <= 1e-5
        out = jn.grouped_gemm(a4, rhs, gs, out_dtype=jnp.float32, backend="ffi")
        assert out.shape == (8, 128)

    def test_rhs_layout_reaches_the_call(self):
        rng = np.random.default_rng(2)
        lhs, rhs, gs, _ = make_problem(rng, 8, 128, 64, [4, 4], False)
        f = jax.jit(lambda a, b: jn.grouped_gemm(a, b, gs, backend="ffi"))
        assert "rhs_layout = 0 : i32" in f.lower(lhs, rhs).as_text()
        assert "rhs_layout = 1 : i32" in f.lower(lhs, jn.prepare_weights(rhs)).as_text()

    def test_cpu_handler_checks_rhs_layout(self, on_cpu):
        """The handler's own checks, for callers that bypass grouped_gemm's validation."""
        platform_device("cpu")
        rng = np.random.default_rng(3)
        lhs, rhs, gs, _ = make_problem(rng, 8, 16, 64, [4, 4], False)
        no_sf = jnp.zeros((0,), jnp.float8_e4m3fn)
        call = lambda code: jax.block_until_ready(jn.gemm._grouped_gemm_op(  # noqa: E731
            lhs, no_sf, rhs.data, rhs.scales, rhs.global_scale, gs, jnp.dtype(jnp.float32), MMA16,
            code))
        with pytest.raises(jax.errors.JaxRuntimeError,
                           match=r"rhs_layout must be 0 \(checkpoint\), 1 \(sm90\) or 2 \(fp8\), got 3"):
            call(3)
        with pytest.raises(jax.errors.JaxRuntimeError,
                           match=r"jax_nvfp4_grouped_gemm: rhs_layout 2 \(weights prepared as e4m3 "
                                 r".*belongs to the FP8 mode"):
            call(2)
        with pytest.raises(jax.errors.JaxRuntimeError,
                           match=r"sm90 layout \(rhs_layout 1\) needs N % 128 == 0 and K % 64 == "
                                 r"0, got N = 16, K = 64"):
            call(1)
        assert np.all(np.isfinite(np.asarray(call(0))))

    def test_cpu_handler_checks_its_workspace(self, monkeypatch, on_cpu):
        """The CPU handler decodes a weight row into the workspace output (it allocates
        nothing): one smaller than K is an error naming it, not a buffer overrun."""
        platform_device("cpu")
        rng = np.random.default_rng(4)
        lhs, rhs, gs, ref = make_problem(rng, 8, 16, 4096 + 64, [4, 4], False)
        f = lambda: jn.grouped_gemm(lhs, rhs, gs, out_dtype=jnp.float32,  # noqa: E731
                                    backend="ffi")
        assert rel_err(np.asarray(f(), np.float64), ref) <= 1e-5
        # the size (the extension's formula: the CUDA launchers' 4096 + 32 G schedules, then
        # cutlass_fp8's 128-byte aligned argument arrays, 256 bytes per group, 64 KiB of ones and
        # 512 KiB for CUTLASS's tensor maps; plus K here) against a reading of its own
        cuda = 4096 + 32 * 2 + 128 + 256 * 2 + 14 * 128 + 4 * 16384 + 512 * 1024
        assert jn.gemm.workspace_bytes(2, 4160) == cuda + 4160
        monkeypatch.setattr(jn.gemm, "workspace_bytes", lambda g, k=0: 4096 + 32 * g)
        with pytest.raises(jax.errors.JaxRuntimeError,
                           match=rf"workspace has 4160 bytes, needs {cuda + 4160}"):
            jax.block_until_ready(f())


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
@pytest.mark.parametrize("backend", ["reference", "ffi"])
class TestGroupSizesAndRange:
    """Group sizes and the accumulation range (issue 23, items 5 and 9): every backend clamps
    the same way, rejects what does not fit int32, and overflows at the same place."""

    def run(self, platform, backend, lhs, rhs, gs, out_dtype=jnp.float32):
        dev = platform_device(platform)
        lhs, rhs = jax.device_put((lhs, rhs), dev)
        with jax.default_device(dev):
            return np.asarray(jn.grouped_gemm(lhs, rhs, gs, out_dtype=out_dtype,
                                              backend=backend), np.float64)

    @pytest.mark.parametrize("sizes", [[2**31 - 1, 1], [5, 2**31 - 1, 2**31 - 1],
                                       [2**30, 2**30, 2**30, 3]])
    def test_group_sizes_running_sum_saturates(self, rng, platform, backend, sizes):
        lhs, rhs, gs, ref = make_problem(rng, 24, 16, 64, sizes, False)
        out = self.run(platform, backend, lhs, rhs, gs)
        assert np.all(np.isfinite(out)) and np.abs(out[0]).max() > 0
        assert rel_err(out, ref) <= 1e-5

    @pytest.mark.parametrize("sizes", [np.array([2**32 + 3, 3], np.int64), [2**31, 0],
                                       (0, -2**31 - 1), np.array([2**31, 0], np.uint32)])
    def test_group_sizes_beyond_int32_rejected(self, rng, platform, backend, sizes):
        lhs, rhs, _, _ = make_problem(rng, 8, 16, 64, [4, 4], False)
        platform_device(platform)
        with pytest.raises(ValueError, match=r"group_sizes: every size must fit int32"):
            jn.grouped_gemm(lhs, rhs, sizes, backend=backend)

    @pytest.mark.parametrize("kind", ["list", "tuple", "int64", "int16", "uint8"])
    def test_group_sizes_list_tuple_and_other_ints(self, rng, platform, backend, kind):
        lhs, rhs, gs, ref = make_problem(rng, 12, 16, 64, [3, 0, 7], False)
        conv = {"list": list, "tuple": tuple, "int64": lambda s: np.asarray(s, np.int64),
                "int16": lambda s: np.asarray(s, np.int16),
                "uint8": lambda s: np.asarray(s, np.uint8)}[kind]
        out = self.run(platform, backend, lhs, rhs, conv([3, 0, 7]))
        np.testing.assert_array_equal(out, self.run(platform, backend, lhs, rhs, gs))
        assert rel_err(out, ref) <= 1e-5

    def test_large_activations_within_range_stay_finite(self, rng, platform, backend):
        # bf16 activations ~1e35 and unit weights: the exact result (~1e36) fits float32; every
        # backend accumulates lhs . W / 128 (the CUDA kernels' scaled weights), so none overflows.
        m, n, k = 16, 32, 128
        w = rng.standard_normal((2, n, k)).astype(np.float32)
        rhs = QUANTIZE_STACK(jnp.asarray(w))
        lhs = jnp.asarray(rng.standard_normal((m, k)) * 1e35, jnp.bfloat16)
        sizes = [9, 7]
        ref = grouped_gemm64(np.asarray(lhs, np.float64), dequant64(rhs.data, rhs.scales),
                             np.asarray(rhs.global_scale, np.float64), sizes)
        assert np.abs(ref).max() > 1e36 and np.abs(ref).max() < 3e38
        for out_dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, BF16_OUT_TOL)):
            out = self.run(platform, backend, lhs, rhs, jnp.asarray(sizes, jnp.int32), out_dtype)
            assert np.all(np.isfinite(out)), f"{(~np.isfinite(out)).sum()} non-finite"
            assert rel_err(out, ref) <= tol

    def test_overflow_past_the_range_is_inf(self, rng, platform, backend):
        # Past the range (every product x * W / 128 is beyond FLT_MAX) each backend gives +Inf.
        rhs = jax.vmap(jn.quantize)(jnp.ones((2, 16, 64), jnp.float32))
        lhs = jnp.full((6, 64), 3e38, jnp.bfloat16)
        out = self.run(platform, backend, lhs, rhs, jnp.asarray([2, 3], jnp.int32))
        assert np.all(np.isposinf(out[:5])) and np.all(out[5:] == 0)


class TestRowsHintAndVmap:
    """Issue 23, item 8: a huge rows_hint, and vmap of the reference backend."""

    def test_rows_hint_past_m_means_m(self, on_cpu, monkeypatch):
        rng = np.random.default_rng(5)
        lhs, rhs, gs, ref = make_problem(rng, 8, 16, 64, [4, 4], False)
        f = lambda h: jax.jit(lambda a: jn.grouped_gemm(a, rhs, gs, out_dtype=jnp.float32,  # noqa: E731
                                                       backend="ffi", rows_hint=h))
        hints, choose = [], jn.kernel_config.choose

        def spy(m, n, k, groups, **kw):                      # what the heuristic is asked
            hints.append(kw.get("rows_hint", 0))
            return choose(m, n, k, groups, **kw)

        monkeypatch.setattr(jn.kernel_config, "choose", spy)
        f(10**20).lower(lhs)
        assert hints and set(hints) == {8}
        np.testing.assert_array_equal(np.asarray(f(10**20)(lhs)), np.asarray(f(None)(lhs)))
        out = jn.grouped_gemm(lhs, rhs, gs, out_dtype=jnp.float32, backend="reference",
                              rows_hint=10**20)
        assert rel_err(out, ref) <= 1e-5

    def test_reference_vmap_error_names_the_backend(self, on_cpu):
        rng = np.random.default_rng(6)
        lhs, rhs, gs, _ = make_problem(rng, 8, 16, 64, [4, 4], False)
        with pytest.raises(NotImplementedError,
                           match=r"backend='reference'\) does not support jax.vmap.*backend='ffi'"):
            jax.vmap(lambda a: jn.grouped_gemm(a, rhs, gs, backend="reference"))(
                jnp.stack([lhs, lhs]))
        with pytest.raises(NotImplementedError, match=r"backend='reference'\) does not support"):
            jax.vmap(lambda s: jn.grouped_gemm(lhs, rhs, s, backend="reference"))(
                jnp.stack([gs, gs]))
        out = jax.vmap(lambda a: jn.grouped_gemm(a, rhs, gs, out_dtype=jnp.float32,
                                                 backend="ffi"))(jnp.stack([lhs, lhs]))
        ref = jn.grouped_gemm(lhs, rhs, gs, out_dtype=jnp.float32, backend="reference")
        np.testing.assert_allclose(np.asarray(out[1]), np.asarray(ref), rtol=1e-6)


# Group sizes around the 256-token configuration's tile boundaries: remainders past the full
# 256-row tiles of 1, 31, 32, 33 and 44 rows (the split tails, on the 128-token kernel), 20 / 31 /
# 1 with no full tile, 129 (a partial 256-row tile), none (256, 512), an empty group; 40 rows
# past the groups.
TILE_256_SIZES = [257, 544, 0, 289, 799, 256, 512, 300, 20, 31, 385, 1]
WGMMA_256 = jn.kernel_config.KernelConfig("wgmma", 256, 5, 2)
WGMMA_128 = jn.kernel_config.KernelConfig("wgmma", 128, 8, 1)


@pytest.mark.parametrize("layout", ["checkpoint", "sm90"])
def test_wgmma_256_extended_and_split_tiles(rng, layout):
    """The 256-token configuration against float64 and, bit for bit, the 128-token one (the same
    products summed in the same order) on every kind of group end (TILE_256_SIZES)."""
    dev = platform_device("cuda")
    if jn.kernel_config.device_arch(dev) != 90:
        skip_or_fail("the wgmma kernels need an sm_90 device")
    sizes = TILE_256_SIZES
    m = sum(sizes) + 40
    lhs, rhs, gs, ref = make_problem(rng, m, 256, 512, sizes, False)
    if layout == "sm90":
        rhs = jn.prepare_weights(rhs)
    args = jax.device_put((lhs, rhs, gs), dev)
    outs = []
    for cfg in (WGMMA_256, WGMMA_128):
        f = jax.jit(lambda a, b, c, cfg=cfg: jn.grouped_gemm(a, b, c, out_dtype=jnp.float32,
                                                              backend="ffi", kernel=cfg))
        poison(dev, m, 256, jnp.float32)
        outs.append(check_output(f(*args), m, 256, sizes, jnp.float32, ref))
    np.testing.assert_array_equal(outs[0], outs[1])


# ------------------------------------------------------------------ grouped_gemm_swiglu (custom call)
from test_reference import make_glu_problem  # noqa: E402

GLU_SHAPES = [  # (M, I, K, group sizes, (limit quantile, row scale, per-half global scales))
    (37, 16, 96, [5, 0, 20], (0.5, True, True)),              # checkpoint layout only (N 32)
    (40, 128, 128, [12, 3, 0, 10], (None, False, False)),     # <= 12 rows per group: mma
    (600, 128, 512, [150, 130, 0, 200], (0.5, True, True)),   # >= 128 rows per group: wgmma
    (700, 192, 256, [300, 5, 250, 100], (None, True, True)),  # N 384: 3 weight tiles
]


def glu_check(out, ref, m, i, sizes, out_dtype):
    assert out.shape == (m, i) and out.dtype == out_dtype
    out = np.asarray(out, np.float64)
    total = min(sum(max(s, 0) for s in sizes), m)
    assert np.all(out[total:] == 0), "rows past the groups must be 0"
    assert rel_err(out, ref) <= out_tol(out_dtype)
    return out


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
class TestGroupedGemmSwigluHandler:
    """jax_nvfp4_grouped_gemm_glu against the float64 GEMM + SwiGLU of the stored (unpaired)
    weights and against reference.grouped_gemm_swiglu; CPU: bitwise the same in both layouts."""

    @pytest.mark.parametrize("m,i,k,sizes,variant", GLU_SHAPES)
    @pytest.mark.parametrize("w4a4", [False, True], ids=["w4a16", "w4a4"])
    @pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
    def test_against_float64_and_reference(self, rng, platform, m, i, k, sizes, variant, w4a4,
                                           out_dtype):
        if platform == "cpu" and m > 100:
            pytest.skip("the multi-tile shapes are for the CUDA kernel families (the CPU handler's "
                        "loops have no tiles; the small shapes cover them)")
        dev = platform_device(platform)
        lim_q, row_scale, per_half = variant
        lhs, rhs, gs, rs, limit, ref = make_glu_problem(
            rng, m, i, k, sizes, w4a4=w4a4, per_half=per_half, row_scale=row_scale,
            limit_quantile=lim_q)
        layouts = [rhs] + ([jn.prepare_weights(rhs)] if (2 * i) % 128 == 0 and k % 64 == 0
                           else [])
        outs = []
        for w in layouts:
            args = jax.device_put((lhs, w, gs, rs), dev)
            f = jax.jit(lambda a, b, c, r: jn.grouped_gemm_swiglu(
                a, b, c, row_scale=r, limit=limit, out_dtype=out_dtype, backend="ffi"))
            if w is rhs:
                assert "jax_nvfp4_grouped_gemm_glu" in f.lower(*args).as_text()
            poison(dev, m, i, out_dtype)
            out = glu_check(f(*args), ref, m, i, sizes, out_dtype)
            want = np.asarray(jn.reference.grouped_gemm_swiglu(
                *args[:3], row_scale=args[3], limit=limit, out_dtype=jnp.float32), np.float64)
            # CPU: the handler's float32 sums and exp against XLA's; CUDA: the kernels' orders
            tol = (2e-6 if platform == "cpu" else 1e-5) if out_dtype == jnp.float32 else 1e-2
            assert rel_err(out, want) <= tol, w.layout
            outs.append(out)
        if platform == "cpu" and len(outs) == 2:
            np.testing.assert_array_equal(outs[1], outs[0])

    def test_nan_rows_contained_and_empty_groups(self, rng, platform):
        dev = platform_device(platform)
        lhs, rhs, gs, rs, limit, ref = make_glu_problem(rng, 40, 64, 128, [10, 0, 20],
                                                        w4a4=False, per_half=True,
                                                        row_scale=True, limit_quantile=0.5)
        lhs = lhs.at[4].set(jnp.nan)
        rs = rs.at[15].set(jnp.nan).at[35].set(jnp.nan)          # row 35 lies past the groups
        for w in (rhs, jn.prepare_weights(rhs)):
            out = np.asarray(jn.grouped_gemm_swiglu(*jax.device_put((lhs, w, gs), dev),
                                                    row_scale=jax.device_put(rs, dev),
                                                    limit=limit, out_dtype=jnp.float32,
                                                    backend="ffi"))
            assert np.isnan(out[4]).all() and np.isnan(out[15]).all()
            assert np.all(out[30:] == 0)
            keep = np.ones(40, bool)
            keep[[4, 15]] = False
            assert rel_err(out[keep], ref[keep]) <= 1e-5
        empty = jn.grouped_gemm_swiglu(*jax.device_put((lhs, rhs, jnp.zeros(3, jnp.int32)), dev),
                                       backend="ffi")
        assert empty.shape == (40, 64) and not np.asarray(empty, np.float32).any()

    @pytest.mark.parametrize("family", ["mma", "mma_ws", "wgmma"])
    def test_each_kernel_family(self, rng, platform, family):
        """Each exact family the GPU runs (the CPU handler checks the choice and ignores it)."""
        dev = platform_device(platform)
        if platform == "cuda" and family != "mma" and jn.kernel_config.device_arch(dev) != 90:
            skip_or_fail(f"{family} needs an sm_90 device")
        lhs, rhs, gs, rs, limit, ref = make_glu_problem(rng, 300, 128, 256, [100, 7, 0, 150],
                                                        w4a4=False, per_half=True,
                                                        row_scale=True, limit_quantile=0.5)
        layouts = [jn.prepare_weights(rhs)] + ([] if family == "mma_ws" else [rhs])
        for w in layouts:
            args = jax.device_put((lhs, w, gs, rs), dev)
            out = jn.grouped_gemm_swiglu(*args[:3], row_scale=args[3], limit=limit,
                                         out_dtype=jnp.float32, backend="ffi", kernel=family)
            glu_check(out, ref, 300, 128, [100, 7, 0, 150], jnp.float32)

    def test_wgmma_256_extended_and_split_tiles(self, rng, platform):
        """The fused SwiGLU epilogue (row scales, per-half scales, a limit) of the 256-token
        configuration on every kind of group end (TILE_256_SIZES), against float64 and, bit for
        bit, the 128-token configuration."""
        dev = platform_device(platform)
        if platform == "cpu":
            pytest.skip("CUDA kernel tiles (the CPU handler has none)")
        if jn.kernel_config.device_arch(dev) != 90:
            skip_or_fail("the wgmma kernels need an sm_90 device")
        sizes = TILE_256_SIZES
        m = sum(sizes) + 40
        lhs, rhs, gs, rs, limit, ref = make_glu_problem(rng, m, 128, 256, sizes, w4a4=False,
                                                        per_half=True, row_scale=True,
                                                        limit_quantile=0.5)
        outs = []
        for w in (jn.prepare_weights(rhs), rhs):
            args = jax.device_put((lhs, w, gs, rs), dev)
            for cfg in (WGMMA_256, WGMMA_128):
                poison(dev, m, 128, jnp.float32)
                out = jn.grouped_gemm_swiglu(*args[:3], row_scale=args[3], limit=limit,
                                             out_dtype=jnp.float32, backend="ffi", kernel=cfg)
                outs.append(glu_check(out, ref, m, 128, sizes, jnp.float32))
            np.testing.assert_array_equal(outs[-2], outs[-1])

    def test_w4a4_native_under_mma(self, rng, platform):
        """kernel "mma" keeps W4A4 native (packed e2m1 lhs) with checkpoint weights."""
        dev = platform_device(platform)
        lhs, rhs, gs, rs, limit, ref = make_glu_problem(rng, 50, 64, 128, [20, 25], w4a4=True,
                                                        per_half=True, row_scale=True,
                                                        limit_quantile=0.5)
        args = jax.device_put((lhs, rhs, gs, rs), dev)
        f = jax.jit(lambda a, b, c, r: jn.grouped_gemm_swiglu(
            a, b, c, row_scale=r, limit=limit, out_dtype=jnp.float32, backend="ffi", kernel="mma"))
        glu_check(f(*args), ref, 50, 64, [20, 25], jnp.float32)

    def test_vmap_sequential_and_no_derivative(self, rng, platform):
        dev = platform_device(platform)
        lhs, rhs, gs, _, _, ref = make_glu_problem(rng, 16, 16, 64, [8, 8], w4a4=False,
                                                   per_half=False)
        lhs, rhs, gs = jax.device_put((lhs, rhs, gs), dev)
        out = jax.vmap(lambda a: jn.grouped_gemm_swiglu(a, rhs, gs, out_dtype=jnp.float32,
                                                        backend="ffi"))(jnp.stack([lhs, lhs]))
        assert rel_err(out[0], ref) <= 1e-5
        np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(out[0]))
        with pytest.raises(NotImplementedError, match="fused custom call has no derivative"):
            jax.grad(lambda a: jn.grouped_gemm_swiglu(a, rhs, gs, out_dtype=jnp.float32,
                                                      backend="ffi").sum())(lhs)


class TestGroupedGemmSwigluBadInput:
    def setup_method(self):
        rng = np.random.default_rng(0)
        self.lhs, self.rhs, self.gs, _, _, _ = make_glu_problem(rng, 8, 16, 64, [4, 4],
                                                                w4a4=False, per_half=True)

    @pytest.mark.parametrize("backend", ["reference", "ffi"])
    def test_errors_name_the_argument(self, backend):
        lhs, rhs, gs = self.lhs, self.rhs, self.gs
        f = functools.partial(jn.grouped_gemm_swiglu, backend=backend)
        odd = jn.NVFP4Tensor(rhs.data[:, :24], rhs.scales[:, :24], rhs.global_scale)
        with pytest.raises(ValueError, match=r"rhs: N = 2I must be a multiple of 16"):
            f(lhs, odd, gs)
        with pytest.raises(ValueError, match=r"row_scale: expected float32 \[8\]"):
            f(lhs, rhs, gs, row_scale=jnp.ones((4,), jnp.float32))
        with pytest.raises(ValueError, match=r"row_scale: expected float32 \[8\]"):
            f(lhs, rhs, gs, row_scale=jnp.ones((8,), jnp.float16))
        for bad in (0, -2.0, float("nan")):
            with pytest.raises(ValueError, match="limit: expected"):
                f(lhs, rhs, gs, limit=bad)
        with pytest.raises(ValueError, match="out_dtype"):
            f(lhs, rhs, gs, out_dtype=jnp.float16)
        with pytest.raises(ValueError, match="group_sizes: expected shape"):
            f(lhs, rhs, gs[:1])
        with pytest.raises(ValueError, match="rows_hint: expected a static int"):
            f(lhs, rhs, gs, rows_hint=-1)
        if backend == "ffi":
            with pytest.raises(ValueError, match="lhs: expected dtype"):
                f(lhs.astype(jnp.float32), rhs, gs)                    # the kernel takes bf16

    def test_mma_rejects_sm90_weights_with_nvfp4_lhs(self):
        rng = np.random.default_rng(1)
        lhs, rhs, gs, _, _, _ = make_glu_problem(rng, 8, 64, 64, [4, 4], w4a4=True,
                                                 per_half=False)
        with pytest.raises(ValueError, match=r"rhs.layout: 'sm90' weights with an NVFP4 lhs"):
            jn.grouped_gemm_swiglu(lhs, jn.prepare_weights(rhs), gs, backend="ffi", kernel="mma")

    def test_attributes_reach_the_call(self):
        """glu_limit (inf without a limit), rhs_layout and the plain call's kernel configuration."""
        rng = np.random.default_rng(2)
        lhs, rhs, gs, _, _, _ = make_glu_problem(rng, 8, 64, 64, [4, 4], w4a4=False,
                                                 per_half=False)
        f = lambda w, lim: jax.jit(lambda a: jn.grouped_gemm_swiglu(  # noqa: E731
            a, w, gs, limit=lim, backend="ffi")).lower(lhs).as_text()
        text = f(rhs, 10.0)
        assert "glu_limit = 1.000000e+01 : f32" in text and "rhs_layout = 0 : i32" in text
        assert "glu_limit = 0x7F800000 : f32" in f(rhs, None)
        assert "rhs_layout = 1 : i32" in f(jn.prepare_weights(rhs), 10.0)
        plain = jax.jit(lambda a: jn.grouped_gemm(a, rhs, gs, backend="ffi")).lower(lhs).as_text()
        for attr in ("kernel", "token_tile", "stages", "cluster", "raster"):
            want = re.search(attr + r" = [^,}]*", plain).group(0)
            assert want in text, (attr, want)

    def test_cpu_handler_checks_its_workspace_and_limit(self, monkeypatch, on_cpu):
        """The CPU handler decodes a gate and an up row (workspace 4096 + 32 G + 2 K): the plain
        call's size is an error naming it; a glu_limit <= 0 or NaN, N % 16 != 0, alpha not
        [2G] and row_scale not [M] or [0] are rejected by the handler itself."""
        platform_device("cpu")
        lhs, rhs, gs, _, _, ref = make_glu_problem(np.random.default_rng(5), 8, 16, 4096 + 64,
                                                   [4, 4], w4a4=False, per_half=False)
        f = lambda: jn.grouped_gemm_swiglu(lhs, rhs, gs, out_dtype=jnp.float32,  # noqa: E731
                                           backend="ffi")
        assert rel_err(np.asarray(f(), np.float64), ref) <= 1e-5
        call = lambda lim: jax.block_until_ready(jn.gemm._grouped_gemm_glu_op(  # noqa: E731
            lhs, jnp.zeros((0,), jnp.float8_e4m3fn), rhs.data, rhs.scales,
            jnp.ones((4,), jnp.float32), gs, jnp.zeros((0,), jnp.float32), jnp.dtype(jnp.float32),
            MMA16, 0, lim))
        for lim in (0.0, -1.0, float("nan")):
            with pytest.raises(jax.errors.JaxRuntimeError, match="glu_limit must be > 0"):
                call(lim)
        # the handler's own shape checks, for callers that bypass grouped_gemm_swiglu's
        raw = lambda w, al, rs: jax.block_until_ready(jn.gemm._grouped_gemm_glu_op(  # noqa: E731
            lhs, jnp.zeros((0,), jnp.float8_e4m3fn), w.data, w.scales, al, gs, rs,
            jnp.dtype(jnp.float32), MMA16, 0, 1.0))
        no_rs, al4 = jnp.zeros((0,), jnp.float32), jnp.ones((4,), jnp.float32)
        odd = jn.NVFP4Tensor(rhs.data[:, :24], rhs.scales[:, :24], rhs.global_scale)
        with pytest.raises(jax.errors.JaxRuntimeError, match=r"N = rhs_data.shape\[1\] % 16 == 0, "
                                                             r"got N = 24"):
            raw(odd, al4, no_rs)
        with pytest.raises(jax.errors.JaxRuntimeError, match=r"alpha must have shape \[2G\]"):
            raw(rhs, al4[:2], no_rs)
        with pytest.raises(jax.errors.JaxRuntimeError, match=r"row_scale must have shape \[M\]"):
            raw(rhs, al4, jnp.ones((3,), jnp.float32))
        monkeypatch.setattr(jn.gemm, "workspace_bytes", lambda g, k=0: 4096 + 32 * g + k // 2)
        with pytest.raises(jax.errors.JaxRuntimeError,
                           match=r"workspace has \d+ bytes, needs \d+"):
            jax.block_until_ready(f())
