#!/usr/bin/env bash
# Lab (GPU machine, one device call, ~6-8 minutes): the FP8 kernel against a patched copy of itself.
#   1. tools/lab/decode_mma_microbench.cu: the decode-and-MMA pipeline alone (supply free), per
#      decoder, WGMMA N and CTAs per SM, in weight elements per second -> $OUT/decode_mma.json;
#   2. an A/B of the whole kernel (csrc/grouped_gemm_fp8_sm90.cu) against a copy patched by VARIANT,
#      both built here (two wheels at once, half the cores each) and timed by tools/lab/fp8_check.py,
#      base, variant, base:
#        split  the microbenchmark's "split" decode (7 instead of 9 integer instructions per 8
#               weights) on checkpoint-layout codes read as if their sign bits were pre-placed: its
#               products are wrong by design, only its time counts;
#        2cta   the 32-token tile at two CTAs per SM (consumers at 104 registers, 7 stages, a grid of
#               twice the SMs): correct, so its rel_l2 must match the base's.
# Carry .cutlass_wheel (the CUTLASS headers: pip download --no-deps nvidia-cutlass==4.2.0.0 -d .cutlass_wheel).
# The two builds take ~140 s of a device call; to spend none there, build both wheels beforehand on a
# machine with nvcc and the device's Python and jax (BUILD_ONLY=<folder>: <folder>/base and
# <folder>/var, with python3 that environment's), carry the folder and pass it as PREBUILT=<folder>.
#   usage: VARIANT=split|2cta tools/lab/fp8_kernel_ab.sh [fp8_check args, default: --cases 1536,6144 --check-rows 8]
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-fp8-ab-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
[ -n "${BUILD_ONLY:-}" ] || nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
python3 -m pip install -q --no-index --no-deps .cutlass_wheel/nvidia_cutlass-*.whl || exit 1
# the variant tree: a copy of the sources, patched by VARIANT
var=/tmp/fp8_ab_variant; rm -rf "$var"; mkdir -p "$var"
if [ -z "${PREBUILT:-}" ]; then
cp -r csrc ffi jax_nvfp4 cmake tools CMakeLists.txt pyproject.toml README.md LICENSE "$var"/
python3 - "$var" "${VARIANT:-split}" <<'EOF'
import sys
root, variant = sys.argv[1:]
def patch(path, old, new, count=1):
    s = open(f"{root}/{path}").read()
    assert s.count(old) == count, (path, old, s.count(old))
    open(f"{root}/{path}", "w").write(s.replace(old, new))
if variant == "split":
    patch("csrc/e2m1_e4m3_decode.cuh", "}  // namespace jax_nvfp4", """
__device__ __forceinline__ void e2m1x8_to_e4m3_split(uint32_t w, uint2 tbl, uint32_t& lo, uint32_t& hi) {
  const uint32_t m = w & 0x77777777u;
  lo = prmt(tbl.x, tbl.y, m) | (w & 0x80808080u);
  hi = prmt(tbl.x, tbl.y, m >> 16) | ((w << 4) & 0x80808080u);
}
}  // namespace jax_nvfp4""")
    patch("csrc/grouped_gemm_fp8_sm90.cu", "      e2m1x8_to_e4m3(", "      e2m1x8_to_e4m3_split(", 2)
elif variant == "2cta":
    patch("csrc/grouped_gemm_fp8_sm90.cu", "__launch_bounds__(kFp8Threads, 1)", "__launch_bounds__(kFp8Threads, BTMAX == 32 ? 2 : 1)")
    patch("csrc/fp8_consumer_sm90.cuh", "setmaxnreg_inc<kFp8ConsumerRegs>();", "setmaxnreg_inc<(BTMAX == 32 ? 104 : kFp8ConsumerRegs)>();")
    import glob
    table = [f[len(root) + 1:] for f in glob.glob(f"{root}/csrc/*.h")
             if "{KernelFamily::kWgmmaFp8, 32, 15, 1}" in open(f).read()]
    assert len(table) == 1, table
    patch(table[0], "{KernelFamily::kWgmmaFp8, 32, 15, 1}", "{KernelFamily::kWgmmaFp8, 32, 7, 1}")
    patch("csrc/wgmma_sm90_common.cuh", "kernel<<<num_sms(), threads, smem_bytes, stream>>>(tm_a, tm_w, kp);",
          "kernel<<<num_sms() * (smem_bytes <= 232448 / 2 - 1024 ? 2 : 1), threads, smem_bytes, stream>>>(tm_a, tm_w, kp);")
