#!/usr/bin/env bash
# Kernel work on a GPU machine, without installing the package: builds the kernel self-test and the
# microbenchmarks with CMake (JAX_NVFP4_BUILD_TOOLS=ON, the extension's flags, build folder
# build/lab) and runs one of
#   check    self-test on small shapes, then all shapes (FULL=1) (KERNEL=wgmma|mma|both)
#   sweep    check small shapes, then the bench shapes with every token tile (args go to the
#            self-test, e.g. --no-sweep, --only L1-1536)
#   memcheck compute-sanitizer memcheck on the small shapes
#   ncu      Nsight Compute stall reasons and per-SASS stall samples for bench cases (args, default
#            L1-192 L1-24576)
#   ncu2     Nsight Compute throughput sections for CASE[:KERNEL[:TOKEN_TILE]] arguments
#   wgmma    the wgmma microbenchmark (tools/lab/wgmma_microbench.cu; argument alu: with ALU work,
#            conv: converter warpgroups beside SS wgmmas)
#   stream   the mma decode copy pipeline without its math (tools/lab/stream_microbench.cu; args: K, CTAs)
# NOBUILD=1 skips the (incremental) build; LAYOUT=sm90 runs the self-test, benchmarks and profiles
# with the weights in the sm90 load-time layout (W4A16 cases only). Logs in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-kernel-lab-out}; mkdir -p "$out"
cmd=${1:-check}; shift || true
k=${KERNEL:-wgmma}
lay="${LAYOUT:+--layout $LAYOUT}"  # LAYOUT=sm90: weights in the sm90 layout (W4A16 cases)

build() {
  [ -n "${NOBUILD:-}" ] && [ -x build/lab/gemm_selftest ] && return 0
  { cmake -S . -B build/lab -G Ninja -DCMAKE_BUILD_TYPE=Release -DJAX_NVFP4_BUILD_TOOLS=ON \
      -DPython_EXECUTABLE="$(command -v python3)" && cmake --build build/lab; } >"$out/build.log" 2>&1 ||
    { tail "$out/build.log"; exit 1; }
  ln -sf "$PWD/build/lab/gemm_selftest" /tmp/st
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
  wgmma)
    build; timeout 120 build/lab/wgmma_microbench "$@" | tee "$out/wgmma.log" ;;
  stream)
    build; timeout 120 build/lab/stream_microbench "$@" | tee "$out/stream.log" ;;
  *) echo "unknown command $cmd (check | sweep | memcheck | ncu | ncu2 | wgmma | stream)"; exit 2 ;;
esac
