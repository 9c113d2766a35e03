// CUTLASS 2.x implicit-GEMM conv fprop with the FixUp epilogue (fixup_epilogue.h), shared by the fixup_*.cu files:
// each includes this header and stamps out one (dtype, tile) instance with KFUSE_FIXUP_DEFINE_INSTANCE, so every
// CUTLASS instantiation is compiled in its own TU. NHWC x KRSC -> NPQK, fp32 accumulate, cp.async multistage +
// mma.sync 16x8x16, serial split-K (partial sums in the output, semaphores in the workspace).
#pragma once

#include <cstdint>

#include "cutlass/cutlass.h"
#include "cutlass/conv/conv2d_problem_size.h"
#include "cutlass/conv/device/implicit_gemm_convolution.h"
#include "cutlass/conv/kernel/default_conv2d_fprop.h"
#include "cutlass/gemm/threadblock/threadblock_swizzle.h"
#include "cutlass/layout/tensor.h"
#include "kernels/conv/conv_fixup.h"
#include "kernels/conv/fixup_epilogue.h"
#include "kernels/conv/cutlass_launch.cuh"
#include "kernels/conv/fixup_instances.h"

namespace kfuse::kernels::detail::fixup_impl {

constexpr int kMaxSplitK = 64;

inline bool problem_is_sane(const Conv2dProblem& p, int split_k) {
  return p.n > 0 && p.h > 0 && p.w > 0 && p.c > 0 && p.k > 0 && p.r > 0 && p.s > 0 && p.pad_h >= 0 &&
         p.pad_w >= 0 && p.stride_h >= 1 && p.stride_w >= 1 && p.p() > 0 && p.q() > 0 && split_k >= 1 &&
         split_k <= kMaxSplitK;
}

inline cutlass::conv::Conv2dProblemSize make_problem_size(const Conv2dProblem& p, int split_k) {
  return cutlass::conv::Conv2dProblemSize(p.n, p.h, p.w, p.c, p.k, p.r, p.s, p.p(), p.q(), p.pad_h, p.pad_w,
                                          p.stride_h, p.stride_w, /*dilation_h=*/1, /*dilation_w=*/1,
                                          cutlass::conv::Mode::kCrossCorrelation, split_k, /*groups=*/1);
}

// Element: cutlass::half_t or cutlass::bfloat16_t. CTA tile TileM x 64 x 32 over 2 x 2 warps.
template <typename Element, int TileM, int TileN, int TileK, int WarpM, int WarpN, int Stages>
struct FixupConv {
  using Layout = cutlass::layout::TensorNHWC;
  static constexpr int kAlign = 128 / cutlass::sizeof_bits<Element>::value;  // 8 elements: 16-byte accesses

  using EpilogueOp = FixupLinearCombinationRelu<Element, kAlign, float, float>;

  using Kernel = typename cutlass::conv::kernel::DefaultConv2dFprop<
      Element, Layout, Element, Layout, Element, Layout, float, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
      cutlass::gemm::GemmShape<TileM, TileN, TileK>, cutlass::gemm::GemmShape<WarpM, WarpN, TileK>,
      cutlass::gemm::GemmShape<16, 8, 16>, EpilogueOp, cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<>,
      Stages, cutlass::arch::OpMultiplyAdd, cutlass::conv::IteratorAlgorithm::kOptimized,
      cutlass::conv::StrideSupport::kUnity, kAlign, kAlign>::Kernel;

  using Conv = cutlass::conv::device::ImplicitGemmConvolution<Kernel>;

  // sm_86 / sm_89 allow 99 KiB of shared memory per CTA; stay below so the sm_80 SASS runs there too.
  static_assert(sizeof(typename Kernel::SharedStorage) <= 99 * 1024, "shared memory exceeds sm_86/89's limit");

  static typename Conv::Arguments make_arguments(const cutlass::conv::Conv2dProblemSize& ps, const void* x,
                                                 const void* w, void* y, const FixupEpilogue& e) {
    auto ref = [](const void* ptr, cutlass::Tensor4DCoord extent) {
      return cutlass::TensorRef<Element, Layout>(const_cast<Element*>(static_cast<const Element*>(ptr)),
                                                 Layout::packed(extent));
    };
    const cutlass::Tensor4DCoord act{ps.N, ps.H, ps.W, ps.C};
    const cutlass::Tensor4DCoord flt{ps.K, ps.R, ps.S, ps.C};
    const cutlass::Tensor4DCoord out{ps.N, ps.P, ps.Q, ps.K};
    // No separate source: split-K partitions after the first read their partial sum back from y (C = D).
    return typename Conv::Arguments(ps, ref(x, act), ref(w, flt), ref(y, out), ref(y, out),
                                    typename EpilogueOp::Params(e.alpha, e.pre, e.post, e.relu),
                                    cutlass::conv::SplitKMode::kSerial);
  }

  static bool can_implement(const Conv2dProblem& problem, int split_k) {
    if (!problem_is_sane(problem, split_k)) return false;
    const auto args = make_arguments(make_problem_size(problem, split_k), nullptr, nullptr, nullptr, {});
    return Conv::can_implement(args) == cutlass::Status::kSuccess;
  }

  static size_t workspace_bytes(const Conv2dProblem& problem, int split_k) {
    if (!can_implement(problem, split_k)) return 0;
    const auto args = make_arguments(make_problem_size(problem, split_k), nullptr, nullptr, nullptr, {});
    return Conv::get_workspace_size(args);
  }

  static cudaError_t launch(const Conv2dProblem& problem, const void* x, const void* w, void* y,
                            const FixupEpilogue& epilogue, int split_k, void* workspace, size_t workspace_bytes,
                            cudaStream_t stream) {
    if (!can_implement(problem, split_k)) return cudaErrorInvalidValue;
    if (x == nullptr || w == nullptr || y == nullptr) return cudaErrorInvalidValue;
    // 128-bit vector loads / stores (cp.async 16 B, epilogue 8 elements) need 16-byte aligned base pointers.
    if (!aligned16(x) || !aligned16(w) || !aligned16(y)) return cudaErrorInvalidValue;

    const auto args = make_arguments(make_problem_size(problem, split_k), x, w, y, epilogue);
    // Serial split-K: the semaphores in the workspace are zeroed first (cudaMemsetAsync on `stream`).
    const size_t semaphore_bytes = Conv::get_workspace_size(args);
    if (semaphore_bytes > 0 && (workspace == nullptr || workspace_bytes < semaphore_bytes))
      return cudaErrorInvalidValue;
    return launch_conv_kernel<typename Conv::UnderlyingKernel>(
        args, semaphore_bytes > 0 ? static_cast<int*>(workspace) : nullptr, semaphore_bytes, stream);
  }
};

}  // namespace kfuse::kernels::detail::fixup_impl
