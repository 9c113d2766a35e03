// CUTLASS 3.x Hopper implicit-GEMM conv fprop: fp16 NHWC x fp16 KRSC -> fp16 NPQK, fp32 accumulate,
// D = alpha * acc + beta * C. One instantiation per TU (it costs ~60 s / 3.5 GB to compile); build for sm_90a only.
#include "kernels/conv/conv_fprop.h"

#include <cstdint>

// Order matters: the conv collective headers use cutlass::KernelHardwareInfo without including it (CUTLASS's own
// tests include the device adapter first).
#include "cutlass/cutlass.h"
#include "cutlass/kernel_hardware_info.hpp"
#include "cute/tensor.hpp"
#include "cutlass/conv/convnd_problem_shape.hpp"
#include "cutlass/conv/device/conv_universal_adapter.hpp"
#include "cutlass/conv/kernel/conv_universal.hpp"
#include "cutlass/conv/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"

namespace kfuse::kernels {
namespace {

using namespace cute;

using ElementAct = cutlass::half_t;
using ElementFlt = cutlass::half_t;
using ElementOut = cutlass::half_t;
using ElementAcc = float;
using ElementCompute = float;
using Layout = cutlass::layout::TensorNHWC;  // KRSC filters are "NHWC" to CUTLASS as well
constexpr int kAlign = 128 / cutlass::sizeof_bits<cutlass::half_t>::value;  // 8 elements = 16 B (TMA)

using TileShape = Shape<_128, _128, Shape<_64>>;
using ClusterShape = Shape<_1, _1, _1>;

using FusionOp = cutlass::epilogue::fusion::LinearCombination<ElementOut, ElementCompute, ElementOut, ElementCompute>;

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, ElementCompute,
    ElementOut, Layout, kAlign,  // C
    ElementOut, Layout, kAlign,  // D
    cutlass::epilogue::TmaWarpSpecialized, FusionOp>::CollectiveOp;

using CollectiveMainloop = typename cutlass::conv::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cutlass::conv::Operator::kFprop,
    ElementAct, Layout, kAlign, ElementFlt, Layout, kAlign, ElementAcc, TileShape, ClusterShape,
    cutlass::conv::collective::StageCountAutoCarveout<
        static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
    cutlass::conv::collective::KernelScheduleAuto>::CollectiveOp;

using ProblemShape = cutlass::conv::ConvProblemShape<CollectiveMainloop::DispatchPolicy::ConvOp,
                                                     CollectiveMainloop::DispatchPolicy::NumSpatialDimensions>;
using ConvKernel = cutlass::conv::kernel::ConvUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
using Conv = cutlass::conv::device::ConvUniversalAdapter<ConvKernel>;

static_assert(ProblemShape::RankS == 2);

// Checks CUTLASS's can_implement does not make: TMA im2col element strides are limited to 8, and our p()/q()
// must be positive (CUTLASS would otherwise see empty or negative extents).
bool problem_is_sane(const Conv2dProblem& p) {
  return p.n > 0 && p.h > 0 && p.w > 0 && p.c > 0 && p.k > 0 && p.r > 0 && p.s > 0 && p.pad_h >= 0 &&
         p.pad_w >= 0 && p.stride_h >= 1 && p.stride_h <= 8 && p.stride_w >= 1 && p.stride_w <= 8 && p.p() > 0 &&
         p.q() > 0;
}

ProblemShape make_problem_shape(const Conv2dProblem& p) {
  // Dense packed tensors; activation [n,h,w,c], filter [k,r,s,c]; symmetric padding, dilation 1, one group.
  return ProblemShape(cutlass::conv::Mode::kCrossCorrelation,
                      ProblemShape::TensorExtent{p.n, p.h, p.w, p.c},
                      ProblemShape::TensorExtent{p.k, p.r, p.s, p.c},
                      ProblemShape::ShapePadding{p.pad_h, p.pad_w},
                      ProblemShape::ShapePadding{p.pad_h, p.pad_w},
                      ProblemShape::TraversalStride{p.stride_h, p.stride_w},
                      ProblemShape::ShapeDilation{1, 1},
                      /*groups=*/1);
}

typename Conv::Arguments make_arguments(const ProblemShape& shape, const __half* x, const __half* w,
                                        const __half* c, __half* d, float alpha, float beta) {
  // The epilogue's C/D strides are ((q, p, n), k, batch): fill mode 0 from the NPQK strides, innermost first,
  // as CUTLASS's conv testbed does.
  typename ConvKernel::StrideC stride_c{};
  typename ConvKernel::StrideD stride_d{};
  cute::for_each(cute::make_seq<cute::rank<0>(typename ConvKernel::StrideC{})>{}, [&](auto i) {
    cute::get<0, i>(stride_c) = shape.stride_C[ProblemShape::RankT - 2 - i];
  });
  cute::for_each(cute::make_seq<cute::rank<0>(typename ConvKernel::StrideD{})>{}, [&](auto i) {
    cute::get<0, i>(stride_d) = shape.stride_C[ProblemShape::RankT - 2 - i];
  });

  typename ConvKernel::MainloopArguments mainloop{reinterpret_cast<const ElementAct*>(x),
                                                  reinterpret_cast<const ElementFlt*>(w)};
  // With beta == 0 the epilogue never loads C, but it still encodes a TMA descriptor for it: point it at D
  // (same shape and strides) rather than at nullptr.
  const __half* src = c != nullptr ? c : d;
  typename ConvKernel::EpilogueArguments epilogue{{}, reinterpret_cast<const ElementOut*>(src), stride_c,
                                                  reinterpret_cast<ElementOut*>(d), stride_d};
  epilogue.thread.alpha = alpha;
  epilogue.thread.beta = beta;

  // Non-persistent schedule: hw_info (SM count) is unused, the default scheduler arguments suffice.
  cutlass::KernelHardwareInfo hw_info{};
  return typename Conv::Arguments{shape, mainloop, epilogue, hw_info};
}

bool aligned16(const void* ptr) { return (reinterpret_cast<std::uintptr_t>(ptr) & 15u) == 0; }

// CUTLASS clears the CUDA error before returning a bare Status; recover the most likely cause (no kernel image
// for this device) on the failure path only, and clear the error that the query itself records.
cudaError_t diagnose_failure() {
  cudaFuncAttributes attr{};
  cudaError_t err = cudaFuncGetAttributes(&attr, cutlass::device_kernel<ConvKernel>);
  (void)cudaGetLastError();
  return err != cudaSuccess ? err : cudaErrorLaunchFailure;
}

}  // namespace

bool conv2d_fprop_f16_sm90_can_implement(const Conv2dProblem& problem) {
  if (!problem_is_sane(problem)) return false;
  const ProblemShape shape = make_problem_shape(problem);
  if (shape.shape_C[1] != problem.p() || shape.shape_C[2] != problem.q()) return false;
  const auto args = make_arguments(shape, nullptr, nullptr, nullptr, nullptr, 1.0f, 0.0f);
  return Conv::can_implement(args) == cutlass::Status::kSuccess;
}

size_t conv2d_fprop_f16_sm90_workspace_bytes(const Conv2dProblem& problem) {
  if (!conv2d_fprop_f16_sm90_can_implement(problem)) return 0;
  const auto args = make_arguments(make_problem_shape(problem), nullptr, nullptr, nullptr, nullptr, 1.0f, 0.0f);
  return Conv::get_workspace_size(args);
}

cudaError_t conv2d_fprop_f16_sm90(const Conv2dProblem& problem, const __half* x, const __half* w, const __half* c,
                                  __half* d, float alpha, float beta, void* workspace, size_t workspace_bytes,
                                  cudaStream_t stream) {
  if (!conv2d_fprop_f16_sm90_can_implement(problem)) return cudaErrorInvalidValue;
  if (x == nullptr || w == nullptr || d == nullptr || (beta != 0.0f && c == nullptr)) return cudaErrorInvalidValue;
  // TMA descriptors need 16-byte aligned base addresses; encoding failures are only asserted (off under NDEBUG).
  if (!aligned16(x) || !aligned16(w) || !aligned16(d) || (c != nullptr && !aligned16(c))) {
    return cudaErrorInvalidValue;
  }

  const auto args = make_arguments(make_problem_shape(problem), x, w, c, d, alpha, beta);
  if (Conv::can_implement(args) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
  const size_t needed = Conv::get_workspace_size(args);
  if (needed > 0 && (workspace == nullptr || workspace_bytes < needed)) return cudaErrorInvalidValue;

  Conv op;
  if (op.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return diagnose_failure();
  if (op.run(stream) != cutlass::Status::kSuccess) return diagnose_failure();
  return cudaSuccess;
}

}  // namespace kfuse::kernels
