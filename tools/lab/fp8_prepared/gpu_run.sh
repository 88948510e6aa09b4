#!/usr/bin/env bash
# Issue 48's open questions in one device call (~6-8 minutes on an H200), most important first; logs
# and a summary under $OUT. The harness is built on the development machine (command in
# fp8_prepared_check.cu's header; gitignored: carry tools/lab/fp8_prepared/fp8_prepared_check).
#   1. smi:      SM clock, power and throttle reasons every 200 ms for the whole call (smi.csv): is the
#                full kernel power-limited (the lab saw 2.60-3.05 ms for one binary across machines)?
#   2. small:    every configuration on the odd shapes against float64 (checks the ordered consumer,
#                configuration digit 2, before it is timed);
#   3. bench:    lab 128x1 (128100), the package kernel (1), the ordered consumer (128102, 192102,
#                128202, 192202), 192x1 and 192x2 at 6144 and 24576 rows, one run, on the API bench's
#                group sizes (--sizes-from), each timed after 1.5 s of back-to-back launches (--warm-ms:
#                the power-capped regime the API bench times; a burst after idle time is 12-15% faster);
#   4. probe:    (only when STEPS names it; build the binaries with -DP8_PROBE=1 / 3 and carry them) the
#                loads alone and the math alone at L1 24576 rows (PROBE1_CFGS, PROBE3_CFGS);
#   5. api:      (only when named) with the installed wheel (after tools/gpu/gpu_check.sh deps install), the
#                bench's prepared rows beside the fp8 mode, and the fp8 reference tests on the GPU
#                (tests/test_api_matrix.py -k "gpu and fp8", tests/test_excess_precision.py);
#   6. ncu:      Nsight Compute (--clock-control none) on one launch of the package kernel and of the
#                ordered one at L1 24576 rows: tensor pipe, shared-memory and L2 throughput against
#                their peaks (which of them bounds the kernel).
# usage: OUT=... bash tools/lab/fp8_prepared/gpu_run.sh      STEPS="smi small bench probe api ncu" (default
#        smi small bench ncu); CFGS (the bench step's configuration codes), NCU_CFGS (the ncu step's), CASES (the
#        bench step's row counts, a space list), API_CASES / API_IMPLS (the api step's bench arguments),
#        API_TESTS (its pytest arguments) override the defaults below
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-fp8p-out}; mkdir -p "$out"; out=$(cd "$out" && pwd)
h=tools/lab/fp8_prepared/fp8_prepared_check
steps=${STEPS:-smi small bench ncu}
want() { [[ " $steps " == *" $1 "* ]]; }
summary=()
run() { local name=$1 lim=$2; shift 2; local t0=$SECONDS
  if timeout "$lim" "$@" >"$out/$name.log" 2>&1; then summary+=("$name ok $((SECONDS - t0)) s")
  else summary+=("$name FAILED (rc $?) $((SECONDS - t0)) s"); fi
  echo "== $name"; tail -n 6 "$out/$name.log"; }

nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee "$out/gpu.txt"
nvidia-smi -q -d POWER,CLOCK >>"$out/gpu.txt" 2>&1
cfgs=${CFGS:-1,128100,128102,192100,192102,128202,192200,192202}
if want smi; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv -lms 200 >"$out/smi.csv" 2>&1 &
  smi_pid=$!
fi
want small && run small 120 "$h" --small
# the API bench's group sizes (jax_nvfp4.bench: case_seed, skewed_group_sizes), so that the harness
# times the problem the API rows time
PYTHONPATH=. python3 - >"$out/bench_sizes.txt" <<'EOF'
from jax_nvfp4.bench import gemm as bench
for lay in bench.LAYERS:
    for r in bench.ROWS:
        s = bench.skewed_group_sizes(r, bench.EXPERTS, bench.case_seed(lay, r))
        print(f"{lay} rows {r}: " + ",".join(map(str, s)))
EOF
for rows in ${CASES:-6144 24576}; do
  want bench && run "bench$rows" 300 "$h" --cfg "$cfgs" --only "rows $rows" --reps 100 --warm-ms 1500 \
    --sizes-from "$out/bench_sizes.txt"
done
# probes (binaries built with -DP8_PROBE=1 / 3, gitignored: carry them; their checks FAIL by design):
# the loads alone and the math alone at L1 24576 rows, sustained, per configuration
if want probe; then
  probe_cfgs=([1]=${PROBE1_CFGS:-128100,128140,128200,128240,192100,192140} [3]=${PROBE3_CFGS:-128100,128102,192100,192102})
  for pr in 1 3; do
    codes=${probe_cfgs[$pr]}
    run "probe$pr" 200 "tools/lab/fp8_prepared/fp8_prepared_probe$pr" --cfg "$codes" --only "L1 rows 24576" \
      --reps 50 --warm-ms 1000 --sizes-from "$out/bench_sizes.txt"
  done
fi
if want api; then
  run api_bench 300 python3 -P -m jax_nvfp4.bench --out "$out/api" --cases "${API_CASES:-L1-6144,L1-24576,L2-6144}" \
    --impls "${API_IMPLS:-w4a16_fp8_prepared,w4a4_fp8_prepared,w4a16_fp8,w4a4_fp8}"
  # shellcheck disable=SC2086
  XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_NVFP4_REQUIRE_GPU=1 run api_tests 300 python3 -P -m pytest -q \
    ${API_TESTS:-tests/test_api_matrix.py -k "gpu and fp8" tests/test_excess_precision.py}
fi
if want ncu; then
  for code in ${NCU_CFGS:-1 128102}; do
    run "ncu_$code" 240 ncu --clock-control none --set full -k regex:fp8_prepared_kernel --launch-skip 3 \
      --launch-count 1 -f -o "$out/ncu_$code" "$h" --cfg "$code" --only "L1 rows 24576" --reps 5 \
      --sizes-from "$out/bench_sizes.txt"
    ncu --import "$out/ncu_$code.ncu-rep" --page details >"$out/ncu_$code.txt" 2>&1
  done
fi
[ -n "${smi_pid:-}" ] && kill "$smi_pid" 2>/dev/null
echo "== summary"; printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
grep -h "rows" "$out"/bench*.log 2>/dev/null | tail -n 14
