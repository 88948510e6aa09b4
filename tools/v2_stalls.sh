#!/usr/bin/env bash
# Where do the v2 kernel's warps wait? Nsight Compute stall reasons (per issued instruction) and
# per-SASS-instruction stall samples for a few bench cases. usage: tools/v2_stalls.sh [cases]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-v2-out}; mkdir -p "$out"
inc=${CUTLASS_INC:-.cutlass_hdr}
nvcc -std=c++17 -O3 -Xcompiler -fopenmp -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
  -lineinfo -I. -I"$inc/include" -I"$inc/util/include" -o /tmp/st \
  tools/gemm_selftest.cu csrc/grouped_gemm_sm90.cu csrc/grouped_gemm_sm90_wgmma.cu >"$out/build.log" 2>&1 || { tail "$out/build.log"; exit 1; }
for c in ${*:-L1-192 L1-24576}; do
  timeout 200 ncu -o "$out/rep_$c" -f --kernel-name regex:wgmma_kernel --launch-skip 3 --launch-count 1 \
    --section WarpStateStats --section SourceCounters --section SpeedOfLight \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    /tmp/st --bench-only --kernel wgmma --no-sweep --only "$c" >"$out/ncu_$c.log" 2>&1
  echo "== $c rc=$?"
  ncu -i "$out/rep_$c.ncu-rep" --page raw --csv --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" >"$out/stalls_$c.csv" 2>&1
  ncu -i "$out/rep_$c.ncu-rep" --page source --csv --print-source sass >"$out/sass_$c.csv" 2>&1
  python3 - "$out/stalls_$c.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
hdr, vals = rows[0], rows[-1]
st = sorted(((float(v.replace(',', '')), h) for h, v in zip(hdr, vals)
             if 'stalled' in h and v.replace(',', '').replace('.', '').isdigit()), reverse=True)
for v, h in st[:10]:
    print(f"  {v:8.3f} {h.replace('smsp__average_warps_issue_stalled_', '').replace('_per_issue_active.ratio', '')}")
PY
done
ls -la "$out"
