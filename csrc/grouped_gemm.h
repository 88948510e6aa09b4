// Grouped NVFP4 GEMM launchers (CUDA runtime; no XLA dependency). The contract, the kernel
// configurations and the heuristic that picks one are in csrc/gemm_contract.h.
#pragma once

#include <cuda_runtime.h>

#include "csrc/gemm_contract.h"

namespace jax_nvfp4 {

// The device's compute capability as 10 * major + minor (cached per device), or 0 on error.
int DeviceArch(int device);

// RunnableFamilies (csrc/gemm_contract.h) of this build on a device of compute capability `arch`.
uint32_t BuildRunnableFamilies(int arch);

// Why configuration c cannot run on a device of compute capability `arch` with this build, or
// nullptr when it can.
const char* ConfigUnsupportedReason(const KernelConfig& c, int arch);

// Enqueues the grouped GEMM with configuration c on `stream`: no allocation, no host
// synchronisation, no device-to-host copy (CUDA-graph capturable). c must be a kKernelConfigs
// entry that runs on `arch` (ConfigUnsupportedReason). wgmma and mma_ws need 16-byte aligned
// buffers (XLA's are) and wgmma the driver's tensor-map encoder; where they are missing, the mma
// kernel runs with the same token tile (64 for larger wgmma tiles). The FP8 mode (p.fp8) runs the
// wgmma_fp8 configurations only, and those run nothing else. No CUDA kernel reads packed
// e2m1 activations with sm90 weights (jax_nvfp4.grouped_gemm dequantizes W4A4 activations to bf16
// first for them): cudaErrorNotSupported. Returns the first CUDA error (launch errors included),
// or cudaErrorInvalidValue when GroupedGemmCheckParams rejects p.
cudaError_t LaunchGroupedGemm(const GroupedGemmParams& p, const KernelConfig& c, int arch, cudaStream_t stream);

// The family launchers LaunchGroupedGemm calls (csrc/grouped_gemm_mma.cu,
// csrc/grouped_gemm_wgmma_sm90.cu). sm90_image: the device runs this build's sm_90a image, whose
// kernels wait for programmatic dependent launches (and only those may be launched so).
cudaError_t LaunchGroupedGemmMma(const GroupedGemmParams& p, const KernelConfig& c, bool sm90_image,
                                 cudaStream_t stream);
bool MmaWsBuffersOk(const GroupedGemmParams& p);
cudaError_t LaunchGroupedGemmWgmma(const GroupedGemmParams& p, const KernelConfig& c, cudaStream_t stream);
bool WgmmaBuffersOk(const GroupedGemmParams& p);
// The FP8 mode (p.fp8; csrc/grouped_gemm_fp8_sm90.cu): configuration c of family wgmma_fp8, checkpoint
// weights, K % 128 == 0; cudaErrorNotSupported for buffers it cannot read (misaligned scales).
cudaError_t LaunchGroupedGemmFp8(const GroupedGemmParams& p, const KernelConfig& c, cudaStream_t stream);

}  // namespace jax_nvfp4
