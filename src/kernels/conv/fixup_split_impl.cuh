// CUTLASS 2.x implicit-GEMM conv fprop with PARALLEL split-K, then the FixUp epilogue as a reduction pass
// (conv_fixup.h, conv2d_fprop_fixup_parallel), shared by the fixup_split_*.cu files: each includes this header and
// stamps out one (dtype, tile) instance with KFUSE_FIXUP_DEFINE_INSTANCE, so every CUTLASS instantiation is compiled
// in its own TU.
//
// Why: at the inference batch (N = 128) the late layers are GEMMs of 512-2048 rows, 16-64 CTA tiles on 132 SMs, and
// serial split-K (fixup_conv_impl.cuh) makes its slices wait on each other's epilogue. Here grid z = split_k; slice z
// accumulates the GEMM-K tiles z, z + split_k, ... (CUTLASS's fprop iterators interleave them) and stores its fp32
// partial output at workspace + z * n*p*q*k; fixup_epilogue_reduce (fixup_epilogue_pass.h) then sums the slices in
// order and applies alpha / pre / act / post, rounding once. Fixed order, no atomics: bitwise reproducible, and the
// partial sums stay fp32 (bf16 can split too, unlike the serial form that rounds them to the output type).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cutlass/cutlass.h"
#include "cutlass/conv/conv2d_problem_size.h"
#include "cutlass/conv/device/implicit_gemm_convolution.h"
#include "cutlass/conv/kernel/default_conv2d_fprop.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/threadblock/threadblock_swizzle.h"
#include "cutlass/layout/tensor.h"
#include "kernels/conv/conv_fixup.h"
#include "kernels/conv/cutlass_launch.cuh"
#include "kernels/conv/fixup_conv_impl.cuh"  // problem_is_sane, make_problem_size
#include "kernels/conv/fixup_epilogue_pass.h"
#include "kernels/conv/fixup_instances.h"

namespace kfuse::kernels::detail::fixup_split_impl {

using fixup_impl::make_problem_size;
using fixup_impl::problem_is_sane;

template <typename Element, int TileM, int TileN, int TileK, int WarpM, int WarpN, int Stages>
struct FixupSplitConv {
  using Layout = cutlass::layout::TensorNHWC;
  static constexpr int kAlign = 128 / cutlass::sizeof_bits<Element>::value;  // 8 elements: 16-byte cp.async
  static constexpr int kAlignOut = 128 / cutlass::sizeof_bits<float>::value;  // 4 floats: 16-byte stores

  // D = accumulator, unscaled and never reading a source (ScaleType::Nothing): exact fp32 partial sums.
  using EpilogueOp = cutlass::epilogue::thread::LinearCombination<float, kAlignOut, float, float,
                                                                  cutlass::epilogue::thread::ScaleType::Nothing>;

  using Kernel = typename cutlass::conv::kernel::DefaultConv2dFprop<
      Element, Layout, Element, Layout, float, Layout, float, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
      cutlass::gemm::GemmShape<TileM, TileN, TileK>, cutlass::gemm::GemmShape<WarpM, WarpN, TileK>,
      cutlass::gemm::GemmShape<16, 8, 16>, EpilogueOp, cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<>,
      Stages, cutlass::arch::OpMultiplyAdd, cutlass::conv::IteratorAlgorithm::kOptimized,
      cutlass::conv::StrideSupport::kUnity, kAlign, kAlign>::Kernel;

  using Conv = cutlass::conv::device::ImplicitGemmConvolution<Kernel>;
  using ConvKernel = typename Conv::UnderlyingKernel;

  // sm_86 / sm_89 allow 99 KiB of shared memory per CTA; stay below so the sm_80 SASS runs there too.
  static_assert(sizeof(typename ConvKernel::SharedStorage) <= 99 * 1024, "shared memory exceeds sm_86/89's limit");

  static typename Conv::Arguments make_arguments(const cutlass::conv::Conv2dProblemSize& ps, const void* x,
                                                 const void* w, float* partials) {
    auto ref = [](const void* ptr, cutlass::Tensor4DCoord extent) {
      return cutlass::TensorRef<Element, Layout>(const_cast<Element*>(static_cast<const Element*>(ptr)),
                                                 Layout::packed(extent));
    };
    const cutlass::Tensor4DCoord act{ps.N, ps.H, ps.W, ps.C};
    const cutlass::Tensor4DCoord flt{ps.K, ps.R, ps.S, ps.C};
    const cutlass::TensorRef<float, Layout> dst(partials, Layout::packed({ps.N, ps.P, ps.Q, ps.K}));
    return typename Conv::Arguments(ps, ref(x, act), ref(w, flt), dst, dst, typename EpilogueOp::Params(),
                                    cutlass::conv::SplitKMode::kParallel);
  }

  // split_k >= 2 (one slice is the plain conv: conv_fixup.h's serial kernels), K % 8 == 0 for the reduction's
  // 8-element vectors.
  static bool can_implement(const Conv2dProblem& problem, int split_k) {
    if (!problem_is_sane(problem, split_k) || split_k < 2 || problem.k % 8 != 0) return false;
    const auto args = make_arguments(make_problem_size(problem, split_k), nullptr, nullptr, nullptr);
    return Conv::can_implement(args) == cutlass::Status::kSuccess;
  }

  // The split_k fp32 partial outputs.
  static size_t workspace_bytes(const Conv2dProblem& problem, int split_k) {
    if (!can_implement(problem, split_k)) return 0;
    return Conv::get_workspace_size(make_arguments(make_problem_size(problem, split_k), nullptr, nullptr, nullptr));
  }

  static cudaError_t launch(const Conv2dProblem& problem, const void* x, const void* w, void* y,
                            const FixupEpilogue& epilogue, int split_k, void* workspace, size_t workspace_bytes,
                            cudaStream_t stream) {
    if (!can_implement(problem, split_k)) return cudaErrorInvalidValue;
    if (x == nullptr || w == nullptr || y == nullptr || workspace == nullptr) return cudaErrorInvalidValue;
    if (!aligned16(x) || !aligned16(w) || !aligned16(y) || !aligned16(workspace)) return cudaErrorInvalidValue;
    const auto ps = make_problem_size(problem, split_k);
    float* partials = static_cast<float*>(workspace);
    const auto args = make_arguments(ps, x, w, partials);
    if (workspace_bytes < Conv::get_workspace_size(args)) return cudaErrorInvalidValue;
    if (const cudaError_t err = launch_conv_kernel<ConvKernel>(args, nullptr, 0, stream); err != cudaSuccess) return err;
    const size_t count = size_t(ps.N) * ps.P * ps.Q * ps.K;
    return fixup_epilogue_reduce(partials, split_k, count, y, count,
                                 std::is_same_v<Element, cutlass::half_t> ? ConvDType::kF16 : ConvDType::kBF16,
                                 epilogue, stream);
  }
};

}  // namespace kfuse::kernels::detail::fixup_split_impl
