"""The fp8 compute mode (jax_nvfp4.ops.fp8, grouped_gemm(precision="fp8"), MoEConfig.precision)
against oracles written here: float64 numpy with ml_dtypes' e4m3 casts and numpy's frexp."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_nvfp4 as jn
from jax_nvfp4 import _extension
from jax_nvfp4.ops import fp8
from oracles import decode_e2m1_bytes, decode_e4m3, dequant64, float_layer64, rel_err
from conftest import QUANTIZE_STACK, cpu_devices, gpu_devices, skip_or_fail

E4M3 = ml_dtypes.float8_e4m3fn
HAS_FFI = _extension.available()
needs_ffi = pytest.mark.skipif(not HAS_FFI, reason="the compiled extension is not built")


# ------------------------------------------------------------------ oracles
def oracle_scale_exponent(amax: float) -> int:
    """The smallest p >= -126 with amax / 2^p <= 448, by frexp and float64 comparisons."""
    if amax == 0:
        return -126
    _, e = np.frexp(amax)                        # amax = m * 2^e, m in [0.5, 1)
    p = int(e) - 10                              # amax / 2^p >= 2^9 > 448: too small
    while amax / 2.0**p > 448.0:
        p += 1
    return max(p, -126)


def oracle_quantize(x):
    """float [M, K] -> (e4m3 codes [M, K] as ml_dtypes, float64 scales [M, K/128])."""
    with np.errstate(invalid="ignore"):                 # (NaN bf16/f16 patterns)
        x64 = np.asarray(x).astype(np.float32).astype(np.float64)
    m, k = x64.shape
    codes = np.empty((m, k), E4M3)
    scales = np.empty((m, k // 128))
    for r in range(m):
        for c in range(k // 128):
            chunk = x64[r, 128 * c:128 * (c + 1)]
            if not np.all(np.isfinite(chunk)):
                codes[r, 128 * c:128 * (c + 1)] = np.full(128, 0x7F, np.uint8).view(E4M3)
                scales[r, c] = 1.0
                continue
            p = oracle_scale_exponent(float(np.max(np.abs(chunk))))
            codes[r, 128 * c:128 * (c + 1)] = (chunk / 2.0**p).astype(E4M3)
            scales[r, c] = 2.0**p
    return codes, scales


def oracle_weights(data, scales):
    """uint8 [..., N, K/2] + e4m3 [..., N, K/16] (checkpoint layout) -> e4m3 [..., N, K]."""
    v = decode_e2m1_bytes(data)
    s = decode_e4m3(scales)
    w = (v.reshape(v.shape[:-1] + (-1, 16)) * s[..., None]).reshape(v.shape) / 8.0
    return w.astype(E4M3)


def oracle_gemm(q, s, w8, alpha, group_sizes):
    """float64 fp8 GEMM from decoded operands: returns (out, abs_sum) [M, N], abs_sum the sum of
    |every scaled product| (what bounds float32 accumulation error)."""
    q = np.asarray(q).astype(np.float64)
    w8 = np.asarray(w8).astype(np.float64)
    m, k = q.shape
    n = w8.shape[1]
    out, mag = np.zeros((m, n)), np.zeros((m, n))
    qs = (q.reshape(m, -1, 128) * s[..., None]).reshape(m, k)       # exact in float64
    start = 0
    for g, size in enumerate(np.asarray(group_sizes)):
        end = min(start + max(int(size), 0), m)
        f = 8.0 * float(alpha[g])
        out[start:end] = f * (qs[start:end] @ w8[g].T)
        mag[start:end] = abs(f) * (np.abs(qs[start:end]) @ np.abs(w8[g]).T)
        start = end
    return out, mag


def assert_within_f32_accumulation(got, want, mag, k, what=""):
    """|got - want| <= (K/128 + 128 + 2) * 2^-24 * sum |products|: recursive float32 summation
    of one chunk, the fold over the chunks and the epilogue multiply (any summation order)."""
    got = np.asarray(got, np.float64)
    bound = (k // 128 + 128 + 2) * 2.0**-24 * mag + 1e-30
    bad = ~(np.abs(got - want) <= bound)
    assert not bad.any(), (what, np.argwhere(bad)[:5], got[bad][:5], want[bad][:5])


def random_wide(rng, shape, hi=120):
    """float32 values over a wide exponent range (per chunk scales from 2^-140 to 2^hi)."""
    m, k = shape
    base = rng.standard_normal(shape) * 2.0 ** rng.integers(-20, 5, shape)
    chunk_exp = rng.integers(-140, hi, (m, k // 128))
    return (base * np.repeat(2.0 ** chunk_exp.astype(np.float64), 128, axis=1)).astype(np.float32)


def nvfp4_weights(rng, g, n, k, scale=1.0):
    return QUANTIZE_STACK(jnp.asarray(rng.standard_normal((g, n, k)) * scale, jnp.float32))


# ------------------------------------------------------------------ activations (spec 1)
class TestQuantizeActivations:
    def check(self, x):
        codes, scales = jax.jit(fp8.quantize_activations_fp8)(jnp.asarray(x))
        assert codes.dtype == jnp.float8_e4m3fn and codes.shape == x.shape
        assert scales.dtype == jnp.float32 and scales.shape == (x.shape[0], x.shape[1] // 128)
        want_c, want_s = oracle_quantize(x)
        np.testing.assert_array_equal(np.asarray(codes).view(np.uint8), want_c.view(np.uint8))
        np.testing.assert_array_equal(np.asarray(scales, np.float64), want_s)
        return codes, scales

    def test_random_wide_range_float32(self, rng):
        self.check(random_wide(rng, (6, 512)))

    def test_bfloat16_and_float16_inputs(self, rng):
        x = rng.standard_normal((4, 256)) * 10.0 ** rng.integers(-3, 3, (4, 256))
        self.check(x.astype(ml_dtypes.bfloat16))
        self.check(x.astype(np.float16))
        tiny = (np.arange(1, 257, dtype=np.uint16).reshape(2, 128)).view(ml_dtypes.bfloat16)
        self.check(tiny)                                  # bf16 subnormals: amax 2^-126 region

    def test_zero_negative_zero_and_subnormal_chunks(self, rng):
        x = np.zeros((4, 256), np.float32)
        x[0, 128:] = -0.0
        x[1, :128] = (rng.integers(1, 1 << 23, 128) * (1 - 2 * rng.integers(0, 2, 128))
                      ).astype(np.float64) * 2.0**-149                 # float32 subnormals
        x[1, 128:] = 2.0**-126 * rng.uniform(-1.0, 1.0, 128)           # subnormal and normal
        x[2, :] = rng.standard_normal(256) * 2.0**-110                  # p just above -126
        x[2, 5] = 3e-42                                                 # a subnormal beside them
        x[3, :128] = rng.standard_normal(128)
        x[3, 7] = -0.0
        codes, scales = self.check(x)
        assert float(scales[0, 0]) == 2.0**-126 and float(scales[0, 1]) == 2.0**-126
        b = np.asarray(codes).view(np.uint8)
        assert (b[0, :128] == 0x00).all() and (b[0, 128:] == 0x80).all()   # signs kept
        assert b[3, 7] == 0x80
        assert (b[1, :128] != 0).any()        # subnormal inputs are not flushed to zero

    def test_chunk_max_at_and_past_448_times_power_of_two(self, rng):
        cases = [(448.0, 0), (448.0 * 2.0**-40, -40),
                 (float(np.nextafter(np.float32(448.0), np.float32(1e9))), 1),
                 (1.75, -8), (float(np.float32(1.75 + 2.0**-22)), -7)]
        x = np.stack([rng.uniform(-1.0, 1.0, 128) * (2.0**-40 if p == -40 else 1.0)
                      for _, p in cases]).astype(np.float32)
        x[:, 3] = [-a for a, _ in cases]
        codes, scales = self.check(x)
        assert [int(np.log2(float(s))) for s in np.asarray(scales)[:, 0]] == [0, -40, 1, -8, -7]
        b = np.asarray(codes).view(np.uint8)
        assert b[0, 3] == 0xFE and b[1, 3] == 0xFE and b[3, 3] == 0xFE   # -448: no saturation

    def test_nan_and_inf_chunks(self, rng):
        x = rng.standard_normal((3, 384)).astype(np.float32)
        x[0, 5] = np.nan
        x[1, 130] = np.inf
        x[2, 300] = -np.inf
        codes, scales = self.check(x)
        b = np.asarray(codes).view(np.uint8)
        assert (b[0, :128] == 0x7F).all() and (b[1, 128:256] == 0x7F).all()
        assert (b[2, 256:] == 0x7F).all() and not (b[0, 128:] == 0x7F).any()
        assert float(scales[0, 0]) == float(scales[2, 2]) == 1.0

    def test_float64_input_is_rounded_to_float32(self, rng):
        x = rng.standard_normal((2, 128))
        with jax.enable_x64(True):
            got = fp8.quantize_activations_fp8(jnp.asarray(x, jnp.float64))
        want = fp8.quantize_activations_fp8(jnp.asarray(x, jnp.float32))
        np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint8),
                                      np.asarray(want[0]).view(np.uint8))

    def test_bad_input(self):
        with pytest.raises(ValueError, match="K=96"):
            fp8.quantize_activations_fp8(jnp.zeros((2, 96)))
        with pytest.raises(ValueError, match=r"\[M, K\]"):
            fp8.quantize_activations_fp8(jnp.zeros((128,)))
        with pytest.raises(ValueError, match="floating"):
            fp8.quantize_activations_fp8(jnp.zeros((2, 128), jnp.int32))


def _chunks_with_scale(y, p):
    """float32 [len(y) / 127 chunks, 128]: each chunk's first value 448 * 2^p (so that its scale
    is exactly 2^p), then 127 of the values y * 2^p (float64 y, exact in float32 after scaling)."""
    y = np.asarray(y, np.float64)
    y = np.concatenate([y, np.zeros((-len(y)) % 127)]).reshape(-1, 127)
    head = np.full((len(y), 1), 448.0)
    return (np.concatenate([head, y], axis=1) * 2.0**p).astype(np.float32)


def adversarial_f32(rng):
    """float32 [M, 1024] of adversarial chunks for the quantizer (one chunk per 128 values):
    subnormal inputs under every scale regime (all subnormal, amax the smallest normal, p = -23 and
    -22 where the integer route's subnormal branch switches), amax bits at the p boundary F ~
    0x600000 for every exponent, x / 2^p at, around and below e4m3's smallest subnormal 2^-9 and
    at every tie between two e4m3 values (p = -126 makes those inputs subnormal float32, p = 119
    puts them near the top), signed-zero chunks, Inf and NaN chunks (NaNs of both signs)."""
    chunks = []
    sub = (rng.integers(1, 1 << 23, (4, 128)) * (1 - 2 * rng.integers(0, 2, (4, 128)))) * 2.0**-149
    chunks += list(sub.astype(np.float32))                                # amax subnormal: p = -126
    big = sub.copy()
    for i, amax in enumerate([2.0**-126, 448 * 2.0**-23, 448 * 2.0**-22, 1.0]):
        big[i, 0] = -amax                                                 # p = -126, -23, -22, -8
    chunks += list(big.astype(np.float32))
    top = np.zeros((1, 128), np.float32)
    top[0] = np.arange(1, 129, dtype=np.uint32).view(np.float32)          # tiniest subnormals
    top[0, 64:] = -top[0, 64:]
    chunks += list(top)
    for e in list(range(0, 12)) + [100, 126, 127, 128, 140, 200, 250, 253, 254]:
        for f in (0x5FFFFF, 0x600000, 0x600001, 0x7FFFFF, 0):
            amax = np.uint32((e << 23) | f).view(np.float32)
            c = (rng.uniform(-1.0, 1.0, 128) * np.float64(amax)).astype(np.float32)
            c[rng.integers(0, 128)] = -amax if f & 1 else amax
            chunks.append(c)
    grid = np.arange(0x7F, dtype=np.uint8).view(E4M3).astype(np.float64)    # 0 .. 448
    mids = (grid[:-1] + grid[1:]) / 2                                        # every RNE tie
    tiny = np.array([2.0**-9, 2.0**-10, 3 * 2.0**-10, 2.0**-11, 2.0**-12, 1.5 * 2.0**-10])
    ys = np.concatenate([grid, mids, -mids, tiny, -tiny])
    for p in (-126, -125, -120, -110, -30, -8, 0, 50, 119):
        block = _chunks_with_scale(ys, p)
        chunks += list(block)
        nb = block.copy()                                                  # one float32 ulp away
        up = rng.integers(0, 2, nb[:, 1:].shape).astype(bool)
        nb[:, 1:] = np.nextafter(nb[:, 1:], np.where(up, np.inf, -np.inf).astype(np.float32))
        chunks += list(nb)
    chunks.append(np.zeros(128, np.float32))
    chunks.append(np.full(128, -0.0, np.float32))
    chunks.append(np.where(rng.integers(0, 2, 128), 0.0, -0.0).astype(np.float32))
    for bad in (np.inf, -np.inf, np.nan, np.uint32(0xFFC00000).view(np.float32),
                np.uint32(0x7F800001).view(np.float32)):
        c = rng.standard_normal(128).astype(np.float32)
        c[rng.integers(0, 128)] = bad
        chunks.append(c)
    chunks.append(np.full(128, np.nan, np.float32))
    x = np.stack(chunks)
    x = np.concatenate([x, np.zeros(((-len(x)) % 8, 128), np.float32)])
    return x.reshape(-1, 1024)


def every_16bit_pattern(dtype):
    """All 65536 bf16 or f16 bit patterns, [64, 1024] (chunk c holds patterns 128c .. 128c + 127:
    the Inf/NaN patterns fill whole chunks), and the finite ones shuffled, 256 a row."""
    allp = np.arange(1 << 16, dtype=np.uint16).view(dtype)
    finite = allp[np.isfinite(allp.astype(np.float32))]
    return allp.reshape(64, 1024), np.random.default_rng(7).permutation(finite).reshape(-1, 256)


def assert_same_bytes(got, want, what):
    """(codes, scales) pairs: codes byte for byte, scales bit for bit."""
    gc, gs = (np.asarray(v) for v in got)
    wc, ws = (np.asarray(v) for v in want)
    bad = np.argwhere(gc.view(np.uint8) != wc.view(np.uint8))
    assert not len(bad), (what, len(bad), bad[:5], gc.view(np.uint8)[tuple(bad[:5].T)],
                          wc.view(np.uint8)[tuple(bad[:5].T)])
    np.testing.assert_array_equal(np.asarray(gs, np.float32).view(np.uint32),
                                  np.asarray(ws, np.float32).view(np.uint32), err_msg=what)


def adversarial_cases(rng):
    """(name, array) for every dtype the quantizer takes."""
    b_all, b_fin = every_16bit_pattern(ml_dtypes.bfloat16)
    h_all, h_fin = every_16bit_pattern(np.float16)
    return [("f32", adversarial_f32(rng)), ("bf16 all", b_all), ("bf16 shuffled", b_fin),
            ("f16 all", h_all), ("f16 shuffled", h_fin)]


class TestAdversarial:
    """The quantizer's routes against the float64 oracle on adversarial data (CPU)."""

    def test_cpu_route_against_oracle(self, rng, on_cpu):
        for name, x in adversarial_cases(rng):
            want_c, want_s = oracle_quantize(x)
            got = jax.jit(fp8.quantize_activations_fp8)(jnp.asarray(x))
            assert_same_bytes(got, (want_c, want_s.astype(np.float32)), name)

    def test_float_route_without_subnormal_inputs(self, rng, on_cpu):
        """The GPU's float route run on the CPU, where it flushes subnormal inputs: on the data
        without them its bytes are the oracle's (its NaN, sign, zero and underflow handling)."""
        for name, x in adversarial_cases(rng):
            x32 = np.asarray(x, np.float32)
            keep = ~((x32 != 0) & (np.abs(x32) < 2.0**-126)).reshape(len(x32), -1, 128).any(-1)
            keep = np.repeat(keep, 128, axis=1)
            x = np.where(keep, x, np.zeros((), x.dtype)).astype(x.dtype)
            want_c, want_s = oracle_quantize(x)
            got = jax.jit(lambda v: fp8._quantize_activations(v, "float"))(jnp.asarray(x))
            assert_same_bytes(got, (want_c, want_s.astype(np.float32)), name)

    def test_scale_exponent_at_the_boundary_for_every_exponent(self):
        e = np.repeat(np.arange(256, dtype=np.uint32), 6)
        f = np.tile(np.array([0, 1, 0x5FFFFF, 0x600000, 0x600001, 0x7FFFFF], np.uint32), 256)
        bits = (e << 23) | f
        p, nonfinite = jax.jit(fp8._scale_exponent)(jnp.asarray(bits))
        want = np.maximum(e.astype(np.int64) - 135 + (f > 0x600000), -126)
        want = np.where(e == 255, 0, want)
        np.testing.assert_array_equal(np.asarray(p), want)
        np.testing.assert_array_equal(np.asarray(nonfinite), e == 255)
        finite = e < 255
        amax = bits[finite].view(np.float32).astype(np.float64)
        np.testing.assert_array_equal(np.asarray(p)[finite],
                                      [oracle_scale_exponent(a) for a in amax])


def elementwise_u32(route, x):
    """Whether the compiled quantizer of bf16 x [M, K] (on x's device) holds uint32 operations of
    x's size: the exact route's bit manipulation does, the float route's does not (its amax is
    reduced on the bf16 bits as uint16)."""
    txt = jax.jit(lambda v: fp8._quantize_activations(v, route)).lower(x).compile().as_text()
    shapes = re.findall(r"u32\[([\d,]+)\]", txt)
    sizes = [np.prod([int(d) for d in dims.split(",")]) for dims in shapes]
    return x.size in sizes


def test_routes_by_their_compiled_operations(on_cpu):
    x = jnp.zeros((16, 256), jnp.bfloat16)
    assert elementwise_u32("exact", x) and not elementwise_u32("float", x)
    assert elementwise_u32("auto", x)                                     # the CPU's: exact


def test_gpu_ftz_flag_selects_the_exact_route(monkeypatch):
    for flags, on in [("", False), ("--xla_gpu_ftz=true", True), ("--a=1 --xla_gpu_ftz", True),
                      ("--xla_gpu_ftz=True --xla_gpu_ftz=false", False),
                      ("--xla_gpu_ftz=false", False)]:
        monkeypatch.setenv("XLA_FLAGS", flags)
        assert fp8._gpu_flushes_subnormals() is on, flags


def test_cuda_quantizer_bytes_equal_exact_route_and_oracle(rng):
    """On the GPU (its float route): the bytes of the exact route run on the CPU, of the exact
    route forced on the GPU and of the float64 oracle, on the adversarial data; also through
    to_kernel_k_order and the transposed scales as gemm._fp8_ffi runs it. The GPU must run the
    float route (no uint32 operations of x's size in its compiled quantizer)."""
    gpus = gpu_devices()
    if not gpus:
        skip_or_fail("no GPU")
    gpu, cpu = gpus[0], jax.devices("cpu")[0]
    quant = jax.jit(fp8.quantize_activations_fp8)
    exact = jax.jit(lambda v: fp8._quantize_activations(v, "exact"))
    ffi_form = jax.jit(lambda v: (lambda c, s: (fp8.to_kernel_k_order(c), s.T))(
        *fp8.quantize_activations_fp8(v)))
    z = jax.device_put(jnp.zeros((16, 256), jnp.bfloat16), gpu)
    assert elementwise_u32("exact", z), "the compiled-HLO check does not see the exact route"
    assert not elementwise_u32("auto", z), "the GPU does not run the float route"
    for name, x in adversarial_cases(rng):
        on_gpu = quant(jax.device_put(jnp.asarray(x), gpu))
        assert list(on_gpu[0].devices()) == [gpu]
        on_cpu = quant(jax.device_put(jnp.asarray(x), cpu))
        assert_same_bytes(on_gpu, on_cpu, f"{name}: GPU vs CPU")
        want_c, want_s = oracle_quantize(x)
        assert_same_bytes(on_gpu, (want_c, want_s.astype(np.float32)), f"{name}: GPU vs oracle")
        assert_same_bytes(exact(jax.device_put(jnp.asarray(x), gpu)), on_cpu,
                          f"{name}: exact route on the GPU")
        c, s = ffi_form(jax.device_put(jnp.asarray(x), gpu))
        assert_same_bytes((fp8.from_kernel_k_order(jax.device_put(c, cpu)), np.asarray(s).T),
                          on_cpu, f"{name}: kernel k order")


# ------------------------------------------------------------------ the quantizer's custom call
def nvfp4_every_code_and_scale():
    """An NVFP4Tensor [16, 256] whose 256 blocks take the 256 scale bytes (negative, zero,
    subnormal and NaN 0x7F / 0xFF ones included), each block holding the 16 codes (rolled per
    block), global scale 0.5 (the call returns it, it does not apply it)."""
    codes = np.stack([np.roll(np.arange(16), b) for b in range(256)]).reshape(16, 256)
    data = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    scales = np.arange(256, dtype=np.uint8).reshape(16, 16).view(E4M3)
    return jn.NVFP4Tensor(jnp.asarray(data), jnp.asarray(scales), jnp.float32(0.5))


def nvfp4_values64(t):
    """float64 ``e2m1 * block scale`` of an NVFP4Tensor [M, K] (checkpoint layout)."""
    with np.errstate(invalid="ignore"):
        return dequant64(np.asarray(t.data), np.asarray(t.scales))


def quantizer_ffi_cases(rng):
    """(name, lhs, oracle input) for every kind the custom call takes: the adversarial float
    cases, NVFP4 with every code and scale byte, random NVFP4, and a shape whose chunk count is
    odd (the CUDA kernel's warps take chunks in pairs)."""
    cases = [(name, jnp.asarray(x), x) for name, x in adversarial_cases(rng)]
    t = nvfp4_every_code_and_scale()
    cases.append(("nvfp4 every code and scale", t, nvfp4_values64(t)))
    r = jn.quantize(jnp.asarray(random_wide(rng, (37, 640)), jnp.float32))
    cases.append(("nvfp4 random", r, nvfp4_values64(r)))
    odd = (rng.standard_normal((53, 384)) * rng.uniform(1e-3, 1e3, (53, 1))).astype(np.float32)
    cases.append(("bf16 odd chunks", jnp.asarray(odd, jnp.bfloat16), odd.astype(ml_dtypes.bfloat16)))
    return cases


def check_quantizer_ffi(lhs, x_oracle, name, device=None):
    """The custom call on ``lhs`` (on ``device``) against the float64 oracle and the jnp route,
    in both scale layouts; returns its (codes, scales)."""
    put = (lambda v: jax.device_put(v, device)) if device is not None else (lambda v: v)
    lhs = jax.tree.map(put, lhs)
    ffi = jax.jit(lambda v: fp8.quantize_kernel_order_ffi(v)[:2])
    ffi_t = jax.jit(lambda v: fp8.quantize_kernel_order_ffi(v, scales_transposed=True)[:2])
    c, s = ffi(lhs)
    if device is not None:
        assert list(c.devices()) == [device]
    want_c, want_s = oracle_quantize(x_oracle)
    logical = fp8.from_kernel_k_order(np.asarray(c))
    assert_same_bytes((logical, s), (want_c, want_s.astype(np.float32)), f"{name}: oracle")
    jc, js, _ = jax.jit(fp8.kernel_lhs)(lhs)                       # the jnp route
    assert_same_bytes((c, s), (jc, js), f"{name}: jnp route")
    ct, st = ffi_t(lhs)
    assert_same_bytes((ct, np.asarray(st).T), (c, s), f"{name}: transposed scales")
    return np.asarray(c), np.asarray(s)


@needs_ffi
def test_quantizer_ffi_cpu_against_oracle_and_jnp_route(rng, on_cpu):
    for name, lhs, x in quantizer_ffi_cases(rng):
        check_quantizer_ffi(lhs, x, name)
    _, _, gs = fp8.quantize_kernel_order_ffi(nvfp4_every_code_and_scale())
    assert float(gs) == 0.5
    # no rows, both kinds and both scale layouts
    empty = [jnp.zeros((0, 256), jnp.bfloat16),
             jn.NVFP4Tensor(jnp.zeros((0, 128), jnp.uint8), jnp.zeros((0, 16), jnp.float8_e4m3fn),
                            jnp.float32(1.0))]
    for lhs in empty:
        for tr in (False, True):
            c, s, _ = fp8.quantize_kernel_order_ffi(lhs, scales_transposed=tr)
            assert c.shape == (0, 256) and c.dtype == jnp.float8_e4m3fn
            assert s.shape == ((2, 0) if tr else (0, 2)) and s.dtype == jnp.float32


@needs_ffi
def test_quantizer_ffi_errors(rng, on_cpu):
    with pytest.raises(ValueError, match=r"lhs: expected a bf16/float16/float32 \[M, K\] array"):
        fp8.quantize_kernel_order_ffi(jnp.zeros((4, 128), jnp.int32))
    with pytest.raises(ValueError, match=r"lhs: expected a bf16/float16/float32"):
        fp8.quantize_kernel_order_ffi(
            jn.prepare_weights(jn.quantize(jnp.ones((128, 128), jnp.float32)), "sm90"))
    with pytest.raises(ValueError, match=r"lhs: expected \[M, K\], got shape \(128,\)"):
        fp8.quantize_kernel_order_ffi(jnp.zeros((128,), jnp.bfloat16))
    with pytest.raises(ValueError, match="K=96: precision='fp8' needs K to be a multiple of 128"):
        fp8.quantize_kernel_order_ffi(jnp.zeros((4, 96), jnp.bfloat16))
    # an lhs the call does not take goes the jnp way in kernel_lhs
    x64 = np.asarray(rng.standard_normal((4, 128)), np.float64)
    c, s, _ = fp8.kernel_lhs(x64, use_ffi=True)
    want_c, want_s = oracle_quantize(x64)
    assert_same_bytes((fp8.from_kernel_k_order(c), s), (want_c, want_s.astype(np.float32)), "f64")


def test_cuda_quantizer_ffi_bytes(rng):
    """The CUDA kernel of the quantizer's custom call: the oracle's bytes, the jnp route's, and
    the CPU handler's, on every case of the CPU test."""
    gpu = _gpu()
    cpu = jax.devices("cpu")[0]
    for name, lhs, x in quantizer_ffi_cases(rng):
        got = check_quantizer_ffi(lhs, x, name, device=gpu)
        on_cpu = jax.jit(lambda v: fp8.quantize_kernel_order_ffi(v)[:2])(
            jax.tree.map(lambda v: jax.device_put(v, cpu), lhs))
        assert_same_bytes(got, on_cpu, f"{name}: GPU vs CPU handler")


# ------------------------------------------------------------------ weights (spec 2)
@pytest.mark.parametrize("layout", ["checkpoint", "sm90"])
def test_weights_fp8_every_code_and_scale_byte(layout):
    """Row n has scale byte n in each of its 4 blocks (NaN bytes 0x7F, 0xFF included); each
    block holds the 16 codes (in a different order per block)."""
    codes = np.stack([np.roll(np.arange(16), b) for b in range(4)]).reshape(64)
    codes = np.tile(codes, (256, 1)).astype(np.uint8)
    data = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)[None]          # [1, 256, 32]
    scales = np.tile(np.arange(256, dtype=np.uint8)[:, None], (1, 4))[None]        # [1, 256, 4]
    w = jn.NVFP4Tensor(jnp.asarray(data), jn.scales_from_bytes(jnp.asarray(scales)),
                       jnp.ones((1,), jnp.float32))
    if layout == "sm90":
        w = jn.prepare_weights(w)
        assert w.layout == "sm90"
    got = np.asarray(jax.jit(fp8.weights_fp8)(w))
    want = oracle_weights(data, scales)
    assert got.dtype == E4M3 and got.shape == (1, 256, 64)
    nan = np.isnan(want.astype(np.float64))
    assert nan[0, 0x7F].all() and nan[0, 0xFF].all() and nan.sum() == 2 * 64
    np.testing.assert_array_equal(np.isnan(got.astype(np.float64)), nan)
    np.testing.assert_array_equal(got.view(np.uint8)[~nan], want.view(np.uint8)[~nan])


