// What every CUTLASS conv launcher of the FixUp family does around its kernel: the pointer alignment check, the
// workspace check, initialize + run with CUTLASS failures turned into a CUDA error, the launch without initialize()
// for parallel split-K, and the macro that stamps out the three plain functions of one instance (declared in
// fixup_instances.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "cutlass/cutlass.h"

namespace kfuse::kernels::detail {

// 128-bit vector accesses (cp.async, TMA, epilogue stores) need 16-byte aligned base pointers.
inline bool aligned16(const void* ptr) { return (reinterpret_cast<std::uintptr_t>(ptr) & 15u) == 0; }

// CUTLASS clears the CUDA error before returning a bare Status; recover the most likely cause (no kernel image for
// this device) on the failure path only, and clear the error that the query itself records.
template <class KernelFn>
cudaError_t diagnose_launch_failure(KernelFn kernel) {
  cudaFuncAttributes attr{};
  const cudaError_t err = cudaFuncGetAttributes(&attr, kernel);
  (void)cudaGetLastError();
  return err != cudaSuccess ? err : cudaErrorLaunchFailure;
}

// Checks the workspace, then initializes and runs the device op `Op` on `stream` (initialize may enqueue a memset of
// the workspace, which graph capture records too).
template <class Op, class KernelFn>
cudaError_t run_cutlass_op(const typename Op::Arguments& args, void* workspace, size_t workspace_bytes,
                           cudaStream_t stream, KernelFn kernel) {
  const size_t needed = Op::get_workspace_size(args);
  if (needed > 0 && (workspace == nullptr || workspace_bytes < needed)) return cudaErrorInvalidValue;
  Op op;
  if (op.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return diagnose_launch_failure(kernel);
  if (op.run(stream) != cutlass::Status::kSuccess) return diagnose_launch_failure(kernel);
  return cudaSuccess;
}

// Launches a CUTLASS 2.x implicit-GEMM conv kernel (`ConvKernel`, e.g. ImplicitGemmConvolution::UnderlyingKernel)
// as ImplicitGemmConvolution::run does, but without its initialize(): for split_k > 1 that cudaMemsetAsync-s the
// whole workspace to 0 (serial split-K's semaphores need it). Parallel split-K does not: the grid has a CTA for every
// (M tile, N tile, slice), and each CTA's epilogue stores every in-range element of its tile (zeros where its K tiles
// are all out of range), so every partial is overwritten in full and the memset would only add as many bytes of
// traffic as the partials themselves. Also the plain launch of a split_k == 1 conv.
template <class ConvKernel, class Arguments>
cudaError_t run_conv_without_memset(const Arguments& args, cudaStream_t stream) {
  const typename ConvKernel::Params params(args, /*semaphore=*/nullptr);  // read only by serial split-K
  const dim3 grid = typename ConvKernel::ThreadblockSwizzle().get_grid_shape(params.grid_tiled_shape);
  const dim3 block(ConvKernel::kThreadCount, 1, 1);
  const int smem_bytes = int(sizeof(typename ConvKernel::SharedStorage));
  if (smem_bytes >= (48 << 10) &&
      cudaFuncSetAttribute(cutlass::Kernel<ConvKernel>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes) !=
          cudaSuccess)
    return diagnose_launch_failure(cutlass::Kernel<ConvKernel>);
  cutlass::Kernel<ConvKernel><<<grid, block, smem_bytes, stream>>>(params);
  return cudaGetLastError();  // also clears a launch error, as CUTLASS's run() does
}

}  // namespace kfuse::kernels::detail

// Defines name##_can_implement / _workspace_bytes / _launch for one instance type (relative to
// kfuse::kernels::detail) that has static can_implement, workspace_bytes and launch.
#define KFUSE_FIXUP_DEFINE_INSTANCE(name, ...)                                                                  \
  namespace kfuse::kernels::detail {                                                                            \
  bool name##_can_implement(const Conv2dProblem& problem, int split_k) {                                       \
    return __VA_ARGS__::can_implement(problem, split_k);                                                       \
  }                                                                                                             \
  size_t name##_workspace_bytes(const Conv2dProblem& problem, int split_k) {                                   \
    return __VA_ARGS__::workspace_bytes(problem, split_k);                                                     \
  }                                                                                                             \
  cudaError_t name##_launch(const Conv2dProblem& problem, const void* x, const void* w, void* y,               \
                            const FixupEpilogue& epilogue, int split_k, void* workspace, size_t workspace_bytes, \
                            cudaStream_t stream) {                                                              \
    return __VA_ARGS__::launch(problem, x, w, y, epilogue, split_k, workspace, workspace_bytes, stream);       \
  }                                                                                                             \
  }
