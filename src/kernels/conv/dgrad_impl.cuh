// CUTLASS 2.x implicit-GEMM data gradient (conv_backward.h), shared by the dgrad_*.cu files: each includes this
// header and stamps out one (dtype, tile) instance with KFUSE_DGRAD_DEFINE_INSTANCE, so every CUTLASS instantiation
// is compiled in its own TU. dy NPQK x w KRSC -> dx NHWC, fp32 accumulate, cp.async multistage + mma.sync 16x8x16.
//
// Why the strided-dgrad kernel (StrideSupport::kStrided, ImplicitGemmConvolutionStridedDgrad): with stride s, the
// input pixels fall into s_h * s_w phases ((h + pad_h) mod s_h, (w + pad_w) mod s_w), and the pixels of one phase are
// reached only by the filter taps r = start_r, start_r + s_h, ... (and likewise s). CUTLASS launches a group of CTA
// rows per phase (StridedDgradIdentityThreadblockSwizzle sizes the grid as tiles-per-phase x s_h * s_w) whose GEMM K
// loops over just those taps: a stride-2 3x3 dgrad does 9/4 taps per pixel on average, not the 9 of a stride-1 conv
// over a zero-upsampled dy. Every phase gets its CTAs, including phases no tap reaches (stride > filter, e.g. 1x1
// stride 2): those CTAs skip the main loop and their epilogue stores the cleared accumulators, i.e. zeros, so every
// element of dx is written. The same kernel is exact for stride 1 (one phase, all taps); CUTLASS's own tests run it
// only for stride > 1, ours run stride 1 too. kOptimized is CUTLASS's precomputed-mask variant of the strided
// iterators (kAnalytic recomputes every coordinate); it needs R, S <= 32, which can_implement checks. The strided
// kernel does not support split-K (CUTLASS rejects it for stride > 1) and needs none here: M = n*h*w is large.
#pragma once

#include <cstdint>

#include "cutlass/cutlass.h"
#include "cutlass/conv/conv2d_problem_size.h"
#include "cutlass/conv/device/implicit_gemm_convolution.h"
#include "cutlass/conv/kernel/default_conv2d_dgrad.h"
#include "cutlass/conv/threadblock/threadblock_swizzle.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/epilogue/thread/scale_type.h"
#include "cutlass/layout/tensor.h"
#include "kernels/conv/cutlass_launch.cuh"
#include "kernels/conv/dgrad_instances.h"

namespace kfuse::kernels::detail::dgrad_impl {

inline bool problem_is_sane(const Conv2dProblem& p) {
  return p.n > 0 && p.h > 0 && p.w > 0 && p.c > 0 && p.k > 0 && p.r > 0 && p.s > 0 && p.pad_h >= 0 &&
         p.pad_w >= 0 && p.stride_h >= 1 && p.stride_w >= 1 && p.p() > 0 && p.q() > 0;
}

// The FORWARD problem, as CUTLASS's dgrad also describes it (activation = dx, output = dy).
inline cutlass::conv::Conv2dProblemSize make_problem_size(const Conv2dProblem& p) {
  return cutlass::conv::Conv2dProblemSize(p.n, p.h, p.w, p.c, p.k, p.r, p.s, p.p(), p.q(), p.pad_h, p.pad_w,
                                          p.stride_h, p.stride_w, /*dilation_h=*/1, /*dilation_w=*/1,
                                          cutlass::conv::Mode::kCrossCorrelation, /*split_k_slices=*/1,
                                          /*groups=*/1);
}

// Element: cutlass::half_t or cutlass::bfloat16_t. CTA tile TileM x TileN x TileK (M = dx pixels, N = c, K = k taps)
// over (TileM / WarpM) x (TileN / WarpN) warps.
template <typename Element, int TileM, int TileN, int TileK, int WarpM, int WarpN, int Stages>
struct StridedDgrad {
  using Layout = cutlass::layout::TensorNHWC;
  static constexpr int kAlign = 128 / cutlass::sizeof_bits<Element>::value;  // 8 elements: 16-byte accesses

  // dx = 1 * acc. OnlyAlphaScaling makes is_source_needed() false at compile time, so the epilogue never reads dx
  // (whose old contents may be anything, NaN included) whatever beta holds.
  using EpilogueOp = cutlass::epilogue::thread::LinearCombination<
      Element, kAlign, float, float, cutlass::epilogue::thread::ScaleType::OnlyAlphaScaling>;

