"""The typed kernel configuration: the heuristic (csrc/gemm_contract.h through the extension), its
plumbing into the custom call's attributes, the handlers' checks of them, and (GPU) every
configuration forced through the public API against the float64 oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as jn
from jax_nvfp4 import _extension
from jax_nvfp4.config.kernel_config import FAMILIES, KernelConfig
from conftest import gpu_devices, skip_or_fail
from oracles import rel_err
from test_gemm import check_output, make_problem, platform_device, poison

kc = jn.kernel_config
ALL = ("mma", "mma_ws", "wgmma")
needs_ext = pytest.mark.skipif(not _extension.available(), reason="the extension is not built")


@needs_ext
def test_config_table():
    configs = kc.kernel_configs()
    assert configs == (
        KernelConfig("mma", 16, 4, 1), KernelConfig("mma", 32, 5, 1), KernelConfig("mma", 64, 4, 1),
        KernelConfig("mma", 128, 4, 1), KernelConfig("mma_ws", 16, 8, 1),
        KernelConfig("wgmma", 32, 20, 1), KernelConfig("wgmma", 64, 12, 1),
        KernelConfig("wgmma", 128, 8, 1), KernelConfig("wgmma", 256, 5, 2),
        KernelConfig("wgmma_fp8", 32, 15, 1), KernelConfig("wgmma_fp8", 64, 12, 1),
        KernelConfig("wgmma_fp8", 128, 8, 1), KernelConfig("wgmma_fp8_prepared", 128, 6, 1),
        KernelConfig("cutlass_fp8", 128, 5, 1, 1), KernelConfig("cutlass_fp8", 128, 5, 2, 1),
        KernelConfig("cutlass_fp8", 128, 5, 1), KernelConfig("cutlass_fp8", 128, 5, 2),
        KernelConfig("cutlass_fp8", 64, 8, 1))
    assert {c.family for c in configs} == set(FAMILIES)


@needs_ext
@pytest.mark.parametrize("rows_per_group,tile", [(4, 32), (24, 32), (25, 64), (64, 64), (65, 128), (512, 128)])
def test_fp8_heuristic(rows_per_group, tile):
    """The FP8 mode has one family; its token tile follows the rows per group, on any device (the
    handler names a device that cannot run it), and the exact families never compute it."""
    g, n, k = 48, 6144, 7168
    for arch, fams in ((90, ALL + ("wgmma_fp8",)), (80, ("mma",)), (0, None)):
        got = kc.choose(rows_per_group * g, n, k, g, arch=arch, families=fams, precision="fp8")
        assert (got.family, got.token_tile) == ("wgmma_fp8", tile)
    assert kc.choose(4 * g, n, k, g, arch=90, families=ALL + ("wgmma_fp8",)).family != "wgmma_fp8"
    assert kc.for_family("wgmma", 64 * g, n, k, g, precision="fp8") is None
    assert kc.for_family("wgmma_fp8", 64 * g, n, k, g) is None                 # not the FP8 mode
    assert kc.for_family("wgmma_fp8", 64 * g, n, k - 64, g, precision="fp8") is None   # K % 128
    assert kc.for_family("wgmma_fp8", 64 * g, n, k, g, rhs_layout="sm90", precision="fp8") is None
    with pytest.raises(ValueError, match="precision: expected one of"):
        kc.choose(64, n, k, 1, precision="fp16")
    with pytest.raises(ValueError, match="does not compute precision='fp8'"):
        kc.resolve(KernelConfig("wgmma", 128, 8, 1), 64, n, k, 1, precision="fp8")
    with pytest.raises(ValueError, match="does not compute precision='exact'"):
        kc.resolve(KernelConfig("wgmma_fp8", 128, 8, 1), 64, n, k, 1)


@needs_ext
@pytest.mark.parametrize("rows_per_group", [1, 4, 32, 63, 64, 128, 512])
def test_fp8_heuristic_prepared_weights(rows_per_group):
    """Weights prepared as e4m3 (layout "fp8") run cutlass_fp8 (128 x 192 cooperative tiles walked
    along M) from 64 rows per group on average, wgmma_fp8_prepared below
    that and where N % 8 != 0,
    on any device; no other family reads them, and those two read nothing else."""
    g, n, k = 48, 6144, 7168
    m = rows_per_group * g
    fams = ALL + kc.FP8_FAMILIES
    for arch, f in ((90, fams), (80, ("mma",)), (0, None)):
        got = kc.choose(m, n, k, g, arch=arch, families=f, rhs_layout="fp8", precision="fp8")
        want = (KernelConfig("cutlass_fp8", 128, 5, 1, 1) if rows_per_group >= 64 else
                KernelConfig("wgmma_fp8_prepared", 128, 6, 1))
        assert got == want
        got = kc.choose(m, n + 4, k, g, arch=arch, families=f, rhs_layout="fp8", precision="fp8")
        assert got == KernelConfig("wgmma_fp8_prepared", 128, 6, 1)
    assert kc.choose(m, n, k, g, arch=90, families=fams, precision="fp8").family == "wgmma_fp8"
    for fam in ("wgmma_fp8_prepared", "cutlass_fp8"):
        assert kc.for_family(fam, m, n, k, g, precision="fp8") is None   # checkpoint
        assert kc.for_family(fam, m, n, k, g, rhs_layout="fp8") is None   # exact mode
        assert kc.for_family(fam, m, n, k - 64, g, rhs_layout="fp8", precision="fp8") is None
    assert kc.for_family("cutlass_fp8", m, n + 4, k, g, rhs_layout="fp8", precision="fp8") is None
    for fam in ALL + ("wgmma_fp8",):
        for prec in ("exact", "fp8"):
            assert kc.for_family(fam, m, n, k, g, rhs_layout="fp8", precision=prec) is None, (fam, prec)
    with pytest.raises(ValueError, match="rhs_layout: expected one of"):
        kc.choose(m, n, k, g, rhs_layout="e4m3", precision="fp8")


@needs_ext
@pytest.mark.parametrize("rows_per_group,layout,want", [
    (4, "checkpoint", KernelConfig("mma", 16, 4, 1)),      # decode: mma streams weights faster
    (4, "sm90", KernelConfig("mma_ws", 16, 8, 1)),         # decode with sm90 weights
    (14, "sm90", KernelConfig("mma", 32, 5, 1)),           # 13-15 rows: mma's 32-token tile
    (16, "checkpoint", KernelConfig("wgmma", 64, 12, 1)),  # wgmma from 16 rows per group
    (24, "sm90", KernelConfig("wgmma", 64, 12, 1)),
    (25, "checkpoint", KernelConfig("wgmma", 128, 8, 1)),
    (127, "checkpoint", KernelConfig("wgmma", 128, 8, 1)),
    (128, "sm90", KernelConfig("wgmma", 256, 5, 2)),       # paired 256-token tiles
])
def test_heuristic_on_hopper(rows_per_group, layout, want):
    g, n, k = 48, 6144, 7168
    got = kc.choose(rows_per_group * g, n, k, g, rhs_layout=layout, arch=90, families=ALL)
    assert got == want


@needs_ext
def test_heuristic_falls_back_to_mma():
    g, n = 48, 6144
    # K % 64 != 0 and packed activations: wgmma does not handle them; the mma tile follows the rows
    assert kc.choose(100 * g, n, 7168 - 32, g, arch=90, families=ALL) == KernelConfig("mma", 64, 4, 1)
    assert kc.choose(30 * g, n, 7168, g, w4a4=True, arch=90, families=ALL) == KernelConfig("mma", 32, 5, 1)
    # rows_hint (expert parallelism: M counts every routed row) steers like the rows it names
    assert kc.choose(100 * g, n, 7168, g, rows_hint=4 * g, arch=90,
                     families=ALL) == KernelConfig("mma", 16, 4, 1)
    # the families a device runs bound the choice: Ampere/Ada/Blackwell run mma only
    for arch in (80, 86, 89, 100, 120):
        assert kc.choose(500 * g, n, 7168, g, arch=arch, families=("mma",)) == KernelConfig("mma", 64, 4, 1)
        assert kc.choose(4 * g, n, 7168, g, rhs_layout="sm90", arch=arch,
                         families=("mma",)) == KernelConfig("mma", 16, 4, 1)


@needs_ext
def test_runnable_families_follow_the_build():
    targets = _extension.load().cuda_targets().split()
    if not _extension.has_cuda():
        assert targets == [] and kc.runnable_families(90) == ()
        return
    assert "compute_80" in targets
    for arch in (80, 86, 89, 100, 120):
        assert kc.runnable_families(arch) == ("mma",)
    assert kc.runnable_families(75) == ()
    assert kc.runnable_families(90) == (ALL + kc.FP8_FAMILIES if "sm_90a" in targets else ("mma",))
    # the heuristic on an H200 with this build
    want = "wgmma" if "sm_90a" in targets else "mma"
    assert kc.choose(500 * 48, 6144, 7168, 48, arch=90).family == want


@needs_ext
def test_for_family_and_resolve(monkeypatch):
    shape = (200, 256, 320, 4)
    assert kc.for_family("wgmma", *shape) == KernelConfig("wgmma", 128, 8, 1)
    assert kc.for_family("wgmma", 200, 256, 96, 4) is None             # K % 64
    assert kc.for_family("mma_ws", *shape) is None                     # checkpoint weights
    assert kc.for_family("mma_ws", *shape, rhs_layout="sm90") == KernelConfig("mma_ws", 16, 8, 1)
    assert kc.resolve("mma", *shape) == KernelConfig("mma", 64, 4, 1)
    assert kc.resolve(KernelConfig("wgmma", 32, 20, 1), *shape) == KernelConfig("wgmma", 32, 20, 1)
    with pytest.raises(ValueError, match=r"kernel: expected one of \('mma', 'mma_ws', 'wgmma', 'wgmma_fp8', "
                                         r"'wgmma_fp8_prepared', 'cutlass_fp8'\)"):
        kc.resolve("cutlass", *shape)
    with pytest.raises(ValueError, match="is not a compiled configuration"):
        kc.resolve(KernelConfig("mma", 24, 4, 1), *shape)
    with pytest.raises(ValueError, match="the 'wgmma' kernel does not handle this problem"):
        kc.resolve("wgmma", 200, 256, 96, 4)
    # the environment variable overrides the heuristic, and falls back where its family cannot run
    monkeypatch.setenv("JAX_NVFP4_KERNEL", "wgmma")
    assert kc.resolve(None, *shape) == KernelConfig("wgmma", 128, 8, 1)
    assert kc.resolve(None, 200, 256, 96, 4) == kc.choose(200, 256, 96, 4)
    monkeypatch.setenv("JAX_NVFP4_KERNEL", "v2")
    with pytest.raises(ValueError, match=r"JAX_NVFP4_KERNEL: expected one of"):
        kc.resolve(None, *shape)


def _lowered(kernel, rhs_layout="checkpoint", w4a4=False):
    lhs, rhs, gs, _ = make_problem(np.random.default_rng(0), 40, 128, 128, [30, 10], w4a4)
    if rhs_layout == "sm90":
        rhs = jn.prepare_weights(rhs)
    f = jax.jit(lambda a, b: jn.grouped_gemm(a, b, gs, backend="ffi", kernel=kernel))
    return f.lower(lhs, rhs).as_text()


@needs_ext
def test_lowered_program_carries_the_config():
    text = _lowered(KernelConfig("wgmma", 256, 5, 2), "sm90")
    for attr in ("kernel = 2 : i32", "token_tile = 256 : i32", "stages = 5 : i32", "cluster = 2 : i32",
                 "rhs_layout = 1 : i32"):
        assert attr in text, attr
    text = _lowered("mma")                                    # 20 rows per group: 32-token tile
    for attr in ("kernel = 0 : i32", "token_tile = 32 : i32", "stages = 5 : i32", "cluster = 1 : i32",
                 "rhs_layout = 0 : i32"):
        assert attr in text, attr
    # W4A4 under an explicit mma: the native call; under wgmma W4A4 lowers too (the GPU branch
    # dequantizes the activations for wgmma, the CPU branch runs natively and ignores the kernel)
    assert _lowered("mma", w4a4=True).count("kernel = 0 : i32") == 1
    assert "token_tile" in _lowered("wgmma", w4a4=True)


@needs_ext
def test_cpu_handler_accepts_every_config_and_ignores_it(on_cpu):
    platform_device("cpu")
    lhs, rhs, gs, ref = make_problem(np.random.default_rng(1), 40, 128, 128, [30, 0, 10], False)
    outs = [np.asarray(jn.grouped_gemm(lhs, rhs, gs, out_dtype=jnp.float32, backend="ffi", kernel=c))
            for c in kc.kernel_configs() if c.family not in kc.FP8_FAMILIES]     # the exact call's families
    assert rel_err(outs[0], ref) <= 1e-5
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


def _raw_call(**attrs):
    """The custom call with hand-written attributes (bypassing grouped_gemm's checks)."""
    lhs, rhs, gs, _ = make_problem(np.random.default_rng(2), 8, 16, 64, [4, 4], False)
    out_t = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    ws_t = jax.ShapeDtypeStruct((jn.gemm.workspace_bytes(2, 64),), jnp.uint8)
    base = dict(rhs_layout=np.int32(0), kernel=np.int32(0), token_tile=np.int32(16), stages=np.int32(4),
                cluster=np.int32(1), raster=np.int32(0))
    base.update(attrs)
    call = jax.ffi.ffi_call(_extension.TARGET, (out_t, ws_t))
    return jax.block_until_ready(call(lhs, jnp.zeros((0,), jnp.float8_e4m3fn), rhs.data, rhs.scales,
                                      rhs.global_scale, gs, **base))


@needs_ext
def test_cpu_handler_rejects_invalid_attributes(on_cpu):
    platform_device("cpu")
    assert np.all(np.isfinite(np.asarray(_raw_call()[0])))
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"kernel=mma \(0\), token_tile=24, stages=4, cluster=1 are not a compiled "
                             r"kernel configuration"):
        _raw_call(token_tile=np.int32(24))
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"kernel=\? \(7\)"):
        _raw_call(kernel=np.int32(7))
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"kernel=wgmma \(2\), token_tile=256, stages=5, cluster=1"):
        _raw_call(kernel=np.int32(2), token_tile=np.int32(256), stages=np.int32(5))
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"rhs_layout must be 0 \(checkpoint\), 1 \(sm90\) or 2 \(fp8\), got 3"):
        _raw_call(rhs_layout=np.int32(3))
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"rhs_layout 2 .* belongs to the FP8 mode: kernels 4 \(wgmma_fp8_prepared\) and 5 "
                             r"\(cutlass_fp8\), got kernel=mma \(0\)"):
        _raw_call(rhs_layout=np.int32(2))
    with pytest.raises(jax.errors.JaxRuntimeError, match="Wrong scalar data type"):
        _raw_call(token_tile=np.float32(16.5))              # typed: int32 only


