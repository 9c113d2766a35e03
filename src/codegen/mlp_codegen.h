// CUDA source generation for one fused MLP (spec + kernel variant). The module holds five kernels:
//   kfuse_mlp_pack(PackParams)                     weights and biases from PyTorch layouts into the packed layout;
//   kfuse_mlp_forward / kfuse_mlp_forward_train(FwdParams)   the forward (the latter also writes the stash);
//   kfuse_mlp_backward / kfuse_mlp_backward_dx(BwdParams)    the activation-gradient chain (dz of every layer, and
//                                                             dL/dx for the _dx one).
// Parameter structs (by value, in this order; pointers are device pointers, i64 = long long):
//   PackParams { const u16* w[kMaxLayers]; const u16* b[kMaxLayers]; u16* out; float* bias_out; }
//   FwdParams  { const u16* x; u16* y; const u16* w; const float* bias; u16* stash; i64 batch; i64 num_blocks; }
//   BwdParams  { const u16* dy; const u16* y; const u16* stash; const u16* w; u16* dz; u16* dx; i64 batch;
//                i64 num_blocks; }
// FwdParams.w points at the packed forward region, BwdParams.w at the backward region (codegen/mlp_layout.h).
// Every kernel runs warps * 32 threads per CTA with the variant's dynamic shared memory; the forward and backward
// kernels loop over row blocks (persistent CTAs): any grid size up to num_blocks works.
#pragma once

#include <string>

#include "kfuse/mlp.h"

namespace kfuse::codegen {

constexpr int kMaxLayers = MlpSpec::kMaxHiddenLayers + 1;

// The fixed device helpers every module starts with (mlp_device_library.cpp).
const char* mlp_device_library();

// Which kernels a module holds: the forward part (pack, forward, forward_train) is compiled when the MLP is
// created; the backward part (backward, backward_dx) separately, so that an inference-only MLP never waits for it.
enum class MlpModulePart { kForward, kBackward, kAll };

// The module source. Deterministic: equal arguments give equal text (the disk cache's key).
std::string generate_mlp_source(const MlpSpec& spec, const MlpVariant& variant,
                                MlpModulePart part = MlpModulePart::kAll);

// A small source holding only the activation's two functions, to check user expressions quickly.
std::string activation_probe_source(const Activation& activation);

}  // namespace kfuse::codegen
