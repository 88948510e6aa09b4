"""The supported jax range (jax_nvfp4/_jax_range.py): what pyproject.toml and the README state, the
refusal of a jax older than the range and of handlers built against newer XLA FFI headers than
the running jaxlib (both before anything is registered, leaving JAX usable), and one wheel
running a GEMM and the layer under the oldest and the newest supported jax."""

import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
import zipfile

import pytest

import jax_nvfp4 as jn
from jax_nvfp4 import _jax_range

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.mark.parametrize("text, want", [
    ("0.10.0", (0, 10, 0)), ("0.12.0.1", (0, 12, 0, 1)), ("0.13.0.dev20261201", (0, 13, 0)),
    ("0.11.2rc1", (0, 11, 2)), ("1", (1,))])
def test_version_tuple(text, want):
    assert _jax_range.version_tuple(text) == want


def test_pyproject_and_readme_state_the_range():
    """pyproject.toml's dependency is the range the import checks; its build requirements pin the
    oldest jaxlib of the range (for Pythons it has wheels for); the README says the same."""
    deps = PYPROJECT["project"]["dependencies"]
    assert f"jax{_jax_range.SUPPORTED}" in deps, deps
    oldest = ".".join(map(str, _jax_range.JAX_MIN))
    build = PYPROJECT["build-system"]["requires"]
    assert f"jaxlib=={oldest}; python_version < '3.15'" in build, build
    readme = " ".join((ROOT / "README.md").read_text().split())
    below = _jax_range.JAX_BELOW
    assert f"jax {oldest} to {below[0]}.{below[1] - 1}.x" in readme
    assert "Python 3.11 to 3.15" in readme and PYPROJECT["project"]["requires-python"] == ">=3.11"


def test_older_jax_is_refused():
    with pytest.raises(ImportError, match=r"needs jax >=0\.10\.0,<0\.13; the installed jax is 0\.9\.2"):
        _jax_range.check_jax("0.9.2")
    for ok in ("0.10.0", "0.11.2", "0.12.1", "0.13.0"):   # newer: XLA keeps older handlers working
        _jax_range.check_jax(ok)


@pytest.mark.parametrize("handlers, framework, ok", [
    ((0, 3), (0, 3), True), ((0, 3), (0, 5), True), ((0, 4), (0, 3), False), ((0, 5), (0, 4), False),
    ((1, 0), (0, 5), False), ((0, 3), (1, 0), False)])
def test_ffi_api_check(handlers, framework, ok):
    """XLA's rule: the same major version, the handlers' minor at most the framework's."""
    if ok:
        _jax_range.check_ffi_api(handlers, "0.10.0", framework=framework)
        return
    with pytest.raises(ImportError) as e:
        _jax_range.check_ffi_api(handlers, "0.12.1", "/src", framework=framework)
    msg = str(e.value)
    assert (f"jaxlib 0.12.1 (FFI API {handlers[0]}.{handlers[1]})" in msg
            and f"has FFI API {framework[0]}.{framework[1]}" in msg
            and "pip install --force-reinstall --no-deps /src" in msg), msg


def test_this_build_declares_an_api_the_running_jaxlib_accepts():
    info = jn.extension_info()
    if not info.built:
        pytest.skip(f"extension not built: {info.reason}")
    framework = _jax_range.framework_ffi_api_version()
    assert framework is not None, "the installed jaxlib ships no readable XLA FFI headers"
    assert info.xla_ffi_api[0] == framework[0] and info.xla_ffi_api[1] <= framework[1]
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.\d+)?", info.built_against_jaxlib)


# The refusals in a fresh process: JAX's backends are not started, registrations are recorded.
_REFUSAL = """
import jax, jax.numpy as jnp
registered = []
jax.ffi.register_ffi_target = lambda *a, **k: registered.append(a[0])
{patch}
try:
    import jax_nvfp4
except ImportError as e:
    print("IMPORT-ERROR", e)
else:
    print("IMPORTED")
print("REGISTERED", registered)
print("JAX-WORKS", float(jax.jit(lambda a: (a * 2).sum())(jnp.arange(4.0))))
"""


def _run_refusal(patch):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, "-c", _REFUSAL.format(patch=textwrap.dedent(patch))],
                         capture_output=True, text=True, env=env, timeout=300, cwd=ROOT / "tests")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "REGISTERED []" in lines and "JAX-WORKS 12.0" in lines, out.stdout
    [err] = [ln for ln in lines if ln.startswith("IMPORT-ERROR")]
    return err


def test_import_with_an_older_jax_is_refused_before_registering():
    err = _run_refusal('jax.__version__ = "0.9.2"')
    assert "needs jax >=0.10.0,<0.13; the installed jax is 0.9.2" in err, err
    assert 'pip install "jax>=0.10.0,<0.13"' in err