def _raw_fp8_call(**attrs):
    """The custom call in the FP8 mode (kernel of an FP8 family) with hand-written attributes: e4m3
    lhs [M, K], chunk scales [K/128, M]."""
    m, k = 8, 128
    _, rhs, gs, _ = make_problem(np.random.default_rng(3), m, 16, k, [4, 4], False)
    out_t = jax.ShapeDtypeStruct((m, 16), jnp.float32)
    ws_t = jax.ShapeDtypeStruct((jn.gemm.workspace_bytes(2, k),), jnp.uint8)
    base = dict(rhs_layout=np.int32(0), kernel=np.int32(3), token_tile=np.int32(32),
                stages=np.int32(15), cluster=np.int32(1), raster=np.int32(0))
    base.update(attrs)
    call = jax.ffi.ffi_call(_extension.TARGET, (out_t, ws_t))
    lhs, lhs_scales = jnp.ones((m, k), jnp.float8_e4m3fn), jnp.ones((k // 128, m), jnp.float32)
    return jax.block_until_ready(call(lhs, lhs_scales, rhs.data, rhs.scales, rhs.global_scale, gs, **base))


@needs_ext
def test_swiglu_call_runs_the_exact_families_only(on_cpu):
    platform_device("cpu")
    lhs, rhs, gs, _ = make_problem(np.random.default_rng(2), 8, 16, 64, [4, 4], False)
    call = jax.ffi.ffi_call(jn.gemm.GLU_TARGET, (jax.ShapeDtypeStruct((8, 8), jnp.float32),
                                                 jax.ShapeDtypeStruct((jn.gemm.workspace_bytes(2, 128),),
                                                                      jnp.uint8)))

    def run(kernel, tile, stages):
        return jax.block_until_ready(call(
            lhs, jnp.zeros((0,), jnp.float8_e4m3fn), rhs.data, rhs.scales, jnp.ones((4,), jnp.float32), gs,
            jnp.zeros((0,), jnp.float32), rhs_layout=np.int32(0), kernel=np.int32(kernel),
            token_tile=np.int32(tile), stages=np.int32(stages), cluster=np.int32(1), raster=np.int32(0),
            glu_limit=np.float32(np.inf)))

    assert np.all(np.isfinite(np.asarray(run(0, 16, 4)[0])))
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"jax_nvfp4_grouped_gemm_glu: attributes kernel=wgmma_fp8 \(3\), token_tile=64, "
                             r"stages=12, cluster=1 compute the FP8 mode; the SwiGLU epilogue runs the exact "
                             r"kernels"):
        run(3, 64, 12)


@needs_ext
def test_the_kernel_attribute_states_the_mode(on_cpu):
    """One target for both modes: the kernel attribute's family states the mode, and the decoder
    checks the operands as that mode's (wgmma_fp8, wgmma_fp8_prepared, cutlass_fp8: the FP8 mode's
    e4m3 lhs and float32 chunk scales; the other families the exact mode's)."""
    platform_device("cpu")
    assert np.all(np.isfinite(np.asarray(_raw_fp8_call()[0])))
    # exact operands (a bf16 lhs) with an FP8 family: decoded as the FP8 mode's, refused as such
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"jax_nvfp4_grouped_gemm \(FP8 mode\): FP8 mode needs K = 2 \* "
                             r"rhs_data.shape\[2\] to be a multiple of 128, got K = 64"):
        _raw_call(kernel=np.int32(3), token_tile=np.int32(64), stages=np.int32(12))
    for kernel, tile, stages in ((4, 128, 6), (5, 128, 5)):     # the prepared-weight FP8 families
        with pytest.raises(jax.errors.JaxRuntimeError, match=r"do not read rhs_layout 0"):
            _raw_call(kernel=np.int32(kernel), token_tile=np.int32(tile), stages=np.int32(stages))
    # FP8 operands with an exact family: decoded as the exact mode's
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"jax_nvfp4_grouped_gemm: lhs must be bf16 \(W4A16\) or uint8 packed e2m1 \(W4A4\)"):
        _raw_fp8_call(kernel=np.int32(0), token_tile=np.int32(16), stages=np.int32(4))
    # the FP8 family must read the weights' layout: wgmma_fp8_prepared the prepared bytes alone
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"kernel=wgmma_fp8_prepared \(4\), token_tile=128, stages=6, cluster=1 do not "
                             r"read rhs_layout 0: kernels 4 \(wgmma_fp8_prepared\) and 5 \(cutlass_fp8\) read "
                             r"the fp8-prepared"):
        _raw_fp8_call(kernel=np.int32(4), token_tile=np.int32(128), stages=np.int32(6))
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"kernel=cutlass_fp8 \(5\), token_tile=64, stages=8, cluster=1 do not read "
                             r"rhs_layout 0"):
        _raw_fp8_call(kernel=np.int32(5), token_tile=np.int32(64), stages=np.int32(8))
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"kernel=wgmma_fp8 \(3\).* do not read rhs_layout 2"):
        _raw_prepared_call(kernel=np.int32(3), stages=np.int32(8))
    out = np.asarray(_raw_prepared_call()[0])
    assert np.all(np.isfinite(out)) and np.abs(out).max() > 0
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"with fp8-prepared weights \(rhs_layout 2\) rhs_scales must have shape \[0\]"):
        _raw_prepared_call(scales=jnp.zeros((2, 16, 8), jnp.float8_e4m3fn))