# ------------------------------------------------------------------ kernel k order (spec 4)
def test_kernel_k_order_by_the_formula_and_round_trip(rng):
    q = jnp.asarray(rng.integers(0, 1 << 30, (3, 384)), jnp.int32)
    got = np.asarray(fp8.to_kernel_k_order(q))
    qn = np.asarray(q)
    for c in range(3):
        for t in range(4):
            for j in range(4):
                for h in range(2):
                    for i in range(4):
                        s, k = 32 * j + 16 * h + 4 * t + i, 32 * t + 8 * j + 4 * h + i
                        assert (got[:, 128 * c + s] == qn[:, 128 * c + k]).all()
    np.testing.assert_array_equal(np.asarray(fp8.from_kernel_k_order(got)), qn)
    codes = fp8.quantize_activations_fp8(rng.standard_normal((2, 256)).astype(np.float32))[0]
    back = fp8.from_kernel_k_order(fp8.to_kernel_k_order(codes))
    assert back.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(back).view(np.uint8), np.asarray(codes).view(np.uint8))
    with pytest.raises(ValueError, match="K=64"):
        fp8.to_kernel_k_order(jnp.zeros((2, 64)))


# ------------------------------------------------------------------ the GEMM (spec 3)
def gemm_case(rng, m=40, n=96, k=384, g=3, sizes=(9, 0, 25), layout="checkpoint", w4a4=False,
              wide=False):
    rhs = nvfp4_weights(rng, g, n, k)
    rhs = jn.NVFP4Tensor(rhs.data, rhs.scales, jnp.asarray(rng.uniform(0.5, 2.0, g), jnp.float32))
    # (wide: up to 2^60, so that no float32 sum overflows)
    x = random_wide(rng, (m, k), hi=60) if wide else rng.standard_normal((m, k)).astype(np.float32)
    if w4a4:
        lhs = jn.quantize(jnp.asarray(x))
        x_vals = dequant64(lhs.data, lhs.scales)                 # e2m1 * scale, no global
        lhs_gs = float(lhs.global_scale)
    else:
        lhs = jnp.asarray(x, jnp.bfloat16)
        x_vals = np.asarray(lhs, np.float64)
        lhs_gs = 1.0
    if layout == "sm90":
        rhs = jn.prepare_weights(rhs)
    q, s = oracle_quantize(x_vals)
    w8 = oracle_weights(np.asarray(jn.prepare_weights(rhs, "checkpoint").data),
                        np.asarray(jn.prepare_weights(rhs, "checkpoint").scales))
    alpha = lhs_gs * np.asarray(rhs.global_scale, np.float64)
    want, mag = oracle_gemm(q, s, w8, alpha, sizes)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32), want, mag


