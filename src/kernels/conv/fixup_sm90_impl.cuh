// CUTLASS 3.x Hopper implicit-GEMM conv fprop (TMA im2col + wgmma) with the FixUp epilogue of conv_fixup.h as an
// sm90 epilogue visitor tree, shared by the fixup_{f16,e4m3}_sm90_*.cu files: each stamps out one CTA tile with
// KFUSE_FIXUP_SM90_DEFINE_INSTANCE, so every CUTLASS instantiation is compiled in its own TU (sm_90a only).
// fp16 or e4m3 NHWC x KRSC -> fp16 NPQK, fp32 accumulate; no split-K (the 3.x conv kernel has none).
//
//   D = post + max(alpha * acc + pre, floor),   floor = 0 (relu) or -inf (identity)
//
// With e4m3 operands alpha is a vector over the output channels (FixupEpilogue::channel_alpha: the dequantization
// scales s_x * s_w[k], with any FixUp scale folded in), a row broadcast of the GEMM (M = pixels, N = channels).
//
// Every scalar is an Sm90ScalarBroadcast: the kernel reads alpha / pre / post through their device pointers (so a
// captured CUDA graph sees their current values) and falls back to the host value when a pointer is null, which
// gives nullptr = 1 / 0 / 0 and makes relu a runtime argument (floor's value) without a second instantiation.
#pragma once

#include <cstdint>
#include <limits>
#include <type_traits>

// Order matters: the conv collective headers use cutlass::KernelHardwareInfo without including it.
#include "cutlass/cutlass.h"
#include "cutlass/kernel_hardware_info.hpp"
#include "cute/tensor.hpp"
#include "cutlass/conv/convnd_problem_shape.hpp"
#include "cutlass/conv/device/conv_universal_adapter.hpp"
#include "cutlass/conv/kernel/conv_universal.hpp"
#include "cutlass/conv/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/functional.h"
#include "kernels/conv/conv_fixup.h"
#include "kernels/conv/cutlass_launch.cuh"
#include "kernels/conv/fixup_instances.h"
#include "kernels/programmatic_launch.h"

namespace kfuse::kernels::detail::fixup_sm90_impl {

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;

// NaN-propagating max: torch.relu keeps NaN, and max(NaN, -inf) must stay NaN for the identity case too.
template <class T>
using MaxPropagateNaN = cutlass::maximum<T, /*PropagateNaN=*/true>;

// post + act for the last node of the tree, keeping the ReLU's decision readable from the stored fp16 value (the
// training backward's mask, relu_mask_backward): where act > 0 but post + act would round to fp16(post), return the
// next fp16 value above it instead (faithful rounding, within one ulp; the tree's conversion then is exact). Only
// with post != 0, as FixupLinearCombinationRelu does for the CUTLASS 2.x kernels.
__device__ inline float plus_keep_active(float post, float act) {
  const float r = post + act;
  if (!(act > 0.f) || post == 0.f) return r;
  const cutlass::half_t hp(post), hr(r);
  if (!(hr == hp)) return r;
  const uint16_t bits = hp.raw();
  const uint16_t up = (bits & 0x7fffu) == 0 ? uint16_t(1) : uint16_t((bits & 0x8000u) ? bits - 1 : bits + 1);
  return float(cutlass::half_t::bitcast(up));
}
template <class T>
struct PlusKeepActive {
  CUTLASS_HOST_DEVICE T operator()(T const& post, T const& act) const {
#if defined(__CUDA_ARCH__)
    return plus_keep_active(post, act);
#else
    return post + act;
#endif
  }
};
template <class T, int N>
struct PlusKeepActive<cutlass::Array<T, N>> {
  CUTLASS_HOST_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& post,
                                                      cutlass::Array<T, N> const& act) const {
    cutlass::Array<T, N> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) out[i] = PlusKeepActive<T>{}(post[i], act[i]);
    return out;
  }
};

