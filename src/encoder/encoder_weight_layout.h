// Internal: the encoder's packed weight buffer, planned once per encoder: every array's byte offset (BlockWeights,
// WeightLayout, plan_weights), the kernels' layouts built on the host (krsc, flipped_crsk, tap_planes, ...) for
// set_weights, and the shapes the fused kernels cover. Not installed.
#pragma once

#include <cstring>
#include <vector>

#include "kernels/conv/conv_problem.h"
#include "kernels/encoder/encoder_kernels.h"
#include "kfuse/encoder_gpu.h"
#include "runtime/half_bits.h"

namespace kfuse {
namespace gpu_detail {

using kernels::ConvDType;

// The packed weight buffer: every array 256-byte aligned in one device allocation. The layout is planned once per
// encoder (plan_weights); set_weights fills it from host tensors, the training step on the device from PyTorch's
// tensors (weight_layout.h). Within a block the shortcut filter directly follows conv1's, so that the two form one
// [2P][3][3][Cin] filter: the training step's data and weight gradients of both convolutions run as one GEMM each.
class HostWeights {
 public:
  HostWeights(size_t bytes, GpuPrecision p) : bytes_(bytes, 0), precision_(p) {}
  void put_t(size_t off, const std::vector<float>& v) {  // network storage type
    const ConvDType dt = precision_ == GpuPrecision::kFloat16 ? ConvDType::kF16 : ConvDType::kBF16;
    for (size_t i = 0; i < v.size(); ++i) {
      const uint16_t b = float_to_bits(v[i], dt);
      std::memcpy(&bytes_[off + 2 * i], &b, 2);
    }
  }
  void put_f32(size_t off, const std::vector<float>& v) {
    if (!v.empty()) std::memcpy(&bytes_[off], v.data(), 4 * v.size());
  }
  const std::vector<uint8_t>& bytes() const { return bytes_; }

 private:
  std::vector<uint8_t> bytes_;
  GpuPrecision precision_;
};

// [K, C, R, S] -> [K, R, S, C]
inline std::vector<float> krsc(const HostTensor<float>& w) {
  const int64_t K = w.dim(0), C = w.dim(1), R = w.dim(2), S = w.dim(3);
  std::vector<float> out(static_cast<size_t>(w.numel()));
  for (int64_t k = 0; k < K; ++k)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t r = 0; r < R; ++r)
        for (int64_t s = 0; s < S; ++s) out[((k * R + r) * S + s) * C + c] = w.at(k, c, r, s);
  return out;
}

// avgpool3x3(stride, pad 1, /9) followed by conv1x1(Wd) is exactly conv3x3(stride, pad 1) with Wd / 9 on every tap:
// one implicit GEMM instead of a pool pass plus a GEMM.
inline std::vector<float> pooled_shortcut_krsc(const HostTensor<float>& wd) {
  const int64_t K = wd.dim(0), C = wd.dim(1);
  std::vector<float> out(static_cast<size_t>(K * 9 * C));
  for (int64_t k = 0; k < K; ++k)
    for (int64_t t = 0; t < 9; ++t)
      for (int64_t c = 0; c < C; ++c) out[(k * 9 + t) * C + c] = wd.at(k, c, 0, 0) / 9.0f;
  return out;
}

// [K, C, R, S] -> [C, R, S, K] with the taps flipped: the filter of the forward conv that computes the data
// gradient of a stride-1 conv with symmetric padding.
inline std::vector<float> flipped_crsk(const HostTensor<float>& w) {
  const int64_t K = w.dim(0), C = w.dim(1), R = w.dim(2), S = w.dim(3);
  std::vector<float> out(static_cast<size_t>(w.numel()));
  for (int64_t k = 0; k < K; ++k)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t r = 0; r < R; ++r)
        for (int64_t s = 0; s < S; ++s) out[((c * R + r) * S + s) * K + k] = w.at(k, c, R - 1 - r, S - 1 - s);
  return out;
}

// [K, C, R, S] -> [R, S, C / 8, K, 8]: per tap and 8-channel group, one 16-byte row per output channel (the filter
// image that kernels::launch_fused_block_wgmma copies to shared memory as it is; C % 8 == 0). With k0 / k_count:
// output channels k0 .. k0 + k_count - 1 only (K = k_count), a slice of a fused kernel's filter stream.
inline std::vector<float> tap_planes(const HostTensor<float>& w, int64_t k0 = 0, int64_t k_count = -1) {
  const int64_t C = w.dim(1), R = w.dim(2), S = w.dim(3), K = k_count < 0 ? w.dim(0) : k_count;
  std::vector<float> out(static_cast<size_t>(K * C * R * S));
  for (int64_t k = 0; k < K; ++k)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t r = 0; r < R; ++r)
        for (int64_t s = 0; s < S; ++s)
          out[((((r * S + s) * (C / 8) + c / 8) * K + k) * 8) + c % 8] = w.at(k0 + k, c, r, s);
  return out;
}

