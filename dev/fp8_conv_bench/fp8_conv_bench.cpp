// Does an e4m3 convolution pay on the encoder's shapes? Times the fastest conv2d_fprop_fixup_e4m3 tile against
// the fastest fp16 FixUp tile for every 3x3 convolution of the default network at 64x64 inputs, batches 128, 1024
// and 2048: GPU time per launch, 50 launches back to back, median of 5 rounds (CUDA events). Random inputs; the
// fp16 tiles that cannot run a shape are skipped. The fp8 rows count only the convolution: the activations'
// quantization to e4m3 comes on top unless an epilogue writes e4m3.
// Build (GPU machine, after scripts/gpu_run.sh built libkfuse into build-gpu/full):
//   g++ -O2 -std=c++17 -Isrc -I/usr/local/cuda/include dev/fp8_conv_bench/fp8_conv_bench.cpp \
//       -Lbuild-gpu/full/src -lkfuse -L/usr/local/cuda/lib64 -lcudart -Wl,-rpath,$PWD/build-gpu/full/src \
//       -o build-gpu/fp8_conv_bench && build-gpu/fp8_conv_bench
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <utility>
#include <vector>

#include "bench_util.h"
#include "kernels/conv/conv_fixup.h"

using namespace kfuse::kernels;

using namespace fp8_bench;


int main() {
  struct Shape {
    const char* name;
    int hw, c, k, stride;
  };
  const Shape shapes[] = {
      {"block1 3x3 64->64 @16", 16, 64, 64, 1},      {"block2 conv1 64->128 s2 @16", 16, 64, 128, 2},
      {"block2 conv2 128->128 @8", 8, 128, 128, 1},  {"block3 conv1 128->256 s2 @8", 8, 128, 256, 2},
      {"block3 conv2 256->256 @4", 4, 256, 256, 1},  {"block4 conv1 256->512 s2 @4", 4, 256, 512, 2},
      {"block4 conv2 512->512 @2", 2, 512, 512, 1},
  };
  const ConvTile f16_tiles[] = {ConvTile::k128x64,       ConvTile::k64x64,         ConvTile::kSm90_128x64,
                                ConvTile::kSm90_64x64,   ConvTile::k64x64x64,      ConvTile::k128x64x64,
                                ConvTile::k64x128,       ConvTile::k128x128,       ConvTile::k128x64w8,
                                ConvTile::kSm90_64x64_c2x2, ConvTile::kSm90_128x64_s4, ConvTile::kSm90_128x128,
                                ConvTile::kSm90_256x64};
  std::mt19937 rng(7);
  float* scales = nullptr;
  CK(cudaMalloc(&scales, 512 * sizeof(float)));
  std::vector<float> ones(512, 0.01f);
  CK(cudaMemcpy(scales, ones.data(), 512 * sizeof(float), cudaMemcpyHostToDevice));
  const std::pair<const char*, ConvTile> e4m3_tiles[] = {{"128x64", ConvTile::kSm90_128x64},
                                                          {"128x64_k64", ConvTile::kSm90_128x64_k64},
                                                          {"128x128", ConvTile::kSm90_128x128},
                                                          {"256x64", ConvTile::kSm90_256x64}};
  std::printf("%-30s %6s %12s %12s %8s  %s\n", "conv", "batch", "fp16 us", "e4m3 us", "ratio", "e4m3 tile");
  for (int n : {128, 1024, 2048}) {
    for (const Shape& s : shapes) {
      const Conv2dProblem p{n, s.hw, s.hw, s.c, s.k, 3, 3, 1, 1, s.stride, s.stride};
      const size_t xe = size_t(n) * s.hw * s.hw * s.c, we = size_t(s.k) * 9 * s.c,
                   ye = size_t(n) * p.p() * p.q() * s.k;
      void* x16 = random_device_bytes(2 * xe, rng, false);
      void* w16 = random_device_bytes(2 * we, rng, false);
      void* x8 = random_device_bytes(xe, rng, true);
      void* w8 = random_device_bytes(we, rng, true);
      void* y = nullptr;
      CK(cudaMalloc(&y, 2 * ye));
      double best = 1e30;
      for (ConvTile t : f16_tiles) {
        if (!conv2d_fprop_fixup_can_implement(p, ConvDType::kF16, t, 1)) continue;
        FixupEpilogue e;
        e.relu = true;
        best = std::min(best, median_us([&] {
                          return conv2d_fprop_fixup(p, ConvDType::kF16, t, x16, w16, y, e, 1, nullptr, 0, nullptr);
                        }));
      }
      double fp8 = -1;
      const char* fp8_tile = "-";
      for (const auto& [name, tile] : e4m3_tiles) {
        const ConvTile t = tile;  // (a lambda may not capture a structured binding in C++17)
        if (!conv2d_fprop_fixup_e4m3_can_implement(p, t)) continue;
        FixupEpilogue e;
        e.relu = true;
        e.channel_alpha = scales;
        const double us = median_us([&] { return conv2d_fprop_fixup_e4m3(p, t, x8, w8, y, e, nullptr); });
        if (fp8 < 0 || us < fp8) fp8 = us, fp8_tile = name;
      }
      std::printf("%-30s %6d %12.2f %12.2f %8.3f  %s\n", s.name, n, best, fp8, fp8 > 0 ? fp8 / best : 0.0, fp8_tile);
      for (void* ptr : {x16, w16, x8, w8, y}) CK(cudaFree(ptr));
    }
  }
  CK(cudaFree(scales));
  return 0;
}
