// Lab harness (issue 48): checks and times the FP8 grouped GEMM on prepared e4m3 weights
// (tools/lab/fp8_prepared/grouped_gemm_fp8_prepared_sm90.cu) against a float64 CPU reference of the FP8 mode's math.
//
// Build (repo root; one static binary, CUDA runtime linked statically, sm_90a only):
//   CUT=$(python -c "import cutlass_library,os;print(os.path.dirname(cutlass_library.__file__))")/source/include
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -cudart static \
//        -I. -I$CUT -o tools/lab/fp8_prepared/fp8_prepared_check \
//        tools/lab/fp8_prepared/fp8_prepared_check.cu tools/lab/fp8_prepared/grouped_gemm_fp8_prepared_sm90.cu \
//        csrc/grouped_gemm_fp8_prepared_sm90.cu
// (The probe builds of docs/archive/fp8-prepared-lab.md add -DP8_PROBE=1/2/3; their results are wrong
// by design and the checks FAIL. -DP8_ST128=N sets the lab 128-token tile's stage count, 6 by default;
// -DP8_WALIAS=1 reads every weight box from a few L2-resident n-tiles, also wrong by design.)
// Run (H200):
//   tools/lab/fp8_prepared/fp8_prepared_check --small     odd shapes, empty/negative groups, sizes summing below and
//                                            above M, M = 0; every row checked; every configuration; bf16
//                                            and f32 out (seconds; also the compute-sanitizer case)
//   tools/lab/fp8_prepared/fp8_prepared_check             bench shapes (48 experts, L1 N 6144 K 7168, L2 N 7168 K 3072,
//                                            rows 192/1536/6144/24576, skewed sizes as jax_nvfp4/bench/gemm.py),
//                                            10 configurations each; 12 sampled rows per case checked
//   options: --seed S, --reps R (timed launches, default 20), --warm-ms W (before timing a configuration,
//            launch it back to back for W ms: the sustained regime the API bench times), --only SUBSTRING (cases whose name has
//            it, e.g. "L1 rows 24576"), --cfg CODES (a comma list of configurations, codes as below),
//            --sizes-from FILE (lines "L1 rows 6144: n0,...,n47": those cases take these group sizes,
//            e.g. the API bench's, which tools/lab/fp8_prepared/gpu_run.sh writes)
// Configurations ("cfg" column, code = tile * 1000 + cluster * 100 + walk * 10 + consumer; code 1,
// "package", is the package's kernel, csrc/grouped_gemm_fp8_prepared_sm90.cu; e.g. --cfg 128100 or --cfg 1):
//   TxC{t|n|sS}[o|r][*]: T tokens per tile (32/64/128/192), C CTAs per cluster (2: activation boxes shared
//   by TMA multicast), the walk inside a group (tens digit: 0 t token-tile-major, 1 n n-tile-major, d >= 2
//   sS blocks of S = 2^(d-1) n-tiles with the block's token tiles in turn), the consumer: plain
//   (digit 0), o the overlapped one (1: two chunk accumulators), r the ordered one (2: the warpgroups take
//   turns issuing, one promotes while the other's wgmmas run); * marks the FP8 mode's heuristic tile (32 up to 24 rows per
//   group on average, 64 up to 64, 128 above) with one CTA, token-tile-major, plain consumer.
//
// The data: NVFP4 weights (e2m1 codes, e4m3 block scales of 16) and e4m3 activation codes with
// power-of-two chunk scales are hash functions of their indices (host and device compute the same
// values). The device prepares w8[g, n, kk] = e4m3_rn(e2m1 * scale / 8) in the kernel k order (kk =
// 128 c + p holds logical k = 128 c + perm(p)) and writes the activations in the same order, as the
// FP8 mode's quantizer does. The reference works in logical k order, in float64, with NVIDIA's
// cuda_fp8 conversions for the e4m3 values: out = alpha[g] * 8 * sum_c xs[c, r] * sum_{k in c} q * w8.
//
// Output: one line per case and tile: ms (median of R launches, each the setup kernel + the GEMM, as
// the API runs them), TFLOP/s on the real rows (2 * rows * N * K), the largest per-row
// ||out - ref|| / ||ref|| ("rel") and the largest |out - ref| / max|ref row| ("elt"), and PASS/FAIL.
// Exit status 1 if any check fails.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "csrc/gemm_contract.h"
#include "csrc/grouped_gemm.h"  // the package's launcher (csrc/grouped_gemm_fp8_prepared_sm90.cu)
#include "tools/bench/cuda_check.h"

