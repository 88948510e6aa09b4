// Lab microbenchmark (tools/lab/): the FP8 kernel's decode-and-MMA pipeline alone, in weight
// elements per second. It runs the production consumer loop (csrc/fp8_consumer_sm90.cuh,
// consumer_mainloop: two consumer warpgroups, 128 weight rows, four m64nNk32 e4m3 RS wgmmas per
// 128-k stage, the next stage decoded while they run, the promotion) on stages that stay in shared
// memory: a producer warp only cycles the full/empty mbarriers, so no byte comes from HBM or L2.
// What it answers: how many NVFP4 weight elements per second an SM turns into e4m3 MMA operands
// when supply is free, for each way of decoding them (docs/archive/perf-log-decode.md).
//
// Decoders (one 32-bit word of 8 codes -> two A-fragment registers of 4 e4m3 each):
//   raw    no decode (the words are the fragments; no table loads): the loop's ceiling;
//   ckpt   the production decode of checkpoint-layout codes (csrc/e2m1_e4m3_decode.cuh): 9 integer
//          instructions per word (4 PRMT, 3 LOP3, 2 shifts);
//   split  codes with their sign bits pre-placed once at load time (the "signs apart" word, below):
//          7 per word (2 PRMT, 3 LOP3, 2 shifts).
// The "signs apart" word keeps each code's 3 magnitude bits in its nibble and moves the sign bits:
// bit 3 of nibble 2b+1 holds the sign of code b (b = 0..3, the low register's byte b), bit 3 of
// nibble 2b the sign of code 4+b (the high register's byte b). Then lo = table(m) | (w & 0x80808080)
// and hi = table(m >> 16) | ((w << 4) & 0x80808080), m = w & 0x77777777.
//
// Build and run (GPU machine; tools/lab/kernel_lab.sh decode does both):
//   cmake -DJAX_NVFP4_BUILD_TOOLS=ON ... && ./decode_mma_microbench [--tiles T] [--k K]
// Prints one row per decoder and WGMMA N: clocks per stage per SM (clock64 in the first consumer
// thread of each CTA, mean over CTAs), the elements per second that gives at the measured SM clock
// (events around the launch), and the prediction from the counted instructions (see predict()).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include <cute/arch/mma_sm90_gmma.hpp>

#include "csrc/e2m1_e4m3_decode.cuh"
#include "csrc/wgmma_sm90_common.cuh"
#include "csrc/fp8_consumer_sm90.cuh"
#include "csrc/fp8_e2m1_operands_sm90.cuh"
#include "tools/bench/cuda_check.h"


namespace jx = jax_nvfp4;
namespace gmma = cute::SM90::GMMA;

