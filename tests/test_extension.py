"""What the extension reports about its build (jax_nvfp4/_extension.py): the reason a build has no
CUDA handler and the exact command that builds it, extension_info()'s fields, and the build's
search for a CUDA toolkit laid out by NVIDIA's wheels (cmake/find_wheel_cuda.py)."""

import pathlib
import subprocess
import sys
import types

import pytest

import jax_nvfp4 as jn
from jax_nvfp4 import _extension

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _fake_ext(cuda, reason="", source=""):
    return types.SimpleNamespace(built_with_cuda=lambda: cuda, cuda_off_reason=lambda: reason,
                                 source_dir=lambda: source)


NO_NVCC = ("no nvcc was found at build time (none on the PATH, no CUDACXX, no nvidia-cuda-nvcc "
           "wheel in the building Python's site-packages)")


def test_no_cuda_message_gives_the_reason_and_the_command():
    msg = _extension.no_cuda_message(_fake_ext(False, NO_NVCC, str(ROOT)))
    assert msg == (f"jax_nvfp4 was built without the CUDA handler: {NO_NVCC}. To build it: pip "
                   f"install nvidia-cuda-nvcc && pip install --force-reinstall --no-deps {ROOT} "
                   "(or put a CUDA toolkit's nvcc on the PATH first)")


def test_no_cuda_message_of_a_build_that_turned_cuda_off():
    msg = _extension.no_cuda_message(
        _fake_ext(False, "the build set JAX_NVFP4_CUDA=OFF", str(ROOT)))
    assert msg.endswith(f"To build it: pip install --force-reinstall --no-deps {ROOT}"), msg


def test_no_cuda_message_without_the_source_folder(tmp_path):
    """A build from a folder that is gone (an sdist's temporary one): a placeholder, not a path
    that does not exist."""
    msg = _extension.no_cuda_message(_fake_ext(False, NO_NVCC, str(tmp_path / "gone")))
    assert "--no-deps <jax_nvfp4 source folder>" in msg and str(tmp_path) not in msg


def test_no_cuda_message_with_cuda_is_none():
    assert _extension.no_cuda_message(_fake_ext(True)) is None


def test_extension_info_is_consistent():
    info = jn.extension_info()
    if not info.built:
        assert info.cuda_reason is None and info.xla_ffi_api is None and info.reason
        return
    assert len(info.xla_ffi_api) == 2 and info.built_against_jaxlib
    if info.cuda:
        assert info.cuda_reason is None and info.cuda_compiler in ("path", "wheels"), info
        assert info.cuda_archs
    else:
        assert info.cuda_compiler is None and info.cuda_archs == ()
        assert info.cuda_reason.startswith("jax_nvfp4 was built without the CUDA handler: ")
        assert "To build it: pip install --force-reinstall --no-deps" in info.cuda_reason or (
            "pip install nvidia-cuda-nvcc && pip install --force-reinstall" in info.cuda_reason)


# --- cmake/find_wheel_cuda.py: where NVIDIA's wheels put a toolkit ---

TOOLKIT_FILES = ("bin/nvcc", "nvvm/bin/cicc", "include/cuda_runtime.h", "include/crt/host_config.h",
                 "lib/libcudart_static.a")
CCCL_FILES = ("include/cccl/nv/target", "include/cccl/cuda/std/cstdint")


def _site(tmp_path, name, files):
    root = tmp_path / name / "nvidia" / "cu13"
    for f in files:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text("")
    return tmp_path / name, root


def _find(what, *sites):
    script = ROOT / "cmake" / "find_wheel_cuda.py"
    code = (f"import sys; sys.path[:0] = {[str(s) for s in sites]!r}; sys.argv = ['x', {what!r}]; "
            f"exec(open({str(script)!r}).read())")
    return subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_find_wheel_toolkit(tmp_path):
    """The first site-packages holding every file nvcc needs (nvidia-cuda-nvcc with the runtime,
    nvvm and crt wheels it requires); an incomplete one is passed over."""
    partial, _ = _site(tmp_path, "partial", TOOLKIT_FILES[:-1])     # no runtime library
    full, root = _site(tmp_path, "full", TOOLKIT_FILES)
    assert _find("toolkit", partial, full) == str(root.resolve())
    assert _find("toolkit", partial) == ""


@pytest.mark.parametrize("missing", TOOLKIT_FILES)
def test_find_wheel_toolkit_needs_every_part(tmp_path, missing):
    site, _ = _site(tmp_path, "s", [f for f in TOOLKIT_FILES if f != missing])
    assert _find("toolkit", site) == ""


def test_find_wheel_cccl(tmp_path):
    site, root = _site(tmp_path, "s", CCCL_FILES)
    assert _find("cccl", site) == str(root.resolve() / "include" / "cccl")
    assert _find("cccl", _site(tmp_path, "t", CCCL_FILES[:1])[0]) == ""