// cutlass::device_kernel (the CUTLASS 3.x kernel entry: launch bounds, TMA descriptors in __grid_constant__
// parameters) plus the programmatic-launch contract of kernels/programmatic_launch.h. CUTLASS 4.2's sm90 conv kernel
// has no grid-dependency control of its own, so the wait comes before any of its work.
template <class Operator>
__global__ void __launch_bounds__(Operator::MaxThreadsPerBlock, Operator::MinBlocksPerMultiprocessor)
    pdl_device_kernel(CUTLASS_GRID_CONSTANT typename Operator::Params const params) {
  extern __shared__ char smem[];
  pdl_wait_for_predecessor();
  pdl_allow_successor();
  Operator op;
  op(params, smem);
}

// ConvUniversalAdapter::initialize + run for a kernel that needs no workspace, through pdl_device_kernel: a cluster
// launch where the cluster shape has more than one CTA, with the programmatic attribute when pdl_requested().
template <class ConvKernel>
cudaError_t launch_sm90_conv_kernel(const typename ConvKernel::Arguments& args, cudaStream_t stream) {
  if (ConvKernel::get_workspace_size(args) != 0) return cudaErrorInvalidValue;  // none of the FixUp tiles needs one
  const typename ConvKernel::Params params = ConvKernel::to_underlying_arguments(args, nullptr);
  const auto kernel = pdl_device_kernel<ConvKernel>;
  const int smem_bytes = ConvKernel::SharedStorageSize;
  if (smem_bytes >= (48 << 10) &&
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes) != cudaSuccess)
    return diagnose_launch_failure(kernel);
  using Cluster = typename ConvKernel::DispatchPolicy::ClusterShape;
  cudaLaunchAttribute attrs[2];
  unsigned count = 0;
  if (cute::size(Cluster{}) > 1) {
    attrs[count].id = cudaLaunchAttributeClusterDimension;
    attrs[count].val.clusterDim.x = unsigned(cute::size<0>(Cluster{}));
    attrs[count].val.clusterDim.y = unsigned(cute::size<1>(Cluster{}));
    attrs[count].val.clusterDim.z = unsigned(cute::size<2>(Cluster{}));
    ++count;
  }
  if (pdl_requested()) {
    attrs[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = ConvKernel::get_grid_shape(params);
  config.blockDim = ConvKernel::get_block_shape();
  config.dynamicSmemBytes = size_t(smem_bytes);
  config.stream = stream;
  config.attrs = attrs;
  config.numAttrs = count;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, params);
  (void)cudaGetLastError();  // returned, not left behind
  return err;
}

// Checks CUTLASS's can_implement does not make: TMA im2col element strides are limited to 8, and p()/q() must be
// positive (CUTLASS would otherwise see empty or negative extents).
inline bool problem_is_sane(const Conv2dProblem& p, int split_k) {
  return p.n > 0 && p.h > 0 && p.w > 0 && p.c > 0 && p.k > 0 && p.r > 0 && p.s > 0 && p.pad_h >= 0 &&
         p.pad_w >= 0 && p.stride_h >= 1 && p.stride_h <= 8 && p.stride_w >= 1 && p.stride_w <= 8 && p.p() > 0 &&
         p.q() > 0 && split_k == 1;
}

// Stages = 0: as many pipeline stages as shared memory holds (one CTA per SM); a fixed count leaves room for more
// CTAs per SM. A cluster of ClusterM x ClusterN CTAs multicasts the shared operand tiles through TMA, cutting the L2
// traffic of the late layers, whose small grids re-read the same weights and activations from every CTA.
// TileK = 0: 128 bytes of channels (the widest swizzle); e4m3 tiles may take 64, for layers of 64 channels, whose C
// would fill only half of a 128-element K tile (the other half zeros from TMA's bounds, multiplied all the same).
template <int TileM, int TileN, int ClusterM = 1, int ClusterN = 1, int Stages = 0, class ElementIn = cutlass::half_t,
          int TileK = 0>
struct FixupConvSm90 {
  using Element = cutlass::half_t;  // the output's
  using ElementAcc = float;
  using ElementCompute = float;
  using Layout = cutlass::layout::TensorNHWC;  // KRSC filters are "NHWC" to CUTLASS as well
  static constexpr bool kFp8 = cutlass::sizeof_bits<ElementIn>::value == 8;
  static constexpr int kAlign = 128 / cutlass::sizeof_bits<Element>::value;      // 8 elements = 16 B (TMA)
  static constexpr int kAlignIn = 128 / cutlass::sizeof_bits<ElementIn>::value;  // 16 B: 8 fp16 or 16 e4m3

