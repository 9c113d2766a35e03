// CUTLASS 2.x Ampere implicit-GEMM conv fprop (cp.async multistage + mma.sync 16x8x16): fp16 NHWC x fp16 KRSC ->
// fp16 NPQK, fp32 accumulate, D = alpha * acc + beta * C. Built for sm_80 and sm_90 so it also runs on Hopper.
#include "kernels/conv/conv_fprop.h"

#include <cstdint>

#include "cutlass/cutlass.h"
#include "cutlass/conv/conv2d_problem_size.h"
#include "cutlass/conv/device/implicit_gemm_convolution.h"
#include "cutlass/conv/kernel/default_conv2d_fprop.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/threadblock/threadblock_swizzle.h"
#include "cutlass/layout/tensor.h"

namespace kfuse::kernels {
namespace {

using Element = cutlass::half_t;
using Layout = cutlass::layout::TensorNHWC;
constexpr int kAlign = 128 / cutlass::sizeof_bits<Element>::value;  // 8 elements = 16-byte vector accesses

using EpilogueOp = cutlass::epilogue::thread::LinearCombination<Element, kAlign, float, float>;

// 128x128x32 CTA tile, 2x2 warps of 64x64x32; 4 stages = 64 KiB of shared memory (fits sm_86/89's 99 KiB too).
using Kernel = typename cutlass::conv::kernel::DefaultConv2dFprop<
    Element, Layout, Element, Layout, Element, Layout, float, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
    cutlass::gemm::GemmShape<128, 128, 32>, cutlass::gemm::GemmShape<64, 64, 32>,
    cutlass::gemm::GemmShape<16, 8, 16>, EpilogueOp, cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<>,
    /*Stages=*/4, cutlass::arch::OpMultiplyAdd, cutlass::conv::IteratorAlgorithm::kOptimized>::Kernel;

using Conv = cutlass::conv::device::ImplicitGemmConvolution<Kernel>;

bool problem_is_sane(const Conv2dProblem& p) {
  return p.n > 0 && p.h > 0 && p.w > 0 && p.c > 0 && p.k > 0 && p.r > 0 && p.s > 0 && p.pad_h >= 0 &&
         p.pad_w >= 0 && p.stride_h >= 1 && p.stride_w >= 1 && p.p() > 0 && p.q() > 0;
}

cutlass::conv::Conv2dProblemSize make_problem_size(const Conv2dProblem& p) {
  return cutlass::conv::Conv2dProblemSize(p.n, p.h, p.w, p.c, p.k, p.r, p.s, p.p(), p.q(), p.pad_h, p.pad_w,
                                          p.stride_h, p.stride_w, /*dilation_h=*/1, /*dilation_w=*/1,
                                          cutlass::conv::Mode::kCrossCorrelation, /*split_k_slices=*/1,
                                          /*groups=*/1);
}

typename Conv::Arguments make_arguments(const cutlass::conv::Conv2dProblemSize& ps, const __half* x,
                                        const __half* w, const __half* c, __half* d, float alpha, float beta) {
  // Packed NHWC strides; the kernel's iterators take only the TensorRef's (pointer, layout).
  auto ref = [](const __half* ptr, cutlass::Tensor4DCoord extent) {
    return cutlass::TensorRef<Element, Layout>(const_cast<Element*>(reinterpret_cast<const Element*>(ptr)),
                                               Layout::packed(extent));
  };
  const cutlass::Tensor4DCoord act{ps.N, ps.H, ps.W, ps.C};
  const cutlass::Tensor4DCoord flt{ps.K, ps.R, ps.S, ps.C};
  const cutlass::Tensor4DCoord out{ps.N, ps.P, ps.Q, ps.K};
  // beta == 0: the epilogue skips the source; D stands in for a missing C so no null TensorRef is formed.
  const __half* src = c != nullptr ? c : d;
  return typename Conv::Arguments(ps, ref(x, act), ref(w, flt), ref(src, out), ref(d, out),
                                  typename EpilogueOp::Params(alpha, beta),
                                  cutlass::conv::SplitKMode::kSerial);
}

bool aligned16(const void* ptr) { return (reinterpret_cast<std::uintptr_t>(ptr) & 15u) == 0; }

// CUTLASS clears the CUDA error before returning a bare Status; recover the most likely cause (no kernel image
// for this device) on the failure path only, and clear the error that the query itself records.
cudaError_t diagnose_failure() {
  cudaFuncAttributes attr{};
  cudaError_t err = cudaFuncGetAttributes(&attr, cutlass::Kernel<Conv::UnderlyingKernel>);
  (void)cudaGetLastError();
  return err != cudaSuccess ? err : cudaErrorLaunchFailure;
}

}  // namespace

bool conv2d_fprop_f16_sm80_can_implement(const Conv2dProblem& problem) {
  if (!problem_is_sane(problem)) return false;
  const auto args = make_arguments(make_problem_size(problem), nullptr, nullptr, nullptr, nullptr, 1.0f, 0.0f);
  return Conv::can_implement(args) == cutlass::Status::kSuccess;
}

size_t conv2d_fprop_f16_sm80_workspace_bytes(const Conv2dProblem& problem) {
  if (!conv2d_fprop_f16_sm80_can_implement(problem)) return 0;
  const auto args = make_arguments(make_problem_size(problem), nullptr, nullptr, nullptr, nullptr, 1.0f, 0.0f);
  return Conv::get_workspace_size(args);
}

cudaError_t conv2d_fprop_f16_sm80(const Conv2dProblem& problem, const __half* x, const __half* w, const __half* c,
                                  __half* d, float alpha, float beta, void* workspace, size_t workspace_bytes,
                                  cudaStream_t stream) {
  if (!conv2d_fprop_f16_sm80_can_implement(problem)) return cudaErrorInvalidValue;
  if (x == nullptr || w == nullptr || d == nullptr || (beta != 0.0f && c == nullptr)) return cudaErrorInvalidValue;
  // 128-bit vector loads/stores (cp.async 16 B, epilogue 8 x fp16) need 16-byte aligned base pointers.
  if (!aligned16(x) || !aligned16(w) || !aligned16(d) || (c != nullptr && !aligned16(c))) {
    return cudaErrorInvalidValue;
  }

  const auto args = make_arguments(make_problem_size(problem), x, w, c, d, alpha, beta);
  if (Conv::can_implement(args) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
  const size_t needed = Conv::get_workspace_size(args);
  if (needed > 0 && (workspace == nullptr || workspace_bytes < needed)) return cudaErrorInvalidValue;

  Conv op;
  if (op.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return diagnose_failure();
  if (op.run(stream) != cutlass::Status::kSuccess) return diagnose_failure();
  return cudaSuccess;
}

}  // namespace kfuse::kernels
