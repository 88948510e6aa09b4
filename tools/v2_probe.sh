#!/usr/bin/env bash
# First GPU probe of the v2 (WGMMA) kernel: build the self-test, run it small then full (each under
# a timeout: a hang means an mbarrier/tx-count bug), memcheck, then v1-vs-v2 bench. Logs in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-v2-out}; mkdir -p "$out"
inc=${CUTLASS_INC:-.cutlass_hdr}
t0=$SECONDS
nvcc -std=c++17 -O3 -Xcompiler -fopenmp -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
  -I. -I"$inc/include" -I"$inc/util/include" -Xptxas -v -o /tmp/st \
  tools/gemm_selftest.cu csrc/grouped_gemm_sm90.cu csrc/grouped_gemm_sm90_wgmma.cu >"$out/build.log" 2>&1
echo "build rc=$? $((SECONDS - t0)) s"
run() { local name=$1 lim=$2; shift 2; local t=$SECONDS
  timeout "$lim" "$@" >"$out/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc $((SECONDS - t)) s"; return $rc; }
k=${KERN:-wgmma}
if run small 60 /tmp/st --small --no-bench --kernel "$k"; then
  run full 240 /tmp/st --no-bench --kernel "$k"
  run memcheck 200 compute-sanitizer --tool memcheck --error-exitcode 1 /tmp/st --small --no-bench --kernel "$k"
  run bench 300 /tmp/st --bench-only --kernel both ${SWEEP:---no-sweep}
fi
for f in small full memcheck; do [ -f "$out/$f.log" ] && { echo "--- $f (fail lines / tail)"; grep -iE "fail|error|mismatch" "$out/$f.log" | head -12; tail -4 "$out/$f.log"; }; done
[ -f "$out/bench.log" ] && grep -E "^bench|^\|" "$out/bench.log"
