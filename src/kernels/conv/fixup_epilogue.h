// CUTLASS 2.x epilogue thread functor for the FixUp convolutions (conv_fixup.h):
//   D = post + act(alpha * accumulator + pre),   act = relu if Params::relu else identity,
// rounded to nearest, except that an active ReLU never rounds to T(post) (see finish()).
// alpha, pre and post are read from device pointers when the functor is built inside the kernel, so a captured CUDA
// graph sees their current values; nullptr stands for 1, 0, 0. CUDA-only (includes CUTLASS).
//
// Serial split-K: every partition but the last writes the raw partial sum (acc, plus the previous partial sum read
// back from D for k_partition > 0) rounded to ElementOutput; only the last applies alpha / pre / act / post.
#pragma once

#include "cutlass/array.h"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/thread/scale_type.h"
#include "cutlass/numeric_conversion.h"
#include "cutlass/numeric_types.h"

namespace kfuse::kernels {

template <typename ElementOutput_, int Count, typename ElementAccumulator_ = float, typename ElementCompute_ = float>
class FixupLinearCombinationRelu {
 public:
  using ElementOutput = ElementOutput_;
  using ElementSource = ElementOutput_;
  using ElementAccumulator = ElementAccumulator_;
  using ElementCompute = ElementCompute_;
  using ElementScalar = ElementCompute;
  using ElementC = ElementOutput_;
  using ElementD = ElementOutput_;

  static int const kCount = Count;
  static cutlass::epilogue::thread::ScaleType::Kind const kScale = cutlass::epilogue::thread::ScaleType::Default;
  static cutlass::FloatRoundStyle const kRound = cutlass::FloatRoundStyle::round_to_nearest;
  static bool const kIsHeavy = false;

  using FragmentOutput = cutlass::Array<ElementOutput, kCount>;
  using FragmentSource = cutlass::Array<ElementSource, kCount>;
  using FragmentAccumulator = cutlass::Array<ElementAccumulator, kCount>;
  using FragmentCompute = cutlass::Array<ElementCompute, kCount>;

  // Host-constructible; the pointers are device pointers (each to one float) and are only dereferenced on device.
  struct Params {
    float const* alpha = nullptr;
    float const* pre = nullptr;
    float const* post = nullptr;
    bool relu = false;

    CUTLASS_HOST_DEVICE Params() {}
    CUTLASS_HOST_DEVICE Params(float const* alpha_, float const* pre_, float const* post_, bool relu_)
        : alpha(alpha_), pre(pre_), post(post_), relu(relu_) {}
  };

 private:
  ElementCompute alpha_;
  ElementCompute pre_;
  ElementCompute post_;
  bool relu_;
  int k_partition_ = 0;
  int k_partition_count_ = 1;

 public:
  // Device only: dereferencing the scalars on the host would read device memory.
  CUTLASS_DEVICE explicit FixupLinearCombinationRelu(Params const& params)
      : alpha_(ElementCompute(params.alpha != nullptr ? *params.alpha : 1.0f)),
        pre_(ElementCompute(params.pre != nullptr ? *params.pre : 0.0f)),
        post_(ElementCompute(params.post != nullptr ? *params.post : 0.0f)),
        relu_(params.relu) {}

  // The source is D itself holding the previous partial sum; only serial split-K partitions after the first read it.
  CUTLASS_HOST_DEVICE bool is_source_needed() const { return k_partition_ > 0; }

  CUTLASS_HOST_DEVICE void set_k_partition(int k_partition, int k_partition_count) {
    k_partition_ = k_partition;
    k_partition_count_ = k_partition_count;
  }

  CUTLASS_HOST_DEVICE FragmentOutput operator()(FragmentAccumulator const& accumulator) const {
    cutlass::NumericArrayConverter<ElementCompute, ElementAccumulator, kCount, kRound> accumulator_converter;
    return finish(accumulator_converter(accumulator));
  }

  CUTLASS_HOST_DEVICE FragmentOutput operator()(FragmentAccumulator const& accumulator,
                                                FragmentSource const& source) const {
    cutlass::NumericArrayConverter<ElementCompute, ElementAccumulator, kCount, kRound> accumulator_converter;
    cutlass::NumericArrayConverter<ElementCompute, ElementSource, kCount, kRound> source_converter;
    FragmentCompute sum = accumulator_converter(accumulator);
    FragmentCompute const src = source_converter(source);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kCount; ++i) sum[i] += src[i];
    return finish(sum);
  }

 private:
  CUTLASS_HOST_DEVICE FragmentOutput finish(FragmentCompute sum) const {
    cutlass::NumericArrayConverter<ElementOutput, ElementCompute, kCount, kRound> destination_converter;
    if (k_partition_ != k_partition_count_ - 1) return destination_converter(sum);  // partial sum, not final
    bool active[kCount];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kCount; ++i) {
      ElementCompute v = alpha_ * sum[i] + pre_;
      // `v < 0 ? 0 : v` (not max) lets NaN through, as torch.relu does.
      if (relu_ && v < ElementCompute(0)) v = ElementCompute(0);
      active[i] = v > ElementCompute(0);
      sum[i] = post_ + v;
    }
    FragmentOutput out = destination_converter(sum);
    // Keep the ReLU's decision readable from the stored value (the training backward's mask, relu_mask_backward):
    // where v > 0 but post + v rounds to T(post), store the next value above T(post) instead (still within one
    // ulp: faithful rounding). Only with post != 0; with post == 0 the store is v itself.
    if (post_ != ElementCompute(0)) {
      const ElementOutput post_t(post_);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kCount; ++i)
        if (active[i] && out[i] == post_t) out[i] = next_up(post_t);
    }
    return out;
  }

  // The next representable value above x (x finite) of a 16-bit float type (half_t, bfloat16_t).
  CUTLASS_HOST_DEVICE static ElementOutput next_up(ElementOutput x) {
    const uint16_t bits = x.raw();
    const bool negative = (bits & 0x8000u) != 0;
    if ((bits & 0x7fffu) == 0) return ElementOutput::bitcast(uint16_t(1));  // +-0 -> smallest positive
    return ElementOutput::bitcast(uint16_t(negative ? bits - 1 : bits + 1));
  }
};

}  // namespace kfuse::kernels