  using Kernel = typename cutlass::conv::kernel::DefaultConv2dDgrad<
      Element, Layout, Element, Layout, Element, Layout, float, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
      cutlass::gemm::GemmShape<TileM, TileN, TileK>, cutlass::gemm::GemmShape<WarpM, WarpN, TileK>,
      cutlass::gemm::GemmShape<16, 8, 16>, EpilogueOp,
      // The strided kernel static_asserts one of its own swizzles: they size the grid per phase (see above).
      cutlass::conv::threadblock::StridedDgradIdentityThreadblockSwizzle<1>, Stages, cutlass::arch::OpMultiplyAdd,
      cutlass::conv::IteratorAlgorithm::kOptimized, cutlass::conv::StrideSupport::kStrided, kAlign, kAlign>::Kernel;

  using Conv = cutlass::conv::device::ImplicitGemmConvolution<Kernel>;

  static_assert(Conv::kConvolutionalOperator == cutlass::conv::Operator::kDgrad, "not a dgrad kernel");
  static_assert(Conv::kStrideSupport == cutlass::conv::StrideSupport::kStrided, "not the strided dgrad kernel");
  // sm_86 / sm_89 allow 99 KiB of shared memory per CTA; stay below so the sm_80 SASS runs there too.
  static_assert(sizeof(typename Kernel::SharedStorage) <= 99 * 1024, "shared memory exceeds sm_86/89's limit");

  static typename Conv::Arguments make_arguments(const cutlass::conv::Conv2dProblemSize& ps, const void* dy,
                                                 const void* w, void* dx) {
    auto ref = [](const void* ptr, cutlass::Tensor4DCoord extent) {
      return cutlass::TensorRef<Element, Layout>(const_cast<Element*>(static_cast<const Element*>(ptr)),
                                                 Layout::packed(extent));
    };
    const cutlass::Tensor4DCoord act{ps.N, ps.H, ps.W, ps.C};
    const cutlass::Tensor4DCoord flt{ps.K, ps.R, ps.S, ps.C};
    const cutlass::Tensor4DCoord out{ps.N, ps.P, ps.Q, ps.K};
    // A = dy, B = w, C = D = dx (C is never read: see EpilogueOp).
    return typename Conv::Arguments(ps, ref(dy, out), ref(w, flt), ref(dx, act), ref(dx, act),
                                    typename EpilogueOp::Params(1.0f, 0.0f), cutlass::conv::SplitKMode::kSerial);
  }

  // CUTLASS checks k % 8 (dy rows), c % 8 (w rows and dx stores), R, S <= 32, tensors below 2 GiB and the grid size.
  static bool can_implement(const Conv2dProblem& problem) {
    if (!problem_is_sane(problem)) return false;
    const auto args = make_arguments(make_problem_size(problem), nullptr, nullptr, nullptr);
    return Conv::can_implement(args) == cutlass::Status::kSuccess;
  }

  // 0: no split-K, hence no semaphores or partial sums.
  static size_t workspace_bytes(const Conv2dProblem& problem) {
    if (!can_implement(problem)) return 0;
    const auto args = make_arguments(make_problem_size(problem), nullptr, nullptr, nullptr);
    return Conv::get_workspace_size(args);
  }

  static cudaError_t launch(const Conv2dProblem& problem, const void* dy, const void* w, void* dx, void* workspace,
                            size_t workspace_bytes, cudaStream_t stream) {
    if (!can_implement(problem)) return cudaErrorInvalidValue;
    if (dy == nullptr || w == nullptr || dx == nullptr) return cudaErrorInvalidValue;
    // 128-bit vector loads / stores (cp.async 16 B, epilogue 8 elements) need 16-byte aligned base pointers.
    if (!aligned16(dy) || !aligned16(w) || !aligned16(dx)) return cudaErrorInvalidValue;

    const auto args = make_arguments(make_problem_size(problem), dy, w, dx);
    return run_cutlass_op<Conv>(args, workspace, workspace_bytes, stream,
                                cutlass::Kernel<typename Conv::UnderlyingKernel>);
  }
};

}  // namespace kfuse::kernels::detail::dgrad_impl

// Defines name##_can_implement / _workspace_bytes / _launch (declared in dgrad_instances.h) for one instance type
// (relative to kfuse::kernels::detail) that has static can_implement, workspace_bytes and launch.
#define KFUSE_DGRAD_DEFINE_INSTANCE(name, ...)                                                                    \
  namespace kfuse::kernels::detail {                                                                              \
  bool name##_can_implement(const Conv2dProblem& problem) { return __VA_ARGS__::can_implement(problem); }          \
  size_t name##_workspace_bytes(const Conv2dProblem& problem) { return __VA_ARGS__::workspace_bytes(problem); }    \
  cudaError_t name##_launch(const Conv2dProblem& problem, const void* dy, const void* w, void* dx, void* workspace, \
                            size_t workspace_bytes, cudaStream_t stream) {                                         \
    return __VA_ARGS__::launch(problem, dy, w, dx, workspace, workspace_bytes, stream);                           \
  }                                                                                                               \
  }
