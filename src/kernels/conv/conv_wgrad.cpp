// Public entry points of the weight-gradient convolutions (conv_backward.h): dispatch on (dtype, tile) to the
// per-instance functions (wgrad_instances.h). Plain C++, no CUTLASS: the instances live in their own CUDA TUs.
#include "kernels/conv/conv_backward.h"

#include "kernels/conv/wgrad_instances.h"

namespace kfuse::kernels {
namespace {

struct Instance {
  bool (*can_implement)(const Conv2dProblem&, int);
  size_t (*workspace_bytes)(const Conv2dProblem&, int);
  cudaError_t (*launch)(const Conv2dProblem&, int, const void*, const void*, float*, void*, size_t, cudaStream_t);
};

#define KFUSE_WGRAD_INSTANCE(name) \
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
      {ConvDType::kF16, BackwardTile::k128x128, KFUSE_WGRAD_INSTANCE(wgrad_f16_128x128)},
      {ConvDType::kF16, BackwardTile::k128x64, KFUSE_WGRAD_INSTANCE(wgrad_f16_128x64)},
      {ConvDType::kF16, BackwardTile::k64x64, KFUSE_WGRAD_INSTANCE(wgrad_f16_64x64)},
      // bf16: one tile.
      {ConvDType::kBF16, BackwardTile::k128x64, KFUSE_WGRAD_INSTANCE(wgrad_bf16_128x64)},
  };
  for (const Entry& e : kTable)
    if (e.dtype == dtype && e.tile == tile) return &e.instance;
  return nullptr;
}

#undef KFUSE_WGRAD_INSTANCE

}  // namespace

bool conv2d_wgrad_can_implement(const Conv2dProblem& problem, ConvDType dtype, BackwardTile tile, int split_k) {
  const Instance* inst = find_instance(dtype, tile);
  return inst != nullptr && inst->can_implement(problem, split_k);
}

size_t conv2d_wgrad_workspace_bytes(const Conv2dProblem& problem, ConvDType dtype, BackwardTile tile, int split_k) {
  const Instance* inst = find_instance(dtype, tile);
  return inst != nullptr ? inst->workspace_bytes(problem, split_k) : 0;
}

cudaError_t conv2d_wgrad(const Conv2dProblem& problem, ConvDType dtype, BackwardTile tile, int split_k,
                         const void* dy, const void* x, float* dw, void* workspace, size_t workspace_bytes,
                         cudaStream_t stream) {
  const Instance* inst = find_instance(dtype, tile);
  if (inst == nullptr) return cudaErrorInvalidValue;
  return inst->launch(problem, split_k, dy, x, dw, workspace, workspace_bytes, stream);
}

}  // namespace kfuse::kernels