  // K tile: 128 bytes of channels per row (64 fp16, 128 e4m3), the swizzle width, unless TileK says otherwise
  static constexpr int kTileK = TileK != 0 ? TileK : (kFp8 ? 128 : 64);
  using TileShape = Shape<Int<TileM>, Int<TileN>, Shape<Int<kTileK>>>;
  using ClusterShape = Shape<Int<ClusterM>, Int<ClusterN>, _1>;

  static constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;
  using Scalar = fusion::Sm90ScalarBroadcast<ElementCompute>;
  using ChannelVector = fusion::Sm90RowBroadcast<0, TileShape, ElementCompute, ElementCompute>;
  using Alpha = std::conditional_t<kFp8, ChannelVector, Scalar>;
  // alpha * acc + pre
  using Affine = fusion::Sm90EVT<
      fusion::Sm90Compute<cutlass::homogeneous_multiply_add, ElementCompute, ElementCompute, kRound>,
      Alpha, fusion::Sm90AccFetch, Scalar>;
  // max(alpha * acc + pre, floor)
  using Act = fusion::Sm90EVT<fusion::Sm90Compute<MaxPropagateNaN, ElementCompute, ElementCompute, kRound>,
                              Affine, Scalar>;
  // post + act(...), rounded to fp16 once (never to fp16(post) where act > 0: PlusKeepActive)
  using FusionOp = fusion::Sm90EVT<fusion::Sm90Compute<PlusKeepActive, Element, ElementCompute, kRound>, Scalar, Act>;

  // ElementC = void: the tree reads no source tensor, so no C load and no C TMA descriptor.
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, ElementCompute,
      void, Layout, kAlign,     // C
      Element, Layout, kAlign,  // D
      cutlass::epilogue::TmaWarpSpecialized, FusionOp>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::conv::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cutlass::conv::Operator::kFprop,
      ElementIn, Layout, kAlignIn, ElementIn, Layout, kAlignIn, ElementAcc, TileShape, ClusterShape,
      std::conditional_t<Stages == 0,
                         cutlass::conv::collective::StageCountAutoCarveout<
                             static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
                         cutlass::conv::collective::StageCount<Stages>>,
      cutlass::conv::collective::KernelScheduleAuto>::CollectiveOp;

  using ProblemShape = cutlass::conv::ConvProblemShape<CollectiveMainloop::DispatchPolicy::ConvOp,
                                                       CollectiveMainloop::DispatchPolicy::NumSpatialDimensions>;
  using ConvKernel = cutlass::conv::kernel::ConvUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Conv = cutlass::conv::device::ConvUniversalAdapter<ConvKernel>;

  static_assert(ProblemShape::RankS == 2);

  static ProblemShape make_problem_shape(const Conv2dProblem& p) {
    // Dense packed tensors; activation [n,h,w,c], filter [k,r,s,c]; symmetric padding, dilation 1, one group.
    return ProblemShape(cutlass::conv::Mode::kCrossCorrelation, typename ProblemShape::TensorExtent{p.n, p.h, p.w, p.c},
                        typename ProblemShape::TensorExtent{p.k, p.r, p.s, p.c},
                        typename ProblemShape::ShapePadding{p.pad_h, p.pad_w},
                        typename ProblemShape::ShapePadding{p.pad_h, p.pad_w},
                        typename ProblemShape::TraversalStride{p.stride_h, p.stride_w},
                        typename ProblemShape::ShapeDilation{1, 1},
                        /*groups=*/1);
  }

