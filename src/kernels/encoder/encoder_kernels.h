// The encoder's non-GEMM kernels (no CUTLASS): the fused stem and the fused squeeze-excitation + residual.
// Plain launchers; T is the network's storage type (fp16 or bf16), all math in fp32.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/conv/conv_fixup.h"

namespace kfuse::kernels {

// Element types the stem reads its input in.
enum class InputDType { kF32, kF16, kBF16, kU8 };

// stem: x0 = relu(conv1x1(space_to_depth_4(v), W)) with v = x * in_scale[c] + in_shift[c] (identity when the scale
// pointer is null), reading x (N, C, H, W) through arbitrary element strides (NCHW, channels_last, NHWC uint8 RGBA
// with C = 3 ...). Writes x0 (NHWC, P0 channels) and, when a0 is non-null, a0 = x0 + *b1a (block 1's input).
struct StemArgs {
  const void* x = nullptr;
  InputDType x_dtype = InputDType::kF16;
  int64_t stride_n = 0, stride_c = 0, stride_h = 0, stride_w = 0;  // in elements
  int n = 0, c = 0, h = 0, w = 0;
  const float* in_scale = nullptr;  // [C] or null
  const float* in_shift = nullptr;  // [C] or null
  const void* weight = nullptr;     // [kpad][p0] of T: row k = dy*4C + dx*C + c, zero rows past 16C
  int kpad = 0, p0 = 0;             // kpad: 16C rounded up to 64; p0 % 8 == 0
  const float* b1a = nullptr;
  void* x0 = nullptr;
  void* a0 = nullptr;
};
cudaError_t launch_stem(const StemArgs& args, ConvDType dtype, cudaStream_t stream);

// squeeze-excitation and residual of one block, one CTA per image:
//   g = sigmoid(fc2(relu(fc1(mean_hw(o))))),  y = relu(o * g + identity)
// o, identity: NHWC (HW x P per image) of T. fc weights/biases fp32 (fc1: [hidden, P], fc2: [P, hidden]).
// Outputs, each optional: y (NHWC, T); a_next = y + *next_b1a (NHWC, T; an active y never stores T(next_b1a), so
// y > 0 <=> a_next > T(next_b1a): numeric.cuh pack8_after_relu); out (NCHW, T or fp32 as out_f32).
// With o_scale (and o_shift), o holds conv2's raw output v and the kernel reads o = T(v * *o_scale + *o_shift) (the
// training step: conv2's FixUp epilogue applied here instead of in a pass over v, numeric.cuh affine8).
struct SqueezeExciteArgs {
  const void* o = nullptr;
  const float* o_scale = nullptr;
  const float* o_shift = nullptr;
  const void* identity = nullptr;
  int n = 0, hw = 0, p = 0, hidden = 0;
  const float* w1 = nullptr;
  const float* b1 = nullptr;
  const float* w2 = nullptr;
  const float* b2 = nullptr;
  void* y = nullptr;
  const float* next_b1a = nullptr;
  void* a_next = nullptr;
  void* out_nchw = nullptr;
  bool out_f32 = false;
  // Optional: w1 and w2 again as T (the network's type; exact for an fp16 / bf16 module). Where set, the 512-channel
  // fast kernel at one image per CTA reads these instead (its time follows the bytes per CTA: 64 instead of 128 KB
  // of weights); other shapes and the generic kernel read w1 / w2. 16-byte aligned, else unused.
  const void* w1_t = nullptr;
  const void* w2_t = nullptr;
  // Optional, the squeeze and fc1 computed ahead (launch_squeeze_projection: the last block's dense conv2 GEMM writes
  // fc1's pre-activations of o's raw means as extra output columns). o_stride: elements from one image's o to the
  // next (0: hw * p); pre_hidden: `hidden` values of T per image, image i's at pre_hidden + i * o_stride; w1_rowsum:
  // [hidden] fp32, the row sums of w1. The hidden units are then relu(*o_scale * pre + *o_shift * rowsum + b1), so
  // o_scale and o_shift are required (o raw). Runs at one image per CTA (the fast kernel); o_stride and pre_hidden
  // 16-byte aligned for every image (o_stride % 8 == 0).
  const void* pre_hidden = nullptr;
  const float* w1_rowsum = nullptr;
  int64_t o_stride = 0;
};
cudaError_t launch_squeeze_excite(const SqueezeExciteArgs& args, ConvDType dtype, cudaStream_t stream);

// The squeeze and fc1 of a block's squeeze-excite folded into its conv2 when that convolution is one dense GEMM
// (kernels/conv/dense_conv.h) with a raw output: mean over o's Ho*Wo pixels of (x Wd^T)[po*K + k] = x . Wbar[k], with
// Wbar[k] = (1 / (Ho*Wo)) sum over po of Wd[po*K + k], so fc1's pre-activation (without scale, b2b, b1) is
// x . proj[j] with proj[j] = sum over k of w1[j][k] Wbar[k]: `hidden` more rows of the GEMM.
// wd: the unrolled filter, row-major [po_count * k][kd] of T; w1: fc1's weight [hidden][k] fp32. Writes proj
// ([hidden][kd] of T, rounded once from fp32 sums) and rowsum[j] = sum over k of w1[j][k] (fp32). The same bits on
// every run (a fixed summation order, squeeze_projection.cu). Shapes: k % 4 == 0, kd % 8 == 0, any po_count and
// hidden >= 1; wd, w1 and proj 16-byte aligned. Anything else returns cudaErrorInvalidValue before any launch.
// run_flag (optional, device memory): where non-null and *run_flag == 0 when the kernel runs, it returns at once and
// writes nothing (the caller skips the remake on the device when the weights it derives from did not change).
struct SqueezeProjectionArgs {
  const void* wd = nullptr;
  int po_count = 0, k = 0, kd = 0, hidden = 0;
  const float* w1 = nullptr;
  void* proj = nullptr;
  float* rowsum = nullptr;
  const unsigned* run_flag = nullptr;
};
cudaError_t launch_squeeze_projection(const SqueezeProjectionArgs& args, ConvDType dtype, cudaStream_t stream);

// A residual block whose shortcut is the identity, 64 -> 64 channels, stride 1 (the encoder's block 1), in one kernel
// for inference (fused_block.cu): h2 = relu(conv3x3(a) + b1b) + b2a, o = conv3x3(h2) * scale + b2b, then the
// squeeze-excitation and join of launch_squeeze_excite: y = relu(o * g + identity), a_next = y + *next_b1a. One CTA
// per image, the image on chip throughout. a, identity, y, a_next: NHWC [n][h][w][64] of T; w1, w2: KRSC [64][3][3][64]
// of T; scalars: fp32 b1a, b1b, b2a, scale, b2b (b1a is unused: a already holds x + b1a); fc weights as for
// launch_squeeze_excite. 16-byte aligned pointers.
struct FusedBlockArgs {
  const void* a = nullptr;
  const void* identity = nullptr;
  const void* w1 = nullptr;
  const void* w2 = nullptr;
  const float* scalars = nullptr;
  const float* fc1_w = nullptr;
  const float* fc1_b = nullptr;
  const float* fc2_w = nullptr;
  const float* fc2_b = nullptr;
  int planes = 0, hidden = 0;
  int n = 0, h = 0, w = 0;
  void* y = nullptr;
  const float* next_b1a = nullptr;
  void* a_next = nullptr;
  // The training forward's stash (launch_fused_block_wgmma only; null: not written), NHWC like a: h = relu(conv1 +
  // b1b), h2 = h + b2a (faithful where h > 0) and conv2's raw output v = T(conv2(h2)), whose readers apply o = T(v *
  // scale + b2b) (numeric.cuh affine1; the squeeze-excite here does the same).
  void* h_out = nullptr;
  void* h2_out = nullptr;
  void* v_out = nullptr;
  // launch_fused_block_wgmma only, inference: with stem.x set, each CTA computes the stem of its own image from the
  // caller's input (stem_tile.cuh) instead of reading a and identity (the stem's output, kept on chip; stem.x0 and
  // stem.a0 are not written), and n must not exceed sm_count (one image per CTA).
  StemArgs stem;
};
// Dynamic shared memory the fused block needs for an h x w image; 0 where the kernel does not take that size (more
// than 256 pixels, a pixel count not a multiple of 16, or a halo of more than 640 pixels).
size_t fused_block_smem_bytes(int h, int w);
cudaError_t launch_fused_block(const FusedBlockArgs& args, ConvDType dtype, cudaStream_t stream);

// The same block on Hopper warpgroup MMAs (fused_block_wgmma.cu, sm_90a), persistent (min(n, sm_count) CTAs, images
// strided over them), for inference (optionally with the stem, args.stem) and for the training forward (which also
// writes args.h_out, h2_out, v_out).
// 16 x 16 images only. Returns the dynamic shared memory it needs for an h x w image on a device of compute
// capability major.minor, 0 where it does not run.
size_t fused_block_wgmma_smem_bytes(int h, int w, int cc_major, int cc_minor);
cudaError_t launch_fused_block_wgmma(const FusedBlockArgs& args, ConvDType dtype, int sm_count, cudaStream_t stream);

// A downsampling block of the encoder (stride 2, the pooled shortcut) in one Hopper warpgroup-MMA kernel for
// inference (sm_90a): idt = conv1x1(avgpool3x3(a)), h2 = relu(conv3x3/2(a) + b1b) + b2a, o = conv3x3(h2) * scale +
// b2b, then the squeeze-excite and join of launch_squeeze_excite: y = relu(o * g + idt), a_next = y + *next_b1a.
// Two shapes, one kernel each:
//   - 64 -> 128 channels, hidden 8, 16 x 16 inputs (block 2; fused_down_block_wgmma.cu): one CTA per image;
//   - 128 -> 256 channels, hidden 16, 8 x 8 inputs (block 3; fused_down_block_group_wgmma.cu): a group of 4 CTAs per
//     4 images (fused_down_block_groups(n) groups), each CTA 64 of the output channels; they exchange h2 and the
//     squeeze's partial sums through args.h2 (NHWC [n][h/2][w/2][planes] of T), args.partials (1 KB per group) and
//     the counters args.sync (1 + 2 x groups words, zero before the first launch; each launch leaves them usable by
//     the next one on the same n).
// a: NHWC [n][h][w][in_planes] of T (x + b1a); y, a_next: NHWC [n][h/2][w/2][planes] of T (each optional, not both
// null). filters: the block's filter stream of T, fused_down_block_filter_ranks() equal slices of the output channels
// one after the other, each slice the shortcut's 1x1 filter, conv1's and conv2's, as tap planes (weight_layout.h
// kTapPlanes) of those output channels, contiguous in that order. scalars and fc weights as for FusedBlockArgs.
struct FusedDownBlockArgs {
  const void* a = nullptr;
  const void* filters = nullptr;
  const float* scalars = nullptr;
  const float* fc1_w = nullptr;
  const float* fc1_b = nullptr;
  const float* fc2_w = nullptr;
  const float* fc2_b = nullptr;
  int in_planes = 0, planes = 0, hidden = 0;
  int n = 0, h = 0, w = 0;  // h, w: the block's input size
  void* y = nullptr;
  const float* next_b1a = nullptr;
  void* a_next = nullptr;
  void* h2 = nullptr;  // block 3's shape: the group's exchange buffers (above)
  float* partials = nullptr;
  unsigned* sync = nullptr;
};
// Dynamic shared memory of the kernel for a block of this shape and input size on a device of compute capability
// major.minor; 0 where none runs (the two shapes above, compute capability 9.0 only).
size_t fused_down_block_smem_bytes(int in_planes, int planes, int hidden, int h, int w, int cc_major, int cc_minor);
// How many output-channel slices the kernel for this block shape streams its filters in (1 or 4; 0: no kernel).
int fused_down_block_filter_ranks(int in_planes, int planes, int hidden);
// Launches the kernel of args' shape.
cudaError_t launch_fused_down_block_wgmma(const FusedDownBlockArgs& args, ConvDType dtype, cudaStream_t stream);
// The block-3 kernel itself and its groups of 4 images for n. launch_fused_down_block_wgmma dispatches to it after
// the checks both shapes share (device, shape, shared memory `smem`, the common arguments).
size_t fused_down_block_group_smem_bytes(int in_planes, int planes, int hidden, int h, int w, int cc_major,
                                         int cc_minor);
int fused_down_block_groups(int n);
int fused_down_block_group_ranks(int in_planes, int planes, int hidden);  // 4 for its shape, else 0
cudaError_t launch_fused_down_block_group_wgmma(const FusedDownBlockArgs& args, ConvDType dtype, size_t smem,
                                               cudaStream_t stream);

}  // namespace kfuse::kernels