def test_import_of_handlers_newer_than_jaxlib_is_refused_before_registering(tmp_path):
    """The installed jaxlib's headers made to declare FFI API 0.2 (older than any build's): the
    import refuses the handlers, naming both versions, and JAX stays usable."""
    if not jn.extension_info().built:
        pytest.skip("extension not built")
    header = tmp_path / "jaxlib" / "include" / "xla" / "ffi" / "api" / "c_api.h"
    header.parent.mkdir(parents=True)
    header.write_text("#define XLA_FFI_API_MAJOR 0\n#define XLA_FFI_API_MINOR 2\n")
    err = _run_refusal(f"""
        import importlib.machinery, importlib.util
        _find = importlib.util.find_spec
        def find_spec(name, *a):
            if name != "jaxlib":
                return _find(name, *a)
            spec = importlib.machinery.ModuleSpec("jaxlib", None, is_package=True)
            spec.submodule_search_locations = [{str(tmp_path / "jaxlib")!r}]
            return spec
        importlib.util.find_spec = find_spec
        """)
    api = jn.extension_info().xla_ffi_api
    assert f"(FFI API {api[0]}.{api[1]})" in err and "has FFI API 0.2 and would refuse" in err, err
    assert "Nothing was registered with JAX" in err


# --- one wheel, the oldest and the newest supported jax ---

def _python312():
    """A Python 3.12 interpreter (the wheel's and both jax versions' Python): JAX_NVFP4_PY312,
    python3.12 on the PATH, or a pyenv 3.12."""
    cands = [os.environ.get("JAX_NVFP4_PY312", ""), shutil.which("python3.12") or ""]
    cands += sorted(str(p) for p in pathlib.Path(os.path.expanduser("~/.pyenv/versions")).glob(
        "3.12*/bin/python3.12"))
    for c in cands:
        if c and subprocess.run([c, "-c", ""], capture_output=True).returncode == 0:
            return c
    return None


def _venv(py, where, *packages):
    subprocess.run([py, "-m", "venv", str(where)], check=True)
    pip = [str(where / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + list(packages), check=True, timeout=900)
    return where / "bin" / "python"


@pytest.mark.slow
def test_one_wheel_runs_on_the_oldest_and_newest_jax(tmp_path):
    """One wheel (JAX_NVFP4_WHEEL, a cp312 wheel .ci/run builds; else built here, CPU only,
    the way pip builds it) in fresh Python 3.12 environments: with jax 0.10.0 and with the newest
    jax pip picks in the range, its handlers register and a GEMM and the layer match the float64
    oracles through the custom calls; with jax 0.9.2 the import is refused and JAX still works.
    JAX_NVFP4_NEWEST_PYTHON: an environment that already holds that wheel with the newest jax
    (.ci/run's Python 3.12 one), used instead of a new one for the newest. Needs PyPI (or a pip
    cache)."""
    py = _python312()
    if py is None:
        pytest.skip("no Python 3.12 interpreter (set JAX_NVFP4_PY312)")
    wheel = os.environ.get("JAX_NVFP4_WHEEL")
    if not wheel:
        subprocess.run([py, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"),
                        "-Ccmake.define.JAX_NVFP4_CUDA=OFF", f"-Cbuild-dir={tmp_path / 'build'}",
                        str(ROOT)], check=True, timeout=1800)
        [wheel] = (tmp_path / "dist").glob("jax_nvfp4-*.whl")
    with zipfile.ZipFile(wheel) as z:
        [so] = [n for n in z.namelist() if n.startswith("jax_nvfp4/_jax_nvfp4") and n.endswith(".so")]
        so_sha256 = hashlib.sha256(z.read(so)).hexdigest()
    oldest = ".".join(map(str, _jax_range.JAX_MIN))
    seen = {}
    for name, pins in (("oldest", [f"jax=={oldest}"]), ("newest", [])):
        python = os.environ.get("JAX_NVFP4_NEWEST_PYTHON") if name == "newest" else None
        python = python or _venv(py, tmp_path / name, str(wheel), *pins)
        out = subprocess.run([str(python), str(ROOT / "tests" / "jax_range_check.py")],
                             capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        seen[name] = got = json.loads(out.stdout.strip().splitlines()[-1])
        print(name, got)
        assert got["handlers_ffi_api"][1] <= got["jaxlib_ffi_api"][1]
        assert got["extension_sha256"] == so_sha256, f"{name}: not the wheel's extension"
    assert seen["oldest"]["jax"] == oldest
    newest = _jax_range.version_tuple(seen["newest"]["jax"])
    assert _jax_range.JAX_MIN < newest < _jax_range.JAX_BELOW, seen["newest"]
    assert seen["oldest"]["handlers_ffi_api"] == seen["newest"]["handlers_ffi_api"]  # one wheel
    # a jax older than the range, forced in (pip would refuse): a clear refusal, JAX usable
    python = tmp_path / "oldest" / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "--no-deps", "jax==0.9.2", "jaxlib==0.9.2"], check=True, timeout=900)
    out = subprocess.run([str(python), "-c", _REFUSAL.format(patch="")], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "IMPORT-ERROR jax_nvfp4 needs jax >=0.10.0,<0.13; the installed jax is 0.9.2" in out.stdout
    assert "JAX-WORKS 12.0" in out.stdout and "REGISTERED []" in out.stdout, out.stdout