@pytest.mark.parametrize("w4a4", [False, True])
@pytest.mark.parametrize("layout", ["checkpoint", "sm90"])
def test_reference_against_float64(rng, w4a4, layout):
    lhs, rhs, sizes, want, mag = gemm_case(rng, n=128, layout=layout, w4a4=w4a4)
    got = jax.jit(lambda a, w, s: fp8.grouped_gemm_fp8_reference(a, w, s, out_dtype=jnp.float32))(
        lhs, rhs, sizes)
    assert got.dtype == jnp.float32
    assert_within_f32_accumulation(got, want, mag, 384)
    assert (np.asarray(got)[34:] == 0).all()                   # rows past the groups
    # the public reference routes to the same function: bit for bit when both are compiled as one
    # program (eager, op by op, a GPU may sum in another order: within the same bound)
    via = jax.jit(lambda a, w, s: jn.reference.grouped_gemm(a, w, s, out_dtype=jnp.float32, precision="fp8"))(
        lhs, rhs, sizes)
    np.testing.assert_array_equal(np.asarray(via), np.asarray(got))
    eager = jn.reference.grouped_gemm(lhs, rhs, sizes, out_dtype=jnp.float32, precision="fp8")
    assert_within_f32_accumulation(eager, want, mag, 384, "eager")


