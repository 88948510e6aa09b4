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
// synchronisation, no device-to-host copy (CUDA-graph capturable). Runs exactly c; it checks
// nothing. Preconditions (the FFI handler, ffi/grouped_gemm_cuda.cc, checks each once per call):
//   GroupedGemmCheckParams(p) == nullptr, and p.fp8 set exactly for the FP8 families
//     (FamilyComputesMode);
//   ConfigUnsupportedReason(c, arch) == nullptr (c is a kKernelConfigs entry this build runs on
//     `arch`, with the driver's tensor-map encoder for the wgmma families);
//   FamilyHandles(c.family, ProblemOf(p)), and no packed e2m1 activations with sm90 weights (no CUDA
//     kernel reads them; jax_nvfp4.grouped_gemm dequantizes such activations to bf16 first);
//   BufferAlignmentError(p, c) == nullptr (every XLA buffer meets it).
// Returns the first CUDA error (launch errors included).
cudaError_t LaunchGroupedGemm(const GroupedGemmParams& p, const KernelConfig& c, int arch, cudaStream_t stream);

// The family launchers LaunchGroupedGemm calls, with its preconditions (csrc/grouped_gemm_mma.cu,
// csrc/grouped_gemm_wgmma_sm90.cu, csrc/grouped_gemm_fp8_sm90.cu, csrc/grouped_gemm_fp8_prepared_sm90.cu,
// csrc/grouped_gemm_cutlass_fp8_sm90.cu). sm90_image: the device runs this
// build's sm_90a image, whose kernels wait for programmatic dependent launches (and only those may
// be launched so); mma_ws configurations need it.
cudaError_t LaunchGroupedGemmMma(const GroupedGemmParams& p, const KernelConfig& c, bool sm90_image,
                                 cudaStream_t stream);
cudaError_t LaunchGroupedGemmWgmma(const GroupedGemmParams& p, const KernelConfig& c, cudaStream_t stream);
cudaError_t LaunchGroupedGemmFp8(const GroupedGemmParams& p, const KernelConfig& c, cudaStream_t stream);
cudaError_t LaunchGroupedGemmFp8Prepared(const GroupedGemmParams& p, const KernelConfig& c, cudaStream_t stream);
cudaError_t LaunchGroupedGemmCutlassFp8(const GroupedGemmParams& p, const KernelConfig& c, cudaStream_t stream);
// Whether the driver provides cuTensorMapEncodeTiled (the wgmma families' tensor maps).
bool TensorMapEncoderAvailable();

}  // namespace jax_nvfp4
