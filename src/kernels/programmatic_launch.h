// Programmatic dependent launch (PDL, compute capability 9.0+): a kernel launched with the programmatic stream
// serialization attribute may start while the kernel before it in the stream is still running, once every CTA of
// that one has said so (griddepcontrol.launch_dependents) or exited. Its CTAs then sit resident at
// griddepcontrol.wait, which returns when the predecessor has completed and its writes are visible. What it saves
// is the launch, the CTA dispatch and the ramp of each kernel boundary, ~1-2 us each; the inference forward at
// batch 128 is a chain of dependent kernels of 5-15 us each, where that is a sizeable share.
//
// The contract, for every kernel launched through launch_kernel below:
//   - it calls pdl_wait_for_predecessor() before its first global memory access, so that running early is safe;
//   - it calls pdl_allow_successor() right after, so that the next kernel's CTAs can be resident before it ends.
// Both are no-ops below sm_90, and when the kernel was launched without the attribute.
//
// Which launches carry the attribute is decided by the caller that knows the stream's history: a PdlScope turns it
// on for the launches of this thread while the scope lives (the encoder's forward after its stem), and a launcher
// that puts a non-kernel operation (a memset) right before its kernel passes allow = false, since a programmatic
// edge may only join two kernels.
#pragma once

#include <utility>

#include <cuda_runtime.h>

namespace kfuse::kernels {

// Whether launch_kernel on this thread adds the attribute now (the innermost live PdlScope's setting; false when
// there is none).
bool pdl_requested();

// Sets pdl_requested() for this thread until destroyed; nests (the previous setting comes back).
class PdlScope {
 public:
  explicit PdlScope(bool on);
  ~PdlScope();
  PdlScope(const PdlScope&) = delete;
  PdlScope& operator=(const PdlScope&) = delete;

 private:
  bool previous_;
};

// Whether `device` can launch with the attribute (compute capability 9.0 or higher). Whether a launch uses it is the
// caller's option (EncoderOptions::programmatic_launch).
bool pdl_supported(int device);

#if defined(__CUDACC__)

__device__ __forceinline__ void pdl_wait_for_predecessor() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_allow_successor() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// <<<grid, block, smem, stream>>>(args...), with the programmatic attribute when pdl_requested() and `allow`.
template <class... Params, class... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          bool allow, Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = allow && pdl_requested() ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

#endif  // __CUDACC__

}  // namespace kfuse::kernels
