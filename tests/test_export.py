"""jax.export of the library (jax_nvfp4/layer/export.py): jitted grouped_gemm, moe and
moe_expert_parallel export with ``disabled_checks=jn.export_checks()`` and nothing else written by
hand; the artifact, deserialized and run in a fresh process, equals the jitted call bit for bit;
a symbolic token count exports; the custom-call targets carry the interface version."""

import json
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import QUANTIZE, QUANTIZE_STACK, cpu_devices

import jax_nvfp4 as jn
from jax_nvfp4 import _extension
from jax_nvfp4.nn.frozen import FrozenMoEWeights

pytest.importorskip("flatbuffers", reason="jax.export serialization needs the flatbuffers package")
needs_ext = pytest.mark.skipif(not _extension.available(), reason="the extension is not built")
# The artifacts are run (and compared) on the CPU handler, on every machine.
pytestmark = pytest.mark.usefixtures("on_cpu")


def _export(f):
    """jax.export with the library's checks, for the CPU (the fresh process runs on the CPU)."""
    return jax.export.export(f, disabled_checks=jn.export_checks(), platforms=("cpu",))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(jn.__file__)))

# The fresh process: imports jax_nvfp4 (nothing else of ours), deserializes the artifact, rebuilds
# each call's arguments from their leaves with the artifact's own (deserialized) pytree structure,
# places them as the artifact's shardings say, runs it, and writes the outputs' bytes.
_RUNNER = r"""
import json, os, sys
import numpy as np
import jax, jax.numpy as jnp
import jax_nvfp4  # noqa: F401  (registers the pytree serializations and the custom calls)

d = sys.argv[1]
with open(os.path.join(d, "blob"), "rb") as f:
    exp = jax.export.deserialize(bytearray(f.read()))
with open(os.path.join(d, "calls.json")) as f:
    calls = json.load(f)
raw = np.load(os.path.join(d, "leaves.npz"))
mesh = None
if exp.nr_devices > 1:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:exp.nr_devices]), ("ep",))
    shardings = list(exp.in_shardings_jax(mesh))     # one per leaf (None: unconstrained)
outs = {}
for c, leaves in enumerate(calls):
    vals = [jnp.asarray(raw[f"{c}_{i}"].view(jnp.dtype(dt)).reshape(shape))
            for i, (dt, shape) in enumerate(leaves)]
    if mesh is not None:
        vals = [v if s is None else jax.device_put(v, s) for v, s in zip(vals, shardings)]
    args, kwargs = jax.tree.unflatten(exp.in_tree, vals)
    for j, o in enumerate(jax.tree.leaves(exp.call(*args, **kwargs))):
        outs[f"{c}_{j}"] = np.asarray(o).view(np.uint8)
np.savez(os.path.join(d, "outs.npz"), **outs)
print("OK")
"""


def _bytes(a) -> np.ndarray:
    a = np.asarray(a)
    return a.reshape(-1).view(np.uint8) if a.size else np.zeros((0,), np.uint8)


