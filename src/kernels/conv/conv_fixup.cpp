// Public entry points of the FixUp convolutions: dispatch on (dtype, tile) to the per-instance functions
// (fixup_instances.h). Plain C++, no CUTLASS: the instances live in their own CUDA TUs.
#include "kernels/conv/conv_fixup.h"

#include "kernels/conv/fixup_instances.h"

namespace kfuse::kernels {
namespace {

struct Instance {
  bool (*can_implement)(const Conv2dProblem&, int);
  size_t (*workspace_bytes)(const Conv2dProblem&, int);
  cudaError_t (*launch)(const Conv2dProblem&, const void*, const void*, void*, const FixupEpilogue&, int, void*,
                        size_t, cudaStream_t);
};

#define KFUSE_FIXUP_INSTANCE(name) \
  Instance { detail::name##_can_implement, detail::name##_workspace_bytes, detail::name##_launch }

// nullptr for a (dtype, tile) without an instance, or an enum value outside the declared ones (e.g. cast from an
// int).
const Instance* find_instance(ConvDType dtype, ConvTile tile, bool parallel = false) {
  struct Entry {
    ConvDType dtype;
    ConvTile tile;
    Instance instance;
    bool parallel = false;  // a parallel split-K instance (conv2d_fprop_fixup_parallel)
  };
  static const Entry kTable[] = {
      {ConvDType::kF16, ConvTile::k128x64, KFUSE_FIXUP_INSTANCE(fixup_f16_128x64)},
      {ConvDType::kF16, ConvTile::k64x64, KFUSE_FIXUP_INSTANCE(fixup_f16_64x64)},
      {ConvDType::kBF16, ConvTile::k128x64, KFUSE_FIXUP_INSTANCE(fixup_bf16_128x64)},
      {ConvDType::kBF16, ConvTile::k64x64, KFUSE_FIXUP_INSTANCE(fixup_bf16_64x64)},
      {ConvDType::kF16, ConvTile::k64x64x64, KFUSE_FIXUP_INSTANCE(fixup_f16_64x64x64)},
      {ConvDType::kF16, ConvTile::k128x64x64, KFUSE_FIXUP_INSTANCE(fixup_f16_128x64x64)},
      {ConvDType::kF16, ConvTile::k64x128, KFUSE_FIXUP_INSTANCE(fixup_f16_64x128)},
      {ConvDType::kF16, ConvTile::k128x128, KFUSE_FIXUP_INSTANCE(fixup_f16_128x128)},
      {ConvDType::kF16, ConvTile::k128x64w8, KFUSE_FIXUP_INSTANCE(fixup_f16_128x64w8)},
      // Hopper tiles: fp16 only.
      {ConvDType::kF16, ConvTile::kSm90_128x64, KFUSE_FIXUP_INSTANCE(fixup_f16_sm90_128x64)},
      {ConvDType::kF16, ConvTile::kSm90_64x64, KFUSE_FIXUP_INSTANCE(fixup_f16_sm90_64x64)},
      {ConvDType::kF16, ConvTile::kSm90_64x64_c2x2, KFUSE_FIXUP_INSTANCE(fixup_f16_sm90_64x64_c2x2)},
      {ConvDType::kF16, ConvTile::kSm90_128x64_s4, KFUSE_FIXUP_INSTANCE(fixup_f16_sm90_128x64_s4)},
      {ConvDType::kF16, ConvTile::kSm90_128x128, KFUSE_FIXUP_INSTANCE(fixup_f16_sm90_128x128)},
      {ConvDType::kF16, ConvTile::kSm90_256x64, KFUSE_FIXUP_INSTANCE(fixup_f16_sm90_256x64)},
      // Parallel split-K.
      {ConvDType::kF16, ConvTile::k128x128, KFUSE_FIXUP_INSTANCE(fixup_split_f16_128x128), true},
      {ConvDType::kF16, ConvTile::k64x128, KFUSE_FIXUP_INSTANCE(fixup_split_f16_64x128), true},
      {ConvDType::kF16, ConvTile::k64x64x64, KFUSE_FIXUP_INSTANCE(fixup_split_f16_64x64x64), true},
      {ConvDType::kF16, ConvTile::k128x64, KFUSE_FIXUP_INSTANCE(fixup_split_f16_128x64), true},
      {ConvDType::kBF16, ConvTile::k128x128, KFUSE_FIXUP_INSTANCE(fixup_split_bf16_128x128), true},
      {ConvDType::kBF16, ConvTile::k64x64, KFUSE_FIXUP_INSTANCE(fixup_split_bf16_64x64), true},
  };
  for (const Entry& e : kTable)
    if (e.dtype == dtype && e.tile == tile && e.parallel == parallel) return &e.instance;
  return nullptr;
}

const Instance* find_e4m3_instance(ConvTile tile) {
  struct Entry {
    ConvTile tile;
    Instance instance;
  };
  static const Entry kTable[] = {
      {ConvTile::kSm90_128x64, KFUSE_FIXUP_INSTANCE(fixup_e4m3_sm90_128x64)},
      {ConvTile::kSm90_128x64_k64, KFUSE_FIXUP_INSTANCE(fixup_e4m3_sm90_128x64_k64)},
      {ConvTile::kSm90_128x128, KFUSE_FIXUP_INSTANCE(fixup_e4m3_sm90_128x128)},
      {ConvTile::kSm90_256x64, KFUSE_FIXUP_INSTANCE(fixup_e4m3_sm90_256x64)},
  };
  for (const Entry& e : kTable)
    if (e.tile == tile) return &e.instance;
  return nullptr;
}

#undef KFUSE_FIXUP_INSTANCE

}  // namespace

bool conv2d_fprop_fixup_e4m3_can_implement(const Conv2dProblem& problem, ConvTile tile) {
  const Instance* inst = find_e4m3_instance(tile);
  return inst != nullptr && problem.c % 16 == 0 && problem.k % 16 == 0 && inst->can_implement(problem, 1);
}

cudaError_t conv2d_fprop_fixup_e4m3(const Conv2dProblem& problem, ConvTile tile, const void* x, const void* w,
                                   void* y, const FixupEpilogue& epilogue, cudaStream_t stream) {
  const Instance* inst = find_e4m3_instance(tile);
  if (inst == nullptr || !conv2d_fprop_fixup_e4m3_can_implement(problem, tile)) return cudaErrorInvalidValue;
  return inst->launch(problem, x, w, y, epilogue, 1, nullptr, 0, stream);
}

bool conv2d_fprop_fixup_can_implement(const Conv2dProblem& problem, ConvDType dtype, ConvTile tile, int split_k) {
  const Instance* inst = find_instance(dtype, tile);
  return inst != nullptr && inst->can_implement(problem, split_k);
}

size_t conv2d_fprop_fixup_workspace_bytes(const Conv2dProblem& problem, ConvDType dtype, ConvTile tile,
                                          int split_k) {
  const Instance* inst = find_instance(dtype, tile);
  return inst != nullptr ? inst->workspace_bytes(problem, split_k) : 0;
}

cudaError_t conv2d_fprop_fixup(const Conv2dProblem& problem, ConvDType dtype, ConvTile tile, const void* x,
                               const void* w, void* y, const FixupEpilogue& epilogue, int split_k, void* workspace,
                               size_t workspace_bytes, cudaStream_t stream) {
  const Instance* inst = find_instance(dtype, tile);
  if (inst == nullptr || epilogue.channel_alpha != nullptr) return cudaErrorInvalidValue;
  return inst->launch(problem, x, w, y, epilogue, split_k, workspace, workspace_bytes, stream);
}

bool conv2d_fprop_fixup_parallel_can_implement(const Conv2dProblem& problem, ConvDType dtype, ConvTile tile,
                                                int split_k) {
  const Instance* inst = find_instance(dtype, tile, /*parallel=*/true);
  return inst != nullptr && inst->can_implement(problem, split_k);
}

size_t conv2d_fprop_fixup_parallel_workspace_bytes(const Conv2dProblem& problem, ConvDType dtype, ConvTile tile,
                                                   int split_k) {
  const Instance* inst = find_instance(dtype, tile, /*parallel=*/true);
  return inst != nullptr ? inst->workspace_bytes(problem, split_k) : 0;
}

cudaError_t conv2d_fprop_fixup_parallel(const Conv2dProblem& problem, ConvDType dtype, ConvTile tile, const void* x,
                                        const void* w, void* y, const FixupEpilogue& epilogue, int split_k,
                                        void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const Instance* inst = find_instance(dtype, tile, /*parallel=*/true);
  if (inst == nullptr || epilogue.channel_alpha != nullptr) return cudaErrorInvalidValue;
  return inst->launch(problem, x, w, y, epilogue, split_k, workspace, workspace_bytes, stream);
}

}  // namespace kfuse::kernels
