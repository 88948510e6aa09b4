// Standalone self-test and benchmark of the grouped NVFP4 GEMM kernels (csrc/): each configuration
// the heuristic picks (csrc/gemm_contract.h) against a float64 reference, on edge-case group sizes.
//
// Build: cmake with -DJAX_NVFP4_BUILD_TOOLS=ON builds it as the target gemm_selftest with the
// extension's flags (e.g. pip wheel . -Cbuild-dir=build/tools -Ccmake.define.JAX_NVFP4_BUILD_TOOLS=ON;
// tests/test_selftest.py does this and runs it on the GPU).
// Usage: gemm_selftest [--small] [--no-bench] [--bench-only] [--no-sweep] [--seed S] [--kernel mma|wgmma|both] [--only L1-1536]
//                      [--force BT]  (bench only that token tile)
//                      [--sustain MS]  (bench under sustained back-to-back load, ~2 x MS ms per case)
//                      [--lognormal]  (bench group sizes with log-normal weights, as python -m
//                                      jax_nvfp4.bench draws them, instead of u^3 with ~20% empty)
//                      [--layout sm90]  (weights in the sm90 load-time layout: W4A16 cases only)
//                      [--kscan]  (wgmma W4A16 time against K: per-k-tile vs per-tile cost)
//   --small: only small shapes (for compute-sanitizer).
//   --kernel: which family the self-test and the benchmark run (default mma: the heuristic's choice
//     among mma and, on sm_90, mma_ws; wgmma: wgmma wherever it handles the case, at its token-tile
//     rule, else the mma choice). "both" runs the self-test with each and benchmarks both side by
//     side. Rows print the family that ran.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "csrc/grouped_gemm.h"
#include "tools/bench/sm90_layout_host.h"

#include "tools/bench/cuda_check.h"