def test_reference_wide_range_and_odd_groups(rng):
    lhs, rhs, sizes, want, mag = gemm_case(rng, m=30, sizes=(-3, 12, 0, 40), g=4, wide=True)
    got = fp8.grouped_gemm_fp8_reference(lhs, rhs, sizes, out_dtype=jnp.float32)
    assert_within_f32_accumulation(got, want, mag, 384)
    assert (np.asarray(got)[:12] != 0).any()


def test_reference_nan_weights_and_activations_stay_in_their_rows(rng):
    lhs, rhs, sizes, _, _ = gemm_case(rng, m=12, n=32, k=128, g=2, sizes=(5, 5))
    sc = np.asarray(rhs.scales).view(np.uint8).copy()
    sc[1, 7, 3] = 0x7F                                          # group 1, column 7: NaN
    rhs = jn.NVFP4Tensor(rhs.data, jn.scales_from_bytes(jnp.asarray(sc)), rhs.global_scale)
    x = np.asarray(lhs, np.float32)
    x[2, 9] = np.nan                                             # row 2 (group 0)
    out = np.asarray(fp8.grouped_gemm_fp8_reference(jnp.asarray(x, jnp.bfloat16), rhs, sizes,
                                                    out_dtype=jnp.float32))
    nan = np.isnan(out)
    want = np.zeros_like(nan)
    want[2, :] = True
    want[5:10, 7] = True
    np.testing.assert_array_equal(nan, want)


def test_precision_validation(rng):
    rhs = nvfp4_weights(rng, 2, 32, 96)
    x = jnp.zeros((4, 96), jnp.bfloat16)
    for backend in ["reference"] + (["ffi"] if HAS_FFI else []):
        with pytest.raises(ValueError, match="K=96"):
            jn.grouped_gemm(x, rhs, jnp.asarray([2, 2]), backend=backend, precision="fp8")
        with pytest.raises(ValueError, match="precision"):
            jn.grouped_gemm(x, rhs, jnp.asarray([2, 2]), backend=backend, precision="fp16")
    with pytest.raises(ValueError, match="precision"):
        jn.reference.grouped_gemm(x, rhs, jnp.asarray([2, 2]), precision=None)


def test_grad_through_fp8_is_the_frozen_weight_backward(rng):
    lhs, rhs, sizes, _, _ = gemm_case(rng, m=20, n=64, k=256, g=2, sizes=(8, 9))
    x = jnp.asarray(lhs, jnp.float32)
    ct = jnp.asarray(rng.standard_normal((20, 64)), jnp.float32)
    want = np.asarray(jn.autodiff.lhs_cotangent(ct, rhs, sizes))
    backends = ["reference"] + (["ffi"] if HAS_FFI else [])
    for backend in backends:
        f = lambda x: jnp.sum(ct * jn.grouped_gemm(  # noqa: E731
            x, rhs, sizes, backend=backend, precision="fp8", out_dtype=jnp.float32))
        g = jax.jit(jax.grad(f))(x)
        np.testing.assert_array_equal(np.asarray(g), want)
    w64 = dequant64(rhs.data, rhs.scales, rhs.global_scale)
    ref = np.zeros((20, 256))
    ref[:8] = np.asarray(ct, np.float64)[:8] @ w64[0]
    ref[8:17] = np.asarray(ct, np.float64)[8:17] @ w64[1]
    assert rel_err(want, ref) <= 1e-5


# ------------------------------------------------------------------ the CPU handler (spec 4)
@needs_ffi
@pytest.mark.parametrize("w4a4", [False, True])
@pytest.mark.parametrize("layout", ["checkpoint", "sm90"])
def test_cpu_handler_against_reference_and_oracle(rng, on_cpu, w4a4, layout):
    lhs, rhs, sizes, want, mag = gemm_case(rng, m=50, n=128, k=384, g=5,
                                           sizes=(7, 0, -2, 30, 4), layout=layout, w4a4=w4a4)
    run = jax.jit(lambda a, w, s, b: jn.grouped_gemm(a, w, s, backend=b, precision="fp8",
                                                     out_dtype=jnp.float32), static_argnums=3)
    got = np.asarray(run(lhs, rhs, sizes, "ffi"))
    ref = np.asarray(run(lhs, rhs, sizes, "reference"))
    assert_within_f32_accumulation(got, want, mag, 384, "ffi vs oracle")
    assert_within_f32_accumulation(got, ref, mag, 384, "ffi vs reference")
    assert (got[41:] == 0).all()
    lowered = run.lower(lhs, rhs, sizes, "ffi").as_text()
    # the grouped GEMM's one target; the kernel attribute (an FP8 family) states the mode
    assert _extension.TARGET in lowered
    assert f"kernel = {jn.kernel_config.FAMILY_CODES['wgmma_fp8']} : i32" in lowered


@needs_ffi
def test_cpu_handler_bf16_out_wide_range_and_float32_lhs(rng, on_cpu):
    lhs, rhs, sizes, want, mag = gemm_case(rng, m=24, n=64, k=256, g=2, sizes=(10, 30), wide=True)
    got16 = jn.grouped_gemm(lhs, rhs, sizes, backend="ffi", precision="fp8")
    assert got16.dtype == jnp.bfloat16
    ref16 = jn.grouped_gemm(lhs, rhs, sizes, backend="reference", precision="fp8")
    # RNE of float32 values that agree to a few ulps: equal or one bf16 step apart.
    np.testing.assert_allclose(np.asarray(got16, np.float64), np.asarray(ref16, np.float64),
                               rtol=2.0**-7, atol=0)
    got32 = jn.grouped_gemm(jnp.asarray(lhs, jnp.float32), rhs, sizes, backend="ffi",
                            precision="fp8", out_dtype=jnp.float32)
    assert_within_f32_accumulation(got32, want, mag, 256)


@needs_ffi
def test_cpu_handler_nan_rules(rng, on_cpu):
    lhs, rhs, sizes, _, _ = gemm_case(rng, m=12, n=32, k=128, g=2, sizes=(5, 5))
    sc = np.asarray(rhs.scales).view(np.uint8).copy()
    sc[1, 7, 3] = 0xFF
    rhs = jn.NVFP4Tensor(rhs.data, jn.scales_from_bytes(jnp.asarray(sc)), rhs.global_scale)
    x = np.asarray(lhs, np.float32)
    x[2, 9] = np.inf
    x[11, 0] = np.nan                                                # past the groups: 0
    a = jnp.asarray(x, jnp.bfloat16)
    got = np.asarray(jn.grouped_gemm(a, rhs, sizes, backend="ffi", precision="fp8",
                                     out_dtype=jnp.float32))
    ref = np.asarray(fp8.grouped_gemm_fp8_reference(a, rhs, sizes, out_dtype=jnp.float32))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    assert np.isnan(got[2]).all() and np.isnan(got[5:10, 7]).all() and (got[11] == 0).all()


# ------------------------------------------------------------------ the CUDA kernel
def _gpu():
    gpus = gpu_devices()
    if not gpus:
        skip_or_fail("no GPU")
    if not _extension.has_cuda():
        skip_or_fail("the extension was built without the CUDA handler")
    if jn.kernel_config.device_arch(gpus[0]) != 90:
        skip_or_fail("the fp8 kernel needs an sm_90 GPU")
    return gpus[0]


