// CUTLASS 2.x implicit-GEMM weight gradient (conv_backward.h) with parallel split-K, shared by the wgrad_*.cu files:
// each includes this header and stamps out one (dtype, tile) instance with KFUSE_WGRAD_DEFINE_INSTANCE, so every
// CUTLASS instantiation is compiled in its own TU. GEMM M = k, N = r*s*c, K = n*p*q: A = dy (NPQK), B = im2col(x)
// (NHWC), fp16 / bf16 in, fp32 accumulate, fp32 KRSC out; cp.async multistage + mma.sync 16x8x16.
//
// split_k == 1: the conv writes dw directly, no workspace.
// split_k > 1 (parallel split-K): grid z = split_k; slice z accumulates the GEMM-K tiles z, z + split_k,
// z + 2 split_k, ... (CUTLASS's wgrad iterators interleave them) and stores its fp32 partial dw at
// workspace + z * k*r*s*c; then CUTLASS's ReduceSplitK sums the split_k partials into dw in slice order 0, 1, ...
// Both kernels use fixed summation orders and no atomics, so the result is bitwise reproducible.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cutlass/cutlass.h"
#include "cutlass/conv/conv2d_problem_size.h"
#include "cutlass/conv/device/implicit_gemm_convolution.h"
#include "cutlass/conv/kernel/default_conv2d_wgrad.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/threadblock/threadblock_swizzle.h"
#include "cutlass/layout/matrix.h"
#include "cutlass/layout/tensor.h"
#include "cutlass/reduction/device/reduce_split_k.h"
#include "cutlass/reduction/kernel/reduce_split_k.h"
#include "cutlass/reduction/thread/reduction_operators.h"
#include "kernels/conv/conv_backward.h"
#include "kernels/conv/cutlass_launch.cuh"
#include "kernels/conv/wgrad_instances.h"

namespace kfuse::kernels::detail::wgrad_impl {

constexpr int kMaxSplitK = 256;

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

// Element: cutlass::half_t or cutlass::bfloat16_t. CTA tile TileM x TileN x 32 over 2 x 2 warps.
template <typename Element, int TileM, int TileN, int WarpM, int WarpN, int Stages>
struct WgradConv {
  using Layout = cutlass::layout::TensorNHWC;
  static constexpr int kAlign = 128 / cutlass::sizeof_bits<Element>::value;  // 8 elements: 16-byte cp.async
  static constexpr int kAlignOut = 128 / cutlass::sizeof_bits<float>::value;  // 4 floats: 16-byte stores

  // D = accumulator, unscaled: the partial sums stay exact fp32 sums, and the source C is never read
  // (ScaleType::Nothing), so no pointer has to be valid for it.
  using EpilogueOp = cutlass::epilogue::thread::LinearCombination<float, kAlignOut, float, float,
                                                                  cutlass::epilogue::thread::ScaleType::Nothing>;

  // kOptimized: the wgrad iterators precompute (r, s, c) per thread and step the n*p*q offset incrementally; they
  // need only c and k to be multiples of the 8-element access (checked by can_implement) and support any stride.
  using Kernel = typename cutlass::conv::kernel::DefaultConv2dWgrad<
      Element, Layout, Element, Layout, float, Layout, float, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
      cutlass::gemm::GemmShape<TileM, TileN, 32>, cutlass::gemm::GemmShape<WarpM, WarpN, 32>,
      cutlass::gemm::GemmShape<16, 8, 16>, EpilogueOp, cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<>,
      Stages, cutlass::arch::OpMultiplyAdd, cutlass::conv::IteratorAlgorithm::kOptimized,
      cutlass::conv::StrideSupport::kStrided, kAlign, kAlign>::Kernel;

  using Conv = cutlass::conv::device::ImplicitGemmConvolution<Kernel>;
  using ConvKernel = typename Conv::UnderlyingKernel;

  // sm_86 / sm_89 allow 99 KiB of shared memory per CTA; stay below so the sm_80 SASS runs there too.
  static_assert(sizeof(typename ConvKernel::SharedStorage) <= 99 * 1024, "shared memory exceeds sm_86/89's limit");

  // Sums the split_k partials of dw, viewed as a row-major k x (r*s*c) matrix: CTAs of 4 rows x 128 columns, one
  // 16-byte vector per thread and partition, partitions added in order (4 loads in flight).
  using ReductionKernel =
      cutlass::reduction::kernel::ReduceSplitK<cutlass::MatrixShape<4, 32 * kAlignOut>, EpilogueOp,
                                               cutlass::reduction::thread::ReduceAdd<float, float, kAlignOut>>;
  using Reduction = cutlass::reduction::device::ReduceSplitK<ReductionKernel>;