namespace jax_nvfp4 {
cudaError_t LaunchGroupedGemmFp8Prepared(const GroupedGemmParams& p, int token_tile, int cluster, int walk,
                                         int consumer, cudaStream_t stream);
}
using jax_nvfp4::GroupedGemmParams;

// Configuration code 1: the package's kernel (its one kKernelConfigs entry), beside the lab's codes,
// so that one run times both on the same machine.
constexpr int kPackageCode = 1;
// The walk digit (tens): 0 token-tile-major, 1 n-tile-major, d >= 2 blocks of 2^(d-1) n-tiles.
static int walk_of(int code) {
  const int d = code / 10 % 10;
  return d < 2 ? d : 1 << (d - 1);
}
static cudaError_t launch(const GroupedGemmParams& p, int code) {
  if (code == kPackageCode)
    return jax_nvfp4::LaunchGroupedGemmFp8Prepared(
        p, jax_nvfp4::KernelConfig{jax_nvfp4::KernelFamily::kWgmmaFp8Prepared, 128, 6, 1}, 0);
  return jax_nvfp4::LaunchGroupedGemmFp8Prepared(p, code / 1000, code / 100 % 10, walk_of(code), code % 10, 0);
}

// ------------------------------------------------------------------------------------------------
// Data as functions of indices (host and device)
__host__ __device__ inline uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
__host__ __device__ inline uint64_t h3(uint64_t seed, uint64_t tag, uint64_t i) {
  return mix(mix(seed * 0x100000001B3ull + tag) ^ i);
}
// e2m1 code (4 bits) of weight (g, n, k): nibble of a hash
__host__ __device__ inline uint32_t wcode(uint64_t seed, int64_t gn, int64_t K, int64_t k) {
  return static_cast<uint32_t>(h3(seed, 1, gn * K + k) >> 20) & 0xFu;
}
// e4m3 block scale byte of weight block (g, n, k / 16): 2^-4 .. ~2^4 plus a few zeros and subnormals
__host__ __device__ inline uint32_t wscale(uint64_t seed, int64_t gn, int64_t K, int64_t k) {
  const uint64_t h = h3(seed, 2, gn * (K / 16) + k / 16);
  if ((h & 1023) == 0) return 0u;      // a zero block
  if ((h & 1023) == 1) return 0x03u;   // a subnormal scale: w8 rounds to small values / zero
  return 0x18u + static_cast<uint32_t>((h >> 12) % 0x40u);  // 2^-4 .. 2^4 (0x58 = 2^4)
}
// e4m3 activation code of (r, k): any finite byte (NaN codes 0x7F / 0xFF become 448 / -448)
__host__ __device__ inline uint32_t acode(uint64_t seed, int64_t r, int64_t K, int64_t k) {
  uint32_t b = static_cast<uint32_t>(h3(seed, 3, r * K + k) >> 24) & 0xFFu;
  if ((b & 0x7Fu) == 0x7Fu) b ^= 1u;
  return b;
}
// power-of-two chunk scale of (r, chunk c): 2^-6 .. 2^2
__host__ __device__ inline float ascale(uint64_t seed, int64_t r, int64_t c) {
  const int e = static_cast<int>(h3(seed, 4, r * 4099 + c) % 9) - 6;
  return ldexpf(1.0f, e);
}
__host__ __device__ inline float e4m3_value(uint32_t b) {
  __nv_fp8_e4m3 v;
  v.__x = static_cast<__nv_fp8_storage_t>(b);
  return static_cast<float>(v);
}
__host__ __device__ inline float e2m1_value(uint32_t c) {
  const float mags[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  return (c & 8u) ? -mags[c & 7u] : mags[c & 7u];
}
// the prepared weight byte: e4m3_rn(e2m1 * scale / 8) (the product is exact in float)
__host__ __device__ inline uint8_t w8_byte(uint64_t seed, int64_t gn, int64_t K, int64_t k) {
  const float v = e2m1_value(wcode(seed, gn, K, k)) * e4m3_value(wscale(seed, gn, K, k)) * 0.125f;
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}
// the FP8 mode's kernel k order: chunk position p = 32j + 16h + 4t + i holds logical k 32t + 8j + 4h + i
__host__ __device__ inline int perm(int p) {
  const int j = p >> 5, h = (p >> 4) & 1, t = (p >> 2) & 3, i = p & 3;
  return 32 * t + 8 * j + 4 * h + i;
}

__global__ void prepare_weights_kernel(uint8_t* w8, int64_t GN, int64_t K, uint64_t seed) {
  const int64_t total = GN * K;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t gn = i / K, kk = i % K;
    const int64_t k = (kk & ~int64_t(127)) + perm(static_cast<int>(kk & 127));
    w8[i] = w8_byte(seed, gn, K, k);
  }
}
__global__ void make_acts_kernel(uint8_t* q, float* xs, int64_t M, int64_t K, uint64_t seed) {
  const int64_t total = M * K;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / K, kk = i % K;
    const int64_t k = (kk & ~int64_t(127)) + perm(static_cast<int>(kk & 127));
    q[i] = static_cast<uint8_t>(acode(seed, r, K, k));
    if ((kk & 127) == 0) xs[(kk / 128) * M + r] = ascale(seed, r, kk / 128);
  }
}

