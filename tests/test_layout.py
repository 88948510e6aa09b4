"""The sm90 load-time layout of weight codes (jax_nvfp4/maths/layout.py).

Oracle: ml_dtypes' float4_e2m1fn and bfloat16 decodes, and an index mapping written out here
from the layout's definition (loops over thread, tile and register), not the module's reshapes.
"""

import dataclasses
import os
import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jax_nvfp4.maths import layout


def random_packed(rng, shape):
    return rng.integers(0, 256, shape, dtype=np.uint8)


@pytest.mark.parametrize("shape", [(128, 32), (2, 256, 96), (3, 1, 128, 64)])
def test_round_trip_and_same_bytes(rng, shape):
    data = random_packed(rng, shape)
    prep = np.asarray(jax.jit(layout.prepare_sm90)(data))
    assert prep.shape == data.shape and prep.dtype == np.uint8
    assert not np.array_equal(prep, data)
    np.testing.assert_array_equal(np.asarray(jax.jit(layout.unprepare_sm90)(prep)), data)
    # a permutation of bits: the number of set bits is kept
    popcount = lambda a: np.unpackbits(a).sum()  # noqa: E731
    assert popcount(prep) == popcount(data)


def test_kernel_extraction_gives_e2m1_times_2_pow_minus_126(rng):
    n, k = 256, 128
    data = random_packed(rng, (n, k // 2))
    prep = np.asarray(layout.prepare_sm90(data))
    codes = np.stack([data & 0xF, data >> 4], -1).reshape(n, k)      # code of (row, k)
    e2m1 = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    checked = 0
    for nb in range(n // 128):
        for kblk in range(k // 64):
            # the stripe's blocks follow each other: block kblk is bytes 4096 kblk.. of the stripe
            stripe = prep[128 * nb:128 * nb + 128].reshape(-1)
            block = stripe[4096 * kblk:4096 * kblk + 4096]
            words = block.view("<u4")                                  # little-endian words
            for mt in range(8):
                for lane in range(32):
                    g8, t = lane // 4, lane % 4
                    for kb in range(4):
                        w = words[(512 * mt + 16 * lane + 4 * kb) // 4]
                        regs = layout.fragments_sm90(np.array([w], np.uint32))[0]
                        for i, (drow, dk) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
                            row = 128 * nb + 16 * mt + g8 + drow
                            kk = 64 * kblk + 16 * kb + 2 * t + dk
                            halves = np.array([regs[i] & 0xFFFF, regs[i] >> 16], np.uint16)
                            got = halves.view(ml_dtypes.bfloat16).astype(np.float64) * 2.0 ** 126
                            np.testing.assert_array_equal(got, e2m1[row, kk:kk + 2])
                            checked += 2
    assert checked == n * k


@pytest.mark.parametrize("shape", [(128, 4), (2, 256, 12), (3, 1, 384, 8)])
def test_scale_order_from_its_definition(rng, shape):
    """The scale of (row n, k-block b) sits at byte 512 (b // 4) + 4 (n % 128) + b % 4 of row
    stripe n // 128 (written out here by loops, not by the module's reshapes); round trip exact."""
    s = rng.integers(0, 256, shape, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    prep = np.asarray(jax.jit(layout.prepare_scales_sm90)(s))
    assert prep.shape == s.shape and prep.dtype == s.dtype
    want = np.zeros(shape, np.uint8)
    src = s.view(np.uint8).reshape((-1,) + shape[-2:])
    flat = want.reshape((-1,) + shape[-2:])
    n_rows, ks = shape[-2:]
    for e in range(src.shape[0]):
        for n in range(n_rows):
            stripe = flat[e, 128 * (n // 128):128 * (n // 128) + 128].reshape(-1)  # a view
            for b in range(ks):
                stripe[512 * (b // 4) + 4 * (n % 128) + b % 4] = src[e, n, b]
    np.testing.assert_array_equal(prep.view(np.uint8), want)
    back = np.asarray(jax.jit(layout.unprepare_scales_sm90)(prep))
    np.testing.assert_array_equal(back.view(np.uint8), s.view(np.uint8))
    with pytest.raises(ValueError, match=r"scales: the sm90 layout needs N % 128 == 0"):
        layout.prepare_scales_sm90(np.zeros((100, 4), np.uint8))


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match=r"data: the sm90 layout needs N % 128 == 0"):
        layout.prepare_sm90(np.zeros((100, 32), np.uint8))
    with pytest.raises(ValueError, match="K % 64"):
        layout.prepare_sm90(np.zeros((128, 16), np.uint8))
    with pytest.raises(ValueError, match="data: expected uint8"):
        layout.unprepare_sm90(np.zeros((128, 32), np.int32))
    # block scales: one per 16 codes, so K = 16 * the last axis; both directions check it
    for fn in (layout.prepare_scales_sm90, layout.unprepare_scales_sm90):
        with pytest.raises(ValueError, match=r"^scales: the sm90 layout needs N % 128 == 0 and "
                                             r"K % 64 == 0, got N = 128, K = 96$"):
            fn(np.zeros((2, 128, 6), np.uint8))
        with pytest.raises(ValueError, match=r"^scales: expected block scales \[\.\.\., N, K/16\], "
                                             r"got shape \(16,\)$"):
            fn(np.zeros(16, np.uint8))
        assert fn(np.zeros((256, 8), np.uint8)).shape == (256, 8)   # the smallest K = 64 blocks


def test_a_layout_no_consumer_knows_is_refused(rng):
    """checkpoint_data / checkpoint_scales (what every pure-jnp consumer reads) refuse a layout
    they do not know instead of reading the bytes in some order."""
    t = jn.quantize(jnp.asarray(rng.standard_normal((128, 64)), jnp.float32))
    odd = jn.NVFP4Tensor(t.data, t.scales, t.global_scale, "sm100")
    for fn in (layout.checkpoint_data, layout.checkpoint_scales):
        with pytest.raises(ValueError, match=r"^layout: expected one of \('checkpoint', 'sm90'\), "
                                             r"got 'sm100'$"):
            fn(odd)
    with pytest.raises(ValueError, match=r"^t\.layout: expected one of"):   # relayout says "t"
        layout.relayout(odd, "sm90")
    with pytest.raises(ValueError, match=r"^t: layout 'sm90' needs .* got N = 96, K = 64"):
        layout.relayout(jn.quantize(jnp.ones((96, 64), jnp.float32)), "sm90")


def test_selftest_host_copy_matches(rng, tmp_path):
    """tools/bench/sm90_layout_host.h (the GPU self-test's C++ copies of prepare_sm90 and
    prepare_scales_sm90) gives the same bytes."""
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = tmp_path / "driver.cpp"
    src.write_text(
        '#include "tools/bench/sm90_layout_host.h"\n#include <cstdio>\n#include <cstdlib>\n'
        "int main(int, char** a) {\n"
        "  long G = atol(a[1]), N = atol(a[2]), K = atol(a[3]);\n"
        "  std::vector<uint8_t> in(G * N * K / 2);\n"
        "  FILE* f = fopen(a[4], \"rb\"); if (fread(in.data(), 1, in.size(), f) != in.size()) return 3; fclose(f);\n"
        "  auto out = jax_nvfp4_tools::prepare_sm90_host(in, G, N, K);\n"
        "  std::vector<uint8_t> sin(in.begin(), in.begin() + G * N * K / 16);\n"
        "  auto sout = jax_nvfp4_tools::prepare_scales_sm90_host(sin, G, N, K);\n"
        "  out.insert(out.end(), sout.begin(), sout.end());\n"
        "  f = fopen(a[5], \"wb\"); fwrite(out.data(), 1, out.size(), f); fclose(f);\n  return 0;\n}\n")
    exe = tmp_path / "driver"
    subprocess.run([cxx, "-O1", "-std=c++17", f"-I{root}", str(src), "-o", str(exe)], check=True)
    for g, n, k in [(1, 128, 64), (3, 256, 192)]:
        data = rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8)
        data.tofile(tmp_path / "in.bin")
        subprocess.run([str(exe), str(g), str(n), str(k), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")],
                       check=True)
        got = np.fromfile(tmp_path / "out.bin", np.uint8)
        np.testing.assert_array_equal(got[:data.size].reshape(g, n, k // 2),
                                      np.asarray(layout.prepare_sm90(jnp.asarray(data))))
        # the scale copy, fed the first G*N*K/16 bytes of the same input as [G, N, K/16]
        scales = data.reshape(-1)[:g * n * k // 16].reshape(g, n, k // 16)
        np.testing.assert_array_equal(got[data.size:].reshape(g, n, k // 16),
                                      np.asarray(layout.prepare_scales_sm90(jnp.asarray(scales))))


# ------------------------------------------------------------------ prepare_weights (public API)

import jax_nvfp4 as jn  # noqa: E402
from conftest import cpu_devices  # noqa: E402


def quantized(rng, shape):
    w = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.1, 10, shape[:-2] + (1, 1))
    q = jax.vmap(jn.quantize) if len(shape) == 3 else jn.quantize
    return q(jnp.asarray(w))


@pytest.mark.parametrize("shape", [(128, 64), (3, 256, 192), (2, 384, 128)])
def test_prepare_weights_round_trip(rng, shape):
    t = quantized(rng, shape)
    p = jax.jit(jn.prepare_weights)(t)
    assert p.layout == "sm90" and p.data.shape == t.data.shape and p.data.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(p.data), np.asarray(layout.prepare_sm90(t.data)))
    assert not np.array_equal(np.asarray(p.data), np.asarray(t.data))
    # scales are reordered (same bytes), global scales untouched
    assert p.scales.shape == t.scales.shape and p.scales.dtype == t.scales.dtype
    np.testing.assert_array_equal(np.asarray(p.scales).view(np.uint8),
                                  np.asarray(layout.prepare_scales_sm90(t.scales)).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(p.global_scale), np.asarray(t.global_scale))
    back = jax.jit(jn.prepare_weights, static_argnames="layout")(p, layout="checkpoint")
    assert back.layout == "checkpoint"
    np.testing.assert_array_equal(np.asarray(back.data), np.asarray(t.data))
    np.testing.assert_array_equal(np.asarray(back.scales).view(np.uint8), np.asarray(t.scales).view(np.uint8))


def test_prepare_weights_idempotent(rng):
    t = quantized(rng, (2, 128, 64))
    assert jn.prepare_weights(t, "checkpoint") is t
    p = jn.prepare_weights(t)
    assert jn.prepare_weights(p, "sm90") is p
    # under jit too: preparing twice moves the bytes once
    twice = jax.jit(lambda t: jn.prepare_weights(jn.prepare_weights(t)))(t)
    np.testing.assert_array_equal(np.asarray(twice.data), np.asarray(p.data))


def moe_weights(rng, e=4, h=128, i=64, per_half=False):
    f = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.05  # noqa: E731
    w = jn.quantize_moe(f(e, h), f(e, 2 * i, h), f(e, h, i), router_bias=f(e),
                        shared_w13=f(2 * i, h), shared_w2=f(h, i),
                        w13_input_scale=np.full(e, 0.01, np.float32))
    if per_half:
        w13 = jn.NVFP4Tensor(w.w13.data, w.w13.scales,
                             jnp.stack([w.w13.global_scale, 2 * w.w13.global_scale], 1))
        w = jn.MoEWeights(**{**w.__dict__, "w13": w13})
    return w


def test_prepare_weights_moe(rng):
    w = moe_weights(rng, per_half=True)
    p = jax.jit(jn.prepare_weights)(w)
    assert isinstance(p, jn.MoEWeights)
    names = ("w13", "w2", "shared_w13", "shared_w2")
    assert p.w13_paired
    for name in names:
        a, b = getattr(w, name), getattr(p, name)
        assert b.layout == "sm90", name
        if name in ("w13", "shared_w13"):     # also put in the paired gate/up row order
            a = layout.pair_gate_up(a)
        np.testing.assert_array_equal(np.asarray(b.data), np.asarray(layout.prepare_sm90(a.data)))
        np.testing.assert_array_equal(np.asarray(b.global_scale), np.asarray(a.global_scale))
    for name in ("router_weight", "router_bias", "w13_input_scale"):
        np.testing.assert_array_equal(np.asarray(getattr(p, name)), np.asarray(getattr(w, name)))
    assert p.w2_input_scale is None and p.hash_table is None
    back = jn.prepare_weights(p, "checkpoint")
    for a, b in zip(jax.tree.leaves(w), jax.tree.leaves(back)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))
    assert jax.tree.structure(back) == jax.tree.structure(w)


def test_prepare_weights_bad_input(rng):
    t = quantized(rng, (2, 128, 64))
    with pytest.raises(ValueError, match=r"layout: expected one of \('checkpoint', 'sm90', 'fp8'\), "
                                         r"got 'sm100'"):
        jn.prepare_weights(t, "sm100")
    with pytest.raises(ValueError, match=r"x: layout 'sm90' needs .*got N = 96, K = 64"):
        jn.prepare_weights(quantized(rng, (2, 96, 64)))
    with pytest.raises(ValueError, match=r"got N = 128, K = 96"):
        jn.prepare_weights(quantized(rng, (128, 96)))
    # a MoE layer names the field that does not fit: w13 [E, 128, 192] does, w2 [E, 192, 64] not
    with pytest.raises(ValueError, match=r"x\.w2: layout 'sm90' needs .*got N = 192, K = 64"):
        jn.prepare_weights(moe_weights(rng, h=192, i=64))
    with pytest.raises(ValueError, match="x: expected an NVFP4Tensor, Fp8Weights or a MoEWeights, "
                                         "got ndarray"):
        jn.prepare_weights(np.zeros((128, 32), np.uint8))
    with pytest.raises(ValueError, match=r"x\.data: expected uint8"):
        jn.prepare_weights(jn.NVFP4Tensor(t.data.astype(jnp.int32), t.scales, t.global_scale))


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
@pytest.mark.parametrize("jit", [False, True])
def test_prepare_weights_on_expert_sharded_stacks(rng, axis_type, jit, on_cpu):
    """Weights already split over devices on the expert axis (shard_moe_weights) convert where
    they lie: same bytes as the unsplit conversion, the sharding kept, no gather of the stack."""
    t = quantized(rng, (8, 256, 128))
    want = jn.prepare_weights(t)
    mesh = jax.make_mesh((4,), ("ep",), axis_types=(getattr(AxisType, axis_type),),
                         devices=cpu_devices(4))
    put = lambda v: jax.device_put(v, NamedSharding(mesh, P("ep")))  # noqa: E731
    ts = jn.NVFP4Tensor(put(t.data), put(t.scales), put(t.global_scale))
    f = jax.jit(jn.prepare_weights) if jit else jn.prepare_weights
    got = f(ts)
    assert got.layout == "sm90"
    for field in ("data", "scales"):
        a, b = getattr(got, field), getattr(want, field)
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
        if jit and axis_type == "Auto":
            continue    # a tracer carries no sharding then: XLA places the result (docstring)
        assert a.sharding.spec[0] == "ep", (field, a.sharding)
    back = f(got, "checkpoint") if not jit else jax.jit(jn.prepare_weights, static_argnames="layout")(
        got, layout="checkpoint")
    np.testing.assert_array_equal(np.asarray(back.data), np.asarray(t.data))
    np.testing.assert_array_equal(np.asarray(back.scales).view(np.uint8), np.asarray(t.scales).view(np.uint8))
    if jit and axis_type == "Explicit":
        hlo = jax.jit(jn.prepare_weights).lower(ts).compile().as_text()
        assert not re.search(r"all-gather", hlo), "the expert stack was gathered"


def test_prepare_weights_rejects_a_split_along_n(rng, on_cpu):
    t = quantized(rng, (2, 256, 128))
    mesh = jax.make_mesh((2,), ("tp",), axis_types=(AxisType.Explicit,), devices=cpu_devices(2))
    put = lambda v, s: jax.device_put(v, NamedSharding(mesh, s))  # noqa: E731
    ts = jn.NVFP4Tensor(put(t.data, P(None, "tp")), put(t.scales, P(None, "tp")), t.global_scale)
    with pytest.raises(ValueError, match=r"x\.data: split over devices along its last two axes"):
        jn.prepare_weights(ts)


# ------------------------------------------------------------------ paired gate/up rows
from oracles import paired_source_rows  # noqa: E402


@pytest.mark.parametrize("shape,lay", [((32, 64), "checkpoint"), ((2, 3, 48, 32), "checkpoint"),
                                       ((2, 256, 128), "checkpoint"), ((2, 256, 128), "sm90")])
def test_pair_gate_up_against_index_oracle(rng, shape, lay):
    """pair_gate_up moves whole rows (codes and scales) as the index oracle says, in either
    layout, any leading axes; unpair_gate_up inverts it; global scale and layout kept."""
    t = quantized(rng, shape[-3:]) if len(shape) <= 3 else jax.vmap(jax.vmap(jn.quantize))(
        jnp.asarray(rng.standard_normal(shape).astype(np.float32)))
    src = paired_source_rows(shape[-2])
    want_d = np.asarray(t.data)[..., src, :]
    want_s = np.asarray(t.scales).view(np.uint8)[..., src, :]
    if lay == "sm90":
        t = jn.prepare_weights(t)
    p = jax.jit(layout.pair_gate_up)(t)
    assert p.layout == lay and p.data.shape == t.data.shape and p.scales.dtype == t.scales.dtype
    np.testing.assert_array_equal(np.asarray(layout.checkpoint_data(p)), want_d)
    np.testing.assert_array_equal(np.asarray(layout.checkpoint_scales(p)).view(np.uint8), want_s)
    np.testing.assert_array_equal(np.asarray(p.global_scale), np.asarray(t.global_scale))
    if lay == "sm90":   # not a row permutation of the sm90 bytes (that layout mixes rows)
        assert not np.array_equal(np.asarray(p.data), np.asarray(t.data)[..., src, :])
    back = layout.unpair_gate_up(p)
    assert back.layout == lay
    np.testing.assert_array_equal(np.asarray(back.data), np.asarray(t.data))
    np.testing.assert_array_equal(np.asarray(back.scales).view(np.uint8),
                                  np.asarray(t.scales).view(np.uint8))


def test_pair_gate_up_bad_input(rng):
    with pytest.raises(ValueError, match=r"t: pair_gate_up needs 2I rows with I % 8 == 0 .*, got 24 "
                                         r"rows \(I = 12\)"):
        layout.pair_gate_up(quantized(rng, (24, 32)))
    with pytest.raises(ValueError, match=r"t: unpair_gate_up needs .* got 40 rows"):
        layout.unpair_gate_up(quantized(rng, (40, 32)))
    with pytest.raises(ValueError, match="t: pair_gate_up expected an NVFP4Tensor"):
        layout.pair_gate_up(np.zeros((32, 16), np.uint8))
    t = quantized(rng, (32, 32))
    with pytest.raises(ValueError, match=r"t\.data: expected uint8"):
        layout.pair_gate_up(jn.NVFP4Tensor(t.data.astype(jnp.int32), t.scales, t.global_scale))


def test_prepare_weights_pairs_w13_and_checkpoint_unpairs(rng):
    """prepare_weights(MoEWeights, "sm90") pairs w13 and shared_w13 once (w13_paired), and
    "checkpoint" restores the stored rows; an sm90 MoEWeights not yet paired gets paired."""
    w = moe_weights(rng, per_half=True)
    p = jn.prepare_weights(w)
    assert p.w13_paired and not w.w13_paired
    for name in ("w13", "shared_w13"):
        src = paired_source_rows(getattr(w, name).data.shape[-2])
        np.testing.assert_array_equal(np.asarray(layout.checkpoint_data(getattr(p, name))),
                                      np.asarray(getattr(w, name).data)[..., src, :], err_msg=name)
    assert jn.prepare_weights(p, "sm90") is not None
    np.testing.assert_array_equal(np.asarray(jn.prepare_weights(p, "sm90").w13.data),
                                  np.asarray(p.w13.data))          # already paired: kept
    # sm90 but unpaired (e.g. built by hand): pairing happens through the checkpoint order
    unp = dataclasses.replace(jn.prepare_weights(p, "checkpoint"))
    by_hand = dataclasses.replace(unp, w13=jn.prepare_weights(unp.w13),
                                  shared_w13=jn.prepare_weights(unp.shared_w13),
                                  w2=jn.prepare_weights(unp.w2),
                                  shared_w2=jn.prepare_weights(unp.shared_w2))
    again = jn.prepare_weights(by_hand)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(p)):
        np.testing.assert_array_equal(np.asarray(a).reshape(-1).view(np.uint8),
                                      np.asarray(b).reshape(-1).view(np.uint8))
    assert jax.tree.structure(again) == jax.tree.structure(p)
    with pytest.raises(TypeError, match="w13_paired: expected a bool"):
        dataclasses.replace(w, w13_paired="yes")


def test_pair_gate_up_on_an_expert_sharded_stack(rng, on_cpu):
    """A gate/up stack split over devices on the expert axis is paired where it lies (sm90:
    through the checkpoint order), same bytes as unsplit, the split kept."""
    t = jn.prepare_weights(quantized(rng, (4, 128, 64)))
    want = layout.pair_gate_up(t)
    mesh = jax.make_mesh((4,), ("ep",), axis_types=(AxisType.Explicit,), devices=cpu_devices(4))
    put = lambda v: jax.device_put(v, NamedSharding(mesh, P("ep")))  # noqa: E731
    got = layout.pair_gate_up(jn.NVFP4Tensor(put(t.data), put(t.scales), put(t.global_scale),
                                             t.layout))
    for field in ("data", "scales"):
        a, b = getattr(got, field), getattr(want, field)
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
        assert a.sharding.spec[0] == "ep", (field, a.sharding)


def _scan_lengths(fn, *args):
    """The lengths of the top-level scans (lax.map) in fn's program."""
    return [e.params["length"] for e in jax.make_jaxpr(fn)(*args).eqns if e.primitive.name == "scan"]


@pytest.mark.parametrize("lead", [(), (1,), (2,), (2, 3)])
def test_stacks_are_converted_one_matrix_at_a_time(rng, lead):
    """prepare_weights' docstring: stacks are converted one matrix at a time (lax.map), so the
    transient memory is about twice one expert's data; one matrix is converted directly."""
    t = quantized(rng, (128, 64)) if not lead else jax.jit(jax.vmap(jn.quantize))(
        jnp.asarray(rng.standard_normal((int(np.prod(lead)), 128, 64)), jnp.float32))
    if len(lead) > 1:
        t = jn.NVFP4Tensor(t.data.reshape(*lead, 128, 32), t.scales.reshape(*lead, 128, 4),
                           t.global_scale.reshape(lead))
    matrices = int(np.prod(lead))
    for target, src in (("sm90", t), ("checkpoint", jax.jit(jn.prepare_weights)(t))):
        got = _scan_lengths(lambda w: jn.prepare_weights(w, target), src)
        # one matrix: converted directly, or by a map over that one matrix (the same memory)
        assert got == [matrices] or (matrices == 1 and got == []), (target, got)
