"""jax_nvfp4.config.options: every option vocabulary has its one home there (the modules that use one take
that very object), and ``precision`` is checked once where it enters the public API and passed
down as a checked :class:`~jax_nvfp4.config.options.Precision`."""

import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as jn
from jax_nvfp4 import _extension, checkpoint
from jax_nvfp4.ops import fp8, gemm
from jax_nvfp4.maths import formats
from jax_nvfp4.config import kernel_config, options
from jax_nvfp4.layer import sharding
from conftest import QUANTIZE_STACK


def test_vocabularies_live_in_options():
    assert sharding.COMBINES is options.COMBINES == ("psum", "psum_scatter")
    assert fp8.FP8_K_ORDERS is formats.FP8_K_ORDERS is options.FP8_K_ORDERS
    assert checkpoint.FORMATS is options.CHECKPOINT_FORMATS == ("modelopt", "quark")
    assert kernel_config.FAMILIES is options.FAMILIES
    assert kernel_config.FP8_FAMILIES is options.FP8_FAMILIES
    assert set(options.FP8_FAMILIES) <= set(options.FAMILIES)
    assert kernel_config.LAYOUT_CODES is options.LAYOUT_CODES
    assert not hasattr(gemm, "RHS_LAYOUT_CODES")                  # no second layout -> code map
    assert set(options.LAYOUT_CODES) == set(options.WEIGHT_LAYOUTS)
    assert sorted(options.LAYOUT_CODES.values()) == list(range(len(options.LAYOUT_CODES)))


def test_codes_come_from_the_compiled_module():
    ext = _extension.compiled_module()
    if ext is None:
        pytest.skip("the compiled extension is not built")
    assert options.FAMILY_CODES == ext.family_codes()
    assert options.FP8_FAMILIES == tuple(ext.fp8_families())
    assert options.LAYOUT_CODES == ext.layout_codes()
    assert options.FAMILIES == tuple(sorted(ext.family_codes(), key=ext.family_codes().get))
    # the copies a package without the extension uses are the module's (the C++ enums)
    assert options.contract_codes(None) == options.contract_codes(ext)
    # and what a configuration's attributes and the heuristic's family mask send back agree
    for c in kernel_config.kernel_configs():
        assert c.attributes()["kernel"] == ext.family_codes()[c.family]
    with pytest.raises(ValueError, match=r"families: expected names from \('mma'"):
        kernel_config.choose(64, 128, 128, 2, arch=90, families=("mma", "tensor"))


