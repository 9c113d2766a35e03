// Parameter layouts of the training step, on the device: packing PyTorch-layout parameters (as the optimizer holds
// them, fp32 / fp16 / bf16) into the kernels' layouts before each forward, and turning the kernels' fp32 weight
// gradients back into PyTorch's layouts after the backward. Both run from a job table in device memory, so a whole
// network costs one launch each way. Plain launchers, no CUTLASS.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/conv/conv_fixup.h"  // ConvDType

namespace kfuse::kernels {

enum class ParamDType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

// One parameter into the packed weight buffer (dst_offset: bytes from its base).
//   kCopyF32: src [count] -> float [count]
//   kKrsc:    src [k][c][r][s] -> T [k][r][s][c]                       (a conv filter for fprop / dgrad / wgrad)
//   kFlip:    src [k][c][r][s] -> T [c][r][s][k], taps flipped:  dst[c][r][s][k] = src[k][c][R-1-r][S-1-s]
//             (the forward conv whose output is the data gradient of a stride-1 conv with symmetric padding)
//   kPooled:  src [k][c][1][1] -> T [k][3][3][c] = src / 9            (avgpool3x3 + conv1x1 as one 3x3 conv)
//   kStem:    src [p][kin][1][1] -> T [kpad][p], rows >= kin zero    (the stem's GEMM operand B)
//   kTapPlanes: src [k][c][r][s] -> T [r][s][c / 8][k][c % 8]         (the warpgroup-MMA block's filter image:
//             one 16-byte row per output channel and (tap, 8-channel group), copied to shared memory as it is; c % 8
//             == 0); with k0: output channels k0 .. k0 + k - 1 of a filter with more (a slice of a fused kernel's
//             stream)
// count is the layout's size (k * r * s * c; kPooled k * 9 * c; kStem r * k). T values are to_t<T>(float(src)),
// kPooled's to_t<T>(float(src) / 9.0f). Fast path (weight_layout.cu): r * s <= 9; src 16-byte aligned with c * r * s
// a multiple of 16 bytes' worth of elements; dst 16-byte aligned with the channel count along its contiguous runs
// (c; kFlip: k) a multiple of 8. Other jobs are packed to the same bytes, slower.
enum class PackKind : int32_t { kCopyF32 = 0, kKrsc, kFlip, kPooled, kStem, kTapPlanes };
struct PackJob {
  const void* src = nullptr;
  int64_t dst_offset = 0;
  int64_t count = 0;  // output elements
  PackKind kind = PackKind::kCopyF32;
  ParamDType src_dtype = ParamDType::kF32;
  int32_t k = 0, c = 0, r = 0, s = 0;  // kStem: k = p, c = kin, r = kpad
  int32_t k0 = 0;                      // kTapPlanes: the first output channel
};
// jobs: device array of `count` PackJob; one launch of a grid sized by the device (nothing about the jobs is read on
// the host). run_flag (device memory, may be null): the kernel packs only where *run_flag != 0; at 0 every CTA returns
// after reading it and nothing is written, so a device-side decision (have the parameters changed?) gates a launch
// that stays in a captured graph.
cudaError_t launch_pack_params(const PackJob* jobs, int count, void* dst_base, ConvDType dtype, cudaStream_t stream,
                               const unsigned* run_flag = nullptr);

// One weight gradient from the kernels' KRSC sums (fp32 from kfuse's CUTLASS wgrad, or T from cuDNN's: g_is_t)
// into PyTorch's layout in the flat fp32 gradient buffer.
//   kKcrs:   g [k][r][s][c] -> dst [k][c][r][s] * (alpha ? *alpha : 1); with `dot_w` (packed T [k][r][s][c]) also
//            dst_dot = sum(dot_w * g) (the gradient of a scalar that multiplied the conv's output: fixup_scale)
//   kPooled: g [k][3][3][c] -> dst [k][c] = sum over the 9 taps / 9
struct GradJob {
  const void* g = nullptr;
  int32_t g_is_t = 0;  // g holds T (the network's fp16 / bf16), else fp32
  float* dst = nullptr;
  const float* alpha = nullptr;
  const void* dot_w = nullptr;
  float* dst_dot = nullptr;
  int32_t kind = 0;  // 0 kKcrs, 1 kPooled
  int32_t k = 0, c = 0, r = 0, s = 0;
};
// Device bytes of the partial sums the dot products need.
size_t grad_finalize_workspace_bytes(int count);
// jobs: device array of `count` GradJob.
cudaError_t launch_grad_finalize(const GradJob* jobs, int count, ConvDType dtype, void* workspace,
                                 cudaStream_t stream);

// out = a + b elementwise over n values of T (n % 8 == 0, 16-byte aligned), and *sum_a = sum of a (fp32, fixed
// order). The data gradient of an identity block: dx = d(conv1 input) + d(identity).
size_t add_and_sum_workspace_bytes(int64_t n);
cudaError_t launch_add_and_sum(const void* a, const void* b, void* out, int64_t n, float* sum_a, ConvDType dtype,
                               void* workspace, cudaStream_t stream);

}  // namespace kfuse::kernels
