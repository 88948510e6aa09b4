#!/usr/bin/env bash
# On a GPU machine with jax[cuda], nanobind, scikit-build-core and pytest preinstalled and no
# package registry: install the extension from this working tree (CUTLASS headers from a carried
# nvidia-cutlass wheel), run the GPU tests, the CUDA self-test (once under compute-sanitizer),
# and the benchmark; print a summary table last. Logs go to $OUT (or ./gpu-check-out).
#   usage: tools/gpu_check.sh [wheel-dir (default .cutlass_wheel)] [bench args...]
set -uo pipefail
cd "$(dirname "$0")/.."
wheels=${1:-.cutlass_wheel}; shift || true
out=${OUT:-gpu-check-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
summary=()
step() { local name=$1; shift; local t0=$SECONDS
  if "$@" >"$out/$name.log" 2>&1; then summary+=("$name|ok|$((SECONDS - t0)) s")
  else summary+=("$name|FAILED (rc $?)|$((SECONDS - t0)) s"); fi
  tail -n 25 "$out/$name.log"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
step install bash -c "python3 -m pip install -q --no-index --no-deps $wheels/nvidia_cutlass-*.whl &&
  python3 -m pip install -v --no-index --no-deps --no-build-isolation . 2>&1 |
  grep -E 'jax_nvfp4|ptxas|error|warning: |Successfully' ; test \${PIPESTATUS[0]} -eq 0"
step cuda_handler python3 -P -c "import jax_nvfp4._extension as e; assert e.has_cuda(), 'no CUDA handler'; print('CUDA handler built')"
step tests env JAX_NVFP4_REQUIRE_GPU=1 python3 -P -m pytest -q -p no:cacheprovider \
  tests/test_gemm.py tests/test_moe.py
if [ -f tools/gemm_selftest.cu ]; then
  cutlass_inc=$(python3 -c "import cutlass_library,os;print(os.path.join(os.path.dirname(cutlass_library.__file__),'source'))")
  step selftest_build nvcc -std=c++17 -O3 -Xcompiler -fopenmp -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
    -I. -I"$cutlass_inc/include" -I"$cutlass_inc/tools/util/include" -o /tmp/gemm_selftest \
    tools/gemm_selftest.cu csrc/grouped_gemm_sm90.cu csrc/grouped_gemm_sm90_wgmma.cu
  step selftest /tmp/gemm_selftest --no-bench --kernel both
  step memcheck compute-sanitizer --tool memcheck --error-exitcode 1 /tmp/gemm_selftest --small --no-bench --kernel both
fi
step bench python3 -P -m jax_nvfp4.bench --out "$out" --check "$@"
echo
echo "== bench =="; sed -n '/^case /,$p' "$out/bench.log"
echo "== summary =="
for row in "${summary[@]}"; do IFS='|' read -r a b c <<<"$row"; printf '%-16s %-18s %s\n' "$a" "$b" "$c"; done
