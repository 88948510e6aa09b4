#!/usr/bin/env bash
# One GPU validation pass in a single device call (~9 minutes on an H200 with 16 cores):
#   1. deps:      the carried wheels (.cutlass_wheel/ for the CUTLASS headers, .whl/ for pytest-xdist,
#                 execnet, hypothesis), no package index;
#   install:      (only when STEPS names it) instead of builds, the wheel that
#                 tools/gpu/build_device_wheel.sh made on the development machine (carry
#                 build/gpu/main/whl and build/gpu/main/gemm_selftest): STEPS="deps install tests"
#                 skips the ~150 s build;
#   2. builds:    two wheels at once, each in its own build folder: the full build with the kernel
#                 self-test (JAX_NVFP4_BUILD_TOOLS=ON; sm_80 + sm_90a machine code, compute_80 PTX)
#                 installed into the Python environment, and the portable build
#                 (JAX_NVFP4_CUDA_PORTABLE=ON: compute_80 PTX only, which the driver compiles at
#                 load) installed into a separate folder put first on PYTHONPATH by the portable steps;
#   3. images:    cuobjdump --list-elf --list-ptx of both extension modules;
#   4. tests:     the whole suite with the GPU as default backend, pytest -n 4;
#   5. portable_tests: the GPU tests of test_gemm.py, test_moe.py and test_kernel_config.py through
#                 the portable build (the handler then runs the mma family: no sm_90a image);
#   6. memcheck:  the kernel self-test's small shapes under compute-sanitizer memcheck, and the FP8
#                 kernel's and the SwiGLU epilogue's small cases (tools/gpu/fp8_check.py --small,
#                 tools/gpu/glu_check.py --small) and the prepared-weights kernel's tests
#                 (tests/test_fp8.py -k cuda_prepared_kernel) likewise;
#   7. bench:     python -m jax_nvfp4.bench with its usual arguments (plus any given to this script,
#                 e.g. --impls w4a16,w4a16_sm90,w4a4,w4a4_sm90 to leave out the slow peers);
#   8. bench_layer: python -m jax_nvfp4.bench.layer (the MoE layer against its grouped GEMMs);
#      ep_share:  one device's share of the 8-way expert-parallel layer (tools/lab/ep_share_bench.py);
#      fp8_check: the FP8 kernel against float64 on the bench shapes, timed beside the exact kernels;
#      prepass:   the W4A4 pre-pass microbenchmark (tools/lab/prepass_bench.py);
#   9. portable_bench: the benchmark rows of jax_nvfp4's four columns through the portable build;
# then a summary table. Steps are skipped once DEADLINE seconds (default 550) have passed, and each
# step's time limit is cut to what is left, so the summary always prints.
#   usage: tools/gpu/gpu_check.sh [bench args...]      logs in $OUT (default gpu-check-out)
#   STEPS="deps builds tests" runs only the named steps; TESTS="tests/test_gemm.py ..." narrows the
#   tests step to those paths.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-check-out}; mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_NVFP4_REQUIRE_GPU=1
export CUDA_CACHE_MAXSIZE=4294967296   # keep the portable build's JIT-compiled kernels between processes
deadline=${DEADLINE:-550}
build=build/gpu; main="$build/main"; port="$build/portable"; port_site="$build/portable_site"
export out main port port_site   # for the step functions, which run under timeout in bash -c
summary=()
step() { local name=$1 lim=$2; shift 2; local t0=$SECONDS left=$((deadline - SECONDS))
  [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]] && return 0
  if [ "$left" -le 10 ]; then summary+=("$name|skipped (deadline)|0 s"); return 0; fi
  [ "$lim" -gt "$left" ] && lim=$left
  if timeout "$lim" "$@" >"$out/$name.log" 2>&1; then summary+=("$name|ok|$((SECONDS - t0)) s")
  else summary+=("$name|FAILED (rc $?)|$((SECONDS - t0)) s"); fi
  echo "== $name"; tail -n 4 "$out/$name.log"; }
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader | tee "$out/gpu.txt"