constexpr size_t kNone = SIZE_MAX;
struct BlockWeights {  // byte offsets into the packed weights; kNone where the block has no such array
  size_t conv1, shortcut, conv2, fc1_w, fc1_b, fc2_w, fc2_b, scalars;
  size_t conv2_flip, conv1_flip;  // training only: data gradients of the stride-1 convs as forward convs
  size_t conv1_planes, conv2_planes;  // blocks of the warpgroup-MMA kernel's shape: its filter images (tap_planes)
  size_t down_stream;  // downsampling blocks of the fused kernel's shape: its filter stream (down_stream_offsets)
  // The squeeze-excite's fc weights as T for the inference forward (kernels::SqueezeExciteArgs::w1_t, w2_t): fc1's
  // [hidden][planes] at fc_t, fc2's [planes][hidden] right after it (fc_t + fc2_t_offset(b)).
  size_t fc_t;
};
inline size_t fc2_t_offset(const EncoderConfig::Block& b) {
  return (2 * size_t(b.se_hidden) * b.planes + 15) / 16 * 16;
}
// Whether a block has the shape of kernels::launch_fused_block / launch_fused_block_wgmma (64 -> 64 channels, stride
// 1, the identity shortcut, hidden = 4; the image size and the device decide the rest).
inline bool fusable_block_shape(const EncoderConfig::Block& b) {
  return !b.has_downsample && b.stride == 1 && b.in_planes == 64 && b.planes == 64 && b.se_hidden == 4;
}
// Whether a block has a shape of kernels::launch_fused_down_block_wgmma (stride 2, the pooled shortcut, and 64 -> 128
// channels with hidden = 8 or 128 -> 256 with hidden = 16: blocks 2 and 3 of the default network).
inline bool fusable_down_block_shape(const EncoderConfig::Block& b) {
  return b.has_downsample && b.stride == 2 &&
         kernels::fused_down_block_filter_ranks(b.in_planes, b.planes, b.se_hidden) != 0;
}
// That kernel's filter stream: `ranks` slices of planes / ranks output channels, one after the other, each the
// shortcut's 1x1 filter, conv1's and conv2's as tap planes of those channels, contiguous (byte offsets of slice 0's
// parts; slice r starts at r * rank_bytes).
struct DownStreamOffsets {
  size_t shortcut, conv1, conv2, rank_bytes, bytes;
  int ranks, rank_planes;
};
inline DownStreamOffsets down_stream_offsets(const EncoderConfig::Block& b) {
  const int ranks = kernels::fused_down_block_filter_ranks(b.in_planes, b.planes, b.se_hidden);
  const int kr = b.planes / ranks;
  const size_t sc = 2 * size_t(kr) * b.in_planes, c1 = 9 * sc, c2 = 2 * size_t(kr) * 9 * b.planes;
  const size_t rank_bytes = sc + c1 + c2;
  return {0, sc, sc + c1, rank_bytes, ranks * rank_bytes, ranks, kr};
}
struct WeightLayout {
  size_t stem_w = 0;
  std::vector<BlockWeights> blocks;
  size_t bytes = 0;
};
inline WeightLayout plan_weights(const EncoderConfig& config, const std::vector<EncoderConfig::Block>& blocks,
                                 int kpad) {
  WeightLayout L;
  auto take = [&](size_t bytes) {
    const size_t off = (L.bytes + 255) / 256 * 256;
    L.bytes = off + bytes;
    return off;
  };
  L.stem_w = take(2 * size_t(kpad) * config.base_planes);
  for (const auto& b : blocks) {
    BlockWeights W{};
    const size_t conv1 = 2 * size_t(b.planes) * 9 * b.in_planes;
    W.conv1 = take(conv1);
    W.shortcut = kNone;
    if (b.has_downsample) {
      W.shortcut = take(2 * size_t(b.planes) * b.in_planes * (b.stride > 1 ? 9 : 1));
      if (W.shortcut != W.conv1 + conv1) throw Error("kfuse: shortcut filter not adjacent to conv1 (internal error)");
    }
    W.conv2 = take(2 * size_t(b.planes) * 9 * b.planes);
    W.fc1_w = take(4 * size_t(b.se_hidden) * b.planes);
    W.fc1_b = take(4 * size_t(b.se_hidden));
    W.fc2_w = take(4 * size_t(b.planes) * b.se_hidden);
    W.fc2_b = take(4 * size_t(b.planes));
    W.scalars = take(4 * 5);
    L.blocks.push_back(W);
  }
  for (size_t i = 0; i < blocks.size(); ++i) {
    const auto& b = blocks[i];
    L.blocks[i].conv2_flip = take(2 * size_t(b.planes) * 9 * b.planes);
    L.blocks[i].conv1_flip = b.stride == 1 ? take(2 * size_t(b.planes) * 9 * b.in_planes) : kNone;
    const bool planes = fusable_block_shape(b);
    L.blocks[i].conv1_planes = planes ? take(2 * size_t(b.planes) * 9 * b.in_planes) : kNone;
    L.blocks[i].conv2_planes = planes ? take(2 * size_t(b.planes) * 9 * b.planes) : kNone;
    L.blocks[i].down_stream = fusable_down_block_shape(b) ? take(down_stream_offsets(b).bytes) : kNone;
    L.blocks[i].fc_t = take(fc2_t_offset(b) + 2 * size_t(b.planes) * b.se_hidden);
  }
  return L;
}
// scalars[5]: b1a, b1b, b2a, scale, b2b
}  // namespace gpu_detail
}  // namespace kfuse
