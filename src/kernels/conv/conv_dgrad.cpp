// Public entry points of the data-gradient convolution (conv_backward.h): dispatch on (dtype, tile) to the
// per-instance functions (dgrad_instances.h). Plain C++, no CUTLASS: the instances live in their own CUDA TUs.
#include "kernels/conv/conv_backward.h"

#include "kernels/conv/dgrad_instances.h"

namespace kfuse::kernels {
namespace {

struct Instance {
  bool (*can_implement)(const Conv2dProblem&);
  size_t (*workspace_bytes)(const Conv2dProblem&);
  cudaError_t (*launch)(const Conv2dProblem&, const void*, const void*, void*, void*, size_t, cudaStream_t);
};

#define KFUSE_DGRAD_INSTANCE(name) \
  Instance { detail::name##_can_implement, detail::name##_workspace_bytes, detail::name##_launch }

// nullptr for a (dtype, tile) without an instance, or an enum value outside the declared ones (e.g. cast from an
// int).
const Instance* find_instance(ConvDType dtype, BackwardTile tile) {
  struct Entry {
    ConvDType dtype;
    BackwardTile tile;
    Instance instance;
  };
  static const Entry kTable[] = {
      {ConvDType::kF16, BackwardTile::k128x128, KFUSE_DGRAD_INSTANCE(dgrad_f16_128x128)},
      {ConvDType::kF16, BackwardTile::k128x64, KFUSE_DGRAD_INSTANCE(dgrad_f16_128x64)},
      {ConvDType::kF16, BackwardTile::k64x64, KFUSE_DGRAD_INSTANCE(dgrad_f16_64x64)},
      {ConvDType::kBF16, BackwardTile::k128x64, KFUSE_DGRAD_INSTANCE(dgrad_bf16_128x64)},
  };
  for (const Entry& e : kTable)
    if (e.dtype == dtype && e.tile == tile) return &e.instance;
  return nullptr;
}

#undef KFUSE_DGRAD_INSTANCE

}  // namespace

bool conv2d_dgrad_can_implement(const Conv2dProblem& problem, ConvDType dtype, BackwardTile tile) {
  const Instance* inst = find_instance(dtype, tile);
  return inst != nullptr && inst->can_implement(problem);
}

size_t conv2d_dgrad_workspace_bytes(const Conv2dProblem& problem, ConvDType dtype, BackwardTile tile) {
  const Instance* inst = find_instance(dtype, tile);
  return inst != nullptr ? inst->workspace_bytes(problem) : 0;
}

cudaError_t conv2d_dgrad(const Conv2dProblem& problem, ConvDType dtype, BackwardTile tile, const void* dy,
                         const void* w, void* dx, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const Instance* inst = find_instance(dtype, tile);
  if (inst == nullptr) return cudaErrorInvalidValue;
  return inst->launch(problem, dy, w, dx, workspace, workspace_bytes, stream);
}

}  // namespace kfuse::kernels
