#!/usr/bin/env bash
# Profile the v2 kernel with Nsight Compute on a few bench cases (after a quick correctness run).
# usage: tools/v2_profile.sh [cases, default L1-192 L1-1536 L1-24576]; logs in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-v2-out}; mkdir -p "$out"
inc=${CUTLASS_INC:-.cutlass_hdr}
nvcc -std=c++17 -O3 -Xcompiler -fopenmp -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
  -lineinfo -I. -I"$inc/include" -I"$inc/util/include" -o /tmp/st \
  tools/gemm_selftest.cu csrc/grouped_gemm_sm90.cu csrc/grouped_gemm_sm90_wgmma.cu >"$out/build.log" 2>&1 || { tail "$out/build.log"; exit 1; }
timeout 60 /tmp/st --small --no-bench --kernel wgmma >"$out/small.log" 2>&1; echo "small rc=$? $(tail -1 "$out/small.log")"
timeout 120 /tmp/st --bench-only --kernel wgmma --no-sweep >"$out/bench.log" 2>&1; grep -E "^bench v2" "$out/bench.log"
cases=${*:-L1-192 L1-1536 L1-24576}
for c in $cases; do
  timeout 150 ncu --kernel-name regex:wgmma_kernel --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section InstructionStats --section Occupancy \
    /tmp/st --bench-only --kernel wgmma --no-sweep --only "$c" >"$out/ncu_$c.txt" 2>&1
  echo "== $c rc=$?"
  grep -E "Duration|DRAM Throughput|Issue Slots Busy|Issued Warp Per Scheduler|No Eligible|Executed Ipc A|Warp Cycles Per Issued|Memory Throughput|Shared.*Throughput|L1/TEX Hit|Mem Pipes Busy|Compute \(SM\) Throughput" "$out/ncu_$c.txt" | head -20
done