namespace {

constexpr int kBK = jx::kFp8BK;  // k per stage (one promotion chunk)

// The decoders besides the kernel's own (jx::CheckpointDecode, "ckpt"), for E2m1RegisterA's Decode.
struct RawDecode {
  static constexpr bool kTable = false;
  static __device__ __forceinline__ void word(uint32_t w, uint2, uint32_t& lo, uint32_t& hi) {
    lo = w;
    hi = w;
  }
};
struct SplitDecode {
  static constexpr bool kTable = true;
  static __device__ __forceinline__ void word(uint32_t w, uint2 t, uint32_t& lo, uint32_t& hi) {
    const uint32_t m = w & 0x77777777u;
    lo = jx::prmt(t.x, t.y, m) | (w & 0x80808080u);
    hi = jx::prmt(t.x, t.y, m >> 16) | ((w << 4) & 0x80808080u);
  }
};
using CkptDecode = jx::CheckpointDecode;
template <typename Dec>
constexpr const char* kDecoderName = std::is_same_v<Dec, RawDecode> ? "raw" : std::is_same_v<Dec, SplitDecode> ? "split" : "ckpt";

// The production kernel's stage layout and operands, with the decoder as a parameter.
template <int BT, int STAGES>
using Cfg = jx::F8Cfg<BT, STAGES>;
template <int BT, int STAGES, typename Dec>
using Operands = jx::E2m1RegisterA<BT, STAGES, Dec>;

// consumer_mainloop's RS path with the stage's four k32 wgmmas in two independent accumulator chains
// (k32 steps 0, 2 into part0; 1, 3 into part1), summed at the promotion: if the per-stage time is the
// latency of four dependent wgmmas, two chains of two halve it.
template <int NN, int STAGES, typename Ops, int ACC>
__device__ __forceinline__ void two_chain_mainloop(float (&acc)[ACC], const Ops& op, uint32_t bar_base, int KT, int& s,
                                                   uint32_t& ph) {
  const uint32_t full0 = bar_base, empty0 = bar_base + STAGES * 8;
  const int lane = threadIdx.x & 31;
  typename Ops::Frag frag[2];
  float part0[NN / 2], part1[NN / 2];
  auto stage = [&](int kt, auto buf_c) {
    constexpr int buf = decltype(buf_c)::value;
    const typename Ops::Desc d = op.descriptors(s, frag[buf]);
    const uint2 flags = jx::fence_operands(0u, 1u);
    jx::fence_acc(part0);
    jx::fence_acc(part1);
    cute::warpgroup_arrive();
    op.template mma<NN>(frag[buf], d, 0, part0, static_cast<gmma::ScaleOut>(flags.x));
    op.template mma<NN>(frag[buf], d, 1, part1, static_cast<gmma::ScaleOut>(flags.x));
    op.template mma<NN>(frag[buf], d, 2, part0, static_cast<gmma::ScaleOut>(flags.y));
    op.template mma<NN>(frag[buf], d, 3, part1, static_cast<gmma::ScaleOut>(flags.y));
    cute::warpgroup_commit_batch();
    jx::fence_acc(part0);
    jx::fence_acc(part1);
    int s_next = s;
    uint32_t ph_next = ph;
    jx::advance_stage<STAGES>(s_next, ph_next);
    if (kt + 1 < KT) {
      jx::mbar_wait(full0 + s_next * 8, ph_next);
      op.load(s_next, frag[buf ^ 1]);
    }
    cute::warpgroup_wait<0>();
    jx::fence_acc(part0);
    jx::fence_acc(part1);
    const uint32_t xs = op.scales(s);
#pragma unroll
    for (int j8 = 0; j8 < NN / 8; ++j8) {
      const float2 sc = jx::lds64f(xs + 32 * j8);
#pragma unroll
      for (int i = 0; i < 4; ++i)
        acc[4 * j8 + i] = fmaf(part0[4 * j8 + i] + part1[4 * j8 + i], (i & 1) ? sc.y : sc.x, acc[4 * j8 + i]);
    }
    jx::release_stage(empty0, s, lane);
    s = s_next;
    ph = ph_next;
  };
  jx::mbar_wait(full0 + s * 8, ph);
  op.load(s, frag[0]);
  int kt = 0;
#pragma unroll 1
  for (; kt + 1 < KT; kt += 2) {
    stage(kt, std::integral_constant<int, 0>{});
    stage(kt + 1, std::integral_constant<int, 1>{});
  }
  if (kt < KT) stage(kt, std::integral_constant<int, 0>{});
}

__device__ __forceinline__ uint32_t mix(uint32_t x) {  // a cheap integer hash: random-looking operands
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  return x ^ (x >> 16);
}

// tiles x KT stages per CTA; clk[block] = clocks of the consumers' loop (first consumer thread).
// CPS CTAs per SM: 1 as in the production kernel (consumers at 232 registers), or 2 (104: the
// register file holds 2 x (128 x 40 + 256 x 104)), which doubles the consumer warps per scheduler.
template <int NN, int STAGES, typename Dec, int CPS, int CHAINS>
__global__ void __launch_bounds__(384, CPS) bench_kernel(int KT, int tiles, float* sink, long long* clk) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = Cfg<NN, STAGES>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (jx::smem_u32(smem_raw) & 1023u)) & 1023u);
  const uint32_t bar_base = jx::smem_u32(smem + C::kBarOff);
  const uint32_t full0 = bar_base, empty0 = bar_base + STAGES * 8;
  // random operands: e4m3 tokens without NaN (bits 0x78 of the magnitude never all set), random
  // codes, block scales 2^-4 .. 2^4 (e4m3 exponent field 3 .. 11), token chunk scales 1
  const uint32_t seed = blockIdx.x * 0x9E3779B9u;
  for (int st = 0; st < STAGES; ++st) {
    uint8_t* s = smem + st * C::kStage;
    for (int i = threadIdx.x; i < NN * kBK / 4; i += blockDim.x)
      reinterpret_cast<uint32_t*>(s + C::kActOff)[i] = mix(seed + 7 * i + st) & 0xB7B7B7B7u;
    for (int i = threadIdx.x; i < 128 * kBK / 8; i += blockDim.x)
      reinterpret_cast<uint32_t*>(s + C::kWOff)[i] = mix(seed + 13 * i + 5 * st + 1);
    for (int i = threadIdx.x; i < 128 * 8; i += blockDim.x)
      s[C::kSOff + i] = static_cast<uint8_t>(((3 + mix(seed + i + 3 * st) % 9) << 3) | (i & 7));
    for (int i = threadIdx.x; i < NN; i += blockDim.x) reinterpret_cast<float*>(s + C::kXsOff)[i] = 1.0f;
  }
  if (threadIdx.x < 256) {
    const uint2 e = jx::product_table(threadIdx.x);
    jx::sts64(jx::smem_u32(smem + C::kTableOff) + threadIdx.x * 8, e.x, e.y);
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      jx::mbar_init(full0 + s * 8, 1);
      jx::mbar_init(empty0 + s * 8, jx::kFp8ConsumerWarps);
    }
    jx::fence_mbarrier_init();
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (warp < 4) {
    jx::setmaxnreg_dec<jx::kFp8ProducerRegs>();
    if (warp != 0 || lane != 0) return;
    int s = 0;
    uint32_t ph = 0;
#pragma unroll 1
    for (int i = 0; i < tiles * KT; ++i) {  // supply is free: a stage is "full" as soon as it is empty
      jx::mbar_wait(empty0 + s * 8, ph ^ 1);
      jx::mbar_arrive(full0 + s * 8);
      jx::advance_stage<STAGES>(s, ph);
    }
    return;
  }
  jx::setmaxnreg_inc<(CPS == 1 ? jx::kFp8ConsumerRegs : 104)>();
  const int cw = warp - 4;
  const int r0 = cw * 16 + (lane >> 2);
  float acc[NN / 2];
  float total = 0.0f;
  int s = 0;
  uint32_t ph = 0;
  const long long t0 = clock64();
