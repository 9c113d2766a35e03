// What the fp8 benches share: CUDA error checks, GPU time per launch and random inputs.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <vector>

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e = (x);                                                                        \
    if (e != cudaSuccess) {                                                                     \
      std::printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e));             \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

namespace fp8_bench {

inline double median_us(const std::function<cudaError_t()>& launch) {
  for (int i = 0; i < 5; ++i) CK(launch());
  std::vector<double> rounds;
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int r = 0; r < 5; ++r) {
    CK(cudaEventRecord(a));
    for (int i = 0; i < 50; ++i) CK(launch());
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    rounds.push_back(1e3 * ms / 50);
  }
  std::sort(rounds.begin(), rounds.end());
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return rounds[2];
}

inline void* random_device_bytes(size_t bytes, std::mt19937& rng, bool fp8) {
  std::vector<unsigned char> h(bytes);
  if (fp8) {  // e4m3 magnitudes in [2^-3, 2^1): exponent bits 4..7, any mantissa and sign
    for (auto& v : h) v = (unsigned char)((rng() & 0x80) | ((4 + rng() % 4) << 3) | (rng() & 7));
  } else {  // fp16 in [-1, 1): exponent 10..14 (2^-5 .. 2^-1), any mantissa and sign
    for (size_t i = 0; i + 1 < bytes; i += 2) {
      const unsigned v = (rng() & 0x8000u) | ((10u + rng() % 5u) << 10) | (rng() & 0x3ffu);
      h[i] = (unsigned char)(v & 0xff), h[i + 1] = (unsigned char)(v >> 8);
    }
  }
  void* d = nullptr;
  CK(cudaMalloc(&d, bytes));
  CK(cudaMemcpy(d, h.data(), bytes, cudaMemcpyHostToDevice));
  return d;
}

}  // namespace fp8_bench