def test_package_imports_without_the_extension():
    # A child interpreter where the compiled module cannot be imported: the package imports, its
    # option vocabularies are the copies, and the reference backend runs.
    code = ("import sys; sys.modules['jax_nvfp4._jax_nvfp4'] = None\n"
            "import jax_nvfp4 as jn, jax.numpy as jnp\n"
            "from jax_nvfp4 import _extension\nfrom jax_nvfp4.config import options\n"
            "assert _extension.compiled_module() is None and not _extension.available()\n"
            "assert options.FAMILY_CODES == options._FAMILY_CODES_UNBUILT\n"
            "assert options.LAYOUT_CODES == options._LAYOUT_CODES_UNBUILT\n"
            "print((options.FAMILIES, options.FP8_FAMILIES, sorted(options.LAYOUT_CODES.items())))\n"
            "w = jn.quantize(jnp.ones((1, 16, 32), jnp.bfloat16))\n"
            "out = jn.grouped_gemm(jnp.ones((2, 32), jnp.bfloat16), w, jnp.array([2], jnp.int32),\n"
            "                      backend='reference')\n"
            "assert out.shape == (2, 16)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=str(Path(jn.__file__).parents[1]))
    assert r.returncode == 0, r.stderr[-2000:]
    # the same vocabularies as this (built, where it is) process's
    assert r.stdout.split("\n")[0] == str((options.FAMILIES, options.FP8_FAMILIES,
                                           sorted(options.LAYOUT_CODES.items())))


@pytest.mark.parametrize("bad", ["fp16", "FP8", "", None, 8, b"fp8"])
def test_check_precision_refuses_naming_the_argument(bad):
    with pytest.raises(ValueError, match=r"precision: expected one of \('exact', 'fp8'\)"):
        options.check_precision(bad)
    with pytest.raises(ValueError, match="mode: expected one of"):
        options.check_precision(bad, name="mode")


def test_precision_is_its_name():
    for name in options.PRECISIONS:
        p = options.check_precision(name)
        assert isinstance(p, options.Precision) and p == name and hash(p) == hash(name)
        assert repr(p) == repr(name) and f"{p}" == name and str(p) == name
        assert options.check_precision(p) is p                     # not checked, not rebuilt
        assert pickle.loads(pickle.dumps(p)) == name
    assert options.EXACT == "exact" and options.FP8 == "fp8"
    assert options.check_precision("fp8", 256) == "fp8" and options.check_precision("exact", 96)
    with pytest.raises(ValueError, match="K=96: precision='fp8' needs K to be a multiple of 128"):
        options.check_precision(options.FP8, 96)                 # a checked value: K still checked


def test_fp8_k_check_names_the_argument():
    """K must be a multiple of 128 under precision='fp8'; the error names the option (by default
    ``precision``, or the name the caller gives) and says why."""
    options.check_fp8_k(128)
    options.check_fp8_k(256 * 3)
    with pytest.raises(ValueError, match=r"^K=160: precision='fp8' needs K to be a multiple of "
                                         r"128 \(one activation scale per 128-wide k chunk\)$"):
        options.check_fp8_k(160)
    with pytest.raises(ValueError, match=r"^K=96: config.precision='fp8' needs K"):
        options.check_precision("fp8", 96, name="config.precision")
    with pytest.raises(ValueError, match=r"^K=64: mode='fp8' needs K"):
        options.check_fp8_k(64, "mode")


def test_resolve_backend(monkeypatch):
    """docs/usage.md: backend "ffi" runs the custom call (a RuntimeError saying why when the
    extension is not built), "reference" the pure-jnp reference always, "auto" the custom call
    where it can run (on this CPU with the extension built) and else the reference."""
    assert options.resolve_backend("reference") == "reference"
    if _extension.available() and jax.default_backend() == "cpu":
        assert options.resolve_backend("ffi") == "ffi"
        assert options.resolve_backend("auto") == "ffi"
    with pytest.raises(ValueError, match="backend: expected one of"):
        options.resolve_backend("AUTO")
    monkeypatch.setattr(_extension, "available", lambda: False)
    monkeypatch.setattr(options, "_warned_fallback", True)       # the warning: below
    assert options.resolve_backend("reference") == "reference"  # needs no extension
    assert options.resolve_backend("auto") == "reference"
    with pytest.raises(RuntimeError, match="backend='ffi': "):
        options.resolve_backend("ffi")


# on_a_gpu as a bool: a parameter "gpu" would mark the test as needing one (conftest.py)
@pytest.mark.parametrize("built, cuda, on_a_gpu, want", [
    (True, False, False, "ffi"), (True, True, True, "ffi"), (True, False, True, "reference"),
    (False, False, False, "reference"), (False, False, True, "reference")])
def test_auto_backend_falls_back_once_with_a_warning(monkeypatch, built, cuda, on_a_gpu, want):
    """backend="auto" runs the custom call where it can (the CPU handler on CPU, the CUDA handler
    on a GPU) and otherwise the reference, warning once per process (a RuntimeWarning saying why,
    pointing at the user's call); "reference" never warns."""
    monkeypatch.setattr(_extension, "available", lambda: built)
    monkeypatch.setattr(_extension, "has_cuda", lambda: built and cuda)
    no_cuda = "jax_nvfp4 was built without the CUDA handler: <why>. To build it: <command>"
    monkeypatch.setattr(_extension, "no_cuda_message", lambda: no_cuda if built and not cuda else None)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu" if on_a_gpu else "cpu")
    monkeypatch.setattr(options, "_warned_fallback", False)
    if want == "ffi":
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert options.resolve_backend("auto") == "ffi"
        assert options._warned_fallback is False
        return
    why = no_cuda if built else _extension.not_built_message()
    rhs = QUANTIZE_STACK(jax.random.normal(jax.random.key(0), (2, 32, 32), jnp.float32))
    x, sizes = jnp.ones((4, 32), jnp.bfloat16), jnp.array([1, 3], jnp.int32)
    with pytest.warns(RuntimeWarning) as record:
        jn.grouped_gemm(x, rhs, sizes, backend="auto")
    [w] = record.list
    assert str(w.message).startswith("jax_nvfp4: grouped_gemm falls back to the pure-jnp "
                                     "reference (slow): ") and why in str(w.message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                            # once: no second warning
        assert options.resolve_backend("auto") == "reference"
        assert options.resolve_backend("reference") == "reference"


def test_fallback_warning_names_the_calling_line(monkeypatch):
    """The fallback warning points at the user's line, eager or traced (through the autodiff
    wrapper and JAX's frames)."""
    monkeypatch.setattr(_extension, "available", lambda: False)
    rhs = QUANTIZE_STACK(jax.random.normal(jax.random.key(0), (2, 32, 32), jnp.float32))
    x, sizes = jnp.ones((4, 32), jnp.bfloat16), jnp.array([1, 3], jnp.int32)
    monkeypatch.setattr(options, "_warned_fallback", False)
    with pytest.warns(RuntimeWarning) as record:
        jn.grouped_gemm(x, rhs, sizes, backend="auto")
    line = sys._getframe().f_lineno - 1
    assert [(w.filename, w.lineno) for w in record.list] == [(__file__, line)]
    monkeypatch.setattr(options, "_warned_fallback", False)
    with pytest.warns(RuntimeWarning) as record:
        jax.jit(lambda a: jn.grouped_gemm(a, rhs, sizes, backend="auto")).lower(x)
    line = sys._getframe().f_lineno - 1
    assert [(w.filename, w.lineno) for w in record.list] == [(__file__, line)]


def test_moe_config_stores_a_checked_precision():
    c = jn.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128,
                     precision="fp8")
    assert isinstance(c.precision, options.Precision) and c.precision == "fp8"
    assert c == jn.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128,
                             precision=options.FP8)
    with pytest.raises(ValueError, match="precision: expected one of"):
        jn.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128,
                     precision="fp4")