// ------------------------------------------------------------------------------------------------
struct Case {
  std::string name;
  int64_t G, N, K, M;
  std::vector<int32_t> sizes;
  bool all_rows;            // check every row (small cases) or a sample
  std::vector<int> tiles;   // configurations: tile * 1000 + cluster * 100 + walk * 10 + consumer
  std::vector<bool> out_f32s;
  int heuristic_tile;       // marked with * in the table (0: none)
};

std::vector<int32_t> skewed_sizes(int64_t rows, int G, uint64_t seed) {
  // log-normal weights, multinomial counts (as jax_nvfp4/bench/gemm.py; not the same stream of numbers)
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> p(G);
  double sum = 0;
  for (auto& v : p) sum += (v = std::exp(nd(rng)));
  std::vector<int32_t> s(G);
  int64_t left = rows;
  double pleft = 1.0;
  for (int g = 0; g < G; ++g) {
    const double q = g + 1 == G ? 1.0 : std::min(1.0, p[g] / sum / pleft);
    std::binomial_distribution<int64_t> bd(left, q);
    s[g] = static_cast<int32_t>(g + 1 == G ? left : bd(rng));
    left -= s[g];
    pleft -= p[g] / sum;
  }
  return s;
}

int heuristic_tile(int64_t rows, int64_t G) {
  const int64_t avg = (rows + G - 1) / G;
  return avg <= 24 ? 32 : avg <= 64 ? 64 : 128;
}

// Reference rows: out[r, :] in float64 for row r of group g.
void reference_row(uint64_t seed, const Case& c, int64_t r, int g, const std::vector<float>& alpha,
                   const std::vector<float>& w8g, std::vector<double>& out) {
  const int64_t K = c.K, N = c.N, KC = K / 128;
  std::vector<double> q(K);
  for (int64_t k = 0; k < K; ++k) q[k] = e4m3_value(acode(seed, r, K, k));
  out.assign(N, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    const float* w = w8g.data() + n * K;
    double acc = 0;
    for (int64_t ch = 0; ch < KC; ++ch) {
      double part = 0;
      for (int k = 0; k < 128; ++k) part += q[ch * 128 + k] * w[ch * 128 + k];
      acc += part * ascale(seed, r, ch);
    }
    out[n] = acc * alpha[g] * 8.0;
  }
}

// The host's w8 values of group g, logical k order, as floats [N][K].
std::vector<float> host_w8_group(uint64_t seed, const Case& c, int g) {
  std::vector<float> w(static_cast<size_t>(c.N * c.K));
  for (int64_t n = 0; n < c.N; ++n)
    for (int64_t k = 0; k < c.K; ++k) w[n * c.K + k] = e4m3_value(w8_byte(seed, g * c.N + n, c.K, k));
  return w;
}

