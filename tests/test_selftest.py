"""The CUDA kernels' own self-test (tools/bench/gemm_selftest.cu: the exact-mode families'
configurations, on edge-case group sizes, against a float64 reference; the FP8 families are checked
by tests/test_fp8.py and tools/gpu/fp8_check.py), built from CMake with the
extension's flags (JAX_NVFP4_BUILD_TOOLS=ON) and run on the small shapes.

GPU only. JAX_NVFP4_SELFTEST=<path> runs an already built binary (tools/gpu/gpu_check.sh builds it
with the wheel); otherwise the test configures and builds the target itself, which needs cmake,
nvcc and the CUTLASS headers (skipped without them, a failure under JAX_NVFP4_REQUIRE_GPU=1)."""

import os
import shutil
import subprocess
import sys

import pytest

from conftest import gpu_devices, skip_or_fail

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def selftest(tmp_path_factory):
    if not gpu_devices():
        skip_or_fail("no GPU: the kernel self-test does not run")
    path = os.environ.get("JAX_NVFP4_SELFTEST")
    if path:
        assert os.access(path, os.X_OK), f"JAX_NVFP4_SELFTEST={path} is not an executable"
        return path
    cmake, nvcc = shutil.which("cmake"), shutil.which("nvcc")
    if cmake is None or nvcc is None:
        skip_or_fail("cmake or nvcc not found: the kernel self-test cannot be built")
    build = tmp_path_factory.mktemp("selftest_build")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    r = subprocess.run([cmake, "-S", ROOT, "-B", str(build), *gen, "-DCMAKE_BUILD_TYPE=Release",
                        "-DJAX_NVFP4_BUILD_TOOLS=ON", f"-DPython_EXECUTABLE={sys.executable}"],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        skip_or_fail("cmake could not configure the self-test build:\n" + r.stdout[-2000:] + r.stderr[-2000:])
    r = subprocess.run([cmake, "--build", str(build), "--target", "gemm_selftest", "-j", str(os.cpu_count() or 2)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return str(build / "gemm_selftest")


@pytest.mark.parametrize("layout", ["checkpoint", "sm90"])
def test_kernel_selftest_small(selftest, layout):
    r = subprocess.run([selftest, "--small", "--no-bench", "--kernel", "both", "--layout", layout],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "SELFTEST PASSED" in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]
