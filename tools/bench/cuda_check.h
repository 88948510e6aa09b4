// CK(call): abort the tool with the CUDA error, its location and the failing call (the tools in
// this folder are standalone programs; the library's code returns errors instead). And
// ms_per_launch: CUDA-event timing of back-to-back launches.
#pragma once

#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

#define CK(x)                                                                                    \
  do {                                                                                           \
    cudaError_t e_ = (x);                                                                        \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "CUDA error %s at %s:%d (%s): %s\n", cudaGetErrorName(e_), __FILE__, \
                   __LINE__, #x, cudaGetErrorString(e_));                                        \
      std::exit(2);                                                                              \
    }                                                                                            \
  } while (0)

// Mean ms per call of launch() (which enqueues one kernel on the default stream): 3 warm-up calls,
// then `reps` back-to-back calls between two events.
template <typename Launch>
float ms_per_launch(Launch launch, int reps = 20) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) launch();
  CK(cudaGetLastError());
  CK(cudaEventRecord(a));
  for (int i = 0; i < reps; ++i) launch();
  CK(cudaEventRecord(b));
  CK(cudaEventSynchronize(b));
  CK(cudaGetLastError());
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, a, b));
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return ms / reps;
}