@pytest.mark.parametrize("m,n,k,g,sizes", [
    (64, 256, 1024, 8, (8, 0, 3, 17, 0, 1, 20, 5)),                 # decode-sized, empty groups
    (2048, 384, 1024, 4, (700, 0, 900, 300)),                         # prefill-sized
    (300, 200, 512, 3, (120, -5, 150)),                               # N % 128 != 0, rows past
])
@pytest.mark.parametrize("w4a4", [False, True])
def test_cuda_kernel_against_cpu_handler_and_oracle(rng, m, n, k, g, sizes, w4a4):
    """The GPU's FP8 MMA sums each 128-k chunk with its own accumulator (about 14 significant
    bits, promoted to float32 after the chunk): its error per chunk is at most ~2^-13 of the
    chunk's sum of |products| per addition step; 2^-9 of the row's total |products| bounds it
    with room, and a wrong k order, scale or group would be off by O(1) of it."""
    gpu = _gpu()
    lhs, rhs, sz, want, mag = gemm_case(rng, m=m, n=n, k=k, g=g, sizes=sizes, w4a4=w4a4)
    f = lambda a, w, s: jn.grouped_gemm(a, w, s, backend="ffi", precision="fp8",  # noqa: E731
                                        out_dtype=jnp.float32)
    on = lambda t: jax.device_put(t, gpu)  # noqa: E731
    got = np.asarray(jax.jit(f)(on(lhs), on(rhs), on(sz)), np.float64)
    cpu = jax.devices("cpu")[0]
    put = lambda t: jax.device_put(t, cpu)  # noqa: E731
    host = np.asarray(jax.jit(f)(put(lhs), put(rhs), put(sz)), np.float64)
    tol = 2.0**-9 * mag + 1e-30
    assert np.all(np.abs(got - want) <= tol), float(np.max(np.abs(got - want) / tol))
    assert np.all(np.abs(got - host) <= tol)
    end = min(sum(max(s, 0) for s in sizes), m)
    assert (got[end:] == 0).all()
    got16 = np.asarray(jax.jit(lambda a, w, s: jn.grouped_gemm(
        a, w, s, backend="ffi", precision="fp8"))(on(lhs), on(rhs), on(sz)), np.float64)
    assert np.all(np.abs(got16 - want) <= tol + 2.0**-8 * np.abs(want))


FP8_TILES = (32, 64, 128)


def test_fp8_tiles_are_the_built_configurations():
    if not _extension.available():
        pytest.skip("the extension is not built")
    assert tuple(c.token_tile for c in jn.kernel_config.kernel_configs() if c.family == "wgmma_fp8") == FP8_TILES


@pytest.mark.parametrize("tile", FP8_TILES)
def test_cuda_kernel_every_token_tile(rng, tile):
    """Every FP8 token tile (the heuristic picks one per size) on groups that end inside and at the
    end of every tile size, one row, empty groups, against the float64 oracle (the bound of
    test_cuda_kernel_against_cpu_handler_and_oracle)."""
    gpu = _gpu()
    cfg = next(c for c in jn.kernel_config.kernel_configs() if c.family == "wgmma_fp8" and c.token_tile == tile)
    sizes = (700, 0, 256, 100, 300, 1, 64, 193, 129)
    m = sum(sizes) + 7
    lhs, rhs, sz, want, mag = gemm_case(rng, m=m, n=256, k=512, g=len(sizes), sizes=sizes)
    f = jax.jit(lambda a, w, s: jn.grouped_gemm(a, w, s, backend="ffi", precision="fp8", kernel=cfg,
                                                out_dtype=jnp.float32))
    got = np.asarray(f(*(jax.device_put(t, gpu) for t in (lhs, rhs, sz))), np.float64)
    tol = 2.0**-9 * mag + 1e-30
    assert np.all(np.abs(got - want) <= tol), float(np.max(np.abs(got - want) / tol))
    assert (got[sum(sizes):] == 0).all()


def test_cuda_rejects_sm90_layout_in_fp8(rng):
    gpu = _gpu()
    rhs = jax.device_put(jn.prepare_weights(nvfp4_weights(rng, 2, 128, 256)), gpu)
    x = jax.device_put(jnp.ones((4, 256), jnp.bfloat16), gpu)
    with pytest.raises(ValueError, match=r"prepare_weights\(w, 'checkpoint'\)"):
        jn.grouped_gemm(x, rhs, jnp.asarray([2, 2]), backend="ffi", precision="fp8")


# ------------------------------------------------------------------ the MoE layer
HM, IM, EM, TM = 128, 128, 8, 32


def moe_layer(rng, activation):
    c = jn.MoEConfig.deepseek_v4_pro(num_experts=EM, hidden_size=HM, intermediate_size=IM,
                                     top_k=4, activation=activation)
    f = dict(router=rng.standard_normal((EM, HM)) * 0.1, w13=rng.standard_normal((EM, 2 * IM, HM)) * 0.05,
             w2=rng.standard_normal((EM, HM, IM)) * 0.05, sw13=rng.standard_normal((2 * IM, HM)) * 0.05,
             sw2=rng.standard_normal((HM, IM)) * 0.05)
    w = jn.quantize_moe(f["router"], f["w13"], f["w2"], shared_w13=f["sw13"], shared_w2=f["sw2"])
    x = jnp.asarray(rng.standard_normal((TM, HM)), jnp.float32)
    return c, w, x, f


def float64_layer(x, w, c, f):
    """The layer on the original float weights in float64 (the quantized layer's routing)."""
    ids, rw = (np.asarray(v) for v in jn.route(x, w, c))
    return float_layer64(x, f, ids, rw, c.swiglu_limit)


def test_moe_config_precision():
    base = dict(num_experts=4, top_k=2, hidden_size=128, intermediate_size=256)
    assert jn.MoEConfig(**base).precision == "exact"
    assert jn.MoEConfig(**base, precision="fp8").precision == "fp8"
    with pytest.raises(ValueError, match="precision"):
        jn.MoEConfig(**base, precision="bf16")
    with pytest.raises(ValueError, match="intermediate_size.*128"):
        jn.MoEConfig(**{**base, "intermediate_size": 96}, precision="fp8")
    hf = dict(model_type="deepseek_v3", n_routed_experts=8, num_experts_per_tok=2, hidden_size=256,
              moe_intermediate_size=128, n_group=1, topk_group=1, scoring_func="sigmoid",
              routed_scaling_factor=2.5, n_shared_experts=1, norm_topk_prob=True)
    assert jn.MoEConfig.from_hf_config(hf).precision == "exact"
    assert jn.MoEConfig.from_hf_config(hf, precision="fp8").precision == "fp8"


@pytest.mark.parametrize("backend", ["reference"] + (["ffi"] if HAS_FFI else []))
@pytest.mark.parametrize("activation", ["w4a16", "w4a4"])
def test_moe_fp8_against_exact_and_float64(rng, on_cpu, backend, activation):
    """README: the fp8 layer's error against the unquantized layer is within ~1.1x of the exact
    mode's (here, a small layer: 1.25x); fp8 and exact differ by the e4m3 rounding, amplified in
    W4A4 by the requantization of the SwiGLU output (codes flip: up to ~0.12)."""
    c, w, x, f = moe_layer(rng, activation)
    c8 = jn.MoEConfig(**{**c.__dict__, "precision": "fp8"})
    run = jax.jit(lambda x, w, c: jn.moe(x, w, c, backend=backend), static_argnums=2)
    exact, fast = np.asarray(run(x, w, c)), np.asarray(run(x, w, c8))
    assert np.all(np.isfinite(fast))
    ref = float64_layer(x, w, c, f)
    e_exact, e_fast = rel_err(exact, ref), rel_err(fast, ref)
    assert e_fast <= 1.25 * e_exact, (e_fast, e_exact)
    assert 1e-3 < rel_err(fast, exact) <= (0.08 if activation == "w4a16" else 0.16)
    if backend == "ffi":
        ref8 = np.asarray(jax.jit(lambda x, w: jn.moe(x, w, c8, backend="reference"))(x, w))
        assert rel_err(fast, ref8) <= 1e-5


def test_moe_expert_parallel_fp8(rng):
    """Both combines (one jit, one compile) against the one-device fp8 layer."""
    c, w, x, _ = moe_layer(rng, "w4a4")
    c8 = jn.MoEConfig(**{**c.__dict__, "precision": "fp8"})                  # fp8 vs exact: above
    backend = "ffi" if HAS_FFI else "reference"
    devs = cpu_devices(8)
    mesh = jax.make_mesh((8,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,), devices=devs)
    with jax.default_device(devs[0]):
        one = np.asarray(jax.jit(lambda x, w: jn.moe(x, w, c8, backend=backend))(x, w))
    ws = jn.shard_moe_weights(w, mesh)
    combines = ("psum", "psum_scatter")
    eps = jax.jit(lambda x, w: [jn.moe_expert_parallel(x, w, c8, mesh, combine=combine,
                                                       backend=backend)
                                for combine in combines])(x, ws)
    assert np.all(np.isfinite(one))
    for combine, ep in zip(combines, eps):
        np.testing.assert_allclose(np.asarray(ep), one, rtol=1e-5, atol=1e-5 * np.abs(one).max(),
                                   err_msg=combine)


@pytest.mark.parametrize("backend", ["reference"] + (["ffi"] if HAS_FFI else []))
@pytest.mark.parametrize("kind", ["bf16", "nvfp4"])
def test_quantize_rows_then_gather_equals_gather_then_quantize(rng, on_cpu, backend, kind):
    """fp8.quantize_rows per token, then Fp8Rows.take of the dispatched rows: the same codes,
    scales and GEMM output, bit for bit, as quantizing gathered copies (the layer's dispatch)."""
    t, k = 24, 256
    x = jnp.asarray(rng.standard_normal((t, k)) * rng.uniform(0.1, 10, (t, 1)), jnp.float32)
    x = x.at[3, :128].set(0.0).at[5, 7].set(1e-40)              # a zero chunk, a subnormal
    lhs = jn.quantize(x) if kind == "nvfp4" else x.astype(jnp.bfloat16)
    idx = jnp.asarray(rng.integers(0, t, 60), jnp.int32)
    copied = (jn.NVFP4Tensor(lhs.data[idx], lhs.scales[idx], lhs.global_scale)
              if kind == "nvfp4" else lhs[idx])
    q = jn.fp8.quantize_rows(lhs).take(idx)
    want = jn.fp8.quantize_rows(copied)
    assert_same_bytes((q.codes, q.scales), (want.codes, want.scales), kind)
    assert float(q.global_scale) == float(want.global_scale)
    # the kernel k order (the layer's dispatch): the same codes permuted by to_kernel_k_order
    qk = jn.fp8.quantize_rows(lhs, k_order="kernel").take(idx)
    assert qk.k_order == "kernel"
    assert_same_bytes((jn.fp8.from_kernel_k_order(qk.codes), qk.scales), (want.codes, want.scales),
                      kind)
    w = jax.vmap(jn.quantize)(jnp.asarray(rng.standard_normal((3, 64, k)), jnp.float32))
    sizes = jnp.asarray([20, 0, 30], jnp.int32)
    run = jax.jit(lambda a: jn.grouped_gemm(a, w, sizes, backend=backend, precision="fp8",
                                            out_dtype=jnp.float32))
    out = np.asarray(run(copied))
    np.testing.assert_array_equal(np.asarray(run(q)), out)
    np.testing.assert_array_equal(np.asarray(run(qk)), out)


