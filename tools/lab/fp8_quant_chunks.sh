#!/usr/bin/env bash
# Builds tools/lab/fp8_quant_chunks (see its .cu): csrc/quantize_fp8.cu compiled once per chunks-per-warp
# value with the launcher renamed, linked with the driver. usage: bash tools/lab/fp8_quant_chunks.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
objs=()
for c in 1 2 4 8; do
  sed "s/constexpr int kChunksPerWarp = 2;/constexpr int kChunksPerWarp = $c;/" csrc/quantize_fp8.cu >"$tmp/q$c.cu"
  grep -q "kChunksPerWarp = $c;" "$tmp/q$c.cu"
  nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I. -DLaunchQuantizeFp8=LaunchQuantizeFp8_c$c \
    -c -o "$tmp/q$c.o" "$tmp/q$c.cu"
  objs+=("$tmp/q$c.o")
done
nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I. -cudart static -o tools/lab/fp8_quant_chunks \
  tools/lab/fp8_quant_chunks.cu "${objs[@]}"
rm -rf "$tmp"
echo built tools/lab/fp8_quant_chunks
