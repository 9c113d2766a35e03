// Fully fused MLPs generated at run time: the network description (MlpSpec: widths, activations, biases, dtype),
// the activations (a built-in table or user CUDA expressions) and the GPU object (FusedMlp) that writes CUDA source
// specialized to one spec, compiles it with NVRTC for the device (cached on disk), loads it through the driver API
// and runs forward, training forward and backward on the caller's stream.
//
// Layouts (all row-major, contiguous, 16-byte aligned device memory; dtype = spec.dtype unless said otherwise):
//   x (batch, input_width), y (batch, output_width), dy like y, dx like x;
//   weights of layer l: PyTorch's nn.Linear layout (out_l, in_l); biases (out_l);
//   gradients: one vector (float32, or spec.dtype where asked), per layer its weight gradient (out_l * in_l) then,
//   when the layer has a bias, its bias gradient (out_l): nn.Sequential's parameter order.
// The C++ core does not depend on PyTorch; the Python module kfuse.FusedMLP allocates every buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "kfuse/mlp_options.h"
#include "kfuse/tuner.h"

struct CUstream_st;

namespace kfuse {

// An element-wise activation as CUDA C++ float expressions: `expression` of x (the pre-activation), `derivative`
// of x and/or y (y = the activation's value). The generated code keeps for backward only what the derivative uses
// (y: the layer's output, which is stored anyway; x: the pre-activation, stored in addition).
struct Activation {
  std::string name;
  std::string expression;
  std::string derivative;

  bool derivative_uses_x() const;
  bool derivative_uses_y() const;
  bool is_identity() const { return name == "identity"; }
  // Checks the text (an identifier-like name, single expressions without ';', '{', '}', '#'); throws
  // InvalidArgument. Whether it compiles is checked by validate_activation (NVRTC).
  void check_syntax() const;
};

// relu, leaky_relu (alpha = negative slope, default 0.01), sigmoid, tanh, silu, gelu (tanh form), softplus (alpha =
// beta, default 1; PyTorch's threshold 20), identity; alpha NaN = the default. Throws InvalidArgument naming the known ones otherwise.
Activation builtin_activation(const std::string& name, double alpha = std::numeric_limits<double>::quiet_NaN());
std::vector<std::string> builtin_activation_names();
// A user-defined activation; checks the syntax and compiles the two expressions with NVRTC (a compile error
// throws InvalidArgument naming the activation and the expression, quoting NVRTC's log). Needs a CUDA build.
Activation user_activation(const std::string& name, const std::string& expression, const std::string& derivative);
void validate_activation(const Activation& activation);

enum class MlpDType { kFloat16, kBFloat16 };
const char* mlp_dtype_name(MlpDType d);  // "float16" / "bfloat16"

// The element type FusedMlp::backward writes the gradients in: float32, or the spec's dtype (each entry rounded once
// from its float32 sum), which is what a module with 16-bit parameters wants, without a cast kernel afterwards.
enum class MlpGradDType { kFloat32, kSpecDType };

// Layers: input_width -> hidden_widths[0] -> ... -> hidden_widths.back() -> output_width, each an affine map (with or
// without bias) followed by an activation: activations[i] after hidden layer i, output_activation after the last.
struct MlpSpec {
  int input_width = 0;
  std::vector<int> hidden_widths;
  int output_width = 0;
  std::vector<Activation> activations;  // one per hidden layer
  Activation output_activation;          // default: identity
  std::vector<bool> bias;                // one per layer (hidden + output); empty = all true
  MlpDType dtype = MlpDType::kFloat16;

  static constexpr int kMaxWidth = 256;        // hidden widths: multiples of 16 up to this
  static constexpr int kMaxIoWidth = 256;      // input and output widths: 1 .. this (padded to 16 inside)
  static constexpr int kMaxHiddenLayers = 15;