  // dy: NPQK, x: NHWC, out: KRSC fp32 (dw itself when split_k == 1, the partials in the workspace otherwise).
  static typename Conv::Arguments make_arguments(const cutlass::conv::Conv2dProblemSize& ps, const void* dy,
                                                 const void* x, float* out) {
    auto ref = [](const void* ptr, cutlass::Tensor4DCoord extent) {
      return cutlass::TensorRef<Element, Layout>(const_cast<Element*>(static_cast<const Element*>(ptr)),
                                                 Layout::packed(extent));
    };
    const cutlass::Tensor4DCoord act{ps.N, ps.H, ps.W, ps.C};
    const cutlass::Tensor4DCoord flt{ps.K, ps.R, ps.S, ps.C};
    const cutlass::Tensor4DCoord grad{ps.N, ps.P, ps.Q, ps.K};
    const cutlass::TensorRef<float, Layout> dst(out, Layout::packed(flt));
    // Parallel mode offsets slice z's output by z * k*r*s*c; serial mode with one slice is the plain conv.
    return typename Conv::Arguments(ps, ref(dy, grad), ref(x, act), dst, dst, typename EpilogueOp::Params(),
                                    ps.split_k_slices > 1 ? cutlass::conv::SplitKMode::kParallel
                                                          : cutlass::conv::SplitKMode::kSerial);
  }

  static cutlass::MatrixCoord reduction_extent(const cutlass::conv::Conv2dProblemSize& ps) {
    return cutlass::MatrixCoord(ps.K, ps.R * ps.S * ps.C);
  }

  static bool can_implement(const Conv2dProblem& problem, int split_k) {
    if (!problem_is_sane(problem, split_k)) return false;
    const auto ps = make_problem_size(problem, split_k);
    if (Conv::can_implement(make_arguments(ps, nullptr, nullptr, nullptr)) != cutlass::Status::kSuccess) return false;
    // The reduction grid's y extent, ceil(r*s*c / 128), is bounded by gridDim.y's 65535.
    return ReductionKernel::grid_shape(reduction_extent(ps)).y <= 65535u;
  }

  // split_k * k*r*s*c floats (the partials) for split_k > 1; nothing else is needed.
  static size_t workspace_bytes(const Conv2dProblem& problem, int split_k) {
    if (split_k == 1 || !can_implement(problem, split_k)) return 0;
    return Conv::get_workspace_size(make_arguments(make_problem_size(problem, split_k), nullptr, nullptr, nullptr));
  }

  static cudaError_t launch(const Conv2dProblem& problem, int split_k, const void* dy, const void* x, float* dw,
                            void* workspace, size_t workspace_bytes, cudaStream_t stream) {
    if (!can_implement(problem, split_k)) return cudaErrorInvalidValue;
    if (dy == nullptr || x == nullptr || dw == nullptr) return cudaErrorInvalidValue;
    // 128-bit vector loads / stores (cp.async 16 B, epilogue 4 floats) need 16-byte aligned base pointers.
    if (!aligned16(dy) || !aligned16(x) || !aligned16(dw)) return cudaErrorInvalidValue;

    const auto ps = make_problem_size(problem, split_k);
    if (split_k == 1) return launch_conv_kernel<ConvKernel>(make_arguments(ps, dy, x, dw), nullptr, 0, stream);

    // The partials are stored and reduced as 16-byte vectors as well.
    float* partials = static_cast<float*>(workspace);
    const auto args = make_arguments(ps, dy, x, partials);
    if (workspace == nullptr || !aligned16(workspace) || workspace_bytes < Conv::get_workspace_size(args))
      return cudaErrorInvalidValue;
    if (const cudaError_t err = launch_conv_kernel<ConvKernel>(args, nullptr, 0, stream); err != cudaSuccess) return err;

    const cutlass::MatrixCoord extent = reduction_extent(ps);
    const cutlass::layout::RowMajor rows(extent.column());
    const typename Reduction::Arguments reduce_args(
        extent, split_k, /*partition_stride=*/size_t(ps.filter_size()), {partials, rows}, /*destination=*/{dw, rows},
        /*source (not read)=*/{dw, rows}, typename EpilogueOp::Params());
    return run_cutlass_op<Reduction>(reduce_args, nullptr, 0, stream, cutlass::Kernel<ReductionKernel>);
  }
};

}  // namespace kfuse::kernels::detail::wgrad_impl

// Defines name##_can_implement / _workspace_bytes / _launch (declared in wgrad_instances.h) for one instance type
// (relative to kfuse::kernels::detail) that has static can_implement, workspace_bytes and launch.
#define KFUSE_WGRAD_DEFINE_INSTANCE(name, ...)                                                                    \
  namespace kfuse::kernels::detail {                                                                              \
  bool name##_can_implement(const Conv2dProblem& problem, int split_k) {                                         \
    return __VA_ARGS__::can_implement(problem, split_k);                                                         \
  }                                                                                                               \
  size_t name##_workspace_bytes(const Conv2dProblem& problem, int split_k) {                                     \
    return __VA_ARGS__::workspace_bytes(problem, split_k);                                                       \
  }                                                                                                               \
  cudaError_t name##_launch(const Conv2dProblem& problem, int split_k, const void* dy, const void* x, float* dw, \
                            void* workspace, size_t workspace_bytes, cudaStream_t stream) {                      \
    return __VA_ARGS__::launch(problem, split_k, dy, x, dw, workspace, workspace_bytes, stream);                 \
  }                                                                                                               \
  }