else:
    sys.exit(f"unknown VARIANT {variant}")
EOF
[ $? -eq 0 ] || { echo "patching the variant failed"; exit 1; }
fi

jobs=$(( ($(nproc) + 1) / 2 ))
build() {  # $1 tree, $2 name
  if [ -n "${PREBUILT:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --target "/tmp/ab_$2_site" "$PREBUILT/$2"/jax_nvfp4-*.whl
    return
  fi
  local w=${BUILD_ONLY:+$BUILD_ONLY/$2}; w=${w:-/tmp/ab_$2_whl}
  (cd "$1" && CMAKE_BUILD_PARALLEL_LEVEL=$jobs python3 -m pip wheel -q --no-build-isolation --no-deps . \
     -w "$w" -Cbuild-dir="/tmp/ab_$2_build") >"$out/build_$2.log" 2>&1 || return 1
  [ -n "${BUILD_ONLY:-}" ] ||
    python3 -m pip install -q --no-index --no-deps --target "/tmp/ab_$2_site" /tmp/ab_$2_whl/jax_nvfp4-*.whl
}
t0=$SECONDS
build "$PWD" base & a=$!
build "$var" var & b=$!
wait $a || { echo "base build failed"; tail "$out/build_base.log"; exit 1; }
wait $b || { echo "variant build failed"; tail "$out/build_var.log"; exit 1; }
echo "builds: $((SECONDS - t0)) s"
[ -n "${BUILD_ONLY:-}" ] && exit 0
cut=$(python3 -c "import importlib.util, os; s = importlib.util.find_spec('cutlass_library'); print(os.path.join(list(s.submodule_search_locations)[0], 'source'))")
nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -I. -I"$cut/include" \
  -o /tmp/decode_mma_microbench tools/lab/decode_mma_microbench.cu >"$out/ab.log" 2>&1 &&
  /tmp/decode_mma_microbench --json "$out/decode_mma.json"

args=("$@"); [ ${#args[@]} -eq 0 ] && args=(--cases 1536,6144 --check-rows 8)
fp8_check=tools/gpu/fp8_check.py; [ -f "$fp8_check" ] || fp8_check=tools/lab/fp8_check.py
for v in base var base; do
  n=$(ls "$out"/ab_"$v"_*.json 2>/dev/null | wc -l)
  PYTHONPATH="/tmp/ab_${v}_site" python3 "$fp8_check" --tiles "" --no-exact "${args[@]}" \
    --out "$out/ab_${v}_$n.json" >>"$out/ab.log" 2>&1 || { echo "fp8_check $v failed"; tail "$out/ab.log"; }
done
python3 - "$out" <<'EOF'
import glob, json, sys
out = sys.argv[1]
rows = {}
for f in sorted(glob.glob(f"{out}/ab_*.json")):
    name = f.rsplit("/", 1)[1][3:-5]
    for r in json.load(open(f))["results"]:
        for k, t in r.items():
            if k.startswith("tile"):
                rows.setdefault((r["layer"], r["rows"], k), {})[name] = (t["ms"], t["rel_l2"])
print("case               " + "  ".join(f"{n:>16}" for n in sorted({n for v in rows.values() for n in v})))
for (lay, m, k), v in sorted(rows.items()):
    print(f"{lay} {m:6d} {k:8s}  " + "  ".join(f"{v[n][0]:8.4f} ({v[n][1]:.0e})" for n in sorted(v)))
EOF