#pragma unroll 1
  for (int t = 0; t < tiles; ++t) {
#pragma unroll
    for (int i = 0; i < NN / 2; ++i) acc[i] = 0.0f;
    if constexpr (CHAINS == 1)
      jx::consumer_mainloop<NN, STAGES>(acc, Operands<NN, STAGES, Dec>(smem, r0, cw >> 2), bar_base, KT, s, ph);
    else
      two_chain_mainloop<NN, STAGES>(acc, Operands<NN, STAGES, Dec>(smem, r0, cw >> 2), bar_base, KT, s, ph);
#pragma unroll
    for (int i = 0; i < NN / 2; ++i) total += acc[i];
  }
  const long long t1 = clock64();
  sink[blockIdx.x * 256 + threadIdx.x - 128] = total;
  if (threadIdx.x == 128) clk[blockIdx.x] = t1 - t0;
#endif
}

// Predicted clocks per stage per SM (docs/archive/perf-notes.md, "What the consumers are actually
// bound by": the integer work of warps that issue wgmmas adds to their tensor time, integer ops at
// half rate, two consumer warps per scheduler): tensor 128 x NN x 128 MACs at 4096 per clock, plus
// 2 warps x 2 clocks x the warp's integer instructions per stage (8 words x the decoder's count,
// ~12 loads and address ops, and NN/2 promotion FFMAs at one clock each).
double predict(const char* dec, int nn) {
  const int per_word = !std::strcmp(dec, "raw") ? 0 : !std::strcmp(dec, "ckpt") ? 9 : 7;
  const double tensor = 128.0 * nn * 128 / 4096;
  const double integer = 2 * (2 * (8 * per_word + 12) + nn / 2.0);
  return tensor + integer;
}

struct Row {
  std::string dec;
  int nn, cps, stages, chains;
  double clk_per_stage, elems_per_s, predicted_clk, sm_ghz;
};

template <int NN, int STAGES, typename Dec, int CPS, int CHAINS = 1>
Row run(int sms, int KT, int tiles, float* sink, long long* clk) {
  using C = Cfg<NN, STAGES>;
  static_assert(CPS == 1 || C::kSmem <= 232448 / 2 - 1024, "two CTAs per SM");
  auto k = bench_kernel<NN, STAGES, Dec, CPS, CHAINS>;
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem));
  auto launch = [&] {
    k<<<sms * CPS, 384, C::kSmem>>>(KT, tiles, sink, clk);
  };
  launch();  // warm-up
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<double> ms, cps, ghz;
  for (int r = 0; r < 5; ++r) {
    CK(cudaEventRecord(a));
    launch();
    CK(cudaGetLastError());
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float t = 0;
    CK(cudaEventElapsedTime(&t, a, b));
    std::vector<long long> c(sms * CPS);
    CK(cudaMemcpy(c.data(), clk, sms * CPS * sizeof(long long), cudaMemcpyDeviceToHost));
    double mean = 0;  // clocks per CTA: CPS CTAs share an SM, so an SM's stage takes mean / CPS
    for (long long v : c) mean += static_cast<double>(v) / (sms * CPS);
    ms.push_back(t);
    cps.push_back(mean / (static_cast<double>(tiles) * KT * CPS));
    ghz.push_back(mean / (t * 1e6));  // clocks of the loop over the launch's time: a lower bound of the SM clock
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double t_ms = median(ms);
  const double elems = static_cast<double>(sms) * CPS * tiles * KT * 128.0 * kBK;
  return Row{kDecoderName<Dec>, NN, CPS, STAGES, CHAINS, median(cps), elems / (t_ms * 1e-3), predict(kDecoderName<Dec>, NN) / CPS,
             median(ghz)};
}

