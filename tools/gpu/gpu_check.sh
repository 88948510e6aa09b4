#!/usr/bin/env bash
# One GPU session's validation: install from this tree (CUTLASS headers from the carried wheel),
# GPU tests with the default kernel choice and with JAX_NVFP4_KERNEL=wgmma (v2 wherever it can
# run), the self-test (small shapes, both kernels, both weight layouts) under compute-sanitizer, the
# benchmark, and with 2+ GPUs the multi-GPU tests and the expert-parallel benchmark. Logs in $OUT.
#   usage: tools/gpu_check.sh [bench args...]   (~15 min on an H200: more than one 10-minute
#   device call; STEPS="install tests_auto tests_wgmma" runs only the named steps, e.g. split in two;
#   on 8 GPUs: STEPS="install tests_gpus bench_ep")
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-check-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
summary=()
step() { local name=$1 lim=$2; shift 2; local t0=$SECONDS
  [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]] && return 0
  if timeout "$lim" "$@" >"$out/$name.log" 2>&1; then summary+=("$name|ok|$((SECONDS - t0)) s")
  else summary+=("$name|FAILED (rc $?)|$((SECONDS - t0)) s"); fi
  tail -n 4 "$out/$name.log"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
step install 150 bash -c "python3 -m pip install -q --no-index --no-deps .cutlass_wheel/nvidia_cutlass-*.whl &&
  python3 -m pip install -q --no-index --no-deps --no-build-isolation ."
step tests_auto 540 env JAX_NVFP4_REQUIRE_GPU=1 python3 -P -m pytest -q -p no:cacheprovider tests/test_gemm.py tests/test_moe.py -k "not cpu"
inc=$(python3 -c "import cutlass_library,os;print(os.path.join(os.path.dirname(cutlass_library.__file__),'source'))")
step selftest_build 60 nvcc -std=c++17 -O3 -Xcompiler -fopenmp -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
  -I. -I"$inc/include" -o /tmp/st tools/gemm_selftest.cu csrc/grouped_gemm_sm90.cu csrc/grouped_gemm_sm90_wgmma.cu
step memcheck 120 compute-sanitizer --tool memcheck --error-exitcode 1 /tmp/st --small --no-bench --kernel both
step memcheck_sm90 90 compute-sanitizer --tool memcheck --error-exitcode 1 /tmp/st --small --no-bench --kernel both --layout sm90
step bench 300 python3 -P -m jax_nvfp4.bench --out "$out" --check "$@"
# The whole suite with the GPU as default backend (multi-device tests still use 8 CPU devices):
# ~9 min on an H200, so only when named: STEPS="install tests_all".
[[ " ${STEPS:-} " == *" tests_all "* ]] && step tests_all 580 env JAX_NVFP4_REQUIRE_GPU=1 python3 -P -m pytest -q -p no:cacheprovider tests
step tests_wgmma 200 env JAX_NVFP4_REQUIRE_GPU=1 JAX_NVFP4_KERNEL=wgmma python3 -P -m pytest -q -p no:cacheprovider tests/test_gemm.py -k cuda
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  step tests_gpus 300 env JAX_NVFP4_REQUIRE_GPU=1 python3 -P -m pytest -q -p no:cacheprovider tests/test_sharding_gpus.py
  step bench_ep 400 python3 -P -m jax_nvfp4.bench_ep --tokens 256,8192 --out "$out/ep"
fi
[ -f "$out/bench.log" ] && { echo; sed -n '/^case /,$p' "$out/bench.log" | head -40; }
echo "== summary"; for row in "${summary[@]}"; do IFS='|' read -r a b c <<<"$row"; printf '%-15s %-15s %s\n' "$a" "$b" "$c"; done
