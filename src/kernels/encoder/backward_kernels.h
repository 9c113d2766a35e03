// The encoder's non-GEMM backward kernels (no CUTLASS), the counterparts of encoder_kernels.h for the training step.
// T is the network's storage type (fp16 or bf16, ConvDType), all math and every sum in fp32. Each launcher runs one or
// more kernels on `stream`, asynchronously; scratch memory comes from the caller (`workspace`, at least the bytes the
// matching *_workspace_bytes function returns, 256-byte aligned). Scalars named sum_* are written with their final
// value (not accumulated into). Every output is fully written (no output needs zeroing by the caller).
// Return cudaErrorInvalidValue without launching for arguments the kernels cannot handle.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/conv/conv_fixup.h"         // ConvDType
#include "kernels/encoder/encoder_kernels.h"  // InputDType

namespace kfuse::kernels {

// Backward of a block's tail (squeeze-excitation + residual join + final ReLU), per image:
//   forward (recomputed from o): m = mean_hw(o), z1 = fc1(m), r = relu(z1), z2 = fc2(r), g = sigmoid(z2),
//                                y = relu(o * g + identity)
//   dz  = dy * (y > 0)                     = dL/d(identity), and dL/d(o * g + identity)
//   dg  = sum_hw(dz * o);  d_z2 = dg * g * (1 - g);  dr = fc2.W^T d_z2;  d_z1 = dr * (r > 0);  dm = fc1.W^T d_z1
//   d_o = dz * g + dm / hw
// and the SE layers' parameter gradients summed over the batch:
//   dw1[j][c] = sum_n d_z1[n][j] * m[n][c],  db1[j] = sum_n d_z1[n][j],
//   dw2[c][j] = sum_n d_z2[n][c] * r[n][j],  db2[c] = sum_n d_z2[n][c].
struct SeBackwardArgs {
  const void* y = nullptr;   // block output (after the ReLU), NHWC [n][hw][p] of T; or y + *y_offset as the forward
  const float* y_offset = nullptr;  // stored it (the next block's a, squeeze_excite's a_next): the ReLU was active
                                    // where y > T(*y_offset) (null: where y > 0)
  const void* dy = nullptr;  // dL/dy: NHWC [n][hw][p] of T; or, when dy_nchw, NCHW [n][p][hw] of T or fp32 (dy_f32)
  bool dy_nchw = false;
  bool dy_f32 = false;       // only with dy_nchw
  const void* o = nullptr;   // the SE input o (after x scale + b2b), NHWC [n][hw][p] of T
  const float* o_scale = nullptr;  // optional (with o_shift): o holds conv2's raw output v, and the SE input is
  const float* o_shift = nullptr;  //   T(v * *o_scale + *o_shift), as the forward's squeeze-excite read it
  int n = 0, hw = 0, p = 0, hidden = 0;
  const float* w1 = nullptr;  // fc1 weight [hidden][p]
  const float* b1 = nullptr;  // [hidden]
  const float* w2 = nullptr;  // fc2 weight [p][hidden]
  const float* b2 = nullptr;  // [p]
  void* d_o = nullptr;        // out: NHWC [n][hw][p] of T
  void* dz = nullptr;         // out: NHWC of T, pixel i of image n at dz + (n * hw + i) * dz_pitch (dz_pitch >= p,
  int dz_pitch = 0;           //      a multiple of 8: dz may be the second half of a [.. | dz] channel concatenation)
  float* dw1 = nullptr;       // out: [hidden][p]
  float* db1 = nullptr;       // out: [hidden]
  float* dw2 = nullptr;       // out: [p][hidden]
  float* db2 = nullptr;       // out: [p]
  float* sum_d_o = nullptr;   // out, optional: sum of d_o over everything  (= dL/d fixup_bias2b)
  float* sum_dz = nullptr;    // out, optional: sum of dz
  float* sum_dy = nullptr;    // out, optional: sum of dy as given
};
size_t se_backward_workspace_bytes(const SeBackwardArgs& args);
cudaError_t launch_se_backward(const SeBackwardArgs& args, ConvDType dtype, void* workspace, cudaStream_t stream);
// The same in two phases on one workspace: _data writes d_o and dz (what the rest of the backward waits for), _params
// the parameter gradients and the scalar sums from what _data left in the workspace. A caller may run _params on
// another stream, after _data and before anything else writes the workspace (the training step does: its
// parameter phase's small grids would otherwise hold the main path for their full latency).
cudaError_t launch_se_backward_data(const SeBackwardArgs& args, ConvDType dtype, void* workspace, cudaStream_t stream);
cudaError_t launch_se_backward_params(const SeBackwardArgs& args, ConvDType dtype, void* workspace,
                                      cudaStream_t stream);

// Backward of conv1's epilogue h2 = relu(v) + b2a (v = conv1 + b1b; h2 is what the forward stored): the gradient
// at v is dh where the ReLU was active. The mask is read from h2 itself: active iff h2 > T(b2a) (b2a rounded to T
// as the forward's store rounded h2). Exact, because the forward's epilogue never rounds an active value to T(b2a)
// (it stores the next value above instead: fixup_epilogue.h), except for b2a == 0, where h2 = T(v) and units with
// 0 < v below T's smallest subnormal read as inactive (fp16: v < 3e-8), as PyTorch's fp16 ReLU would store them.
//   d_pre[i][c] = h2[i][c] > T(*b2a) ? T(scale * dh[i][c]) : 0,   sums over scale * dh and d_pre
struct ReluMaskBackwardArgs {
  const void* dh = nullptr;   // dL/dh2 / scale: [pixels][c] of T, densely packed
  const float* scale = nullptr; // device scalar multiplying dh (conv2's fixup_scale: dh is then conv2^T(d_o)), or null
  const void* h2 = nullptr;   // [pixels][c] of T, densely packed
  const float* b2a = nullptr; // device scalar
  int64_t pixels = 0;
  int c = 0;                  // multiple of 8
  void* d_pre = nullptr;      // out: [pixels] rows of c values of T at d_pre + i * d_pre_pitch (pitch >= c, % 8 == 0)
  int d_pre_pitch = 0;
  float* sum_dh = nullptr;    // out, optional: sum of scale * dh   (= dL/d fixup_bias2a)
  float* sum_d_pre = nullptr; // out, optional: sum of d_pre (= dL/d fixup_bias1b)
};
size_t relu_mask_backward_workspace_bytes(const ReluMaskBackwardArgs& args);
cudaError_t launch_relu_mask_backward(const ReluMaskBackwardArgs& args, ConvDType dtype, void* workspace,
                                      cudaStream_t stream);
// The two full sums from partial sums part[0, parts) and part[parts, 2 parts) (fixed order, float64), as the ReLU-mask
// backward finishes its own: *sum_a and *sum_b (either may be null) are overwritten. One CTA.
cudaError_t launch_sum_pair_finalize(const float* part, int parts, float* sum_a, float* sum_b, cudaStream_t stream);

// Backward of the stem x0 = relu(conv1x1(space_to_depth_4(v), W)), v = x * in_scale[c] + in_shift[c], on the
// operands the forward's multiply consumed (rounded to T, as mixed-precision autograd computes it):
//   g        = T(da + dz) where x0 > 0, else 0                            (dz optional: the identity's gradient)
//   dw[p][k] = sum over pixels (n, i, j) of g[n][i][j][p] * s[n][i][j][k],  s = T(space_to_depth_4(v)), k < 16C,
//              k = dy*4C + dx*C + c for input pixel (4i+dy, 4j+dx), channel c (stem.1.weight's [P0][16C] layout)
//   dinput[n][c][4i+dy][4j+dx] = in_scale[c] * sum_p g[n][i][j][p] * W[k][p]      (optional)
//   sum_da   = sum of da (without dz)                                     (= dL/d fixup_bias1a of block 1)
struct StemBackwardArgs {
  // The forward's input, read as launch_stem reads it (any strides; fp32, fp16, bf16 or uint8).
  const void* x = nullptr;
  InputDType x_dtype = InputDType::kF16;
  int64_t stride_n = 0, stride_c = 0, stride_h = 0, stride_w = 0;  // in elements
  int n = 0, c = 0, h = 0, w = 0;
  const float* in_scale = nullptr;  // [C] or null (identity)
  const float* in_shift = nullptr;  // [C] or null
  const void* weight = nullptr;     // the stem's packed weight [kpad][p0] of T (as StemArgs), for dinput
  int kpad = 0, p0 = 0;             // p0 <= 64 (a multiple of 8)
  const void* x0 = nullptr;         // stem output (after the ReLU): NHWC [n][h/4][w/4][p0] of T
  const void* da = nullptr;         // NHWC [n][h/4][w/4][p0] of T
  const void* dz = nullptr;         // optional, same layout, added to da
  float* dw = nullptr;              // out: [p0][16C]
  float* sum_da = nullptr;          // out, optional
  void* dinput = nullptr;           // out, optional: contiguous NCHW [n][c][h][w] of dinput_dtype
  InputDType dinput_dtype = InputDType::kF32;  // kF32, kF16 or kBF16
};
size_t stem_backward_workspace_bytes(const StemBackwardArgs& args);
cudaError_t launch_stem_backward(const StemBackwardArgs& args, ConvDType dtype, void* workspace, cudaStream_t stream);

}  // namespace kfuse::kernels