float read_out(const std::vector<uint8_t>& host, bool f32, size_t idx) {
  if (f32) {
    float v;
    std::memcpy(&v, host.data() + idx * 4, 4);
    return v;
  }
  uint16_t b;
  std::memcpy(&b, host.data() + idx * 2, 2);
  uint32_t u = uint32_t(b) << 16;
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

struct CheckResult {
  double rel = 0, elt = 0;
  int64_t bad = 0;  // NaN / unwritten / wrong zero rows
};

static double g_warm_ms = 0;  // --warm-ms

int run_case(const Case& c, uint64_t seed, int reps, bool print_header) {
  const int64_t G = c.G, N = c.N, K = c.K, M = c.M;
  // group bounds, clamped to M as the setup kernel does (negative sizes count as 0)
  std::vector<int64_t> st(G), en(G);
  int64_t pre = 0;
  for (int64_t g = 0; g < G; ++g) {
    st[g] = std::min(pre, M);
    pre += std::max(c.sizes[g], 0);
    en[g] = std::min(pre, M);
  }
  const int64_t used = std::min(pre, M);
  std::vector<float> alpha(G);
  for (int64_t g = 0; g < G; ++g) alpha[g] = 1e-3f * static_cast<float>(1 + h3(seed, 5, g) % 997);

  uint8_t *d_w8 = nullptr, *d_q = nullptr;
  float *d_xs = nullptr, *d_alpha = nullptr;
  int32_t* d_sizes = nullptr;
  void *d_out = nullptr, *d_ws = nullptr;
  const size_t ws_bytes = jax_nvfp4::GroupedGemmWorkspaceBytes(G);
  CK(cudaMalloc(&d_w8, std::max<size_t>(16, G * N * K)));
  CK(cudaMalloc(&d_q, std::max<size_t>(16, M * K)));
  CK(cudaMalloc(&d_xs, std::max<size_t>(16, (K / 128) * M * 4)));
  CK(cudaMalloc(&d_alpha, G * 4));
  CK(cudaMalloc(&d_sizes, G * 4));
  CK(cudaMalloc(&d_out, std::max<size_t>(16, M * N * 4)));
  CK(cudaMalloc(&d_ws, ws_bytes));
  prepare_weights_kernel<<<2048, 256>>>(d_w8, G * N, K, seed);
  CK(cudaGetLastError());
  if (M > 0) {
    make_acts_kernel<<<2048, 256>>>(d_q, d_xs, M, K, seed);
    CK(cudaGetLastError());
  }
  CK(cudaMemcpy(d_alpha, alpha.data(), G * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_sizes, c.sizes.data(), G * 4, cudaMemcpyHostToDevice));
  CK(cudaDeviceSynchronize());

  // rows to check and their references
  std::vector<int64_t> rows;
  std::vector<int> row_group;
  if (c.all_rows) {
    for (int64_t g = 0; g < G; ++g)
      for (int64_t r = st[g]; r < en[g]; ++r) rows.push_back(r), row_group.push_back(static_cast<int>(g));
  } else {
    // 4 groups (the largest, the smallest non-empty, the first and the last non-empty), 3 rows each
    std::vector<int> gs;
    int big = -1, small = -1, first = -1, last = -1;
    for (int g = 0; g < G; ++g) {
      const int64_t n = en[g] - st[g];
      if (n <= 0) continue;
      if (first < 0) first = g;
      last = g;
      if (big < 0 || n > en[big] - st[big]) big = g;
      if (small < 0 || n < en[small] - st[small]) small = g;
    }
    for (int g : {big, small, first, last})
      if (g >= 0 && std::find(gs.begin(), gs.end(), g) == gs.end()) gs.push_back(g);
    for (int g : gs)
      for (int64_t r : {st[g], (st[g] + en[g]) / 2, en[g] - 1})
        if (std::find(rows.begin(), rows.end(), r) == rows.end()) rows.push_back(r), row_group.push_back(g);
  }
  std::vector<std::vector<double>> ref(rows.size());
  {
    int cur = -1;
    std::vector<float> w8g;
    // rows are grouped by group in both orders above
    for (size_t i = 0; i < rows.size(); ++i) {
      if (row_group[i] != cur) w8g = host_w8_group(seed, c, cur = row_group[i]);
      reference_row(seed, c, rows[i], row_group[i], alpha, w8g, ref[i]);
    }
  }

  if (print_header)
    std::printf("%-22s %8s %4s %9s %9s %10s %10s  %s\n", "case", "cfg", "out", "ms", "TFLOP/s", "rel", "elt",
                "check");
  int fails = 0;
  std::vector<cudaEvent_t> e0(reps), e1(reps);
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventCreate(&e0[i]));
    CK(cudaEventCreate(&e1[i]));
  }
  for (int tile : c.tiles)
    for (bool f32 : c.out_f32s) {
      GroupedGemmParams p;
      p.lhs = d_q;
      p.rhs = d_w8;
      p.alpha = d_alpha;
      p.group_sizes = d_sizes;
      p.out = d_out;
      p.workspace = d_ws;
      p.workspace_bytes = ws_bytes;
      p.M = M;
      p.N = N;
      p.K = K;
      p.G = G;
      p.out_f32 = f32;
      p.fp8 = true;
      p.lhs_chunk_scales = d_xs;
      // poison: every output element NaN, so that an unwritten one shows
      CK(cudaMemset(d_out, 0xFF, std::max<size_t>(16, M * N * 4)));
      CK(launch(p, tile));
      CK(cudaDeviceSynchronize());
      const size_t esz = f32 ? 4 : 2;
      std::vector<uint8_t> host(static_cast<size_t>(M * N) * esz);
      if (M * N > 0) CK(cudaMemcpy(host.data(), d_out, host.size(), cudaMemcpyDeviceToHost));
      CheckResult cr;
      const double tol_rel = f32 ? 1e-3 : 8e-3, tol_elt = f32 ? 2e-3 : 1.6e-2;
      for (size_t i = 0; i < rows.size(); ++i) {
        double num = 0, den = 0, mx = 0, emax = 0;
        for (int64_t n = 0; n < N; ++n) mx = std::max(mx, std::fabs(ref[i][n]));
        for (int64_t n = 0; n < N; ++n) {
          const double o = read_out(host, f32, rows[i] * N + n);
          const double d = o - ref[i][n];
          if (!std::isfinite(o)) {
            ++cr.bad;
            continue;
          }
          num += d * d;
          den += ref[i][n] * ref[i][n];
          emax = std::max(emax, std::fabs(d));
        }
        const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
        const double elt = mx > 0 ? emax / mx : emax;
        cr.rel = std::max(cr.rel, rel);
        cr.elt = std::max(cr.elt, elt);
      }
      // rows past the groups must be +0; in full-check mode every row of a group must be finite
      for (int64_t r = used; r < M; ++r)
        for (int64_t n = 0; n < N; ++n)
          if (read_out(host, f32, r * N + n) != 0.0f) ++cr.bad;
      if (!c.all_rows && M * N > 0) {  // the sampled mode still checks that every used row was written
        for (int64_t r = 0; r < used; ++r)
          for (int64_t n = 0; n < N; n += 97)
            if (!std::isfinite(read_out(host, f32, r * N + n))) ++cr.bad;
      }
      const bool ok = cr.bad == 0 && cr.rel <= tol_rel && cr.elt <= tol_elt;
      fails += !ok;

      // timing: setup + GEMM per launch, median of reps (bf16 out only in the bench cases)
      double ms = 0;
      if (!c.all_rows && M > 0) {
        for (int i = 0; i < 3; ++i) CK(launch(p, tile));
        // sustained load first (--warm-ms): the API bench times back-to-back calls for seconds, and under
        // the GPU's power cap a burst after the checks' idle time runs at higher clocks than that
        for (auto w0 = std::chrono::steady_clock::now();
             std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - w0).count() < g_warm_ms;) {
          for (int i = 0; i < 8; ++i) CK(launch(p, tile));
          CK(cudaDeviceSynchronize());
        }
        std::vector<float> t(reps);
        for (int i = 0; i < reps; ++i) {
          CK(cudaEventRecord(e0[i]));
          CK(launch(p, tile));
          CK(cudaEventRecord(e1[i]));
        }
        CK(cudaEventSynchronize(e1[reps - 1]));
        CK(cudaGetLastError());
        for (int i = 0; i < reps; ++i) CK(cudaEventElapsedTime(&t[i], e0[i], e1[i]));
        std::sort(t.begin(), t.end());
        ms = t[reps / 2];
      }
      const double tflops = ms > 0 ? 2.0 * used * N * K / (ms * 1e-3) / 1e12 : 0.0;
      char tl[16];
      if (tile == kPackageCode)
        std::snprintf(tl, sizeof tl, "package");
      else
        std::snprintf(tl, sizeof tl, "%dx%d%s%s%s", tile / 1000, tile / 100 % 10,
                      walk_of(tile) == 0 ? "t" : walk_of(tile) == 1 ? "n" : ("s" + std::to_string(walk_of(tile))).c_str(),
                      tile % 10 == 1 ? "o" : tile % 10 == 2 ? "r" : "", tile == c.heuristic_tile ? "*" : "");
      if (ms > 0)
        std::printf("%-22s %8s %4s %9.3f %9.1f %10.2e %10.2e  %s", c.name.c_str(), tl, f32 ? "f32" : "bf16", ms,
                    tflops, cr.rel, cr.elt, ok ? "PASS" : "FAIL");
      else
        std::printf("%-22s %8s %4s %9s %9s %10.2e %10.2e  %s", c.name.c_str(), tl, f32 ? "f32" : "bf16", "-", "-",
                    cr.rel, cr.elt, ok ? "PASS" : "FAIL");
      if (cr.bad) std::printf("  (%lld bad elements: NaN/unwritten, or nonzero past the groups)", (long long)cr.bad);
      std::printf("\n");
      std::fflush(stdout);
    }
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventDestroy(e0[i]));
    CK(cudaEventDestroy(e1[i]));
  }
  CK(cudaFree(d_w8));
  CK(cudaFree(d_q));
  CK(cudaFree(d_xs));
  CK(cudaFree(d_alpha));
  CK(cudaFree(d_sizes));
  CK(cudaFree(d_out));
  CK(cudaFree(d_ws));
  return fails;
}