def run_fresh(tmp_path, exported, calls, devices=1):
    """Serialize ``exported``, run it in a new Python process on each ``(args, kwargs)`` of
    ``calls``; returns per call the list of output leaves (numpy, in the outputs' dtypes)."""
    (tmp_path / "blob").write_bytes(exported.serialize())
    meta, leaves_out = [], {}
    for c, (args, kwargs) in enumerate(calls):
        leaves = jax.tree.leaves((args, kwargs))
        meta.append([(str(jnp.asarray(v).dtype), list(np.shape(v))) for v in leaves])
        leaves_out.update({f"{c}_{i}": _bytes(v) for i, v in enumerate(leaves)})
    (tmp_path / "calls.json").write_text(json.dumps(meta))
    np.savez(tmp_path / "leaves.npz", **leaves_out)
    (tmp_path / "runner.py").write_text(_RUNNER)
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([ROOT] + [p for p in os.environ.get(
                   "PYTHONPATH", "").split(os.pathsep) if p]))
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={max(devices, 1)}"
    r = subprocess.run([sys.executable, "-P", str(tmp_path / "runner.py"), str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
    outs = np.load(tmp_path / "outs.npz")
    result = []
    for c, (args, kwargs) in enumerate(calls):
        ref = jax.eval_shape(exported.call, *args, **kwargs)
        result.append([outs[f"{c}_{j}"].view(o.dtype).reshape(o.shape)
                       for j, o in enumerate(jax.tree.leaves(ref))])
    return result


def assert_bitwise(got, want):
    want = np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(_bytes(got), _bytes(want))


# ------------------------------------------------------------------ the targets and their checks


def test_export_checks_name_every_versioned_target():
    checks = jn.export_checks()
    assert all(isinstance(c, jax.export.DisabledSafetyCheck) for c in checks)
    names = [c.is_custom_call() for c in checks]                 # the target name, or None
    assert set(_extension.TARGETS) <= set(names) and len(set(names)) == len(names)
    assert len(_extension.TARGETS) == 4                          # one grouped GEMM target for both modes
    for t in _extension.TARGETS:
        assert t.startswith("jax_nvfp4_") and t.endswith(f"_v{_extension.ABI_VERSION}")
    assert _extension.TARGET == "jax_nvfp4_grouped_gemm_v3"


@needs_ext
def test_extension_registers_exactly_the_versioned_targets():
    """ffi/module.cc's names and the package's are the same set (CPU; CUDA where built)."""
    ext = _extension.load()
    assert set(ext.cpu_registrations()) == set(_extension.TARGETS)
    if _extension.has_cuda():
        assert set(ext.cuda_registrations()) == set(_extension.TARGETS)


def test_stale_extension_is_refused_naming_the_targets():
    old = types.SimpleNamespace(__file__="/x/_jax_nvfp4.so",
                                cpu_registrations=lambda: {"jax_nvfp4_grouped_gemm": None})
    with pytest.raises(ImportError, match=r"does not register the custom calls "
                                          r"\[.*'jax_nvfp4_grouped_gemm_v3'.*ABI version 3"):
        _extension._check_abi(old)


def _gemm_case(rng, g=3, n=128, k=64, layout="checkpoint"):
    rhs = QUANTIZE_STACK(jnp.asarray(rng.standard_normal((g, n, k)), jnp.float32))
    if layout != "checkpoint":
        rhs = jax.jit(lambda w: jn.prepare_weights(w, layout))(rhs)
    return rhs


@needs_ext
def test_export_without_the_checks_is_refused(rng):
    """The checks are needed: jax.export refuses the custom call by name without them."""
    rhs = _gemm_case(rng)
    f = jax.jit(lambda x, w, gs: jn.grouped_gemm(x, w, gs, backend="ffi"))
    x = jnp.ones((8, 64), jnp.bfloat16)
    gs = jnp.array([3, 0, 5], jnp.int32)
    with pytest.raises(ValueError, match="jax_nvfp4_grouped_gemm_v3"):
        jax.export.export(f, platforms=("cpu",))(x, rhs, gs)


@needs_ext
def test_artifact_of_another_interface_version_fails_naming_the_target(rng, monkeypatch):
    """An artifact whose custom call is another version's (here v0, as a build of that version
    would have written it) does not run: compiling it names the missing target."""
    rhs = _gemm_case(rng)
    old = "jax_nvfp4_grouped_gemm_v0"
    monkeypatch.setattr(_extension, "TARGET", old)
    f = jax.jit(lambda x, w, gs: jn.grouped_gemm(x, w, gs, backend="ffi"))
    x = jnp.ones((8, 64), jnp.bfloat16)
    gs = jnp.array([3, 0, 5], jnp.int32)
    exp = jax.export.export(f, disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(old)],
                            platforms=("cpu",))(x, rhs, gs)
    assert old in exp.mlir_module()
    monkeypatch.undo()
    restored = jax.export.deserialize(exp.serialize())
    with pytest.raises(Exception, match=old):
        restored.call(x, rhs, gs)


# ------------------------------------------------------------------ pytree serialization


def _moe_weights(rng, e=4, h=128, i=128, shared=True):
    f = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.1, jnp.float32)  # noqa: E731
    return jax.jit(jn.quantize_moe)(f(e, h), f(e, 2 * i, h), f(e, h, i), router_bias=f(e) * 0.01,
                                    shared_w13=f(2 * i, h) if shared else None,
                                    shared_w2=f(h, i) if shared else None)


def _config(e=4, h=128, i=128, shared=True, **kw):
    return jn.MoEConfig.deepseek_v4_pro(num_experts=e, hidden_size=h, intermediate_size=i,
                                        n_shared_experts=1 if shared else 0, top_k=2, n_group=1,
                                        topk_group=1, **kw)


