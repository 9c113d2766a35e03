// CUDA source generation for one fused MLP (spec + kernel variant). The module holds these kernels:
//   kfuse_mlp_pack(PackParams)                     weights and biases from PyTorch layouts into the packed layout;
//   kfuse_mlp_forward / kfuse_mlp_forward_train(FwdParams)   the forward (the latter also writes the stash);
//   kfuse_mlp_backward / kfuse_mlp_backward_dx(BwdParams)    the activation-gradient chain (and dL/dx for the _dx
//       one). Without fused_wgrad they store every layer's dz (the runtime's cuBLAS GEMMs make the weight and bias
//       gradients from it); with fused_wgrad they accumulate the bias gradients and the weight gradients whose
//       accumulators fit (mlp/codegen/mlp_wgrad_plan.h), each CTA writes its partial gradient vector, and they store dz
//       only for the layers whose weight gradient cuBLAS makes;
//   kfuse_mlp_wgrad_reduce(ReduceParams)           fused_wgrad only: sums the CTAs' partials into the gradients
//       (256 threads, ceil(num_parameters / 32) CTAs, no dynamic shared memory).
// A wgmma_backward variant's two backward kernels come from mlp/codegen/mlp_wgmma_backward.h instead (same parameters,
// every gradient inside, partials in the same layout).
// Parameter structs (by value, in this order; pointers are device pointers, i64 = long long):
//   PackParams   { const u16* w[kMaxLayers]; const u16* b[kMaxLayers]; u16* out; float* bias_out; }
//   FwdParams    { const u16* x; u16* y; const u16* w; const float* bias; u16* stash; i64 batch; i64 num_blocks; }
//   BwdParams    { const u16* dy; const u16* y; const u16* stash; const u16* w; u16* dz; u16* dx; const u16* x;
//                  float* partials; i64 batch; i64 num_blocks; }   (x, partials: fused_wgrad only)
//   ReduceParams { const float* partials; void* grads; int slices; int grads_16bit; }   (slices: the backward's
//                  grid size; grads_16bit: the gradients in the spec's dtype, else float32)
// FwdParams.w points at the packed forward region, BwdParams.w at the backward region (mlp/codegen/mlp_layout.h), of
// the whole packed buffer: a backward with recomputed activations (MlpVariant::recompute) also reads the forward
// region before it and the biases after it.
// Every forward and backward kernel runs warps * 32 threads per CTA with the variant's dynamic shared memory and
// loops over row blocks (persistent CTAs): any grid size up to num_blocks works.
#pragma once

#include <sstream>
#include <string>

#include "kfuse/mlp.h"

namespace kfuse::codegen {

constexpr int kMaxLayers = MlpSpec::kMaxHiddenLayers + 1;

// Text of the arguments streamed one after the other (also sidesteps a GCC 12 -Wrestrict false positive on
// "literal" + std::string).
template <class... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

// The fixed device helpers every module starts with (mlp_device_library.cpp, device/mlp_device_library.cuh).
const char* mlp_device_library();

// The name of layer l's activation functor in the generated source (f(x) and df(x, y) as static members).
inline std::string activation_struct_name(int layer) { return "ActL" + std::to_string(layer); }

// Which kernels a module holds: the forward part (pack, forward) is compiled when the MLP is created; the training
// part (forward_train, backward, backward_dx, wgrad_reduce) on a helper thread from then on, so that an MLP waits
// only for the inference kernel before its first forward (half the compile time of both forwards: at width 256
// one takes 0.9 s of a build machine's core).
enum class MlpModulePart { kForward, kTraining, kAll };

// The module source. Deterministic: equal arguments give equal text (the disk cache's key). `options` are the ones
// in effect (FusedMlp::options()): nothing here reads the environment.
std::string generate_mlp_source(const MlpSpec& spec, const MlpVariant& variant,
                                MlpModulePart part = MlpModulePart::kAll, const MlpOptions& options = {});

// A small source holding only the activation's two functions, to check user expressions quickly.
std::string activation_probe_source(const Activation& activation);

}  // namespace kfuse::codegen