  // Throws InvalidArgument naming the problem (width not a multiple of 16, > 256, wrong count of activations, ...).
  void validate() const;
  int num_layers() const { return static_cast<int>(hidden_widths.size()) + 1; }
  int layer_in(int l) const;   // true widths
  int layer_out(int l) const;
  int layer_in_padded(int l) const;  // multiples of 16
  int layer_out_padded(int l) const;
  bool has_bias(int l) const;
  const Activation& layer_activation(int l) const;
  // Weight then bias element counts in nn.Sequential order: the gradient vector's length.
  int64_t num_parameters() const;
  std::string to_string() const;
};

// A kernel variant: how rows are tiled and where the weights live. FusedMlp takes one explicitly or uses the
// heuristic default (mlp_default_variant); mlp_candidate_variants is the set an autotuner times.
struct MlpVariant {
  int m_tiles = 1;            // 16-row MMA tiles per warp (1 or 2): rows per warp = 16 * m_tiles
  int warps = 4;              // warps per CTA: rows per CTA = 16 * m_tiles * warps
  bool weights_resident = true;  // all layers' weights in shared memory for the CTA's life (persistent CTAs);
                                 // otherwise streamed through shared-memory buffers in k-chunks (two; the
                                 // wgmma forward's: up to four, mlp_layout.h)
  int k_chunk = 64;           // columns per streamed chunk (multiple of 16); ignored when resident
  // Weight and bias gradients inside the backward kernel: each CTA accumulates its share of every db and of the
  // dW that fit the register budget in registers over all its row blocks (the warps split each layer's dW), then
  // a small kernel sums the CTAs' partials; the widest layers' dW that do not fit are cuBLAS GEMMs over the dz the
  // kernel stores for them. Needs resident weights (mlp_fused_wgrad_fits). Without it the backward kernel stores
  // every layer's dz and cuBLAS computes every gradient from it.
  bool fused_wgrad = false;
  // The forward's layers as Hopper warpgroup MMAs (wgmma, sm_90a only): each warpgroup multiplies 64 rows per
  // instruction with the activations in registers and the weights in shared memory (in wgmma's core-matrix layout),
  // and prefetches its next rows of x with cp.async while it computes. With m_tiles 2 a warpgroup runs two 64-row
  // chains, one chain's activation math overlapping the other's MMAs. Without weights_resident the weights stream
  // through shared memory in k_chunk-column chunks shared by the CTA's warpgroups (m_tiles 1). Needs warps a
  // multiple of 4. The backward is the same as without it.
  bool wgmma = false;
  // The first `recompute` hidden layers' outputs are not stashed by the training forward: the backward kernel
  // recomputes them from x at the start of each row block into shared-memory tiles (with the forward weights of
  // those layers resident beside the transposed ones), trading ~2 x rows x width x 2 bytes of DRAM traffic per layer
  // (the stash write and its re-read) for one more GEMM of the layer per row. Needs fused_wgrad with those layers'
  // successors' weight gradients inside the kernel (the mma.sync backward; the wgmma backward stores a recomputed
  // input of an external weight gradient itself), and activations whose derivative needs no pre-activation.
  int recompute = 0;
  // The backward on Hopper warpgroup MMAs too (sm_90a; mlp/codegen/mlp_wgmma_backward.h): each warpgroup recomputes
  // its 64 rows' first `recompute` hidden outputs (the others come from the stash) into shared memory, runs the
  // activation-gradient chain as wgmma, and accumulates the weight gradients as wgmma over its rows (both operands
  // from shared memory), overlapped with the chain. Where they do not all fit its registers, the widest layers'
  // weight gradients are cuBLAS GEMMs over the h and dz the kernel stores (their bias gradients stay inside).
  // Needs the wgmma forward, fused_wgrad and m_tiles 1; with recompute, activations whose derivative needs no
  // pre-activation.
  bool wgmma_backward = false;