@pytest.mark.parametrize("activation", ["w4a16", "w4a4"])
def test_moe_fp8_dispatches_quantized_rows(rng, on_cpu, activation):
    """The fp8 layer quantizes each token once and gathers the e4m3 rows: the routed experts'
    output equals the one from quantizing the dispatched copies, bit for bit."""
    from jax_nvfp4.layer.moe import _expert_gemm                                  # noqa: PLC0415
    c, w, x, _ = moe_layer(rng, activation)
    c8 = jn.MoEConfig(**{**c.__dict__, "precision": "fp8"})
    backend = "ffi" if HAS_FFI else "reference"
    r = 3 * TM
    gather = jnp.asarray(rng.integers(0, TM, r), jnp.int32)
    row_expert = jnp.sort(jnp.asarray(rng.integers(0, EM, r), jnp.int32))
    sizes = jnp.bincount(row_expert, length=EM).astype(jnp.int32)
    f = jax.jit(lambda xs, g: _expert_gemm(xs, row_expert, w.w13, None, sizes, c8, backend,
                                           gather=g))
    got = f(x, gather)
    # the dispatch gathers e4m3 codes (as 32-bit words: jax_nvfp4.maths.rows), their chunk scales and
    # (W4A4) the per-row global scales, not float rows
    gathers = [ln.split("->")[-1] for ln in f.lower(x, gather).as_text().splitlines()
               if "stablehlo.gather" in ln]
    k = x.shape[1]
    allowed = (f"x{k // 4}xui32>", f"x{k}xf8E4M3FN>", f"x{k // 128}xf32>", f"<{r}xf32>")
    assert gathers and all(any(a in out for a in allowed) for out in gathers), gathers
    want = jax.jit(lambda xs: _expert_gemm(xs, row_expert, w.w13, None, sizes, c8, backend))(
        x[gather])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_fp8_rows_errors(rng, on_cpu):
    x = jnp.asarray(rng.standard_normal((8, 128)), jnp.bfloat16)
    w = jax.vmap(jn.quantize)(jnp.asarray(rng.standard_normal((2, 16, 128)), jnp.float32))
    q = jn.fp8.quantize_rows(x)
    with pytest.raises(ValueError,
                       match=r"k_order: expected one of \('logical', 'kernel'\), got 'sm90'"):
        jn.fp8.quantize_rows(x, k_order="sm90")
    for backend in ["reference"] + (["ffi"] if HAS_FFI else []):
        with pytest.raises(ValueError, match="lhs: Fp8Rows .* need precision='fp8'"):
            jn.grouped_gemm(q, w, [4, 4], backend=backend)
        with pytest.raises(ValueError,
                           match=r"lhs.k_order: expected one of \('logical', 'kernel'\)"):
            jn.grouped_gemm(jn.formats.Fp8Rows(q.codes, q.scales, q.global_scale, "sm90"), w,
                            [4, 4], backend=backend, precision="fp8")
        with pytest.raises(ValueError, match=r"lhs.scales: expected float32 \[8, 1\]"):
            jn.grouped_gemm(jn.formats.Fp8Rows(q.codes, q.scales[:, :0], q.global_scale), w,
                            [4, 4], backend=backend, precision="fp8")


def kernel_k_order_oracle() -> np.ndarray:
    """Logical k of each kernel-order position in a 128-chunk, from docs/design.md ("position
    32j + 16h + 4t + i holds k 32t + 8j + 4h + i")."""
    order = np.empty(128, np.int64)
    for j in range(4):
        for h in range(2):
            for t in range(4):
                for i in range(4):
                    order[32 * j + 16 * h + 4 * t + i] = 32 * t + 8 * j + 4 * h + i
    return order