def test_library_pytrees_round_trip_through_serialization(rng):
    """Every argument type's structure (static layout, k order, expert ids, pairing, frozen
    metadata) survives serialize -> deserialize, and unflattens to an equal object."""
    w = _moe_weights(rng)
    prepared = jax.jit(jn.prepare_weights)(w)                    # sm90 layout, w13 paired
    subset = jn.MoEWeights(w.router_weight, w.w13, w.w2, expert_ids=(3, 1, 0, 2))
    rows = jax.jit(jn.fp8.quantize_rows)(jnp.ones((4, 128), jnp.float32))
    trees = [QUANTIZE(jnp.ones((4, 64))), prepared.w13, prepared, subset,
             jax.jit(lambda t: jn.prepare_weights(t, "fp8"))(w.w13), rows,
             FrozenMoEWeights.freeze(prepared), jn.ragged_rhs(prepared.w2)]
    for tree in trees:
        exp = jax.export.export(jax.jit(lambda t: jax.tree.leaves(t)[0]))(tree)
        back = jax.export.deserialize(exp.serialize())
        assert back.in_tree == exp.in_tree == jax.tree.structure(((tree,), {}))
        (rebuilt,), _ = jax.tree.unflatten(back.in_tree, jax.tree.leaves(tree))
        assert type(rebuilt) is type(tree)
        assert jax.tree.structure(rebuilt) == jax.tree.structure(tree)
    assert prepared.w13_paired and prepared.w13.layout == "sm90"


# ------------------------------------------------------------------ the entry points


@needs_ext
@pytest.mark.parametrize("layout", ["checkpoint", "sm90", "fp8"])
@pytest.mark.parametrize("lhs_kind", ["bf16", "nvfp4"])
def test_grouped_gemm_exports_with_a_symbolic_row_count(rng, tmp_path, layout, lhs_kind):
    """Exact mode on checkpoint and sm90 weights; the fp8 mode on fp8-prepared weights (whose
    workspace grows with M)."""
    k = 128 if layout == "fp8" else 64
    rhs = _gemm_case(rng, k=k, layout=layout)
    quant, precision = lhs_kind == "nvfp4", "fp8" if layout == "fp8" else "exact"
    f = jax.jit(lambda x, w, gs: jn.grouped_gemm(QUANTIZE(x) if quant else x, w, gs,
                                                 backend="ffi", precision=precision))
    m, = jax.export.symbolic_shape("m")
    exp = _export(f)(
        jax.ShapeDtypeStruct((m, k), jnp.bfloat16), rhs,
        jax.ShapeDtypeStruct((3,), jnp.int32))
    assert "jax_nvfp4_grouped_gemm_v3" in exp.mlir_module()     # both modes: one target
    calls = []
    for rows, gs in ((1, [1, 0, 0]), (7, [2, 0, 3]), (40, [17, 9, 14])):
        x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
        calls.append(((x, rhs, jnp.array(gs, jnp.int32)), {}))
    for (args, _), (got,) in zip(calls, run_fresh(tmp_path, exp, calls)):
        want = f(*args)
        assert_bitwise(got, want)
        assert np.abs(np.asarray(want, np.float32)).max() > 0


@needs_ext
@pytest.mark.parametrize("prepared", [False, True], ids=["checkpoint", "sm90-fused"])
@pytest.mark.parametrize("activation", ["w4a16", "w4a4"])
def test_moe_exports_with_a_symbolic_token_count(rng, tmp_path, prepared, activation):
    """One artifact, T symbolic, run at 1, 5 and 16 tokens in a fresh process: each equals the
    jitted layer at that T bit for bit (and the static-T artifact the same)."""
    w = _moe_weights(rng)
    if prepared:
        w = jn.prepare_weights(w)
    config = _config(activation=activation)
    f = jax.jit(lambda x, w: jn.moe(x, w, config, backend="ffi"))
    t, = jax.export.symbolic_shape("t")
    exp = _export(f)(
        jax.ShapeDtypeStruct((t, 128), jnp.bfloat16), w)
    if prepared:
        assert "jax_nvfp4_grouped_gemm_glu_v3" in exp.mlir_module()
    xs = [jnp.asarray(rng.standard_normal((n, 128)), jnp.bfloat16) for n in (1, 5, 16)]
    calls = [((x, w), {}) for x in xs]
    for x, (got,) in zip(xs, run_fresh(tmp_path, exp, calls)):
        assert_bitwise(got, f(x, w))
    static = _export(f)(xs[1], w)
    assert_bitwise(np.asarray(jax.export.deserialize(static.serialize()).call(xs[1], w)),
                   f(xs[1], w))