  std::string name() const;   // e.g. "mt2_w4_resident", "mt1_w8_stream64", "mt2_w8_resident_fw", "mt1_w8_resident_wg",
                              // "mt1_w8_resident_fw_rc4" (recompute 4), "mt1_w8_resident_fw_wg_rc4_wgb",
                              // "mt1_w8_resident_fw_wg_wgb" (wgmma backward, nothing recomputed)
  int rows_per_cta() const { return 16 * m_tiles * warps; }
  bool operator==(const MlpVariant&) const = default;
};

// Whether a device of this compute capability runs the wgmma forward (MlpVariant::wgmma: sm_90a code, which
// later architectures do not run).
inline bool mlp_wgmma_supported(int cc_major, int cc_minor) { return cc_major == 9 && cc_minor == 0; }

// Throws InvalidArgument naming the field when a variant cannot run `spec` (m_tiles 1 or 2, warps 1..16, k_chunk a
// multiple of 16, fused weight gradients only with resident weights and accumulators that fit, wgmma only with
// whole warpgroups, and with streamed weights only with m_tiles 1).
void validate_variant(const MlpSpec& spec, const MlpVariant& v);

// Shared memory (bytes) a variant needs for its forward and backward kernels. The functions that take MlpOptions
// size the kernels those options generate (MlpOptions::mma_bias changes the wgmma forward's).
size_t mlp_forward_smem_bytes(const MlpSpec& spec, const MlpVariant& v, const MlpOptions& options = {});
size_t mlp_backward_smem_bytes(const MlpSpec& spec, const MlpVariant& v);
// The variants worth trying for a spec on a device with `smem_optin` bytes of shared memory per block (the
// default first); the heuristic default alone is mlp_default_variant. With `hopper` (mlp_wgmma_supported) the
// wgmma forward variants that fit join them, and a network whose weights must stream defaults to the wgmma one.
std::vector<MlpVariant> mlp_candidate_variants(const MlpSpec& spec, size_t smem_optin, bool hopper = false,
                                               const MlpOptions& options = {});
MlpVariant mlp_default_variant(const MlpSpec& spec, size_t smem_optin, bool hopper = false,
                               const MlpOptions& options = {});
// Whether `v` can take fused_wgrad for `spec` (its value of fused_wgrad aside): resident weights, per-thread weight
// gradient accumulators within the budget, shared memory within smem_optin.
bool mlp_fused_wgrad_fits(const MlpSpec& spec, const MlpVariant& v, size_t smem_optin,
                          const MlpOptions& options = {});

// The variants the autotuner chose for one spec and batch on one device: the inference forward's and the training
// step's (its forward_train and backward), timed as two ops ("mlp_forward", "mlp_train") over
// mlp_candidate_variants, each checked against the heuristic default's output and cached like every kfuse op
// (kfuse/tuner.h). The two may differ: weights, stash and activations are laid out the same for every variant (a
// variant with recompute leaves the stash arrays of its recomputed layers unwritten, so only its own backward may
// read a stash its forward_train wrote).
// Compiles (or loads from the kernel cache) one FusedMlp per candidate, with `mlp_options` (and the developer
// overrides, as FusedMlp), when it has to time them; options other than the defaults are part of the tuning key.
struct MlpTuning {
  MlpVariant forward;   // inference: forward()
  MlpVariant backward;  // training: forward_train() and backward()
  std::vector<OpTuningReport> rows;  // forward, backward
};
MlpTuning tune_mlp(const MlpSpec& spec, int device, int64_t batch, TuningMode mode = TuningMode::kOnFirstUse,
                   const TunerOptions& options = {}, const MlpOptions& mlp_options = {});

// How a FusedMlp got its kernels: compile time and whether the binary came from the disk cache.
struct MlpBuildInfo {
  std::string cache_file;
  bool from_disk_cache = false;
  bool from_memory = false;   // another FusedMlp of this process had loaded the same binary
  double compile_seconds = 0;  // NVRTC (0 when cached)
  double load_seconds = 0;     // cache read + driver module load
  std::string arch;            // e.g. "sm_90"
};

// The fused MLP on one CUDA device. Construction generates, compiles (or finds in the cache) and loads the kernels;
// throws Unsupported without a CUDA device of compute capability >= 8.0 and InvalidArgument for invalid specs.
// Every call is asynchronous on `stream` (a cudaStream_t; nullptr = the legacy default stream). The inference
// forward is compiled (or loaded) by the constructor; the training kernels (forward_train and the backward) on a
// helper thread from then on, loaded by the first forward_train() or backward().
// `options` choose between the kernels' alternative code paths (kfuse/mlp_options.h); the developer's environment
// overrides (KFUSE_MLP_*) apply on top of them, once, here; without a variant the default is the one for them.
class FusedMlp {
 public:
  using Stream = CUstream_st*;
  FusedMlp(const MlpSpec& spec, int device = 0, const MlpOptions& options = {});
  FusedMlp(const MlpSpec& spec, int device, const MlpVariant& variant, const MlpOptions& options = {});
  ~FusedMlp();
  FusedMlp(const FusedMlp&) = delete;
  FusedMlp& operator=(const FusedMlp&) = delete;

  const MlpSpec& spec() const;
  const MlpVariant& variant() const;
  const MlpOptions& options() const;  // in effect: the given ones with the environment's overrides
  const MlpBuildInfo& build_info() const;
  int device() const;

  // Device buffers the caller allocates (16-byte aligned).
  size_t packed_weights_bytes() const;                 // the kernels' weight layout (both orientations) + biases
  size_t stash_bytes(int64_t batch) const;             // what forward_train keeps for backward
  // fused_wgrad: a float32 partial gradient vector for each CTA the backward kernel can launch on this device;
  // otherwise every layer's activation gradient dz (batch rows) + a ones vector.
  size_t backward_workspace_bytes(int64_t batch) const;

  // Packs the layers' weights (and biases; nullptr where a layer has none) from PyTorch layouts in spec.dtype.
  void pack_weights(const std::vector<const void*>& weights, const std::vector<const void*>& biases, void* packed,
                    Stream stream) const;
  void forward(const void* packed, const void* x, void* y, int64_t batch, Stream stream) const;
  // As forward, and keeps the activations backward needs in `stash` (stash_bytes(batch)).
  void forward_train(const void* packed, const void* x, void* y, void* stash, int64_t batch, Stream stream) const;
  // From dy = dL/dy: every parameter's gradient into `grads` (float32, num_parameters(), overwritten) and, when
  // dx is not null, dL/dx. x, y and stash are this object's forward_train's (a variant with recompute leaves part of
  // the stash unwritten); `workspace` holds backward_workspace_bytes(batch).
  void backward(const void* packed, const void* x, const void* y, const void* dy, const void* stash,
                void* workspace, float* grads, void* dx, int64_t batch, Stream stream) const;
  // As above, with the gradients in `grads_dtype`.
  void backward(const void* packed, const void* x, const void* y, const void* dy, const void* stash,
                void* workspace, void* grads, MlpGradDType grads_dtype, void* dx, int64_t batch,
                Stream stream) const;


 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kfuse