def sequential_fp8_gemm(q, s, w8, alpha, sizes):
    """float32 fp8 GEMM with each chunk's products added one by one in the kernel k order, folded
    by an fma (numpy: the product by a power of two is exact, the float64 sum rounded once)."""
    q = np.asarray(q).astype(np.float32)
    w8 = np.asarray(w8).astype(np.float32)
    m, k = q.shape
    out = np.zeros((m, w8.shape[1]), np.float32)
    order = kernel_k_order_oracle()
    start = 0
    for g, size in enumerate(sizes):
        end = min(start + max(int(size), 0), m)
        acc = np.zeros((end - start, w8.shape[1]), np.float32)
        for c in range(k // 128):
            part = np.zeros_like(acc)
            for pos in order:
                kk = 128 * c + pos
                part = part + q[start:end, kk, None] * w8[g, :, kk][None, :]   # exact products
            acc = (part.astype(np.float64) * s[start:end, c, None] + acc).astype(np.float32)
        out[start:end] = acc * np.float32(np.float32(alpha[g]) * np.float32(8))
        start = end
    return out


@needs_ffi
def test_cpu_handler_and_reference_within_stated_bound(rng, on_cpu):
    # fp8.py's docstring: the backends differ only in the order of a chunk's float32 sum, by at
    # most 2 (K/128 + 130) 2^-24 mag per element; the CPU handler's order is sequential in the
    # kernel k order (checked bit for bit against numpy), the reference's is XLA's.
    k, sizes = 512, (30, 34)
    lhs, rhs, gs, want, mag = gemm_case(rng, m=64, n=128, k=k, g=2, sizes=sizes)
    f = lambda a, w, s, b: jn.grouped_gemm(a, w, s, backend=b, precision="fp8",  # noqa: E731
                                           out_dtype=jnp.float32)
    jf = jax.jit(f, static_argnums=3)
    outs = {"ffi": f(lhs, rhs, gs, "ffi"), "ffi jit": jf(lhs, rhs, gs, "ffi"),
            "reference": f(lhs, rhs, gs, "reference"),
            "reference jit": jf(lhs, rhs, gs, "reference"),
            "fp8 reference": fp8.grouped_gemm_fp8_reference(lhs, rhs, gs, out_dtype=jnp.float32)}
    outs = {name: np.asarray(v, np.float64) for name, v in outs.items()}
    q, s = oracle_quantize(np.asarray(lhs, np.float64))
    w8 = oracle_weights(np.asarray(rhs.data), np.asarray(rhs.scales))
    np.testing.assert_array_equal(outs["ffi"], sequential_fp8_gemm(q, s, w8, rhs.global_scale, sizes))
    np.testing.assert_array_equal(outs["ffi jit"], outs["ffi"])
    bound = 2 * (k // 128 + 130) * 2.0**-24 * mag
    names = list(outs)
    worst = 0.0
    for i, a in enumerate(names):
        assert_within_f32_accumulation(outs[a], want, mag, k, a)       # half the bound each
        for b in names[i + 1:]:
            diff = np.abs(outs[a] - outs[b])
            assert (diff <= bound).all(), (a, b, float(np.max(diff / (mag + 1e-30))))
            worst = max(worst, float(np.max(diff / (mag + 1e-30))))
    # the docstring quotes 6.2e-9 * mag (19 of 8192 elements differ): an order difference shows,
    # far below the bound; 2x margin so that a change of summation order shows here
    assert 0 < worst <= 1.3e-8, worst


# ------------------------------------------------------------------ weights prepared as e4m3
def oracle_prepared_codes(data, scales):
    """The bytes of prepare_weights(w, "fp8").codes from checkpoint bytes: the ml_dtypes e4m3
    rounding of e2m1 * scale / 8 (oracle_weights), each 128-chunk permuted into the kernel order
    by the docs' formula (kernel_k_order_oracle)."""
    w8 = oracle_weights(data, scales)
    k = w8.shape[-1]
    perm = (np.arange(k) // 128 * 128) + kernel_k_order_oracle()[np.arange(k) % 128]
    return w8[..., perm]


def _as_checkpoint(w):
    return jn.prepare_weights(w, "checkpoint")


@pytest.mark.parametrize("layout", ["checkpoint", "sm90"])
def test_prepare_fp8_codes_against_oracle(rng, layout):
    """Every code under ordinary, extreme and NaN scale bytes, from either NVFP4 layout, eager, jit
    with arguments and jit closed over: the oracle's bytes, the global scale untouched."""
    w = nvfp4_weights(rng, 3, 128, 256)
    sc = np.asarray(w.scales).view(np.uint8).copy()
    sc[0, :16, 0] = np.arange(16) * 17                      # bytes 0x00, 0x11, .., 0xFF (-NaN)
    sc[1, 5, 3], sc[2, 9, 1], sc[2, 10, 2] = 0x7F, 0xFF, 0x7E   # NaN, -NaN, the largest
    w = jn.NVFP4Tensor(w.data, jn.scales_from_bytes(jnp.asarray(sc)),
                       jnp.asarray([0.5, 2.0**-20, 3.0], jnp.float32))
    want = oracle_prepared_codes(np.asarray(w.data), sc)
    src = jn.prepare_weights(w) if layout == "sm90" else w
    outs = {"eager": jn.prepare_weights(src, "fp8"),
            "jit": jax.jit(lambda t: jn.prepare_weights(t, "fp8"))(src),
            "closed": jax.jit(lambda: jn.prepare_weights(src, "fp8"))()}
    nan = np.isnan(want.astype(np.float64))
    assert nan.any()
    for name, p in outs.items():
        assert isinstance(p, fp8.Fp8Weights) and p.layout == "fp8", name
        assert p.codes.dtype == jnp.float8_e4m3fn and p.shape == (3, 128, 256), name
        got = np.asarray(p.codes)
        np.testing.assert_array_equal(np.isnan(got.astype(np.float64)), nan, err_msg=name)
        np.testing.assert_array_equal(got.view(np.uint8)[~nan], want.view(np.uint8)[~nan],
                                      err_msg=name)
        np.testing.assert_array_equal(np.asarray(p.global_scale), np.asarray(w.global_scale))
    p = outs["eager"]
    assert jn.prepare_weights(p, "fp8") is p                               # already prepared
    # one matrix, and the logical order back
    one = jn.prepare_weights(jn.NVFP4Tensor(w.data[1], w.scales[1], w.global_scale[1]), "fp8")
    np.testing.assert_array_equal(np.asarray(one.codes).view(np.uint8)[~nan[1]],
                                  want[1].view(np.uint8)[~nan[1]])
    # (NaN bytes compared by position only: a GPU's NaN may carry another sign bit)
    logical = np.asarray(p.logical_codes())
    w8 = oracle_weights(np.asarray(w.data), sc)
    nan_logical = np.isnan(w8.astype(np.float64))
    np.testing.assert_array_equal(np.isnan(logical.astype(np.float64)), nan_logical)
    np.testing.assert_array_equal(logical.view(np.uint8)[~nan_logical], w8.view(np.uint8)[~nan_logical])


def test_prepare_fp8_errors(rng):
    w = nvfp4_weights(rng, 2, 32, 256)
    p = jn.prepare_weights(w, "fp8")
    for layout in ("checkpoint", "sm90"):
        with pytest.raises(ValueError, match=r"x: Fp8Weights .* cannot be converted to layout "
                                             f"'{layout}'.*not invertible"):
            jn.prepare_weights(p, layout)
    with pytest.raises(ValueError, match=r"x: layout 'fp8' needs K % 128 == 0.*K = 96"):
        jn.prepare_weights(nvfp4_weights(rng, 2, 32, 96), "fp8")
    with pytest.raises(ValueError, match=r"layout: expected one of \('checkpoint', 'sm90', 'fp8'\)"):
        jn.prepare_weights(w, "e4m3")
    with pytest.raises(ValueError, match="x: expected an NVFP4Tensor, Fp8Weights or a MoEWeights"):
        jn.prepare_weights(np.zeros((2, 32, 256)), "fp8")
    with pytest.raises(ValueError, match=r"rhs.codes: expected float8_e4m3fn \[..., N, K\]"):
        jn.grouped_gemm(jnp.zeros((4, 256)), fp8.Fp8Weights(p.codes.astype(jnp.float32), p.global_scale),
                        [2, 2], backend="reference", precision="fp8")
    with pytest.raises(ValueError, match=r"rhs.global_scale: shape \(3,\)"):
        jn.grouped_gemm(jnp.zeros((4, 256)), fp8.Fp8Weights(p.codes, jnp.ones((3,), jnp.float32)),
                        [2, 2], backend="reference", precision="fp8")


def test_prepared_weights_refused_outside_fp8(rng, on_cpu):
    w = nvfp4_weights(rng, 2, 32, 256)
    p = jn.prepare_weights(w, "fp8")
    x = jnp.zeros((4, 256), jnp.bfloat16)
    for backend in ["reference"] + (["ffi"] if HAS_FFI else []):
        with pytest.raises(ValueError, match=r"rhs: Fp8Weights .* need precision='fp8', got "
                                             r"precision='exact'"):
            jn.grouped_gemm(x, p, [2, 2], backend=backend)
        with pytest.raises(ValueError, match="rhs: Fp8Weights .* grouped_gemm_swiglu computes the "
                                             "exact mode only"):
            jn.grouped_gemm_swiglu(x, p, [2, 2], backend=backend)
    with pytest.raises(ValueError, match=r"rhs: Fp8Weights .* need precision='fp8'"):
        jn.reference.grouped_gemm(x, p, [2, 2])
    if not HAS_FFI:
        return
    cfgs = {c.family: c for c in jn.kernel_config.kernel_configs()}
    with pytest.raises(ValueError, match=r"kernel: .*wgmma_fp8'.* does not read 'fp8' weights"):
        jn.grouped_gemm(x, p, [2, 2], backend="ffi", precision="fp8", kernel=cfgs["wgmma_fp8"])
    with pytest.raises(ValueError, match=r"does not read 'checkpoint' weights"):
        jn.grouped_gemm(x, w, [2, 2], backend="ffi", precision="fp8",
                        kernel=cfgs["wgmma_fp8_prepared"])
    with pytest.raises(ValueError, match=r"the 'wgmma_fp8' kernel does not handle this problem"):
        jn.grouped_gemm(x, p, [2, 2], backend="ffi", precision="fp8", kernel="wgmma_fp8")


PREPARED_CASES = [   # (m, n, k, g, sizes, w4a4): every shape class of the fp8 GEMM tests
    (50, 128, 384, 5, (7, 0, -2, 30, 4), False),  # empty and negative groups, sizes below M
    (50, 128, 384, 5, (7, 0, -2, 30, 4), True),   # the same, W4A4
    (40, 96, 256, 3, (9, 0, 25), False),          # N % 128 != 0
    (24, 64, 128, 2, (10, 30), False),            # sizes past M
]
BACKENDS = ["reference"] + (["ffi"] if HAS_FFI else [])
PREPARED_CONFIGS = [   # every compiled configuration of the two families that read fp8-prepared weights
    ("wgmma_fp8_prepared", 128, 6, 1), ("cutlass_fp8", 128, 5, 1), ("cutlass_fp8", 128, 5, 1, 1),
    ("cutlass_fp8", 128, 5, 2), ("cutlass_fp8", 128, 5, 2, 1), ("cutlass_fp8", 64, 8, 1)]


def _prepared_config(cfg, n):
    """The KernelConfig of a PREPARED_CONFIGS entry, skipping the test where it does not handle N."""
    c = jn.kernel_config.KernelConfig(*cfg)
    if c.family == "cutlass_fp8" and n % 8:
        pytest.skip("cutlass_fp8 needs N % 8 == 0")
    return c


def _fp8_both(backend):
    """One jit: the fp8 GEMM of (lhs, w) and of (lhs, p), float32 and bf16 out."""
    def f(a, w, p, s):
        g = lambda r, d: jn.grouped_gemm(a, r, s, backend=backend, precision="fp8",  # noqa: E731
                                         out_dtype=d)
        return [g(r, d) for r in (w, p) for d in (jnp.float32, jnp.bfloat16)]
    return jax.jit(f)


@pytest.mark.parametrize("m,n,k,g,sizes,w4a4", PREPARED_CASES)
def test_prepared_equals_checkpoint_fp8_every_backend(rng, on_cpu, m, n, k, g, sizes, w4a4):
    """prepare_weights(w, "fp8") gives bit for bit the numbers of w in the fp8 mode on each backend
    (the same operand values and products in the same order), float32 and bf16 out, within the
    float64 oracle's bound."""
    lhs, rhs, gs, want, mag = gemm_case(rng, m=m, n=n, k=k, g=g, sizes=sizes, w4a4=w4a4)
    prep = jn.prepare_weights(rhs, "fp8")
    end = min(sum(max(s, 0) for s in sizes), m)
    for backend in BACKENDS:
        w32, w16, p32, p16 = (np.asarray(v) for v in _fp8_both(backend)(lhs, rhs, prep, gs))
        assert p32.dtype == np.float32 and p16.dtype == jnp.bfloat16 and p32.shape == (m, n)
        np.testing.assert_array_equal(p32, w32, err_msg=backend)
        np.testing.assert_array_equal(p16, w16, err_msg=backend)
        assert_within_f32_accumulation(p32, want, mag, k, backend)
        assert (p32[end:] == 0).all() and np.abs(p32[:end]).max() > 0


def test_prepared_eager_closed_over_and_empty(rng, on_cpu):
    """Eager, jit closed over (the weights constants) and M = 0, on each backend: the numbers of
    the checkpoint-layout weights (closed over: within the stated bound, XLA may fold constants in
    another order)."""
    lhs, rhs, gs, want, mag = gemm_case(rng, m=20, n=64, k=128, g=2, sizes=(8, 0))
    prep = jn.prepare_weights(rhs, "fp8")
    for backend in BACKENDS:
        f = lambda a, w, s: jn.grouped_gemm(a, w, s, backend=backend, precision="fp8",  # noqa: E731
                                            out_dtype=jnp.float32)
        base = np.asarray(jax.jit(f)(lhs, rhs, gs))
        np.testing.assert_array_equal(np.asarray(f(lhs, prep, gs)), base, err_msg=backend)
        closed = np.asarray(jax.jit(lambda: f(lhs, prep, gs))())
        assert_within_f32_accumulation(closed, want, mag, 128, backend)
        assert (closed[8:] == 0).all()
        empty = f(jnp.zeros((0, 128), jnp.bfloat16), prep, gs)
        assert empty.shape == (0, 64) and empty.dtype == jnp.float32


@needs_ffi
def test_prepared_cpu_handler_sequential_order_and_nan(rng, on_cpu):
    """The CPU handler on prepared weights: the numpy sequential sum bit for bit (the order stated
    in fp8.py), and a NaN block scale's NaN codes in their group's column only."""
    k, sizes = 256, (5, 6)
    lhs, rhs, gs, _, _ = gemm_case(rng, m=12, n=32, k=k, g=2, sizes=sizes)
    sc = np.asarray(rhs.scales).view(np.uint8).copy()
    sc[1, 7, 3] = 0xFF
    rhs = jn.NVFP4Tensor(rhs.data, jn.scales_from_bytes(jnp.asarray(sc)), rhs.global_scale)
    prep = jn.prepare_weights(rhs, "fp8")
    got = np.asarray(jn.grouped_gemm(lhs, prep, gs, backend="ffi", precision="fp8",
                                     out_dtype=jnp.float32))
    q, s = oracle_quantize(np.asarray(lhs, np.float64))
    w8 = oracle_weights(np.asarray(rhs.data), sc)
    want = sequential_fp8_gemm(q, s, w8, np.asarray(rhs.global_scale), sizes)
    np.testing.assert_array_equal(got, want)
    nan = np.zeros_like(got, bool)
    nan[5:11, 7] = True
    np.testing.assert_array_equal(np.isnan(got), nan)


@needs_ffi
def test_prepared_lowering_names_layout_and_kernel(rng, on_cpu):
    """The prepared weights reach the custom call as e4m3 bytes [G, N, K], rhs_layout 2, with the
    heuristic's configuration (cutlass_fp8 from 64 rows per group, N % 8 == 0) in the attributes."""
    lhs, rhs, gs, _, _ = gemm_case(rng, m=128, n=64, k=256, g=2, sizes=(64, 64))
    prep = jn.prepare_weights(rhs, "fp8")
    want = jn.kernel_config.choose(128, 64, 256, 2, rhs_layout="fp8", precision="fp8")
    assert want.family == "cutlass_fp8" and want.raster == 1 and want.cluster == 1
    text = jax.jit(lambda a, w, s: jn.grouped_gemm(a, w, s, backend="ffi", precision="fp8")).lower(
        lhs, prep, gs).as_text()
    assert jn._extension.TARGET in text
    assert "rhs_layout = 2 : i32" in text and "kernel = 5 : i32" in text and "raster = 1 : i32" in text
    assert f"token_tile = {want.token_tile} : i32" in text and "cluster = 1 : i32" in text
    assert "tensor<2x64x256xui8>" in text


def test_grad_through_prepared_weights(rng):
    """The straight-through backward with prepared weights: alpha_g * dy @ (8 * w8_g), against
    float64; every backend."""
    lhs, rhs, sizes, _, _ = gemm_case(rng, m=20, n=64, k=256, g=2, sizes=(8, 9))
    prep = jn.prepare_weights(rhs, "fp8")
    x = jnp.asarray(lhs, jnp.float32)
    ct = jnp.asarray(rng.standard_normal((20, 64)), jnp.float32)
    w8 = oracle_weights(np.asarray(rhs.data), np.asarray(rhs.scales)).astype(np.float64)
    gsc = np.asarray(rhs.global_scale, np.float64)
    ref = np.zeros((20, 256))
    ref[:8] = gsc[0] * 8 * np.asarray(ct, np.float64)[:8] @ w8[0]
    ref[8:17] = gsc[1] * 8 * np.asarray(ct, np.float64)[8:17] @ w8[1]
    for backend in BACKENDS:
        f = lambda x: jnp.sum(ct * jn.grouped_gemm(  # noqa: E731
            x, prep, sizes, backend=backend, precision="fp8", out_dtype=jnp.float32))
        g = np.asarray(jax.jit(jax.grad(f))(x))
        assert rel_err(g, ref) <= 1e-6, backend
        assert (g[17:] == 0).all()


@pytest.mark.parametrize("cfg", PREPARED_CONFIGS)
@pytest.mark.parametrize("m,n,k,g,sizes,w4a4", PREPARED_CASES)
def test_cuda_prepared_kernel_against_checkpoint_fp8_and_oracle(rng, m, n, k, g, sizes, w4a4, cfg):
    """Each configuration that reads fp8-prepared weights (wgmma_fp8_prepared, cutlass_fp8) on every
    shape class of the prepared-weights tests: against float64 and the CPU handler within the bound
    of test_cuda_kernel_against_cpu_handler_and_oracle (the tensor core's chunk sums), against the
    checkpoint-layout fp8 kernel (the same operands) within the same bound, float32 and bf16 out;
    rows past the groups are zero; the lowered attributes name the configuration."""
    gpu = _gpu()
    kernel = _prepared_config(cfg, n)
    lhs, rhs, sz, want, mag = gemm_case(rng, m=m, n=n, k=k, g=g, sizes=sizes, w4a4=w4a4)
    prep = jn.prepare_weights(rhs, "fp8")
    on = lambda t: jax.device_put(t, gpu)  # noqa: E731
    f = jax.jit(lambda a, w, s: jn.grouped_gemm(a, w, s, backend="ffi", precision="fp8",
                                                out_dtype=jnp.float32, kernel=kernel))
    code = jn.kernel_config.FAMILIES.index(kernel.family)
    text = f.lower(on(lhs), on(prep), on(sz)).as_text()
    assert f"kernel = {code} : i32" in text and f"token_tile = {kernel.token_tile} : i32" in text
    got = np.asarray(f(on(lhs), on(prep), on(sz)), np.float64)
    ckpt = np.asarray(jax.jit(lambda a, w, s: jn.grouped_gemm(
        a, w, s, backend="ffi", precision="fp8", out_dtype=jnp.float32))(on(lhs), on(rhs), on(sz)),
        np.float64)
    cpu = jax.devices("cpu")[0]
    host = np.asarray(f(*(jax.device_put(t, cpu) for t in (lhs, prep, sz))), np.float64)
    tol = 2.0**-9 * mag + 1e-30
    assert np.all(np.abs(got - want) <= tol), float(np.max(np.abs(got - want) / tol))
    assert np.all(np.abs(got - host) <= tol)
    assert np.all(np.abs(got - ckpt) <= tol)
    end = min(sum(max(s, 0) for s in sizes), m)
    assert (got[end:] == 0).all() and np.abs(got[:end]).max() > 0
    got16 = np.asarray(jax.jit(lambda a, w, s: jn.grouped_gemm(
        a, w, s, backend="ffi", precision="fp8", kernel=kernel))(on(lhs), on(prep), on(sz)), np.float64)
    assert np.all(np.abs(got16 - want) <= tol + 2.0**-8 * np.abs(want))
    assert (got16[end:] == 0).all()


@pytest.mark.parametrize("cfg", PREPARED_CONFIGS)
def test_cuda_prepared_kernel_tile_edges_eager_closed_over_and_empty(rng, cfg):
    """Each prepared-weights configuration on groups that end inside and at the end of its tiles
    (and the 128-token kernel's WGMMA N steps 32, 64, 128), one row, empty groups, N past a
    multiple of 128: against float64; eager and with the weights closed over under jit (the same
    bound); M = 0 and all-empty groups give zeros of the right shape."""
    gpu = _gpu()
    kernel = _prepared_config(cfg, 320)
    sizes = (700, 0, 256, 100, 300, 1, 64, 193, 129, 32, 33)
    m = sum(sizes) + 7
    lhs, rhs, sz, want, mag = gemm_case(rng, m=m, n=320, k=512, g=len(sizes), sizes=sizes)
    lhs, prep, sz = (jax.device_put(t, gpu) for t in (lhs, jn.prepare_weights(rhs, "fp8"), sz))
    f = lambda a, w, s: jn.grouped_gemm(a, w, s, backend="ffi", precision="fp8",  # noqa: E731
                                        out_dtype=jnp.float32, kernel=kernel)
    tol = 2.0**-9 * mag + 1e-30
    for got in (f(lhs, prep, sz), jax.jit(f)(lhs, prep, sz), jax.jit(lambda: f(lhs, prep, sz))()):
        got = np.asarray(got, np.float64)
        assert np.all(np.abs(got - want) <= tol), float(np.max(np.abs(got - want) / tol))
        assert (got[sum(sizes):] == 0).all()
    empty = jax.jit(f)(jnp.zeros((0, 512), jnp.bfloat16), prep, sz)
    assert empty.shape == (0, 320) and empty.dtype == jnp.float32
    zeros = np.asarray(jax.jit(f)(lhs, prep, jnp.zeros_like(sz)))
    assert zeros.shape == (m, 320) and (zeros == 0).all()


def test_cuda_layer_on_prepared_weights(rng):
    """The MoE layer in the FP8 mode on the GPU with weights prepared as e4m3 (the dispatch's e4m3
    rows feed the prepared kernel): the checkpoint-layout weights' fp8 layer on the GPU and the
    prepared weights' layer on the CPU handler within 1e-2 (the GEMMs agree within the tensor core's
    chunk bound; a requantized activation may move one e2m1 step), both activations, 0 and 1 tokens."""
    gpu = _gpu()
    cpu = jax.devices("cpu")[0]
    for activation in ("w4a16", "w4a4"):
        c, w, x, _ = moe_layer(rng, activation)
        c8 = jn.MoEConfig(**{**c.__dict__, "precision": "fp8"})
        prep = jn.prepare_weights(w, "fp8")
        f = jax.jit(lambda x, w: jn.moe(x, w, c8, backend="ffi"))
        got = np.asarray(f(jax.device_put(x, gpu), jax.device_put(prep, gpu)), np.float64)
        ckpt = np.asarray(f(jax.device_put(x, gpu), jax.device_put(w, gpu)), np.float64)
        host = np.asarray(f(jax.device_put(x, cpu), jax.device_put(prep, cpu)), np.float64)
        assert rel_err(got, ckpt) <= 1e-2, (activation, rel_err(got, ckpt))
        assert rel_err(got, host) <= 1e-2, (activation, rel_err(got, host))
        for t in (0, 1):
            out = f(jax.device_put(x[:t], gpu), jax.device_put(prep, gpu))
            assert out.shape == (t, HM) and bool(jnp.all(jnp.isfinite(out)))


def test_prepared_weights_and_sm90_on_gpu_decided_at_trace_time(rng, on_cpu, monkeypatch):
    """Where the computation runs is gemm._on_gpu's decision (the platform the arrays live on,
    else the default device), taken before anything is lowered: with it forced to the GPU, sm90
    NVFP4 weights in the FP8 mode are refused (no CUDA kernel reads them) while Fp8Weights and
    checkpoint weights run as usual."""
    if not HAS_FFI:
        pytest.skip("the extension is not built")
    lhs, rhs, gs, _, _ = gemm_case(rng, m=8, n=128, k=128, g=2, sizes=(4, 4))
    prep = jn.prepare_weights(rhs, "fp8")
    monkeypatch.setattr(jn.gemm, "_on_gpu", lambda *a: True)
    with pytest.raises(ValueError, match=r"rhs.layout: precision='fp8' on the GPU reads "
                                         r"checkpoint-layout NVFP4 weights or Fp8Weights, got 'sm90'"):
        jn.grouped_gemm(lhs, jn.prepare_weights(rhs), gs, backend="ffi", precision="fp8")
    np.testing.assert_array_equal(
        np.asarray(jn.grouped_gemm(lhs, prep, gs, backend="ffi", precision="fp8")),
        np.asarray(jn.grouped_gemm(lhs, rhs, gs, backend="ffi", precision="fp8")))