deps() {  # the CUTLASS headers only for a build on the device
  local w=(.whl/*.whl); compgen -G ".cutlass_wheel/nvidia_cutlass-*.whl" >/dev/null && w+=(.cutlass_wheel/nvidia_cutlass-*.whl)
  python3 -m pip install -q --no-index --no-deps "${w[@]}"
}
export -f deps
step deps 120 bash -c deps

[[ " ${STEPS:-} " == *" install "* ]] &&   # only when named: the default run builds on the device
  step install 60 python3 -m pip install -q --no-index --no-deps --force-reinstall build/gpu/main/whl/jax_nvfp4-*.whl

builds() {  # both wheels at once, half the cores each
  local jobs=$(( ($(nproc) + 1) / 2 )); rm -rf "$main/whl" "$port/whl" "$port_site"
  CMAKE_BUILD_PARALLEL_LEVEL=$jobs python3 -m pip wheel --no-build-isolation --no-deps . -w "$main/whl" \
    -Cbuild-dir="$main" -Ccmake.define.JAX_NVFP4_BUILD_TOOLS=ON >"$out/build_main.log" 2>&1 & local a=$!
  CMAKE_BUILD_PARALLEL_LEVEL=$jobs python3 -m pip wheel --no-build-isolation --no-deps . -w "$port/whl" \
    -Cbuild-dir="$port" -Ccmake.define.JAX_NVFP4_CUDA_PORTABLE=ON >"$out/build_portable.log" 2>&1 & local b=$!
  wait $a || { echo "full build failed (build_main.log)"; return 1; }
  wait $b || { echo "portable build failed (build_portable.log)"; return 1; }
  python3 -m pip install -q --no-index --no-deps --force-reinstall "$main"/whl/jax_nvfp4-*.whl &&
    python3 -m pip install -q --no-index --no-deps --target "$port_site" "$port"/whl/jax_nvfp4-*.whl &&
    echo "built: full and portable"
}
export -f builds
step builds 300 bash -c builds

images() {
  local cuobjdump; cuobjdump=$(command -v cuobjdump || echo "$(dirname "$(command -v nvcc)")/cuobjdump")
  for site in "" "$port_site"; do
    PYTHONPATH="$site" python3 -P -c "import jax_nvfp4._jax_nvfp4 as e, jax_nvfp4.config.kernel_config as k
print(e.__file__); print('  cuda targets:', e.cuda_targets()); print('  families on 9.0:', k.runnable_families(90))"
    "$cuobjdump" --list-elf --list-ptx "$(PYTHONPATH="$site" python3 -P -c "import jax_nvfp4._jax_nvfp4 as e; print(e.__file__)")"
  done
}
export -f images
step images 60 bash -c images

# The whole suite, the GPU as default backend (the multi-device tests run on 8 CPU devices).
# -v: each result is logged as it happens, so a run cut by its time limit still names its failures
# (the summary below greps them); the suite takes more than one call's 600 s together with the
# builds now: run STEPS="deps builds tests" alone. On a cold machine even the suite alone may
# outrun the step (92% in 520 s): TESTS names what it runs (default: tests), so two calls can split
# it, e.g. TESTS=tests/test_gemm.py, then the other files.
# shellcheck disable=SC2086  # TESTS is a list of paths
step tests 520 env JAX_NVFP4_SELFTEST="$main/gemm_selftest" python3 -P -m pytest -n ${JOBS:-8} -v --durations=15 -p no:cacheprovider \
  -rfE ${TESTS:-tests}

step portable_tests 240 env PYTHONPATH="$port_site" python3 -P -m pytest -n 4 -q -p no:cacheprovider \
  tests/test_gemm.py tests/test_moe.py tests/test_kernel_config.py -k "not cpu"

memcheck() {
  for lay in checkpoint sm90; do
    compute-sanitizer --tool memcheck --error-exitcode 1 "$main/gemm_selftest" --small --no-bench --kernel both \
      --layout "$lay" || return 1
  done
  compute-sanitizer --tool memcheck --error-exitcode 1 python3 -P tools/gpu/fp8_check.py --small || return 1
  compute-sanitizer --tool memcheck --error-exitcode 1 python3 -P tools/gpu/glu_check.py --small || return 1
  compute-sanitizer --tool memcheck --error-exitcode 1 python3 -P -m pytest -q -p no:cacheprovider \
    tests/test_fp8.py -k "cuda_prepared_kernel" || return 1
}
export -f memcheck
step memcheck 150 bash -c memcheck

# (every row, peers included, takes ~6 minutes on an H200: 10 rows of 8 cases took 300 s with --check;
# give --impls to fit a shorter call)
step bench 420 python3 -P -m jax_nvfp4.bench --out "$out" --check "$@"


step bench_layer 240 python3 -P -m jax_nvfp4.bench.layer --out "$out/layer"

step ep_share 120 python3 -P tools/lab/ep_share_bench.py --json "$out/ep_share.json"

step fp8_check 240 python3 -P tools/gpu/fp8_check.py --check-rows 16 --out "$out/fp8_check.json"

step prepass 120 python3 -P tools/lab/prepass_bench.py --out "$out/prepass.json"

step portable_bench 150 env PYTHONPATH="$port_site" python3 -P -m jax_nvfp4.bench --out "$out/portable" \
  --impls w4a16,w4a16_sm90,w4a4,w4a4_sm90

for b in bench bench_layer portable_bench; do
  [ -f "$out/$b.log" ] && { echo; echo "== $b"; sed -n '/^case /,$p' "$out/$b.log" | head -40; }
done
[ -f "$out/tests.log" ] && { echo; echo "== tests: failures"; grep -E "(FAILED|ERROR) tests/" "$out/tests.log" | sed 's/^\[gw[0-9]*\] *\[ *[0-9]*%\] *//' | sort -u | head -40; }
for b in ep_share fp8_check prepass; do [ -f "$out/$b.log" ] && { echo; echo "== $b"; tail -n 12 "$out/$b.log"; }; done
echo; echo "== summary ($SECONDS s)"
for row in "${summary[@]}"; do IFS='|' read -r a b c <<<"$row"; printf '%-16s %-20s %s\n' "$a" "$b" "$c"; done
