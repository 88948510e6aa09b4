#!/usr/bin/env bash
# Builds the full wheel (kernel self-test included) for the device machine here, so that a device
# call spends its time on tests and benchmarks instead of the ~150 s build. The device runs Python
# 3.12 with jax 0.11.2; the wheel is built as pip builds it, against the XLA FFI headers of the
# oldest supported jaxlib (pyproject.toml's build requirement), which every supported jax's XLA
# accepts (a newer jaxlib's handlers declare an FFI API version an older XLA refuses).
#   usage: tools/gpu/build_device_wheel.sh        (JAXLIB_HEADERS, PY312, VENV to override)
# then carry build/gpu/main/whl, build/gpu/main/gemm_selftest and .whl (pytest-xdist, execnet,
# hypothesis as cp312 wheels, fetched here) and run e.g. STEPS="deps install tests" tools/gpu/gpu_check.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
jaxlib_version=${JAXLIB_HEADERS:-$(sed -n "s/.*\"jaxlib==\([0-9.]*\); python_version < '3.15'\".*/\1/p" pyproject.toml)}
py=${PY312:-}
if [ -z "$py" ]; then  # python3.12 on PATH if it runs (a pyenv shim may not), else a pyenv 3.12
  for c in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
    "$c" -c "" >/dev/null 2>&1 && { py=$c; break; }
  done
fi
[ -n "$py" ] || { echo "no working python3.12 found (set PY312)" >&2; exit 1; }
venv=${VENV:-/tmp/jax_nvfp4_device_py312_headers}
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q --no-deps nvidia-cutlass==4.2.0.0 "jaxlib==$jaxlib_version"
  "$venv/bin/python" -m pip install -q scikit-build-core nanobind ninja cmake
fi
got=$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('jaxlib'))")
[ "$got" = "$jaxlib_version" ] || { echo "$venv has jaxlib $got, expected $jaxlib_version" >&2; exit 1; }
# the test plugins the device lacks, as Python 3.12 wheels (.whl/, ignored by git)
compgen -G ".whl/hypothesis-*cp312*.whl" >/dev/null || "$venv/bin/python" -m pip download -q --no-deps \
  --python-version 3.12 --only-binary=:all: -d .whl pytest-xdist execnet hypothesis sortedcontainers attrs
rm -rf build/gpu/main/whl
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$venv/bin/python" -m pip wheel -q --no-build-isolation --no-deps . \
  -w build/gpu/main/whl -Cbuild-dir=build/gpu/main -Ccmake.define.JAX_NVFP4_BUILD_TOOLS=ON
ls build/gpu/main/whl/jax_nvfp4-*-cp312-*.whl build/gpu/main/gemm_selftest
echo "carry: build/gpu/main/whl build/gpu/main/gemm_selftest .whl"
