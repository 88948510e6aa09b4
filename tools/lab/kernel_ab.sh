#!/usr/bin/env bash
# A/B of self-test builds in one device call: builds one tools/gemm_selftest.cu binary per variant
# (in parallel), checks each on the small shapes, then runs the bench shapes (auto token tile)
# ROUNDS times, the variants interleaved, and prints min ms per case and the ratio to variant 0.
#   tools/kernel_ab.sh "-DJAX_NVFP4_V1_STAGES16=4" "-DJAX_NVFP4_V1_STAGES16=6"
#   BASE_REV=HEAD~1 tools/kernel_ab.sh ""   # variant 0: the kernels of a git revision; then this tree
#   BASE_DIR=.dbg/base tools/kernel_ab.sh "" # variant 0: self-test, host encoder and kernels of another
#     tree (csrc/ and tools/ under BASE_DIR, e.g. `git archive REV csrc tools | tar -x -C .dbg/base`,
#     carried to the device: its copy of the tree has no git history); use it when the weight
#     layout differs, so that each variant encodes its own
# Env: KERNEL (mma | wgmma | both, default mma), LAYOUTS (default "checkpoint sm90"), ROUNDS (2),
# CUTLASS_INC (default .cutlass_hdr), ONLY (bench cases, e.g. "L1-192 L2-192"; one build for all),
# DEADLINE (seconds: no new bench run after it; the table still prints), SUSTAIN (ms: bench under
# sustained back-to-back load, where the H200 runs at its power cap at 24576 rows, as the JAX
# benchmark does; default: short synchronized bursts), LOGNORMAL (non-empty: the JAX benchmark's
# log-normal group sizes instead of the harness's u^3 with ~20% empty groups). Logs in $OUT.
# For decisions at 1536-24576 rows use LOGNORMAL=1 SUSTAIN=1000: that pair reproduced the JAX
# benchmark's numbers and its sign at 1536 rows where the defaults did not (session 13).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-kernel-ab-out}; mkdir -p "$out"
inc=${CUTLASS_INC:-.cutlass_hdr}
k=${KERNEL:-mma}; rounds=${ROUNDS:-2}; layouts=${LAYOUTS:-checkpoint sm90}
variants=("$@"); srcs=()
for i in "${!variants[@]}"; do srcs+=("csrc/grouped_gemm_sm90.cu csrc/grouped_gemm_sm90_wgmma.cu"); done
base_dir=""
if [ -n "${BASE_DIR:-}" ]; then   # variant 0: another tree's self-test and kernels, built there
  base_dir=$(cd "$BASE_DIR" && pwd) || exit 1
  variants=("" "${variants[@]}"); srcs=("" "${srcs[@]}")
elif [ -n "${BASE_REV:-}" ]; then   # variant 0 from the revision's kernel sources (headers from this tree)
  mkdir -p /tmp/ab_base/csrc
  for f in grouped_gemm_sm90.cu grouped_gemm_sm90_wgmma.cu; do git show "$BASE_REV:csrc/$f" > /tmp/ab_base/csrc/$f || exit 1; done
  variants=("" "${variants[@]}"); srcs=("/tmp/ab_base/csrc/grouped_gemm_sm90.cu /tmp/ab_base/csrc/grouped_gemm_sm90_wgmma.cu" "${srcs[@]}")
fi
[ ${#variants[@]} -ge 2 ] || { echo "need two or more variants"; exit 2; }
inc=$(cd "$inc" && pwd); outabs=$(cd "$out" && pwd)
for i in "${!variants[@]}"; do rm -f /tmp/ab_$i; done  # a failed build must not leave an older binary
for i in "${!variants[@]}"; do
  if [ "$i" = 0 ] && [ -n "$base_dir" ]; then
    (cd "$base_dir" && nvcc -std=c++17 -O3 -Xcompiler -fopenmp -gencode=arch=compute_90a,code=sm_90a \
      --expt-relaxed-constexpr -I. -I"$inc/include" -I"$inc/util/include" -o /tmp/ab_0 tools/gemm_selftest.cu \
      csrc/grouped_gemm_sm90.cu csrc/grouped_gemm_sm90_wgmma.cu >"$outabs/build_0.log" 2>&1) &
    continue
  fi
  # shellcheck disable=SC2086
  nvcc -std=c++17 -O3 -Xcompiler -fopenmp -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
    ${variants[$i]} -I. -I"$inc/include" -I"$inc/util/include" -o /tmp/ab_$i tools/gemm_selftest.cu ${srcs[$i]} \
    >"$out/build_$i.log" 2>&1 &
done
wait
for i in "${!variants[@]}"; do
  [ -x /tmp/ab_$i ] || { echo "variant $i (${variants[$i]}) did not build:"; tail "$out/build_$i.log"; exit 1; }
  for L in $layouts; do
    timeout 90 /tmp/ab_$i --small --no-bench --kernel "$k" --layout "$L" >"$out/small_${i}_$L.log" 2>&1
    echo "variant $i [${variants[$i]}] $L small: rc=$? $(tail -1 "$out/small_${i}_$L.log")"
  done
done
for r in $(seq "$rounds"); do for i in "${!variants[@]}"; do for L in $layouts; do for c in ${ONLY:-all}; do
  only=(); [ "$c" = all ] || only=(--only "$c")
  # DEADLINE (seconds of this script): skip the remaining runs, still print the table of what ran
  if [ -n "${DEADLINE:-}" ] && [ "$SECONDS" -ge "$DEADLINE" ]; then echo "deadline: skipped round $r variant $i $c"; continue; fi
  extra=(); [ -n "${SUSTAIN:-}" ] && extra=(--sustain "$SUSTAIN")
  [ -n "${LOGNORMAL:-}" ] && extra+=(--lognormal)
  timeout 120 /tmp/ab_$i --bench-only --no-sweep --kernel "$k" --layout "$L" "${only[@]}" "${extra[@]}" >"$out/bench_${i}_${L}_${r}_$c.log" 2>&1
done; done; done; done
python3 - "$out" "${#variants[@]}" <<'PY'
import collections, glob, os, re, sys
out, n = sys.argv[1], int(sys.argv[2])
t = collections.defaultdict(list)
for f in glob.glob(os.path.join(out, "bench_*.log")):
    i, lay = os.path.basename(f).split("_")[1:3]
    for line in open(f):
        m = re.match(r"bench (v\d) (L\d) (W4A\d+)\s+rows=(\d+).*?([\d.]+) ms", line)
        if m:
            t[(m[2], m[3], int(m[4]), lay, m[1], int(i))].append(float(m[5]))
keys = sorted({k[:5] for k in t})
print("| case | layout | kernel | " + " | ".join(f"v{i} ms" for i in range(n)) + " | " +
      " | ".join(f"v{i}/v0" for i in range(1, n)) + " |")
print("|---" * (3 + 2 * n - 1) + "|")
for k in keys:
    ms = [min(t.get(k + (i,), [float("nan")])) for i in range(n)]
    print(f"| {k[0]} {k[1]} {k[2]} | {k[3]} | {k[4]} | " + " | ".join(f"{v:.4f}" for v in ms) +
          " | " + " | ".join(f"{v / ms[0]:.3f}" for v in ms[1:]) + " |")
PY