@needs_ext
def test_moe_expert_parallel_exports(rng, tmp_path):
    """Two devices: the artifact of the jitted expert-parallel layer (its shardings included)
    runs in a fresh process with two CPU devices and equals the jitted call bit for bit."""
    devs = cpu_devices(2)
    mesh = jax.sharding.Mesh(np.array(devs), ("ep",))
    config = _config()
    w = jn.shard_moe_weights(_moe_weights(rng), mesh, axis_name="ep")
    f = jax.jit(lambda x, w: jn.moe_expert_parallel(x, w, config, mesh, axis_name="ep",
                                                    backend="ffi"))
    x = jnp.asarray(rng.standard_normal((12, 128)), jnp.bfloat16)
    exp = _export(f)(x, w)
    assert exp.nr_devices == 2
    want = f(x, w)
    (got,), = run_fresh(tmp_path, exp, [((x, w), {})], devices=2)
    assert_bitwise(got, want)


_SHARD_MAP_SYMBOLIC = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("a",))
f = jax.jit(jax.shard_map(lambda x: x * 2.0, mesh=mesh, in_specs=P(), out_specs=P()))
t, = jax.export.symbolic_shape("t") if sys.argv[1] == "symbolic" else (3,)
exp = jax.export.export(f)(jax.ShapeDtypeStruct((t, 4), jnp.float32))
x = jax.device_put(jnp.ones((3, 4)), jax.sharding.NamedSharding(mesh, P()))
print(float(exp.call(x)[0, 0]))
"""


@needs_ext
def test_moe_expert_parallel_exports_with_a_symbolic_token_count(rng):
    """A symbolic T exports (the capacity ladder's static sizes give way to all rows). Running
    such an artifact needs a JAX that runs a shard_map program with a symbolic dimension on the
    CPU: jax 0.10.2 fails on the plain program above ("Error refining shapes"; with a matmul
    inside, SIGSEGV). So the test runs that program in a subprocess (with a static shape too, to
    show the probe right) and runs ours only where the symbolic one passes."""
    devs = cpu_devices(2)
    mesh = jax.sharding.Mesh(np.array(devs), ("ep",))
    config = _config()
    w = jn.shard_moe_weights(_moe_weights(rng), mesh, axis_name="ep")
    f = jax.jit(lambda x, w: jn.moe_expert_parallel(x, w, config, mesh, axis_name="ep",
                                                    backend="ffi"))
    t, = jax.export.symbolic_shape("t")
    exp = _export(f)(
        jax.ShapeDtypeStruct((t, 128), jnp.bfloat16), w)
    assert exp.in_avals[0].shape[0] == t
    probe = {kind: subprocess.run([sys.executable, "-P", "-c", _SHARD_MAP_SYMBOLIC, kind],
                                  capture_output=True, text=True, timeout=300,
                                  env=dict(os.environ, JAX_PLATFORMS="cpu"))
             for kind in ("static", "symbolic")}
    r = probe["static"]
    assert r.returncode == 0 and r.stdout.strip() == "2.0", r.stderr[-2000:]
    r = probe["symbolic"]
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or [""])[-3] if r.returncode > 0 \
            else f"signal {-r.returncode}"
        pytest.skip(f"jax {jax.__version__}: a plain shard_map program with a symbolic dimension "
                    f"does not run on the CPU ({why[:200]})")
    assert r.stdout.strip() == "2.0", r.stdout
    back = jax.export.deserialize(exp.serialize())
    for n in (3, 12):
        x = jnp.asarray(rng.standard_normal((n, 128)), jnp.bfloat16)
        assert_bitwise(np.asarray(back.call(x, w)), f(x, w))


@needs_ext
def test_moe_exports_for_cpu_and_cuda(rng):
    """One artifact for both platforms (the platform-dependent choices lowered per platform), run
    here on the CPU, equals the jitted layer; a CUDA-only artifact lowers without a GPU."""
    w = _moe_weights(rng)
    config = _config(activation="w4a4")
    f = jax.jit(lambda x, w: jn.moe(x, w, config, backend="ffi"))
    t, = jax.export.symbolic_shape("t")
    spec = jax.ShapeDtypeStruct((t, 128), jnp.bfloat16)
    exp = jax.export.export(f, disabled_checks=jn.export_checks(), platforms=("cpu", "cuda"))(
        spec, w)
    assert exp.platforms == ("cpu", "cuda")
    x = jnp.asarray(rng.standard_normal((7, 128)), jnp.bfloat16)
    got = jax.export.deserialize(exp.serialize()).call(x, w)
    assert_bitwise(np.asarray(got), f(x, w))
    cuda = jax.export.export(f, disabled_checks=jn.export_checks(), platforms=("cuda",))(spec, w)
    assert "jax_nvfp4_grouped_gemm_v3" in cuda.mlir_module()


# ------------------------------------------------------------------ issue 68


@pytest.mark.parametrize("backend,activation,scale", [
    ("reference", "w4a16", "dynamic"),
    pytest.param("reference", "w4a4", "static", marks=pytest.mark.slow),
    pytest.param("ffi", "w4a4", "static", marks=pytest.mark.slow)])
def test_moe_artifact_with_a_symbolic_token_count_runs(rng, backend, activation, scale):
    """An artifact of jn.moe with T symbolic is called (deserialized, here) at 1 and 6 tokens and
    equals the jitted layer bit for bit: W4A4 with static input scales (what
    MoEConfig.from_hf_config gives a ModelOpt NVFP4 checkpoint) and the reference backend, whose
    row gathers move uint32 words where the shapes are static."""
    if backend == "ffi" and not _extension.available():
        pytest.skip("the extension is not built")
    e = 4
    w = _moe_weights(rng, e=e, h=64, i=32)
    if scale == "static":
        w = jn.MoEWeights(**{**w.__dict__, "w13_input_scale": jnp.full((e,), 2 / 2688, jnp.float32),
                             "w2_input_scale": jnp.full((e,), 0.1 / 2688, jnp.float32),
                             "shared_w13_input_scale": jnp.float32(2 / 2688),
                             "shared_w2_input_scale": jnp.float32(0.1 / 2688)})
    config = _config(e=e, h=64, i=32, activation=activation, activation_scale=scale)
    f = jax.jit(lambda x, w: jn.moe(x, w, config, backend=backend))
    t, = jax.export.symbolic_shape("t")
    exp = _export(f)(jax.ShapeDtypeStruct((t, 64), jnp.bfloat16), w)
    back = jax.export.deserialize(exp.serialize())
    for n in (1, 6):
        x = jnp.asarray(rng.standard_normal((n, 64)), jnp.bfloat16)
        want = f(x, w)
        assert_bitwise(np.asarray(back.call(x, w)), want)
        assert np.abs(np.asarray(want, np.float32)).max() > 0


def test_take_rows_with_symbolic_shapes(rng):
    """rows.take_rows exported with a symbolic row count (of the table and of the indices) runs,
    equal to ``a[rows]``."""
    from jax_nvfp4.maths.rows import take_rows  # noqa: PLC0415
    m, = jax.export.symbolic_shape("m")
    a = jnp.asarray(rng.integers(0, 256, (9, 64)), jnp.uint8)
    rows = jnp.array([8, 0, 3, 3, 1], jnp.int32)
    f = jax.jit(take_rows)
    for spec in ((jax.ShapeDtypeStruct((m, 64), jnp.uint8), jax.ShapeDtypeStruct((5,), jnp.int32)),
                 (jax.ShapeDtypeStruct((9, 64), jnp.uint8), jax.ShapeDtypeStruct((m,), jnp.int32))):
        # for the CPU, where this module's tests run (on_cpu), whatever the default backend is
        back = jax.export.deserialize(jax.export.export(f, platforms=("cpu",))(*spec).serialize())
        np.testing.assert_array_equal(np.asarray(back.call(a, rows)), np.asarray(a)[np.asarray(rows)])


def test_serialized_pytree_names_are_pinned(rng):
    """An artifact names each library pytree type by its registered serialized name, with its
    auxdata bytes: a rename silently breaks every stored artifact, so the names and auxdata
    encodings are pinned here (read from the serialized bytes, and deserialized back)."""
    w = _moe_weights(rng, e=2, h=128, i=128, shared=False)
    w = jn.MoEWeights(w.router_weight, w.w13, w.w2, expert_ids=(3, 1), w13_paired=False)
    rows = jax.jit(jn.fp8.quantize_rows)(jnp.ones((2, 128), jnp.float32))
    tree = (w, rows, jax.jit(lambda t: jn.prepare_weights(t, "fp8"))(w.w2), jn.ragged_rhs(w.w2))
    exp = jax.export.export(jax.jit(lambda t: jax.tree.leaves(t)[0]))(tree)
    blob = bytes(exp.serialize())
    for name in ("NVFP4Tensor", "Fp8Rows", "Fp8Weights", "MoEWeights", "RaggedRhs"):
        assert f"jax_nvfp4.{name}".encode() in blob, name
    assert b"[[3, 1], false]" in blob and b"checkpoint" in blob and b"logical" in blob
    back = jax.export.deserialize(bytearray(blob))
    assert back.in_tree == jax.tree.structure(((tree,), {}))
