// Lab (issue 48): the FP8 mode's activation quantizer (csrc/quantize_fp8.cu) with 1, 2, 4 and 8
// chunks per warp (kChunksPerWarp; the package has 2), timed on bf16 rows of the bench shapes after
// back-to-back launches, each variant's codes and scales compared byte for byte with the package's.
// Each variant is the package file compiled with the constant changed and its launcher renamed
// (tools/lab/fp8_quant_chunks.sh builds it; binary gitignored).
//   usage: fp8_quant_chunks [--warm-ms W] [--reps R]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <cuda_runtime.h>

#include "csrc/quantize_fp8.h"
#include "tools/bench/cuda_check.h"

namespace jax_nvfp4 {
cudaError_t LaunchQuantizeFp8_c1(const QuantizeFp8Params& p, cudaStream_t stream);
cudaError_t LaunchQuantizeFp8_c2(const QuantizeFp8Params& p, cudaStream_t stream);
cudaError_t LaunchQuantizeFp8_c4(const QuantizeFp8Params& p, cudaStream_t stream);
cudaError_t LaunchQuantizeFp8_c8(const QuantizeFp8Params& p, cudaStream_t stream);
}  // namespace jax_nvfp4

using Launch = cudaError_t (*)(const jax_nvfp4::QuantizeFp8Params&, cudaStream_t);

int main(int argc, char** argv) {
  double warm_ms = 500;
  int reps = 50;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--warm-ms")) warm_ms = std::atof(argv[++i]);
    else if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[++i]);
  }
  const struct { const char* name; Launch f; } vars[] = {{"c2 (package)", jax_nvfp4::LaunchQuantizeFp8_c2},
                                                        {"c1", jax_nvfp4::LaunchQuantizeFp8_c1},
                                                        {"c4", jax_nvfp4::LaunchQuantizeFp8_c4},
                                                        {"c8", jax_nvfp4::LaunchQuantizeFp8_c8}};
  const struct { const char* name; int64_t M, K; } cases[] = {
      {"L1 6144", 6144, 7168}, {"L1 24576", 24576, 7168}, {"L2 6144", 6144, 3072}, {"L2 24576", 24576, 3072}};
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# %s; bf16 rows, kernel k order, transposed scales; ms median of %d after %.0f ms warm\n", prop.name,
              reps, warm_ms);
  std::printf("%-10s %-14s %8s %8s %6s\n", "case", "variant", "ms", "GB/s", "same");
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (const auto& c : cases) {
    const size_t nx = static_cast<size_t>(c.M * c.K), ns = static_cast<size_t>(c.M * (c.K / 128));
    std::vector<uint16_t> hx(nx);
    uint32_t h = 12345u;
    for (size_t i = 0; i < nx; ++i) {  // bf16 of magnitude ~2^-4..2^4, both signs
      h ^= h << 13; h ^= h >> 17; h ^= h << 5;
      hx[i] = static_cast<uint16_t>(((h & 0x8000u) | (0x3D00u + (h % 0x0600u))) & 0xFFFFu);
    }
    void* x;
    uint8_t *codes, *ref_codes;
    float *scales, *ref_scales;
    CK(cudaMalloc(&x, nx * 2));
    CK(cudaMalloc(&codes, nx));
    CK(cudaMalloc(&ref_codes, nx));
    CK(cudaMalloc(&scales, ns * 4));
    CK(cudaMalloc(&ref_scales, ns * 4));
    CK(cudaMemcpy(x, hx.data(), nx * 2, cudaMemcpyHostToDevice));
    jax_nvfp4::QuantizeFp8Params p;
    p.x = x;
    p.kind = jax_nvfp4::Fp8InputKind::kBf16;
    p.M = c.M;
    p.K = c.K;
    p.scales_transposed = true;
    p.codes = ref_codes;
    p.scales = ref_scales;
    CK(vars[0].f(p, 0));
    CK(cudaDeviceSynchronize());
    std::vector<uint8_t> rc(nx), vc(nx);
    std::vector<float> rs(ns), vs(ns);
    CK(cudaMemcpy(rc.data(), ref_codes, nx, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(rs.data(), ref_scales, ns * 4, cudaMemcpyDeviceToHost));
    p.codes = codes;
    p.scales = scales;
    for (const auto& v : vars) {
      CK(cudaMemset(codes, 0, nx));
      CK(cudaMemset(scales, 0, ns * 4));
      CK(v.f(p, 0));
      CK(cudaDeviceSynchronize());
      CK(cudaMemcpy(vc.data(), codes, nx, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(vs.data(), scales, ns * 4, cudaMemcpyDeviceToHost));
      const bool same = vc == rc && std::memcmp(vs.data(), rs.data(), ns * 4) == 0;
      auto t0 = std::chrono::steady_clock::now();
      do {
        for (int i = 0; i < 20; ++i) CK(v.f(p, 0));
        CK(cudaDeviceSynchronize());
      } while (std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() < warm_ms);
      std::vector<float> ms(reps);
      for (int r = 0; r < reps; ++r) {
        CK(cudaEventRecord(e0));
        CK(v.f(p, 0));
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        CK(cudaEventElapsedTime(&ms[r], e0, e1));
      }
      std::sort(ms.begin(), ms.end());
      const double med = ms[reps / 2], bytes = nx * 3.0 + ns * 4.0;
      std::printf("%-10s %-14s %8.4f %8.0f %6s\n", c.name, v.name, med, bytes / (med * 1e6), same ? "yes" : "NO");
    }
    CK(cudaFree(x));
    CK(cudaFree(codes));
    CK(cudaFree(ref_codes));
    CK(cudaFree(scales));
    CK(cudaFree(ref_scales));
  }
  return 0;
}