int main(int argc, char** argv) {
  bool small = false;
  uint64_t seed = 1;
  int reps = 20;
  std::string only;
  std::vector<int> only_cfgs;
  std::string sizes_from;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--small")) small = true;
    else if (!std::strcmp(argv[i], "--seed") && i + 1 < argc) seed = std::strtoull(argv[++i], nullptr, 10);
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--warm-ms") && i + 1 < argc) g_warm_ms = std::atof(argv[++i]);
    else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
    else if (!std::strcmp(argv[i], "--sizes-from") && i + 1 < argc) sizes_from = argv[++i];
    else if (!std::strcmp(argv[i], "--cfg") && i + 1 < argc) {
      for (const char* t = argv[++i]; *t;) {  // a comma list of codes
        only_cfgs.push_back(std::atoi(t));
        while (*t && *t != ',') ++t;
        if (*t == ',') ++t;
      }
    }
    else {
      std::fprintf(stderr,
                   "usage: %s [--small] [--seed S] [--reps R] [--warm-ms W] [--only CASE_SUBSTRING] [--cfg CODE[,CODE...]] "
                   "[--sizes-from FILE]\n",
                   argv[0]);
      return 2;
    }
  }
  reps = std::max(1, std::min(reps, 1000));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("fp8_prepared_check: %s (sm_%d%d, %d SMs), seed %llu, %s\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount, (unsigned long long)seed,
              small ? "--small: every row checked, no timing" : "bench shapes: 12 sampled rows checked per case");
  std::printf("math: out = alpha[g] * 8 * sum_c xs[c, r] * (sum_{k in c} q[r, k] * e4m3(e2m1 * scale / 8)); "
              "reference float64 on the CPU\n");
  if (prop.major != 9) {
    std::printf("needs an sm_90 GPU (H100/H200)\n");
    return 2;
  }
  std::vector<Case> cases;
  if (small) {
    const std::vector<int> tiles = {kPackageCode, 32100, 64100, 128100, 192100, 64200, 128200, 192200, 128110, 128210,
                                    128101, 128201, 64201, 128102, 128202, 192102, 192202, 128130, 128140, 128142,
                                    128240, 192140, 64130, 128242, 192142, 192242};
    const std::vector<bool> outs = {false, true};
    // odd N (rows past N of a tile read the next group's weights and are dropped), empty and negative
    // groups, sizes summing below M (tail rows zeroed), above M (clamped), tiles over several boxes
    cases.push_back({"G5 N200 K384 sum<M", 5, 200, 384, 300, {0, 37, 1, 130, 0}, true, tiles, outs, 0});
    cases.push_back({"G3 N128 K128 sum=M", 3, 128, 128, 129, {64, 0, 65}, true, tiles, outs, 0});
    cases.push_back({"G4 N72 K256 sum>M", 4, 72, 256, 150, {100, -3, 100, 7}, true, tiles, outs, 0});
    cases.push_back({"G6 N264 K640 mixed", 6, 264, 640, 400, {1, 33, 0, 97, 128, 129}, true, tiles, outs, 0});
    cases.push_back({"G2 N128 K256 M=0", 2, 128, 256, 0, {0, 0}, true, tiles, {false}, 0});
    cases.push_back({"G1 N256 K7168 one", 1, 256, 7168, 70, {70}, true, tiles, outs, 0});
  } else {
    const int64_t G = 48;
    struct Shape {
      const char* name;
      int64_t N, K;
    } shapes[] = {{"L1", 6144, 7168}, {"L2", 7168, 3072}};
    for (const auto& s : shapes)
      for (int64_t rows : {192, 1536, 6144, 24576}) {
        Case c;
        c.name = std::string(s.name) + " rows " + std::to_string(rows);
        c.G = G;
        c.N = s.N;
        c.K = s.K;
        c.M = rows;
        c.sizes = skewed_sizes(rows, static_cast<int>(G), seed * 1000 + rows);
        c.all_rows = false;
        c.tiles = {kPackageCode, 32100, 64100, 128100, 192100, 64200, 128200, 192200, 128101, 128201, 64201,
                   128102, 128202, 192102, 192202};
        c.out_f32s = {false};
        c.heuristic_tile = heuristic_tile(rows, G) * 1000 + 100;
        cases.push_back(c);
      }
  }
  if (!sizes_from.empty()) {
    // lines "<case name>: n0,n1,...": those cases take these group sizes (the API bench's, so that the
    // two time the same problem); a listed case whose G differs is an error
    FILE* f = std::fopen(sizes_from.c_str(), "r");
    if (!f) {
      std::fprintf(stderr, "--sizes-from: cannot open %s\n", sizes_from.c_str());
      return 2;
    }
    char line[8192];
    while (std::fgets(line, sizeof line, f)) {
      const char* colon = std::strchr(line, ':');
      if (!colon) continue;
      const std::string name(line, colon - line);
      std::vector<int32_t> sz;
      for (const char* t = colon + 1; *t && *t != '\n';) {
        sz.push_back(static_cast<int32_t>(std::strtol(t, nullptr, 10)));
        while (*t && *t != ',' && *t != '\n') ++t;
        if (*t == ',') ++t;
      }
      for (auto& c : cases)
        if (c.name == name) {
          if (static_cast<int64_t>(sz.size()) != c.G) {
            std::fprintf(stderr, "--sizes-from: %s has %zu sizes, the case %lld groups\n", name.c_str(), sz.size(),
                         (long long)c.G);
            std::fclose(f);
            return 2;
          }
          c.sizes = sz;
        }
    }
    std::fclose(f);
    std::printf("group sizes of the listed cases from %s\n", sizes_from.c_str());
  }
  int fails = 0;
  bool header = true;
  for (size_t i = 0; i < cases.size(); ++i) {
    if (!only.empty() && cases[i].name.find(only) == std::string::npos) continue;
    if (!only_cfgs.empty()) cases[i].tiles = only_cfgs;
    fails += run_case(cases[i], seed + i, reps, header);
    header = false;
  }
  if (!small)
    std::printf("targets (issue 48, H200, ms): L1 6144 <= 0.66, L1 24576 <= 1.75, L2 6144 <= 0.33, "
                "L2 24576 <= 0.88\n");
  std::printf("%s: %d check(s) failed\n", fails ? "FAIL" : "OK", fails);
  return fails ? 1 : 0;
}
