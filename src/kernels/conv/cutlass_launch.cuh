// What every CUTLASS conv launcher of the FixUp family does around its kernel: the pointer alignment check, the
// workspace check, initialize + run with CUTLASS failures turned into a CUDA error, the CUTLASS 2.x conv launch
// through kfuse's own kernel wrapper (programmatic dependent launch, kernels/programmatic_launch.h), and the macro
// that stamps out the three plain functions of one instance (declared in fixup_instances.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "cutlass/cutlass.h"
#include "kernels/programmatic_launch.h"

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

// CUTLASS 2.x's cutlass::Kernel, plus the programmatic-launch contract of kernels/programmatic_launch.h: wait for
// the predecessor before touching memory, then let the successor's CTAs in.
template <class Operator>
__global__ void pdl_cutlass_kernel(typename Operator::Params params) {
  extern __shared__ int shared_storage_base[];
  pdl_wait_for_predecessor();
  pdl_allow_successor();
  Operator op;
  op(params, *reinterpret_cast<typename Operator::SharedStorage*>(shared_storage_base));
}

// Launches a CUTLASS 2.x implicit-GEMM conv kernel (`ConvKernel`, e.g. ImplicitGemmConvolution::UnderlyingKernel)
// as ImplicitGemmConvolution::initialize + run do, through pdl_cutlass_kernel.
// - `semaphores` (serial split-K only, else null): `semaphore_bytes` of them are zeroed first with
//   cudaMemsetAsync, as initialize() does; the kernel then follows a memset, so it never launches early.
// - Parallel split-K needs no memset: the grid has a CTA for every (M tile, N tile, slice), and each CTA's epilogue
//   stores every in-range element of its tile (zeros where its K tiles are all out of range), so every partial is
//   overwritten in full.
template <class ConvKernel, class Arguments>
cudaError_t launch_conv_kernel(const Arguments& args, int* semaphores, size_t semaphore_bytes, cudaStream_t stream) {
  if (semaphores != nullptr && semaphore_bytes > 0) {
    if (const cudaError_t err = cudaMemsetAsync(semaphores, 0, semaphore_bytes, stream); err != cudaSuccess)
      return err;
  }
  const typename ConvKernel::Params params(args, semaphores);
  const dim3 grid = typename ConvKernel::ThreadblockSwizzle().get_grid_shape(params.grid_tiled_shape);
  const dim3 block(ConvKernel::kThreadCount, 1, 1);
  const int smem_bytes = int(sizeof(typename ConvKernel::SharedStorage));
  if (smem_bytes >= (48 << 10) &&
      cudaFuncSetAttribute(pdl_cutlass_kernel<ConvKernel>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           smem_bytes) != cudaSuccess)
    return diagnose_launch_failure(pdl_cutlass_kernel<ConvKernel>);
  const cudaError_t err = launch_kernel(pdl_cutlass_kernel<ConvKernel>, grid, block, size_t(smem_bytes), stream,
                                        /*allow=*/semaphores == nullptr, params);
  (void)cudaGetLastError();  // clear a launch error, as CUTLASS's run() does; it is returned
  return err;
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
