#!/usr/bin/env bash
# Build the self-test, check the small cases, then sweep v2 token tiles on the bench shapes.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-v2-out}; mkdir -p "$out"
inc=${CUTLASS_INC:-.cutlass_hdr}
nvcc -std=c++17 -O3 -Xcompiler -fopenmp -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr ${NVFLAGS:-} \
  -I. -I"$inc/include" -I"$inc/util/include" -o /tmp/st \
  tools/gemm_selftest.cu csrc/grouped_gemm_sm90.cu csrc/grouped_gemm_sm90_wgmma.cu >"$out/build.log" 2>&1 || { tail "$out/build.log"; exit 1; }
timeout 60 /tmp/st --small --no-bench --kernel wgmma >"$out/small.log" 2>&1; echo "small rc=$? $(tail -1 "$out/small.log")"
[ -n "${FULL:-}" ] && { timeout 200 /tmp/st --no-bench --kernel wgmma >"$out/full.log" 2>&1; echo "full rc=$? $(tail -1 "$out/full.log")"; }
timeout 300 /tmp/st --bench-only --kernel wgmma "$@" >"$out/bench.log" 2>&1; echo "bench rc=$?"
grep -E "^bench v2" "$out/bench.log" | sed -E 's/K=[0-9]+ N=[0-9]+ //; s/\[min.*//'
