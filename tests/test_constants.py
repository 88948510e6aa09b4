"""Every public op with its NVFP4 operands as jit arguments and as closed-over constants.

A module-level ``weights`` captured by a jitted function becomes a compile-time constant, and
XLA constant-folds what depends only on it. On jax 0.10 the CPU folding of a sub-byte bitcast
(uint8 -> float4_e2m1fn) gave wrong values, so dequantize, the reference GEMM and the MoE layer
disagreed with themselves (issue 23, item 1). Codes are now decoded with integer operations and
a same-width uint32 -> float32 bitcast; these tests compare both ways bit for bit (and against
ml_dtypes / a float64 oracle), on the CPU and, where one is present, on the GPU.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_nvfp4 as jn
from jax_nvfp4 import _extension
from jax_nvfp4.maths import formats, quantization
from conftest import cpu_devices, gpu_devices, skip_or_fail
from oracles import decode_e2m1_bytes, dequant64, grouped_gemm64, rel_err


@pytest.fixture(params=["cpu", "gpu"])
def device(request):
    if request.param == "cpu":
        return jax.devices("cpu")[0]
    devs = gpu_devices()
    if not devs:
        skip_or_fail("no GPU: closed-over constants are not checked on the GPU")
    return devs[0]


def both_ways(device, f, *args):
    """``(jit(f)(*args), jit(lambda: f(*args))())`` on ``device``: arguments vs constants."""
    with jax.default_device(device):
        args = jax.device_put(args, device)
        as_args = jax.jit(f)(*args)
        closed = jax.jit(lambda: f(*args))()
    return jax.tree.map(np.asarray, as_args), jax.tree.map(np.asarray, closed)


def assert_same(a, b):
    # NaN at the same places and every other element bit for bit (NaN payloads may differ);
    # numpy's own NaN-aware equality does not cover ml_dtypes' bfloat16 on every numpy version
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        nan = np.isnan(x.astype(np.float32))
        np.testing.assert_array_equal(nan, np.isnan(y.astype(np.float32)))
        bits = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize]
        np.testing.assert_array_equal(x.view(bits)[~nan], y.view(bits)[~nan])


def weights(rng, g=2, n=128, k=128):
    w = rng.standard_normal((g, n, k)).astype(np.float32) * rng.uniform(0.5, 4, (g, 1, 1))
    return jax.vmap(jn.quantize)(jnp.asarray(w))


def test_dequantize_closed_over_constant(device, rng):
    t = weights(rng)
    a, c = both_ways(device, jn.dequantize, t)
    assert_same(a, c)
    np.testing.assert_allclose(a, dequant64(t.data, t.scales, t.global_scale), rtol=1e-6)


@pytest.mark.parametrize("static", [False, True])
def test_quantize_closed_over_constant(device, rng, static):
    x = rng.standard_normal((6, 96)).astype(np.float32) * 3
    x[2, 5], x[4, 40] = np.inf, np.nan
    gs = 0.002 if static else None
    a, c = both_ways(device, lambda x: jn.quantize(x, gs), jnp.asarray(x))
    assert_same(a, c)
    ref = jn.quantize(jnp.asarray(x), gs)                     # eager: nothing folded
    assert_same(a, jax.tree.map(np.asarray, ref))


@pytest.mark.parametrize("layout", ["checkpoint", "sm90"])
def test_prepare_weights_closed_over_constant(device, rng, layout):
    t = weights(rng)
    start = t if layout == "sm90" else jn.prepare_weights(t)
    a, c = both_ways(device, lambda t: jn.prepare_weights(t, layout), start)
    assert_same(a, c)


@pytest.mark.parametrize("backend", ["reference", "ffi"])
@pytest.mark.parametrize("lhs_kind", ["bf16", "nvfp4"])
@pytest.mark.parametrize("layout", ["checkpoint", "sm90"])
def test_grouped_gemm_closed_over_constant(device, rng, backend, lhs_kind, layout):
    if backend == "ffi" and (not _extension.available()
                             or (device.platform == "gpu" and not _extension.has_cuda())):
        skip_or_fail("the custom call is not built for this platform")
    rhs = weights(rng, g=3)
    x = rng.standard_normal((40, 128)).astype(np.float32)
    sizes = [10, 0, 25]
    if lhs_kind == "nvfp4":
        lhs = jn.quantize(jnp.asarray(x))
        a64 = dequant64(lhs.data, lhs.scales, lhs.global_scale)
    else:
        lhs = jnp.asarray(x, jnp.bfloat16)
        a64 = np.asarray(lhs, np.float64)
    ref = grouped_gemm64(a64, dequant64(rhs.data, rhs.scales),
                         np.asarray(rhs.global_scale, np.float64), sizes)
    if layout == "sm90":
        rhs = jn.prepare_weights(rhs)
    f = lambda a, w, s: jn.grouped_gemm(a, w, s, out_dtype=jnp.float32,  # noqa: E731
                                        backend=backend)
    a, c = both_ways(device, f, lhs, rhs, jnp.asarray(sizes, jnp.int32))
    assert_same(a, c)
    assert rel_err(a, ref) <= 1e-5


def small_layer(rng, activation):
    e, h, i = 4, 128, 128
    cfg = jn.MoEConfig(num_experts=e, top_k=2, hidden_size=h, intermediate_size=i,
                       n_shared_experts=1, activation=activation)
    n = lambda *s: (rng.standard_normal(s) * 0.1).astype(np.float32)  # noqa: E731
    w = jn.quantize_moe(n(e, h), n(e, 2 * i, h), n(e, h, i), router_bias=n(e),
                        shared_w13=n(2 * i, h), shared_w2=n(h, i))
    return cfg, w, jnp.asarray(rng.standard_normal((12, h)), jnp.bfloat16)


@pytest.mark.parametrize("backend", ["reference", "ffi"])
@pytest.mark.parametrize("activation", ["w4a4", "w4a16"])
def test_moe_closed_over_constant(device, rng, backend, activation):
    if backend == "ffi" and (not _extension.available()
                             or (device.platform == "gpu" and not _extension.has_cuda())):
        skip_or_fail("the custom call is not built for this platform")
    cfg, w, x = small_layer(rng, activation)
    f = lambda x, w: jn.moe(x, w, cfg, backend=backend)  # noqa: E731
    # The weights closed over, the activations an argument (a model's case). With x a constant
    # too, XLA folds the routing on the host, whose exp differs from the GPU's by an ulp (H200:
    # 8 of 24 route weights, none with constant folding off): that case is checked on the CPU.
    with jax.default_device(device):
        x, w = jax.device_put((x, w), device)
        as_args = np.asarray(jax.jit(f)(x, w))
        closed_w = np.asarray(jax.jit(lambda x: f(x, w))(x))
    assert_same(as_args, closed_w)
    if device.platform == "cpu":
        assert_same(*both_ways(device, f, x, w))


def test_moe_expert_parallel_closed_over_constant(rng):
    cfg, w, x = small_layer(rng, "w4a4")
    mesh = jax.make_mesh((4,), ("ep",), devices=cpu_devices(4),
                         axis_types=(jax.sharding.AxisType.Explicit,))
    ws = jn.shard_moe_weights(w, mesh)
    f = lambda x, w: jn.moe_expert_parallel(x, w, cfg, mesh, backend="reference")  # noqa: E731
    with jax.default_device(cpu_devices(1)[0]):
        as_args = np.asarray(jax.jit(f)(x, ws))
        closed = np.asarray(jax.jit(lambda: f(x, ws))())
        single = np.asarray(jax.jit(lambda x, w: jn.moe(x, w, cfg, backend="reference"))(x, w))
    np.testing.assert_array_equal(as_args, closed)
    np.testing.assert_allclose(as_args.astype(np.float32), single.astype(np.float32),
                               rtol=2e-2, atol=2e-2)


def e2m1_oracle_bits(codes, dtype):
    """ml_dtypes' float4_e2m1fn value of each low nibble, as the bit pattern of ``dtype``."""
    v = (np.asarray(codes, np.uint8) & 0xF).view(ml_dtypes.float4_e2m1fn).astype(dtype)
    return v.view(np.uint16 if v.dtype.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_e2m1_every_code_bit_exact(device, dtype):
    # every byte (only the low nibble is read): values and the sign of -0 (code 8), eagerly, as
    # a jit argument and as a closed-over constant, against ml_dtypes and the value table
    codes = jnp.arange(256, dtype=jnp.uint8)
    want = e2m1_oracle_bits(np.arange(256), dtype)
    np.testing.assert_array_equal(
        want[:16], formats.E2M1_VALUES.astype(dtype).view(want.dtype))
    with jax.default_device(device):
        eager = np.asarray(formats.decode_e2m1(jax.device_put(codes, device), dtype))
    a, c = both_ways(device, lambda c: formats.decode_e2m1(c, dtype), codes)
    for got in (eager, a, c):
        assert got.dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(got.view(want.dtype), want)


def test_decode_packed_every_byte_closed_over_constant(device):
    data = jnp.arange(256, dtype=jnp.uint8).reshape(8, 32)
    a, c = both_ways(device, formats.decode_packed, data)
    want = np.asarray(decode_e2m1_bytes(np.asarray(data)), np.float32)
    np.testing.assert_array_equal(a.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(c.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_e2m1_scaled_closed_over_constant(device, rng, dtype):
    # the GPU W4A4 pre-pass (e2m1 * e4m3 scale, bf16): every code under every scale byte
    # (subnormal, zero, negative and NaN scales included), bit for bit against float64 ml_dtypes
    block = np.array([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE], np.uint8)  # codes 0..15
    data = np.concatenate([np.tile(block, (16, 16)),
                           rng.integers(0, 256, (16, 128), dtype=np.uint8)], axis=1)
    sbytes = np.arange(256, dtype=np.uint8).reshape(16, 16)
    sbytes = np.concatenate([sbytes, sbytes[::-1, rng.permutation(16)]], axis=1)
    t = jn.NVFP4Tensor(jnp.asarray(data), jn.scales_from_bytes(jnp.asarray(sbytes)),
                       jnp.float32(1.0))
    a, c = both_ways(device, lambda t: quantization.e2m1_scaled(t, dtype), t)
    want = dequant64(data, sbytes).astype(dtype)          # exact products: any rounding agrees
    assert_same(a, c)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(a.astype(np.float32)), nan)
    bits = np.uint16 if a.dtype.itemsize == 2 else np.uint32
    np.testing.assert_array_equal(a.view(bits)[~nan], want.view(bits)[~nan])