template <int NN, int STAGES, int CPS = 1>
void run_all(std::vector<Row>& rows, int sms, int KT, int tiles, float* sink, long long* clk) {
  rows.push_back(run<NN, STAGES, RawDecode, CPS>(sms, KT, tiles, sink, clk));
  rows.push_back(run<NN, STAGES, CkptDecode, CPS>(sms, KT, tiles, sink, clk));
  rows.push_back(run<NN, STAGES, SplitDecode, CPS>(sms, KT, tiles, sink, clk));
}

}  // namespace

int main(int argc, char** argv) {
  int K = 7168, tiles = 64;
  const char* json = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--k") && i + 1 < argc) K = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--tiles") && i + 1 < argc) tiles = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
    else {
      std::fprintf(stderr, "usage: %s [--k K] [--tiles T] [--json out.json]\n", argv[0]);
      return 2;
    }
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount, KT = K / kBK;
  float* sink;
  long long* clk;
  CK(cudaMalloc(&sink, sms * 256 * sizeof(float)));
  CK(cudaMalloc(&clk, sms * sizeof(long long)));
  std::vector<Row> rows;
  // the production token tiles and their stage counts (csrc/gemm_contract.h, kKernelConfigs, wgmma_fp8)
  run_all<32, 15>(rows, sms, KT, tiles, sink, clk);
  run_all<64, 12>(rows, sms, KT, tiles, sink, clk);
  run_all<128, 8>(rows, sms, KT, tiles, sink, clk);
  // two CTAs per SM at the small token tiles (half the shared memory each: fewer stages)
  run_all<32, 7, 2>(rows, sms, KT, tiles, sink, clk);
  run_all<64, 5, 2>(rows, sms, KT, tiles, sink, clk);
  // two accumulator chains per stage (two_chain_mainloop), one CTA per SM
  rows.push_back(run<32, 15, RawDecode, 1, 2>(sms, KT, tiles, sink, clk));
  rows.push_back(run<32, 15, CkptDecode, 1, 2>(sms, KT, tiles, sink, clk));
  rows.push_back(run<64, 12, RawDecode, 1, 2>(sms, KT, tiles, sink, clk));
  rows.push_back(run<64, 12, CkptDecode, 1, 2>(sms, KT, tiles, sink, clk));
  std::printf("%s, %d SMs, K %d (%d stages of 128 x 128 weights per tile), %d tiles per CTA\n", prop.name, sms, K,
              KT, tiles);
  std::printf("%-6s %4s %8s %6s %6s %14s %14s %12s %10s\n", "decode", "N", "CTAs/SM", "stages", "chains",
              "clk/stage/SM", "pred clk", "elem/s", "SM GHz>=");
  for (const Row& r : rows)
    std::printf("%-6s %4d %8d %6d %6d %14.1f %14.1f %12.3e %10.3f\n", r.dec.c_str(), r.nn, r.cps, r.stages, r.chains,
                r.clk_per_stage, r.predicted_clk, r.elems_per_s, r.sm_ghz);
  if (json) {
    FILE* f = std::fopen(json, "w");
    if (!f) {
      std::perror(json);
      return 1;
    }
    std::fprintf(f, "{\"device\": \"%s\", \"sms\": %d, \"k\": %d, \"tiles\": %d, \"rows\": [\n", prop.name, sms, K,
                 tiles);
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      std::fprintf(f,
                   "  {\"decode\": \"%s\", \"n\": %d, \"ctas_per_sm\": %d, \"stages\": %d, \"chains\": %d, \"clk_per_stage\": %.1f, "
                   "\"predicted_clk_per_stage\": %.1f, \"elements_per_s\": %.4e, \"sm_ghz_lower_bound\": %.3f}%s\n",
                   r.dec.c_str(), r.nn, r.cps, r.stages, r.chains, r.clk_per_stage, r.predicted_clk, r.elems_per_s,
                   r.sm_ghz,
                   i + 1 < rows.size() ? "," : "");
    }
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }
  CK(cudaFree(sink));
  CK(cudaFree(clk));
  return 0;
}