  static typename Conv::Arguments make_arguments(const ProblemShape& shape, const void* x, const void* w, void* y,
                                                 const FixupEpilogue& e) {
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

    typename ConvKernel::MainloopArguments mainloop{static_cast<const ElementIn*>(x), static_cast<const ElementIn*>(w)};

    // A null pointer makes Sm90ScalarBroadcast use the value next to it: 1 / 0 / 0 as conv_fixup.h specifies.
    auto scalar = [](const float* ptr, float fallback) {
      typename Scalar::Arguments a{};
      a.scalars[0] = fallback;
      a.scalar_ptrs[0] = ptr;
      return a;
    };
    const float floor = e.relu ? 0.0f : -std::numeric_limits<float>::infinity();
    typename Alpha::Arguments alpha{};
    if constexpr (kFp8) {
      alpha.ptr_row = e.channel_alpha;  // null only in can_implement's probe (the launch refuses it)
      alpha.null_default = 1.0f;
    } else {
      alpha = scalar(e.alpha, 1.0f);
    }
    // Nested as the tree: {children..., node op}; Sm90Compute's op arguments are empty.
    typename FusionOp::Arguments thread{
        scalar(e.post, 0.0f), {{alpha, {}, scalar(e.pre, 0.0f), {}}, scalar(nullptr, floor), {}}, {}};

    typename ConvKernel::EpilogueArguments epilogue{thread, nullptr, stride_c, static_cast<Element*>(y), stride_d};

    // Non-persistent schedule: hw_info (SM count) is unused, the default scheduler arguments suffice.
    cutlass::KernelHardwareInfo hw_info{};
    return typename Conv::Arguments{shape, mainloop, epilogue, hw_info};
  }

  static bool can_implement(const Conv2dProblem& problem, int split_k) {
    if (!problem_is_sane(problem, split_k)) return false;
    const ProblemShape shape = make_problem_shape(problem);
    if (shape.shape_C[1] != problem.p() || shape.shape_C[2] != problem.q()) return false;
    const auto args = make_arguments(shape, nullptr, nullptr, nullptr, {});
    return Conv::can_implement(args) == cutlass::Status::kSuccess;
  }

  static size_t workspace_bytes(const Conv2dProblem& problem, int split_k) {
    if (!can_implement(problem, split_k)) return 0;
    const auto args = make_arguments(make_problem_shape(problem), nullptr, nullptr, nullptr, {});
    return Conv::get_workspace_size(args);
  }

  // sm_90a SASS runs on compute capability 9.0 only; elsewhere TMA descriptor encoding or the launch would fail in
  // ways CUTLASS reports poorly (asserts are off), so refuse up front.
  static cudaError_t check_device() {
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
      const cudaError_t err = cudaGetLastError();  // clear it: a rejected call leaves no sticky error
      return err != cudaSuccess ? err : cudaErrorInvalidDevice;
    }
    return major == 9 ? cudaSuccess : cudaErrorInvalidDevice;
  }

  static cudaError_t launch(const Conv2dProblem& problem, const void* x, const void* w, void* y,
                            const FixupEpilogue& epilogue, int split_k, void* workspace, size_t workspace_bytes,
                            cudaStream_t stream) {
    if (!can_implement(problem, split_k)) return cudaErrorInvalidValue;
    if (x == nullptr || w == nullptr || y == nullptr) return cudaErrorInvalidValue;
    // e4m3: the per-channel scales, and no scalar alpha beside them; fp16: no per-channel scales to ignore
    if (kFp8 ? (epilogue.channel_alpha == nullptr || epilogue.alpha != nullptr) : epilogue.channel_alpha != nullptr)
      return cudaErrorInvalidValue;
    if (kFp8 && !aligned16(epilogue.channel_alpha)) return cudaErrorInvalidValue;
    // TMA descriptors need 16-byte aligned base addresses; encoding failures are only asserted (off under NDEBUG).
    if (!aligned16(x) || !aligned16(w) || !aligned16(y)) return cudaErrorInvalidValue;
    if (const cudaError_t err = check_device(); err != cudaSuccess) return err;

    const auto args = make_arguments(make_problem_shape(problem), x, w, y, epilogue);
    if (Conv::can_implement(args) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
    (void)workspace;  // workspace_bytes() is 0 for every tile (launch_sm90_conv_kernel checks)
    (void)workspace_bytes;
    return launch_sm90_conv_kernel<ConvKernel>(args, stream);
  }
};

}  // namespace kfuse::kernels::detail::fixup_sm90_impl