using jax_nvfp4::GroupedGemmParams;

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 12345) {}
  uint64_t next() {
    s += 0x9E3779B97F4A7C15ull;
    uint64_t z = s;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uni() { return (next() >> 11) * (1.0 / 9007199254740992.0); }
  int range(int lo, int hi) { return lo + static_cast<int>(next() % static_cast<uint64_t>(hi - lo + 1)); }
  double normal() {
    double u1 = uni() + 1e-300, u2 = uni();
    return std::sqrt(-2 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
};

static float e2m1_lut[16];
static float e4m3_lut[256];
static void init_luts() {
  const float mag[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  for (int c = 0; c < 16; ++c) e2m1_lut[c] = (c & 8) ? -mag[c & 7] : mag[c & 7];
  for (int b = 0; b < 256; ++b) {
    int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
    float v;
    if (e == 15 && m == 7) v = NAN;
    else if (e == 0) v = std::ldexp(m / 8.0f, -6);
    else v = std::ldexp(1.0f + m / 8.0f, e - 7);
    e4m3_lut[b] = s ? -v : v;
  }
}
static uint16_t f2bf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return 0x7fc0;
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}
static float bf2f(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Random e4m3 scale byte in a sane range (some subnormals, positive).
static uint8_t rand_scale(Rng& r) {
  if (r.uni() < 0.03) return static_cast<uint8_t>(r.range(1, 7));  // subnormal
  int e = r.range(3, 11), m = r.range(0, 7);
  return static_cast<uint8_t>((e << 3) | m);
}

static GroupedGemmParams make_params(const void* lhs, const void* lhs_s, const void* rhs, const void* rhs_s,
                                     const float* alpha, const int32_t* gs, void* out, void* ws, size_t ws_bytes,
                                     int64_t M, int64_t N, int64_t K, int64_t G, bool a_fp4, bool out_f32) {
  GroupedGemmParams p;
  p.lhs = lhs;
  p.lhs_scales = static_cast<const uint8_t*>(lhs_s);
  p.rhs = static_cast<const uint8_t*>(rhs);
  p.rhs_scales = static_cast<const uint8_t*>(rhs_s);
  p.alpha = alpha;
  p.group_sizes = gs;
  p.out = out;
  p.workspace = ws;
  p.workspace_bytes = ws_bytes;
  p.M = M;
  p.N = N;
  p.K = K;
  p.G = G;
  p.a_fp4 = a_fp4;
  p.out_f32 = out_f32;
  return p;
}

enum GsMode { kSkewEmpty, kOneGroupAll, kNegative, kOversized, kExact, kLogNormal };

static std::vector<int32_t> make_group_sizes(Rng& r, int64_t M, int64_t G, GsMode mode) {
  std::vector<int32_t> gs(G, 0);
  if (mode == kOneGroupAll) {
    gs[r.range(0, static_cast<int>(G - 1))] = static_cast<int32_t>(M);
    return gs;
  }
  int64_t target = mode == kExact || mode == kLogNormal ? M
                   : (mode == kOversized ? M + M / 3 + 5 : M - std::max<int64_t>(1, M / 7));
  if (target < 0) target = 0;
  std::vector<double> w(G);
  double sw = 0;
  for (auto& x : w) {
    if (mode == kLogNormal) {
      x = std::exp(r.normal());  // the JAX benchmark's weights (it then draws a multinomial)
    } else {
      double u = r.uni();
      x = (r.uni() < 0.2) ? 0.0 : u * u * u + 0.01;  // skewed, ~20% empty
    }
    sw += x;
  }
  if (sw == 0) { w[0] = 1; sw = 1; }
  int64_t acc = 0;
  for (int64_t g = 0; g < G; ++g) {
    gs[g] = static_cast<int32_t>(std::floor(target * w[g] / sw));
    acc += gs[g];
  }
  int64_t rem = target - acc;
  for (int64_t g = 0; rem > 0; g = (g + 1) % G)
    if (w[g] > 0) { gs[g]++; rem--; }
  if (mode == kNegative && G >= 2) {
    int g = r.range(0, static_cast<int>(G - 1));
    gs[g] = -static_cast<int32_t>(r.range(1, 1000));
  }
  if (mode == kOversized) gs[G - 1] += 1000000;  // far past M: clamped
  return gs;
}

struct Case {
  int64_t M, N, K, G;
  GsMode mode;
};

static const char* mode_name(GsMode m) {
  switch (m) {
    case kSkewEmpty: return "skew+empty,sum<M";
    case kOneGroupAll: return "one group all rows";
    case kNegative: return "negative size";
    case kOversized: return "oversized (clamped)";
    case kExact: return "sum==M";
    case kLogNormal: return "log-normal, sum==M";
  }
  return "?";
}

static int g_fail = 0;
static bool g_wgmma = false;  // which family run_case/bench run (--kernel)
static int g_arch = 0;        // the device's compute capability (10 * major + minor)
static int g_cur_force = 0;   // token tile forced for the next launches (0: the heuristic's)

// The configuration the next launches of p run.
static jax_nvfp4::KernelConfig config_of(const GroupedGemmParams& p) {
  using jax_nvfp4::KernelFamily;
  jax_nvfp4::ProblemDesc d;
  d.arch = g_arch;
  d.M = p.M;
  d.N = p.N;
  d.K = p.K;
  d.G = p.G;
  d.a_fp4 = p.a_fp4;
  d.layout = p.rhs_layout;
  const uint32_t runnable = jax_nvfp4::BuildRunnableFamilies(g_arch);
  if (g_wgmma && (runnable & jax_nvfp4::FamilyBit(KernelFamily::kWgmma)) &&
      jax_nvfp4::FamilyHandles(KernelFamily::kWgmma, d)) {
    if (g_cur_force) return jax_nvfp4::DefaultConfigFor(KernelFamily::kWgmma, g_cur_force == 16 ? 32 : g_cur_force);
    return jax_nvfp4::ConfigForFamily(KernelFamily::kWgmma, d);
  }
  d.families = runnable & ~jax_nvfp4::FamilyBit(KernelFamily::kWgmma);
  const bool ws = (d.families & jax_nvfp4::FamilyBit(KernelFamily::kMmaWs)) &&
                  jax_nvfp4::FamilyHandles(KernelFamily::kMmaWs, d);
  if (g_cur_force == 16 && ws) return jax_nvfp4::DefaultConfigFor(KernelFamily::kMmaWs, 16);
  // A forced 256-token tile is a wgmma one; where wgmma does not handle the problem (K % 64, packed
  // activations) the mma family runs its largest tile instead.
  if (g_cur_force) return jax_nvfp4::DefaultConfigFor(KernelFamily::kMma, g_cur_force > 128 ? 128 : g_cur_force);
  return jax_nvfp4::ChooseKernelConfig(d);
}
static cudaError_t launch(const GroupedGemmParams& p, cudaStream_t s) {
  const jax_nvfp4::KernelConfig c = config_of(p);
  if (!jax_nvfp4::IsKnownConfig(c)) return cudaErrorInvalidValue;
  return jax_nvfp4::LaunchGroupedGemm(p, c, g_arch, s);
}
// token tile of the configuration that runs (0: none), and its family
static int tile_of(const GroupedGemmParams& p) {
  const jax_nvfp4::KernelConfig c = config_of(p);
  return jax_nvfp4::IsKnownConfig(c) ? c.token_tile : 0;
}
static const char* kern_of(const GroupedGemmParams& p) { return jax_nvfp4::FamilyName(config_of(p).family); }

static bool g_layout = false;  // --layout sm90: weights in the sm90 load-time layout (W4A16 only)

static void run_case(const Case& cs, bool a_fp4, bool out_f32, uint64_t seed, int force_bt = 0) {
  // Under --layout sm90 only the W4A16 cases with N % 128 == 0 and K % 64 == 0 run
  // (the reference below keeps using the checkpoint-layout bytes, so it checks the re-layout and
  // the kernel's reading of it).
  if (g_layout && (a_fp4 || cs.N % 128 != 0 || cs.K % 64 != 0)) return;
  Rng r(seed);
  const int64_t M = cs.M, N = cs.N, K = cs.K, G = cs.G;
  const int64_t KH = K / 2, KS = K / 16;
  std::vector<uint8_t> rhs(G * N * KH), rhs_s(G * N * KS);
  for (auto& b : rhs) b = static_cast<uint8_t>(r.next());
  for (auto& b : rhs_s) b = rand_scale(r);
  std::vector<uint16_t> lhs_bf;
  std::vector<uint8_t> lhs_q, lhs_s;
  if (a_fp4) {
    lhs_q.resize(M * KH);
    lhs_s.resize(M * KS);
    for (auto& b : lhs_q) b = static_cast<uint8_t>(r.next());
    for (auto& b : lhs_s) b = rand_scale(r);
  } else {
    lhs_bf.resize(M * K);
    for (auto& h : lhs_bf) h = f2bf(static_cast<float>(r.normal()));
  }
  std::vector<float> alpha(G);
  for (auto& a : alpha) a = static_cast<float>(0.25 + r.uni());
  std::vector<int32_t> gs = make_group_sizes(r, M, G, cs.mode);

  // device
  uint8_t *d_rhs, *d_rhs_s, *d_lhs, *d_lhs_s = nullptr, *d_ws;
  float* d_alpha;
  int32_t* d_gs;
  void* d_out;
  const size_t ws_bytes = jax_nvfp4::GroupedGemmWorkspaceBytes(G);
  const size_t out_bytes = M * N * (out_f32 ? 4 : 2);
  const size_t lhs_bytes = a_fp4 ? lhs_q.size() : lhs_bf.size() * 2;
  CK(cudaMalloc(&d_rhs, std::max<size_t>(rhs.size(), 16)));
  CK(cudaMalloc(&d_rhs_s, std::max<size_t>(rhs_s.size(), 16)));
  CK(cudaMalloc(&d_lhs, std::max<size_t>(lhs_bytes, 16)));
  if (a_fp4) CK(cudaMalloc(&d_lhs_s, std::max<size_t>(lhs_s.size(), 16)));
  CK(cudaMalloc(&d_alpha, G * 4));
  CK(cudaMalloc(&d_gs, G * 4));
  CK(cudaMalloc(&d_ws, ws_bytes));
  CK(cudaMalloc(&d_out, std::max<size_t>(out_bytes, 16)));
  if (g_layout) {
    const std::vector<uint8_t> laid = jax_nvfp4_tools::prepare_sm90_host(rhs, G, N, K);
    CK(cudaMemcpy(d_rhs, laid.data(), laid.size(), cudaMemcpyHostToDevice));
  } else {
    CK(cudaMemcpy(d_rhs, rhs.data(), rhs.size(), cudaMemcpyHostToDevice));
  }
  if (g_layout) {
    const std::vector<uint8_t> laid = jax_nvfp4_tools::prepare_scales_sm90_host(rhs_s, G, N, K);
    CK(cudaMemcpy(d_rhs_s, laid.data(), laid.size(), cudaMemcpyHostToDevice));
  } else {
    CK(cudaMemcpy(d_rhs_s, rhs_s.data(), rhs_s.size(), cudaMemcpyHostToDevice));
  }
  if (a_fp4) {
    CK(cudaMemcpy(d_lhs, lhs_q.data(), lhs_q.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_lhs_s, lhs_s.data(), lhs_s.size(), cudaMemcpyHostToDevice));
  } else if (lhs_bytes) {
    CK(cudaMemcpy(d_lhs, lhs_bf.data(), lhs_bytes, cudaMemcpyHostToDevice));
  }
  CK(cudaMemcpy(d_alpha, alpha.data(), G * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_gs, gs.data(), G * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(d_out, 0xFF, std::max<size_t>(out_bytes, 16)));  // NaN poison
  CK(cudaMemset(d_ws, 0xAB, ws_bytes));

  GroupedGemmParams p = make_params(d_lhs, d_lhs_s, d_rhs, d_rhs_s, d_alpha, d_gs, d_out, d_ws, ws_bytes, M, N,
                                    K, G, a_fp4, out_f32);
  g_cur_force = force_bt;
  p.rhs_layout = g_layout ? jax_nvfp4::RhsLayout::kSm90 : jax_nvfp4::RhsLayout::kCheckpoint;
  CK(launch(p, 0));
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());

  std::vector<uint8_t> out_raw(out_bytes);
  if (out_bytes) CK(cudaMemcpy(out_raw.data(), d_out, out_bytes, cudaMemcpyDeviceToHost));
  auto out_at = [&](int64_t rr, int64_t n) -> float {
    if (out_f32) {
      float f;
      std::memcpy(&f, &out_raw[(rr * N + n) * 4], 4);
      return f;
    }
    uint16_t h;
    std::memcpy(&h, &out_raw[(rr * N + n) * 2], 2);
    return bf2f(h);
  };

  // group bounds (host, same clamping rule)
  std::vector<int64_t> st(G), en(G);
  int64_t pre = 0;
  for (int64_t g = 0; g < G; ++g) {
    st[g] = std::min(pre, M);
    pre += std::max(gs[g], 0);
    en[g] = std::min(pre, M);
  }
  const int64_t total = G ? en[G - 1] : 0;

  // every element: finite in valid rows, exactly zero past the total
  int64_t nonfinite = 0, tail_nonzero = 0;
  for (int64_t rr = 0; rr < M; ++rr)
    for (int64_t n = 0; n < N; ++n) {
      float v = out_at(rr, n);
      if (rr < total) nonfinite += !std::isfinite(v);
      else tail_nonzero += (v != 0.0f);
    }

  // reference rows: all if small, else a sample (first/last row of every group + random)
  std::vector<int64_t> rows;
  const bool full = static_cast<double>(total) * N * K <= 3e8;
  if (full) {
    for (int64_t rr = 0; rr < total; ++rr) rows.push_back(rr);
  } else {
    for (int64_t g = 0; g < G; ++g)
      if (en[g] > st[g]) { rows.push_back(st[g]); rows.push_back(en[g] - 1); }
    for (int i = 0; i < 32 && total > 0; ++i) rows.push_back(static_cast<int64_t>(r.next() % total));
    std::sort(rows.begin(), rows.end());
    rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
    if (rows.size() > 160) {
      std::vector<int64_t> keep;
      for (size_t i = 0; i < rows.size(); i += rows.size() / 160 + 1) keep.push_back(rows[i]);
      rows.swap(keep);
    }
  }
  double num = 0, den = 0;
  int64_t ref_nan = 0;
#pragma omp parallel for reduction(+ : num, den, ref_nan) schedule(dynamic)
  for (int64_t ii = 0; ii < static_cast<int64_t>(rows.size()); ++ii) {
    const int64_t rr = rows[ii];
    int64_t g = 0;
    while (!(rr >= st[g] && rr < en[g])) ++g;
    std::vector<double> a(K);
    for (int64_t k = 0; k < K; ++k) {
      if (a_fp4) {
        uint8_t b = lhs_q[rr * KH + k / 2];
        a[k] = static_cast<double>(e2m1_lut[(k & 1) ? (b >> 4) : (b & 15)]) * e4m3_lut[lhs_s[rr * KS + k / 16]];
      } else {
        a[k] = bf2f(lhs_bf[rr * K + k]);
      }
    }
    for (int64_t n = 0; n < N; ++n) {
      const uint8_t* wq = &rhs[(g * N + n) * KH];
      const uint8_t* ws = &rhs_s[(g * N + n) * KS];
      double s = 0;
      for (int64_t kg = 0; kg < KS; ++kg) {
        double part = 0;
        for (int j = 0; j < 16; ++j) {
          int64_t k = kg * 16 + j;
          uint8_t b = wq[k / 2];
          part += a[k] * e2m1_lut[(k & 1) ? (b >> 4) : (b & 15)];
        }
        s += part * e4m3_lut[ws[kg]];
      }
      double ref = s * alpha[g];
      double got = out_at(rr, n);
      if (std::isnan(got)) ref_nan++;
      num += (got - ref) * (got - ref);
      den += ref * ref;
    }
  }
  const double rel = den > 0 ? std::sqrt(num / den) : (num > 0 ? INFINITY : 0.0);
  const double tol = out_f32 ? 1e-5 : 1e-2;
  const bool ok = nonfinite == 0 && tail_nonzero == 0 && ref_nan == 0 && rel <= tol && std::isfinite(rel);
  if (!ok) g_fail++;
  std::printf("%-5s %-4s kern=%s M=%-6lld N=%-5lld K=%-5lld G=%-3lld BT=%-3d %-20s total=%-6lld rows_checked=%-6zu "
              "relL2=%.3e nonfinite=%lld tail_nonzero=%lld  %s\n",
              a_fp4 ? "W4A4" : "W4A16", out_f32 ? "f32" : "bf16", kern_of(p), (long long)M, (long long)N,
              (long long)K, (long long)G, tile_of(p), mode_name(cs.mode), (long long)total, rows.size(), rel,
              (long long)nonfinite, (long long)tail_nonzero, ok ? "PASS" : "FAIL");
  std::fflush(stdout);
  cudaFree(d_rhs);
  cudaFree(d_rhs_s);
  cudaFree(d_lhs);
  if (d_lhs_s) cudaFree(d_lhs_s);
  cudaFree(d_alpha);
  cudaFree(d_gs);
  cudaFree(d_ws);
  cudaFree(d_out);
}

// ------------------------------------------------------------------------------------------
struct BenchRow {
  std::string name;
  bool a_fp4;
  int64_t rows, K, N;
  int bt;
  double ms, tflops, gbs;
};

static int g_sweep = 1;
static const char* g_only = nullptr;  // --only L1-1536: bench just that case (for profilers)
static int g_force_bt = 0;             // --force 128: bench only this token tile (for profilers)
static GsMode g_bench_sizes = kExact;  // --lognormal: kLogNormal
static int g_sustain_ms = 0;           // --sustain 1000: time back-to-back launches under sustained load
static std::vector<BenchRow> best_table;

// 3 warm-up launches, then 20 timed ones (CUDA events); the times in ms, sorted. These short,
// synchronized bursts leave the GPU below its power cap. With --sustain MS: launches back to back
// for ~MS ms (the GPU settles at its power cap at the largest shapes, as in the JAX benchmark's
// sustained calls), then 5 timed batches of back-to-back launches of ~MS / 5 ms each; the per-call
// times of the batches, sorted.
static std::vector<float> time_launches(const GroupedGemmParams& p, cudaEvent_t e0, cudaEvent_t e1) {
  for (int i = 0; i < 3; ++i) CK(launch(p, 0));
  CK(cudaDeviceSynchronize());
  auto per_call = [&](int n) {  // ms per call of n back-to-back launches
    CK(cudaEventRecord(e0, 0));
    for (int i = 0; i < n; ++i) CK(launch(p, 0));
    CK(cudaEventRecord(e1, 0));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    return ms / static_cast<float>(n);
  };
  std::vector<float> t;
  if (g_sustain_ms > 0) {
    const int batch = std::max(5, static_cast<int>(g_sustain_ms / 5 / std::max(per_call(1), 1e-3f)));
    for (int i = 0; i < 5 * batch; ++i) CK(launch(p, 0));  // heat: ~MS ms
    for (int b = 0; b < 5; ++b) t.push_back(per_call(batch));
  } else {
    for (int i = 0; i < 20; ++i) t.push_back(per_call(1));
  }
  std::sort(t.begin(), t.end());
  return t;
}

static void bench(std::vector<BenchRow>& table) {
  const int64_t G = 48;
  std::printf("bench group sizes: %s\n", mode_name(g_bench_sizes));
  const int64_t shapes[2][2] = {{7168, 6144}, {3072, 7168}};  // (K, N) for L1, L2
  const int64_t rows_list[4] = {192, 1536, 6144, 24576};
  const int64_t maxKH = 7168 / 2, maxN = 7168;
  size_t rhs_bytes = 0, rhs_s_bytes = 0;
  for (auto& s : shapes) {
    rhs_bytes = std::max<size_t>(rhs_bytes, G * s[1] * s[0] / 2);
    rhs_s_bytes = std::max<size_t>(rhs_s_bytes, G * s[1] * s[0] / 16);
  }
  (void)maxKH;
  const int64_t maxM = 24576;
  uint8_t *d_rhs, *d_rhs_s, *d_lhs, *d_lhs_s, *d_ws;
  float* d_alpha;
  int32_t* d_gs;
  void* d_out;
  CK(cudaMalloc(&d_rhs, rhs_bytes));
  CK(cudaMalloc(&d_rhs_s, rhs_s_bytes));
  CK(cudaMalloc(&d_lhs, maxM * 7168 * 2));
  CK(cudaMalloc(&d_lhs_s, maxM * 7168 / 16));
  CK(cudaMalloc(&d_alpha, G * 4));
  CK(cudaMalloc(&d_gs, G * 4));
  CK(cudaMalloc(&d_ws, jax_nvfp4::GroupedGemmWorkspaceBytes(G)));
  CK(cudaMalloc(&d_out, maxM * maxN * 2));
  {  // random contents (host-generated once, reused); 1 MiB chunks with their own seeds, in
     // parallel: serially this took ~10 s per bench process, most of an A/B call's device time
    auto fill = [](auto& v, uint64_t seed, auto gen) {
      const int64_t n = static_cast<int64_t>(v.size()), chunk = 1 << 20;
#pragma omp parallel for schedule(dynamic)
      for (int64_t c = 0; c < (n + chunk - 1) / chunk; ++c) {
        Rng r(seed + static_cast<uint64_t>(c));
        for (int64_t i = c * chunk; i < std::min(n, (c + 1) * chunk); ++i) v[i] = gen(r);
      }
    };
    std::vector<uint8_t> h(rhs_bytes);
    fill(h, 777, [](Rng& r) { return static_cast<uint8_t>(r.next()); });
    CK(cudaMemcpy(d_rhs, h.data(), rhs_bytes, cudaMemcpyHostToDevice));
    std::vector<uint8_t> hs(rhs_s_bytes);
    fill(hs, 1u << 24, [](Rng& r) { return rand_scale(r); });
    CK(cudaMemcpy(d_rhs_s, hs.data(), rhs_s_bytes, cudaMemcpyHostToDevice));
    std::vector<uint16_t> a(maxM * 7168);
    fill(a, 2u << 24, [](Rng& r) { return f2bf(static_cast<float>(r.normal())); });
    CK(cudaMemcpy(d_lhs, a.data(), a.size() * 2, cudaMemcpyHostToDevice));
    std::vector<uint8_t> as(maxM * 7168 / 16);
    fill(as, 3u << 24, [](Rng& r) { return rand_scale(r); });
    CK(cudaMemcpy(d_lhs_s, as.data(), as.size(), cudaMemcpyHostToDevice));
    std::vector<float> al(G);
    Rng r(777);
    for (auto& x : al) x = static_cast<float>(0.5 + r.uni());
    CK(cudaMemcpy(d_alpha, al.data(), G * 4, cudaMemcpyHostToDevice));
  }
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int li = 0; li < 2; ++li) {
    const int64_t K = shapes[li][0], N = shapes[li][1];
    for (int64_t rows : rows_list) {
      if (g_only && std::string(g_only) != std::string(li == 0 ? "L1-" : "L2-") + std::to_string(rows)) continue;
      Rng r(1000 + rows + li);
      std::vector<int32_t> gs = make_group_sizes(r, rows, G, g_bench_sizes);
      CK(cudaMemcpy(d_gs, gs.data(), G * 4, cudaMemcpyHostToDevice));
      for (int fp4 = 0; fp4 < 2; ++fp4) {
        GroupedGemmParams p = make_params(d_lhs, d_lhs_s, d_rhs, d_rhs_s, d_alpha, d_gs, d_out, d_ws,
                                          jax_nvfp4::GroupedGemmWorkspaceBytes(G), rows, N, K, G, fp4, false);
        // timing only: the random bytes are valid codes in either layout
        if (g_layout && fp4) continue;
        p.rhs_layout = g_layout ? jax_nvfp4::RhsLayout::kSm90 : jax_nvfp4::RhsLayout::kCheckpoint;
        g_cur_force = 0;
        const int auto_bt = tile_of(p);
        BenchRow best{}, chosen{};
        best.ms = 1e30;
        const bool wg = config_of(p).family == jax_nvfp4::KernelFamily::kWgmma;
        for (int bt : {16, 32, 64, 128, 256}) {
          if (g_force_bt ? bt != g_force_bt : (g_sweep == 0 && bt != auto_bt)) continue;
          if (rows >= 6144 && bt == 16) continue;  // hopeless, saves time
          if (wg ? (bt < 32) : (bt > 128)) continue;  // wgmma tiles: 32-256; mma: 16-128
          g_cur_force = bt;
          if (tile_of(p) != bt) continue;  // not available in this build
          const std::vector<float> t = time_launches(p, e0, e1);
          const double ms = t[t.size() / 2];
          const double flops = 2.0 * rows * K * N;
          const double wbytes = G * N * K * 0.5625;
          BenchRow b{li == 0 ? "L1" : "L2", fp4 != 0, rows, K, N, bt, ms, flops / ms / 1e9, wbytes / ms / 1e6};
          std::printf("bench %s %s %-5s rows=%-6lld K=%lld N=%lld BT=%-3d%s %.4f ms  %.1f TFLOP/s  %.0f GB/s(weights)  "
                      "[min %.4f max %.4f]\n",
                      kern_of(p), b.name.c_str(), fp4 ? "W4A4" : "W4A16", (long long)rows, (long long)K, (long long)N, bt,
                      bt == auto_bt ? "*" : " ", ms, b.tflops, b.gbs, t.front(), t.back());
          std::fflush(stdout);
          if (bt == auto_bt) chosen = b;
          if (ms < best.ms) best = b;
        }
        table.push_back(chosen);
        best_table.push_back(best);
      }
    }
  }
  cudaFree(d_rhs);
  cudaFree(d_rhs_s);
  cudaFree(d_lhs);
  cudaFree(d_lhs_s);
  cudaFree(d_alpha);
  cudaFree(d_gs);
  cudaFree(d_ws);
  cudaFree(d_out);
}

// Device buffers of a timing-only W4A16 problem (constant bytes: valid codes and scales in either
// layout; alpha 1), sized for the largest G x N x K and M x K the caller runs.
struct TimingBuffers {
  uint8_t *rhs, *rhs_s, *lhs, *ws;
  float* alpha;
  int32_t* gs;
  void* out;
  TimingBuffers(int64_t G, int64_t N, int64_t K, int64_t M) {
    CK(cudaMalloc(&rhs, G * N * K / 2));
    CK(cudaMalloc(&rhs_s, G * N * K / 16));
    CK(cudaMalloc(&lhs, M * K * 2));
    CK(cudaMalloc(&alpha, G * 4));
    CK(cudaMalloc(&gs, G * 4));
    CK(cudaMalloc(&ws, jax_nvfp4::GroupedGemmWorkspaceBytes(G)));
    CK(cudaMalloc(&out, M * N * 2));
    CK(cudaMemset(rhs, 0x5a, G * N * K / 2));
    CK(cudaMemset(rhs_s, 0x38, G * N * K / 16));
    CK(cudaMemset(lhs, 0x3f, M * K * 2));
    std::vector<float> al(G, 1.0f);
    CK(cudaMemcpy(alpha, al.data(), G * 4, cudaMemcpyHostToDevice));
  }
  ~TimingBuffers() {
    for (void* q : {static_cast<void*>(rhs), static_cast<void*>(rhs_s), static_cast<void*>(lhs),
                    static_cast<void*>(ws), static_cast<void*>(alpha), static_cast<void*>(gs), out})
      cudaFree(q);
  }
  // params of `rows` rows of the problem (G, N, K) with these group sizes (copied to the device)
  GroupedGemmParams params(const std::vector<int32_t>& sizes, int64_t rows, int64_t N, int64_t K) {
    const int64_t G = static_cast<int64_t>(sizes.size());
    CK(cudaMemcpy(gs, sizes.data(), G * 4, cudaMemcpyHostToDevice));
    GroupedGemmParams p = make_params(lhs, nullptr, rhs, rhs_s, alpha, gs, out, ws,
                                      jax_nvfp4::GroupedGemmWorkspaceBytes(G), rows, N, K, G, false, false);
    p.rhs_layout = g_layout ? jax_nvfp4::RhsLayout::kSm90 : jax_nvfp4::RhsLayout::kCheckpoint;
    g_cur_force = g_force_bt;
    return p;
  }
};

// --kscan: wgmma W4A16 time against K at fixed N, G and rows. A straight-line fit time = a + b * KT
// per tile separates the per-k-tile cost from a per-tile cost (tile switches, epilogue, lookups).
static void kscan() {
  const int64_t G = 48, N = 6144, maxK = 7168, maxM = 24576;
  TimingBuffers buf(G, N, maxK, maxM);
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  for (int64_t rows : {192, 1536, 24576}) {
    Rng r(1000 + rows);
    const std::vector<int32_t> gs = make_group_sizes(r, rows, G, g_bench_sizes);
    for (int64_t K : {1024, 2048, 3072, 4096, 7168}) {
      const GroupedGemmParams p = buf.params(gs, rows, N, K);
      const int bt = tile_of(p);
      int64_t tiles = 0;
      for (int32_t g : gs) tiles += (std::max(g, 0) + bt - 1) / bt;
      tiles *= (N + 127) / 128;
      const std::vector<float> t = time_launches(p, e0, e1);
      const double ms = t[t.size() / 2];
      const double per_cta = static_cast<double>(tiles) / sms;
      std::printf("kscan %s rows=%-6lld K=%-5lld BT=%-3d tiles/CTA=%6.1f %.4f ms  us/tile=%.3f\n", kern_of(p),
                  (long long)rows, (long long)K, bt, per_cta, ms, 1000.0 * ms / std::ceil(per_cta));
      std::fflush(stdout);
    }
  }
}


int main(int argc, char** argv) {
  bool small = false, do_bench = true, bench_only = false, do_kscan = false;
  uint64_t seed = 42;
  std::vector<bool> kernels = {false};  // false: mma, true: wgmma
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--small")) small = true;
    else if (!std::strcmp(argv[i], "--no-bench")) do_bench = false;
    else if (!std::strcmp(argv[i], "--bench-only")) bench_only = true;
    else if (!std::strcmp(argv[i], "--no-sweep")) g_sweep = 0;
    else if (!std::strcmp(argv[i], "--kscan")) do_kscan = true;
    else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) g_only = argv[++i];
    else if (!std::strcmp(argv[i], "--force") && i + 1 < argc) g_force_bt = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--sustain") && i + 1 < argc) g_sustain_ms = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--lognormal")) g_bench_sizes = kLogNormal;
    else if (!std::strcmp(argv[i], "--layout") && i + 1 < argc) {
      const char* l = argv[++i];
      if (!std::strcmp(l, "sm90")) g_layout = true;
      else if (std::strcmp(l, "checkpoint")) { std::fprintf(stderr, "--layout must be checkpoint or sm90\n"); return 2; }
    }
    else if (!std::strcmp(argv[i], "--seed") && i + 1 < argc) seed = std::strtoull(argv[++i], nullptr, 10);
    else if (!std::strcmp(argv[i], "--kernel") && i + 1 < argc) {
      const char* k = argv[++i];
      if (!std::strcmp(k, "mma")) kernels = {false};
      else if (!std::strcmp(k, "wgmma")) kernels = {true};
      else if (!std::strcmp(k, "both")) kernels = {false, true};
      else { std::fprintf(stderr, "--kernel must be mma, wgmma or both\n"); return 2; }
    }
  }
  init_luts();
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  g_arch = jax_nvfp4::DeviceArch(0);
  std::printf("device: %s, %d SMs, compute capability %d.%d\n", prop.name, prop.multiProcessorCount, g_arch / 10,
              g_arch % 10);
  if (do_kscan) {  // wgmma only
    g_wgmma = true;
    kscan();
    return 0;
  }

  for (bool kw : kernels) {
    g_wgmma = kw;
    std::printf("\n===== kernel: %s =====\n", kw ? "wgmma (mma where wgmma does not handle the case)" : "mma");
    if (!bench_only) {
      std::vector<Case> cases = {
          {0, 64, 64, 4, kSkewEmpty},       {1, 8, 32, 1, kExact},           {1, 8, 32, 1, kSkewEmpty},
          {37, 8, 96, 3, kSkewEmpty},       {37, 8, 96, 3, kNegative},       {37, 8, 96, 3, kOversized},
          {300, 200, 160, 5, kSkewEmpty},   {300, 200, 160, 5, kOneGroupAll}, {300, 200, 160, 5, kNegative},
          {300, 200, 160, 5, kOversized},   {70, 130, 32, 2, kSkewEmpty},    {2048, 256, 256, 4, kSkewEmpty},
          {5000, 300, 512, 3, kNegative},
          // K % 64 == 0 variants of the small shapes (wgmma handles these: odd k-tile counts, N tails)
          {1, 8, 64, 1, kExact},            {37, 8, 128, 3, kNegative},      {37, 8, 192, 3, kOversized},
          {300, 200, 192, 5, kSkewEmpty},   {300, 200, 192, 5, kOneGroupAll}, {70, 130, 64, 2, kSkewEmpty},
          {700, 72, 320, 9, kOversized},
          // N % 128 == 0 shapes (the only ones --layout sm90 runs)
          {1, 128, 64, 1, kExact},          {37, 128, 128, 3, kNegative},    {300, 256, 192, 5, kSkewEmpty},
          {300, 256, 192, 5, kOneGroupAll}, {700, 384, 320, 9, kOversized},
      };
      if (!small) {
        cases.push_back({1000, 136, 7168, 64, kSkewEmpty});
        cases.push_back({1000, 136, 7168, 64, kOversized});
        cases.push_back({4096, 7168, 3072, 48, kSkewEmpty});
        cases.push_back({20000, 384, 1024, 8, kSkewEmpty});
        // V4-Pro decode on one GPU: 384 experts, ~4 rows each (L1 and L2 shapes)
        cases.push_back({1536, 7168, 3072, 384, kSkewEmpty});
        cases.push_back({1536, 6144, 7168, 384, kSkewEmpty});
      }
      uint64_t s = seed;
      for (const Case& c : cases)
        for (int fp4 = 0; fp4 < 2; ++fp4)
          for (int f32 = 0; f32 < 2; ++f32) {
            if (c.M * c.N * c.K > 2000000000LL && f32 == 0 && fp4 == 1) continue;  // keep the big case short
            run_case(c, fp4 != 0, f32 != 0, ++s);
          }
      // every token-tile config on a few shapes
      const Case forced[] = {{37, 8, 96, 3, kNegative},       {300, 200, 160, 5, kSkewEmpty},
                             {1000, 136, 7168, 64, kOversized}, {300, 200, 192, 5, kSkewEmpty},
                             {700, 72, 320, 9, kOversized},      {700, 384, 320, 9, kOversized},
                             {300, 256, 192, 5, kSkewEmpty},     {2000, 256, 128, 7, kSkewEmpty},
                             {1300, 384, 192, 5, kLogNormal}};  // groups over 256 rows: the 256 tile's split
      for (const Case& c : forced)
        for (int bt : {16, 32, 64, 128, 256}) {
          if (!kw && bt == 256) continue;
          run_case(c, false, true, ++s, bt);
          run_case(c, true, false, ++s, bt);
        }
      std::printf("selftest (%s): %d failure(s) so far\n", kw ? "wgmma" : "mma", g_fail);
    }
    std::vector<BenchRow> table;
    best_table.clear();
    if (do_bench && !small) bench(table);
    if (g_layout) {  // W4A16 rows only
      for (const BenchRow& a : table)
        std::printf("| %s sm90 layout | %lld | BT %d | %.3f ms | %.1f TFLOP/s |\n", a.name.c_str(), (long long)a.rows,
                    a.bt, a.ms, a.tflops);
      table.clear();
      best_table.clear();
    }
    if (!table.empty()) {
      std::printf("\n[%s] auto token tile:\n| case | rows | BT | W4A16 ms | TFLOP/s | GB/s | W4A4 ms | TFLOP/s | GB/s |\n|---|---|---|---|---|---|---|---|---|\n",
                  kw ? "wgmma" : "mma");
      for (size_t i = 0; i + 1 < table.size(); i += 2) {
        const BenchRow& a = table[i];
        const BenchRow& b = table[i + 1];
        std::printf("| %s K=%lld N=%lld | %lld | %d | %.3f | %.1f | %.0f | %.3f | %.1f | %.0f |\n", a.name.c_str(),
                    (long long)a.K, (long long)a.N, (long long)a.rows, a.bt, a.ms, a.tflops, a.gbs, b.ms, b.tflops,
                    b.gbs);
      }
    }
    if (!best_table.empty()) {
      std::printf("\n[%s] best token tile per case (sweep):\n| case | rows | W4A16 best BT | ms | W4A4 best BT | ms |\n|---|---|---|---|---|---|\n",
                  kw ? "wgmma" : "mma");
      for (size_t i = 0; i + 1 < best_table.size(); i += 2)
        std::printf("| %s | %lld | %d | %.3f | %d | %.3f |\n", best_table[i].name.c_str(),
                    (long long)best_table[i].rows, best_table[i].bt, best_table[i].ms, best_table[i + 1].bt,
                    best_table[i + 1].ms);
    }
  }
  if (!bench_only) std::printf("SELFTEST %s\n", g_fail ? "FAILED" : "PASSED");
  return g_fail ? 1 : 0;
}