@needs_ext
def test_prepared_call_needs_the_transposed_scales_workspace(on_cpu, monkeypatch):
    """The FP8 mode on prepared weights needs 4 M K/128 bytes past the launchers' workspace (the
    chunk scales cutlass_fp8 reads K-major): a workspace without them is an error naming both
    sizes, on the CPU handler too (one check for every handler)."""
    platform_device("cpu")
    with_extra = jn.gemm.workspace_bytes(2, 4 * 8 * 1)
    monkeypatch.setattr(jn.gemm, "workspace_bytes", lambda g, k=0: with_extra - 32)
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=rf"jax_nvfp4_grouped_gemm \(FP8 mode\): workspace has {with_extra - 32} bytes, "
                             rf"needs {with_extra}"):
        _raw_prepared_call()


def _raw_prepared_call(scales=None, **attrs):
    """The custom call in the FP8 mode on prepared e4m3 weights bytes [G, N, K] (rhs_layout 2, rhs_scales [0])."""
    m, k = 8, 128
    _, rhs, gs, _ = make_problem(np.random.default_rng(3), m, 16, k, [4, 4], False)
    w8 = jax.lax.bitcast_convert_type(jn.prepare_weights(rhs, "fp8").codes, jnp.uint8)
    out_t = jax.ShapeDtypeStruct((m, 16), jnp.float32)
    # prepared weights: the workspace's extra bytes hold cutlass_fp8's [M, K/128] chunk scales
    ws_t = jax.ShapeDtypeStruct((jn.gemm.workspace_bytes(2, 4 * m * (k // 128)),), jnp.uint8)
    base = dict(rhs_layout=np.int32(2), kernel=np.int32(4), token_tile=np.int32(128),
                stages=np.int32(6), cluster=np.int32(1), raster=np.int32(0))
    base.update(attrs)
    call = jax.ffi.ffi_call(_extension.TARGET, (out_t, ws_t))
    lhs, lhs_scales = jnp.ones((m, k), jnp.float8_e4m3fn), jnp.ones((k // 128, m), jnp.float32)
    sc = jnp.zeros((0,), jnp.float8_e4m3fn) if scales is None else scales
    return jax.block_until_ready(call(lhs, lhs_scales, w8, sc, rhs.global_scale, gs, **base))


def _device_configs():
    devs = gpu_devices()
    if not devs:
        skip_or_fail("no GPU: the kernel families are not exercised")
    if not _extension.has_cuda():
        skip_or_fail("the extension was built without the CUDA handler")
    fams = kc.runnable_families(kc.device_arch(devs[0]))
    return devs[0], [c for c in kc.kernel_configs() if c.family in fams and c.family not in kc.FP8_FAMILIES]


@pytest.mark.parametrize("rhs_layout", ["checkpoint", "sm90"])
@pytest.mark.parametrize("m,sizes", [
    (37, [5, 0, 20]),                                    # decode-sized, an empty group
    (700, [300, 1, 0, 250, 100]),                        # several tiles per group, a 1-row group
    (1200, [500, 0, 600, 60]),                           # 256-token tiles fill, odd tails
    (1150, [512, 384, 129, 75]),                         # the 256 tile's split: tails 0, 128, 129
])
def test_every_config_through_the_public_api(rng, rhs_layout, m, sizes):
    """grouped_gemm(kernel=KernelConfig) runs each configuration this device and build can run (an
    H200 with the full build: all nine of the exact mode; the portable build: the four mma ones)
    against float64. (The FP8 mode's wgmma_fp8 configurations: tests/test_fp8.py.)"""
    dev, configs = _device_configs()
    n, k = 384, 320                                      # odd n-tile count: a cluster's spare tile
    lhs, rhs, gs, ref = make_problem(rng, m, n, k, sizes, False)
    if rhs_layout == "sm90":
        rhs = jn.prepare_weights(rhs)
    lhs, rhs, gs = jax.device_put((lhs, rhs, gs), dev)
    ran = []
    for c in configs:
        if c.family == "mma_ws" and rhs_layout != "sm90":
            continue
        poison(dev, m, n, jnp.float32)
        out = jn.grouped_gemm(lhs, rhs, gs, out_dtype=jnp.float32, backend="ffi", kernel=c)
        check_output(out, m, n, sizes, jnp.float32, ref)
        ran.append(c.family)
    assert "mma" in ran


def test_w4a4_native_mma_on_gpu(rng):
    """kernel="mma" keeps W4A4 native (packed e2m1 activations) on the GPU."""
    dev, configs = _device_configs()
    lhs, rhs, gs, ref = make_problem(rng, 300, 136, 320, [100, 0, 150, 40], True)
    lhs, rhs, gs = jax.device_put((lhs, rhs, gs), dev)
    for c in [c for c in configs if c.family == "mma"] + ["mma"]:
        out = jn.grouped_gemm(lhs, rhs, gs, out_dtype=jnp.float32, backend="ffi", kernel=c)
        check_output(out, 300, 136, [100, 0, 150, 40], jnp.float32, ref)


def test_unsupported_family_on_this_device_is_a_clear_error(rng):
    """A family this device or build cannot run fails at call time naming the device."""
    dev, configs = _device_configs()
    missing = [c for c in kc.kernel_configs() if c not in configs and c.family not in kc.FP8_FAMILIES]
    if not missing:
        pytest.skip("this device and build run every configuration")
    lhs, rhs, gs, _ = make_problem(rng, 64, 128, 128, [32, 32], False)
    lhs, rhs, gs = jax.device_put((lhs, jn.prepare_weights(rhs), gs), dev)
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"cannot run on .*compute capability"):
        jax.block_until_ready(jn.grouped_gemm(lhs, rhs, gs, backend="ffi", kernel=missing[-1]))


def test_the_lowered_config_runs_or_the_call_fails(rng):
    """The CUDA handler runs the configuration the lowered attributes name, or fails naming it: an
    mma_ws configuration on checkpoint-layout weights (mma_ws reads the sm90 layout) and a wgmma one
    with K % 64 != 0 are errors, never the mma kernel in their place."""
    dev, configs = _device_configs()
    cases = ((KernelConfig("mma_ws", 16, 8, 1), 128), (KernelConfig("wgmma", 128, 8, 1), 96))
    refused = [(c, k) for c, k in cases if c in configs]
    if not refused:
        pytest.skip("this device and build run neither mma_ws nor wgmma")
    for cfg, k in refused:
        lhs, rhs, gs, _ = make_problem(rng, 64, 128, k, [32, 32], False)
        lhs, rhs, gs = jax.device_put((lhs, rhs, gs), dev)
        with pytest.raises(jax.errors.JaxRuntimeError,
                           match=rf"kernel={cfg.family} .* does not compute this problem"):
            jax.block_until_ready(jn.grouped_gemm(lhs, rhs, gs, backend="ffi", kernel=cfg))


@needs_ext
def test_explicit_fp8_config_reads_its_weight_layout():
    """An explicit FP8 configuration runs on the weights its family reads (wgmma_fp8:
    checkpoint-layout NVFP4; wgmma_fp8_prepared and cutlass_fp8: fp8-prepared) and is a
    ValueError on the others."""
    n, k = 256, 512
    cfgs = {c.family: c for c in kc.kernel_configs()}
    for fam, layout in (("wgmma_fp8", "checkpoint"), ("wgmma_fp8_prepared", "fp8"),
                        ("cutlass_fp8", "fp8")):
        cfg = cfgs[fam]
        assert kc.resolve(cfg, 64, n, k, 1, rhs_layout=layout, precision="fp8") is cfg
        other = "fp8" if layout == "checkpoint" else "checkpoint"
        with pytest.raises(ValueError, match=f"does not read '{other}' weights"):
            kc.resolve(cfg, 64, n, k, 1, rhs_layout=other, precision="fp8")


# --- the one table of the kernel families' facts, the weight shifts and the interface version ---

@needs_ext
def test_family_table_is_the_python_vocabulary():
    """kernel_config.family_table() (the C++ kFamilyTable through the extension) against the Python
    constants taken from the same extension, the compiled configurations and the heuristic's
    for_family: each family computes its mode only and reads its layouts only."""
    from jax_nvfp4.config import kernel_config, options  # noqa: PLC0415
    table = kernel_config.family_table()
    assert tuple(f.name for f in table) == FAMILIES
    assert [f.code for f in table] == list(range(len(table)))
    assert {f.name: f.code for f in table} == options.FAMILY_CODES
    assert tuple(f.name for f in table if f.mode == "fp8") == options.FP8_FAMILIES
    for f in table:
        assert f.mode in options.PRECISIONS and set(f.layouts) <= set(options.WEIGHT_LAYOUTS)
        tiles = {c.token_tile for c in kernel_config.kernel_configs() if c.family == f.name}
        assert set(f.token_tiles) == tiles and len(f.token_tiles) == len(tiles)
        for layout in options.WEIGHT_LAYOUTS:
            for precision in options.PRECISIONS:
                for w4a4 in (False, True):
                    c = kernel_config.for_family(f.name, 512, 256, 256, 4, rhs_layout=layout,
                                                 precision=precision, w4a4=w4a4 and precision == "exact")
                    if precision != f.mode or layout not in f.layouts:
                        assert c is None, (f.name, layout, precision)
        assert f.archs in ("sm_80 and newer", "sm_90 (sm_90a image)")


@needs_ext
def test_weight_shifts_and_interface_version_are_the_extensions():
    """The scale shifts (2^7 of the exact mode's weights, 2^3 of the FP8 mode's) and the custom
    calls' interface version are stated once, in C++ (csrc/gemm_attributes.h); Python's copies,
    which a package without the extension needs, equal them."""
    from jax_nvfp4.maths import formats  # noqa: PLC0415
    from jax_nvfp4.ops import fp8, reference  # noqa: PLC0415
    ext = _extension.load()
    shifts = ext.weight_shifts()
    assert shifts == {"exact": 7, "fp8": 3}
    assert reference.WEIGHT_PRESCALE == 2.0 ** -shifts["exact"]
    assert formats.FP8_WEIGHT_SHIFT == fp8.WEIGHT_SHIFT == shifts["fp8"]
    assert _extension.ABI_VERSION == ext.interface_version()
    assert set(ext.cpu_registrations()) == set(_extension.TARGETS)


@needs_ext
def test_the_type_stub_names_the_compiled_modules_functions():
    """jax_nvfp4/_jax_nvfp4.pyi (the package ships py.typed) declares exactly the functions the
    compiled module defines, with the same parameter names."""
    import ast  # noqa: PLC0415
    import pathlib  # noqa: PLC0415
    import re  # noqa: PLC0415
    ext = _extension.load()
    stub = ast.parse((pathlib.Path(_extension.__file__).parent / "_jax_nvfp4.pyi").read_text())
    declared = {f.name: [a.arg for a in f.args.args] for f in stub.body if isinstance(f, ast.FunctionDef)}
    public = {n for n in dir(ext) if not n.startswith("_") and callable(getattr(ext, n))}
    assert set(declared) == public
    for name, params in declared.items():
        signature = (getattr(ext, name).__doc__ or "").splitlines()[0]     # nanobind's first line
        assert signature.startswith(f"{name}("), signature
        assert re.findall(r"[(,]\s*(\w+)\s*:", signature.split(") ->")[0]) == params, (name, signature)


def test_cutlass_fp8_n_edge():
    """cutlass_fp8 handles N % 8 == 0 (its epilogue's vector width), not only N % 16: N = 8, 24
    and 40 take it, N = 4, 12 and 20 do not (None: the heuristic falls back)."""
    from jax_nvfp4.config import kernel_config as kc  # noqa: PLC0415
    kw = dict(rhs_layout="fp8", precision="fp8")
    for n in (8, 24, 40):
        assert kc.for_family("cutlass_fp8", 256, n, 256, 2, **kw).family == "cutlass_fp8", n
    for n in (4, 12, 20):
        assert kc.for_family("cutlass_fp8", 256, n, 256, 2, **kw) is None, n
