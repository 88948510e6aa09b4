#!/usr/bin/env bash
# Kernel work on a GPU machine, without installing the package: builds tools/gemm_selftest.cu
# (v1 + v2 kernels) and runs one of
#   check    self-test on small shapes, then all shapes (FULL=1), v2 (KERNEL=wgmma|mma|both)
#   sweep    check small shapes, then the bench shapes with every token tile (args go to the
#            self-test, e.g. --no-sweep, --only L1-1536); NVFLAGS=-DJAX_NVFP4_V2_DIAG=1|2 builds the
#            diagnostic variants (docs/perf-notes.md)
#   memcheck compute-sanitizer memcheck on the small shapes
#   ncu      Nsight Compute stall reasons and per-SASS stall samples for bench cases (args, default
#            L1-192 L1-24576)
#   ncu2     Nsight Compute throughput sections for CASE[:KERNEL[:TOKEN_TILE]] arguments
#   trace    clock64 trace of v2's tile switches per bench case (a -DJAX_NVFP4_V2_DIAG=3 build)
#   wgmma    the wgmma microbenchmark (tools/wgmma_microbench.cu; argument alu: with ALU work,
#            conv: converter warpgroups beside SS wgmmas)
#   stream   v1's decode copy pipeline without its math (tools/stream_microbench.cu; args: K, CTAs)
# NOBUILD=1 reuses /tmp/st from the previous command of the same device call; LAYOUT=sm90 runs the
# self-test, benchmarks and profiles with the weights in the sm90 load-time layout (W4A16 cases only).
# Headers: CUTLASS_INC (default .cutlass_hdr, an unzipped nvidia-cutlass wheel's
# cutlass_library/source, carried to the device). Logs in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-kernel-lab-out}; mkdir -p "$out"
inc=${CUTLASS_INC:-.cutlass_hdr}
cmd=${1:-check}; shift || true
k=${KERNEL:-wgmma}
lay="${LAYOUT:+--layout $LAYOUT}"  # LAYOUT=sm90: weights in the sm90 layout (W4A16 cases)

build() {
  [ -n "${NOBUILD:-}" ] && [ -x /tmp/st ] && return 0  # NOBUILD=1: reuse the last build
  nvcc -std=c++17 -O3 -Xcompiler -fopenmp -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
    ${NVFLAGS:-} -lineinfo -I. -I"$inc/include" -I"$inc/util/include" -o /tmp/st \
    tools/gemm_selftest.cu csrc/grouped_gemm_sm90.cu csrc/grouped_gemm_sm90_wgmma.cu >"$out/build.log" 2>&1 ||
    { tail "$out/build.log"; exit 1; }
}
small() { timeout 60 /tmp/st --small --no-bench --kernel "$k" $lay >"$out/small.log" 2>&1
  local rc=$?; echo "small rc=$rc $(tail -1 "$out/small.log")"; return $rc; }

