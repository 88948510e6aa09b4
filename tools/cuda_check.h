// CK(call): abort the tool with the CUDA error, its location and the failing call (the tools in
// this folder are standalone programs; the library's code returns errors instead).
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