@pytest.fixture
def counted(monkeypatch):
    """The number of times a precision string is checked against PRECISIONS (or the layer's
    LAYER_PRECISIONS)."""
    calls = []
    real = options.check_choice

    def check_choice(value, choices, name):
        if choices in (options.PRECISIONS, options.LAYER_PRECISIONS):
            calls.append(value)
        return real(value, choices, name)

    monkeypatch.setattr(options, "check_choice", check_choice)
    return calls


@pytest.mark.parametrize("precision", ["exact", "fp8"])
@pytest.mark.parametrize("backend", ["ffi", "reference"])
def test_grouped_gemm_checks_precision_once_per_trace(counted, precision, backend):
    rhs = QUANTIZE_STACK(jax.random.normal(jax.random.key(0), (2, 128, 128), jnp.float32))
    x = jnp.ones((8, 128), jnp.bfloat16)
    sizes = jnp.array([3, 5], jnp.int32)
    f = jax.jit(lambda a: jn.grouped_gemm(a, rhs, sizes, precision=precision, backend=backend))
    f.lower(x)
    assert counted == [precision]
    counted.clear()
    jn.grouped_gemm(x, rhs, sizes, precision=options.check_precision(precision), backend=backend)
    assert counted == [precision]                    # the explicit check above, none inside