case $cmd in
  check)
    build; small || exit 1
    if [ -n "${FULL:-}" ]; then
      timeout 240 /tmp/st --no-bench --kernel "$k" $lay >"$out/full.log" 2>&1; echo "full rc=$? $(tail -1 "$out/full.log")"
      grep -E "FAIL" "$out/full.log" | head; true
    fi ;;
  sweep)
    build; small || exit 1
    timeout 300 /tmp/st --bench-only --kernel "$k" $lay "$@" >"$out/bench.log" 2>&1; echo "bench rc=$?"
    grep -E "^bench" "$out/bench.log" | sed -E 's/K=[0-9]+ N=[0-9]+ //; s/\[min.*//' ;;
  memcheck)
    build
    timeout 200 compute-sanitizer --tool memcheck --error-exitcode 1 /tmp/st --small --no-bench --kernel "$k" $lay \
      >"$out/memcheck.log" 2>&1; echo "memcheck rc=$?"; grep "ERROR SUMMARY" "$out/memcheck.log" | tail -1 ;;
  ncu)
    build
    for c in ${*:-L1-192 L1-24576}; do
      timeout 200 ncu -o "$out/rep_$c" -f --kernel-name regex:wgmma_kernel --launch-skip 3 --launch-count 1 \
        --section WarpStateStats --section SourceCounters --section SpeedOfLight \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
        /tmp/st --bench-only --kernel wgmma --no-sweep --only "$c" $lay >"$out/ncu_$c.log" 2>&1
      echo "== $c rc=$?"
      ncu -i "$out/rep_$c.ncu-rep" --page raw --csv \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" >"$out/stalls_$c.csv" 2>&1
      ncu -i "$out/rep_$c.ncu-rep" --page source --csv --print-source sass >"$out/sass_$c.csv" 2>&1
    done ;;
  ncu2)
    # Throughput view (SOL, memory workload incl. shared memory, scheduler, warp states) of one
    # bench case per argument, CASE[:KERNEL[:TOKEN_TILE]], e.g. L1-24576:wgmma:128 L1-192:mma.
    build
    for spec in "$@"; do
      IFS=: read -r c kk force <<<"$spec"; kk=${kk:-wgmma}
      rx=$([ "$kk" = mma ] && echo "regex:grouped_gemm_kernel" || echo "regex:wgmma_kernel")
      tag=$(echo "$spec" | tr ':/' '__')
      timeout 200 ncu --kernel-name "$rx" --launch-skip 3 --launch-count 1 --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section SchedulerStats \
        --section WarpStateStats --section ComputeWorkloadAnalysis \
        /tmp/st --bench-only --kernel "$kk" --no-sweep --only "$c" ${force:+--force "$force"} $lay >"$out/ncu2_$tag.log" 2>&1
      echo "== $spec rc=$?"
      grep -E "^ +(Duration|DRAM Throughput|L1/TEX Cache Throughput|L2 Cache Throughput|Compute \(SM\) Throughput|Mem Busy|Max Bandwidth|Mem Pipes Busy|Issue Slots Busy|No Eligible|Warp Cycles Per Issued Instruction|Executed Ipc Active|SM Frequency|L2 Hit Rate) " \
        "$out/ncu2_$tag.log" | awk '{$1=$1};1' | head -20
      grep -iE "bank.conflict|shared (load|store)" "$out/ncu2_$tag.log" | awk '{$1=$1};1' | head -6
    done ;;
  trace)
    # clock64 trace of v2's tile switches (a -DJAX_NVFP4_V2_DIAG=3 build) for bench cases (args,
    # default L1-192 L2-192 L1-24576 L2-24576); LAYOUT applies. Overwrites /tmp/st: a later
    # NOBUILD=1 command would reuse the diagnostic build
    NVFLAGS="${NVFLAGS:-} -DJAX_NVFP4_V2_DIAG=3" NOBUILD= build
    for c in ${*:-L1-192 L2-192 L1-24576 L2-24576}; do
      timeout 60 /tmp/st --trace "$c" $lay 2>&1 | tee -a "$out/trace.log" | grep -E "^trace|rror"
    done ;;
  wgmma)
    nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -I. -I"$inc/include" \
      -o /tmp/wgmma_microbench tools/wgmma_microbench.cu >"$out/build.log" 2>&1 || { tail "$out/build.log"; exit 1; }
    timeout 120 /tmp/wgmma_microbench "$@" | tee "$out/wgmma.log" ;;
  stream)
    nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I. -o /tmp/stream_microbench \
      tools/stream_microbench.cu >"$out/build.log" 2>&1 || { tail "$out/build.log"; exit 1; }
    timeout 120 /tmp/stream_microbench "$@" | tee "$out/stream.log" ;;
  *) echo "unknown command $cmd (check | sweep | memcheck | ncu | ncu2 | trace | wgmma | stream)"; exit 2 ;;
esac