@pytest.mark.parametrize("precision", ["fp8", "auto"])
def test_the_layer_checks_precision_when_the_config_is_built(counted, precision):
    """Once, when the config is built; "auto" resolved for a call (to fp8 at 64 tokens) is not
    checked again."""
    rng = np.random.default_rng(0)
    f = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.1  # noqa: E731
    w = jn.quantize_moe(f(4, 128), f(4, 256, 128), f(4, 128, 128))
    c = jn.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128,
                     precision=precision, activation="w4a16")
    assert counted == [precision]
    counted.clear()
    jax.jit(lambda x: jn.moe(x, w, c, backend="ffi")).lower(jnp.ones((64, 128), jnp.bfloat16))
    assert counted == []


def test_check_choice():
    """The one check of every vocabulary: the value back, or a ValueError naming the argument."""
    for layout in ("checkpoint", "sm90"):
        assert options.check_choice(layout, options.LAYOUTS, "rhs.layout") == layout
    for bad in ("fp8", "SM90", "", None, 1):
        with pytest.raises(ValueError, match=r"^rhs.layout: expected one of \('checkpoint', "
                                             r"'sm90'\)"):
            options.check_choice(bad, options.LAYOUTS, "rhs.layout")


def test_a_resolved_backend_is_not_resolved_again(monkeypatch):
    """resolve_backend returns a Backend; given one, it returns it as is, checking nothing (even
    where a fresh resolution would now differ)."""
    b = options.resolve_backend("reference")
    assert isinstance(b, options.Backend) and b == "reference" and hash(b) == hash("reference")
    monkeypatch.setattr(options, "check_choice", lambda *a: pytest.fail("checked again"))
    assert options.resolve_backend(b) is b
    assert options.resolve_backend(options.FFI) is options.FFI


@pytest.fixture
def option_checks(monkeypatch):
    """Every option check made: ``(name, value)`` for each vocabulary check (``check_choice``:
    backends, precisions, layouts, ...) and each check of an operand against the precision
    (``gemm_args.check_lhs_precision``/``check_rhs_precision``, as every module calls them)."""
    import importlib  # noqa: PLC0415
    gemm_args, moe, reference = (importlib.import_module(f"jax_nvfp4.{m}")   # (jn.moe: the function)
                                 for m in ("gemm_args", "moe", "reference"))
    calls = []
    real_choice = options.check_choice
    monkeypatch.setattr(options, "check_choice", lambda value, choices, name: (
        calls.append((name, value)), real_choice(value, choices, name))[1])
    for fn in ("check_lhs_precision", "check_rhs_precision"):
        real = getattr(gemm_args, fn)
        for mod in (gemm_args, gemm, moe, reference):
            if getattr(mod, fn, None) is real:
                monkeypatch.setattr(mod, fn, lambda *a, _real=real, _fn=fn, **k: (
                    calls.append((_fn, a[1])), _real(*a, **k))[1])
    return calls


@pytest.mark.parametrize("precision,shared,paired", [("exact", True, True), ("fp8", True, False)])
def test_moe_checks_each_option_once_per_trace(option_checks, precision, shared, paired):
    """A ``jn.moe`` trace checks its options once, at its entry: the backend once (resolved, then
    passed down as a Backend), the precision not at all (MoEConfig checked it when built), and
    each weight against the precision once (validate_moe); the GEMMs below check none of them
    again. (Before this was so, a trace made 10 such checks for two exact GEMMs, 24 for four fp8
    ones: 4 backend and 2 operand checks per GEMM.)"""
    rng = np.random.default_rng(0)
    f = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.1  # noqa: E731
    w = jn.quantize_moe(f(4, 128), f(4, 256, 128), f(4, 128, 128),
                        **(dict(shared_w13=f(256, 128), shared_w2=f(128, 128)) if shared else {}))
    if paired:
        w = jn.prepare_weights(w, "checkpoint")
    c = jn.MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128,
                     precision=precision, n_shared_experts=int(shared))
    n_weights = 4 if shared else 2
    for backend in ("reference", "ffi"):
        option_checks.clear()
        jax.jit(lambda x: jn.moe(x, w, c, backend=backend)).lower(jnp.ones((4, 128), jnp.bfloat16))
        assert option_checks == ([("backend", backend)] + [("check_rhs_precision", precision)]
                                 * n_weights), option_checks
