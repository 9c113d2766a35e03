// FusedMlp: one spec's generated kernels on one device, and the calls that run them. The kernels come from, in
// order: this process's module registry (same source and device: shared), the disk cache, NVRTC. Weight gradients:
// with a fused_wgrad variant the backward kernel accumulates them per CTA and a reduction kernel sums the CTAs'
// partials (mlp/codegen/mlp_wgrad_plan.h); otherwise cuBLAS GEMMs over the activation gradients the backward kernel
// writes (dW_l = dz_l^T h_{l-1}, db_l = dz_l^T 1).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <future>
#include <map>
#include <mutex>

#include "mlp/codegen/driver_api.h"
#include "mlp/codegen/kernel_cache.h"
#include "mlp/codegen/mlp_codegen.h"
#include "mlp/codegen/mlp_layout.h"
#include "mlp/codegen/mlp_wgrad_plan.h"
#include "mlp/codegen/nvrtc_compiler.h"
#include "core/dev_overrides.h"
#include "kfuse/device.h"
#include "kfuse/error.h"
#include "kfuse/mlp.h"
#include "runtime/cuda_check.h"
#include "runtime/device_guard.h"

namespace kfuse {
namespace {

using codegen::DriverApi;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

void check_cublas(cublasStatus_t s, const char* what) {
  KFUSE_CHECK(s == CUBLAS_STATUS_SUCCESS, Error, what, " failed: cuBLAS status ", static_cast<int>(s));
}


// Host mirrors of the generated kernels' parameter structs (mlp_codegen.h).
struct PackParams {
  const void* w[codegen::kMaxLayers];
  const void* b[codegen::kMaxLayers];
  void* out;
  float* bias_out;
};
struct FwdParams {
  const void* x;
  void* y;
  const void* w;
  const float* bias;
  void* stash;
  long long batch, num_blocks;
};
struct BwdParams {
  const void* dy;
  const void* y;
  const void* stash;
  const void* w;
  void* dz;
  void* dx;
  const void* x;
  float* partials;
  long long batch, num_blocks;
};
struct ReduceParams {
  const float* partials;
  void* grads;
  int slices;
  int grads_16bit;
};

// A compiled module: the binary from the disk cache or NVRTC. Thread-safe (runs off the caller's thread for the
// backward part).
struct ModuleBinary {
  std::string image;
  std::string registry_key;
  MlpBuildInfo info;
};

// `arch_specific`: the source uses sm_90a's wgmma (MlpVariant::wgmma, wgmma_backward), compiled for sm_90a instead of the
// device's portable target.
ModuleBinary build_binary(const std::string& source, const DeviceInfo& dev, bool arch_specific = false) {
  const auto t_start = Clock::now();
  ModuleBinary b;
  codegen::KernelCacheKey key{codegen::fnv1a64_hex(source),
                              arch_specific ? std::string("sm_90a") : codegen::nvrtc_target_for(dev.major, dev.minor),
                              codegen::nvrtc_version(), codegen::nvrtc_options_string()};
  b.registry_key = key.str() + "|dev" + std::to_string(dev.index);
  b.info.arch = key.arch;
  codegen::KernelCache cache;
  b.info.cache_file = cache.path_for(key);
  if (std::optional<std::string> hit = cache.load(key)) {
    b.image = std::move(*hit);
    b.info.from_disk_cache = true;
  } else {
    const auto t0 = Clock::now();
    b.image = codegen::nvrtc_compile(source, "kfuse_mlp_" + key.source_hash + ".cu", key.arch).binary;
    b.info.compile_seconds = seconds_since(t0);
    try {
      cache.store(key, b.image);
    } catch (const Error& e) {
      // A read-only cache folder costs compile time in later processes, nothing else.
      std::fprintf(stderr, "kfuse: warning: %s\n", e.what());
    }
  }
  b.info.load_seconds = seconds_since(t_start) - b.info.compile_seconds;
  return b;
}

// A loaded module with its kernels' launch geometry, shared by every FusedMlp of the same source on one device.
struct ModuleKernel {
  CUfunction f = nullptr;
  int ctas_per_sm = 0;  // row-block kernels: the occupancy at their threads and shared memory
};
struct LoadedKernels {
  std::unique_ptr<codegen::DriverModule> module;
  std::map<std::string, ModuleKernel> kernels;
};

// A row-block kernel of a module and its dynamic shared memory.
struct BlockedKernel {
  std::string name;
  size_t smem = 0;
};

std::mutex registry_mutex;
std::map<std::string, std::weak_ptr<LoadedKernels>>& registry() {
  static std::map<std::string, std::weak_ptr<LoadedKernels>> r;
  return r;
}

// Loads `binary` into the device's primary context (or finds it loaded). `blocked` kernels loop over row blocks
// with `threads` threads. Caller holds a DeviceGuard.
std::shared_ptr<LoadedKernels> load_module(ModuleBinary& binary, const std::vector<BlockedKernel>& blocked,
                                           const std::vector<std::string>& others, int threads,
                                           const std::string& variant_name) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  const auto t0 = Clock::now();
  if (auto hit = registry()[binary.registry_key].lock()) {
    binary.info.from_memory = true;
    return hit;
  }
  auto k = std::make_shared<LoadedKernels>();
  k->module = std::make_unique<codegen::DriverModule>(binary.image);
  const DriverApi& api = DriverApi::get();
  for (const auto& [name, smem] : blocked) {
    CUfunction f = k->module->function(name);
    api.check(api.cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, static_cast<int>(smem)),
              "cuFuncSetAttribute(max dynamic shared memory)");
    int n = 0;
    api.check(api.cuOccupancyMaxActiveBlocksPerMultiprocessor(&n, f, threads, smem),
              "cuOccupancyMaxActiveBlocksPerMultiprocessor");
    KFUSE_CHECK(n >= 1, Error, "MLP kernel ", name, " of variant ", variant_name,
                " cannot run on this device (occupancy 0: too many registers or too much shared memory)");
    k->kernels[name] = {f, n};
  }
  for (const std::string& name : others) k->kernels[name] = {k->module->function(name), 0};
  binary.info.load_seconds += seconds_since(t0);
  registry()[binary.registry_key] = k;
  return k;
}

}  // namespace

struct FusedMlp::Impl {
  MlpSpec spec;
  MlpVariant variant;
  MlpOptions options;  // in effect (the environment's overrides applied)
  int device = 0;
  DeviceInfo dev;
  size_t smem_optin = 0;
  codegen::MlpLayout layout;
  codegen::WgradPlan wgrad;  // fused_wgrad only
  size_t forward_smem = 0, backward_smem = 0;
  // An upper bound of the backward kernel's CTAs per SM from threads and shared memory alone (registers can only
  // lower it): sizes the fused_wgrad workspace before the backward module is loaded.
  int backward_ctas_per_sm_bound = 1;
  std::shared_ptr<LoadedKernels> forward_kernels;
  MlpBuildInfo info;

  // The training module (forward_train and the backward): compiled (or read from the cache) on a helper thread
  // from construction on, loaded into the context by the first training forward or backward.
  mutable std::mutex training_mutex;
  mutable std::future<ModuleBinary> training_binary;
  mutable std::shared_ptr<LoadedKernels> training_kernels;
  mutable cublasHandle_t cublas = nullptr;

  const LoadedKernels& training_module() const {
    // Caller holds training_mutex and a DeviceGuard.
    if (!training_kernels) {
      ModuleBinary b = training_binary.get();  // rethrows a compile error
      std::vector<std::string> others;
      if (variant.fused_wgrad) others.push_back("kfuse_mlp_wgrad_reduce");
      training_kernels = load_module(b,
                                     {{"kfuse_mlp_forward_train", forward_smem},
                                      {"kfuse_mlp_backward", backward_smem},
                                      {"kfuse_mlp_backward_dx", backward_smem}},
                                     others, variant.warps * 32, variant.name());
      for (const char* k : {"kfuse_mlp_backward", "kfuse_mlp_backward_dx"}) {
        const int n = training_kernels->kernels.at(k).ctas_per_sm;
        KFUSE_CHECK(!variant.fused_wgrad || n <= backward_ctas_per_sm_bound, Error, "MLP ", k, " of variant ",
                    variant.name(), ": ", n, " CTAs per SM, more than the bound ", backward_ctas_per_sm_bound,
                    " its workspace was sized for");
      }
    }
    return *training_kernels;
  }

  // Launches a row-block kernel on min(blocks, ctas_per_sm * SMs) persistent CTAs; returns the grid size.
  long long launch(const ModuleKernel& k, long long blocks, size_t smem, void* params, Stream stream) const {
    const long long grid = std::min<long long>(blocks, static_cast<long long>(k.ctas_per_sm) * dev.sm_count);
    void* args[] = {params};
    const DriverApi& api = DriverApi::get();
    api.check(api.cuLaunchKernel(k.f, static_cast<unsigned>(grid), 1, 1, variant.warps * 32, 1, 1,
                                 static_cast<unsigned>(smem), reinterpret_cast<CUstream>(stream), args, nullptr),
              "cuLaunchKernel (fused MLP)");
    return grid;
  }
  long long num_blocks(int64_t batch) const { return (batch + variant.rows_per_cta() - 1) / variant.rows_per_cta(); }
  // The most CTAs a backward launch of `batch` rows can have: the fused_wgrad partials the workspace holds.
  long long max_backward_grid(int64_t batch) const {
    return std::min<long long>(num_blocks(batch), static_cast<long long>(backward_ctas_per_sm_bound) * dev.sm_count);
  }
  // fused_wgrad: the CTAs' partial gradient vectors at the workspace's start; the dz of layers whose weight
  // gradients cuBLAS makes follow them (256-byte aligned).
  int64_t partials_bytes(int64_t batch) const {
    return (max_backward_grid(batch) * wgrad.partial_stride_floats * 4 + 255) / 256 * 256;
  }
  void check_batch(int64_t batch) const {
    KFUSE_CHECK(batch >= 1 && batch < (int64_t(1) << 31), InvalidArgument, "MLP batch must be in [1, 2^31), got ",
                batch);
  }
};

namespace {
void check_aligned(const void* p, const char* what) {
  KFUSE_CHECK(p != nullptr, InvalidArgument, what, " is null");
  KFUSE_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, InvalidArgument, what,
              " must be 16-byte aligned (a fresh allocation is; a sliced view may not be)");
}
}  // namespace

// m_tiles == 0 marks "no variant given": the heuristic default for this device.
FusedMlp::FusedMlp(const MlpSpec& spec, int device, const MlpOptions& options)
    : FusedMlp(spec, device, MlpVariant{0, 0, true, 0}, options) {}

FusedMlp::FusedMlp(const MlpSpec& spec, int device, const MlpVariant& variant, const MlpOptions& options)
    : impl_(std::make_unique<Impl>()) {
  spec.validate();
  Impl& m = *impl_;
  m.spec = spec;
  m.options = with_dev_overrides(options);
  m.device = device;
  m.dev = cuda_device_info(device);  // throws Unsupported without such a device
  KFUSE_CHECK(m.dev.major >= 8, Unsupported, "fused MLPs need compute capability 8.0 or newer; ", m.dev.name,
              " has ", m.dev.major, ".", m.dev.minor);
  DeviceGuard guard(device, /*init_context=*/true);
  int optin = 0;
  check_cuda(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
             "cudaDeviceGetAttribute(shared memory)");
  m.smem_optin = static_cast<size_t>(optin);
  m.variant = variant.m_tiles == 0
                  ? mlp_default_variant(spec, m.smem_optin, mlp_wgmma_supported(m.dev.major, m.dev.minor), m.options)
                  : variant;
  validate_variant(spec, m.variant);  // before anything divides by its fields
  KFUSE_CHECK(!m.variant.wgmma || mlp_wgmma_supported(m.dev.major, m.dev.minor), Unsupported, "MLP variant ",
              m.variant.name(), ": the wgmma forward needs a compute capability 9.0 device (Hopper); ", m.dev.name,
              " has ", m.dev.major, ".", m.dev.minor);
  m.layout = codegen::mlp_layout(spec);
  m.forward_smem = mlp_forward_smem_bytes(spec, m.variant, m.options);
  m.backward_smem = mlp_backward_smem_bytes(spec, m.variant);
  KFUSE_CHECK(std::max(m.forward_smem, m.backward_smem) <= m.smem_optin, InvalidArgument, "MLP variant ",
              m.variant.name(), " needs ", std::max(m.forward_smem, m.backward_smem),
              " bytes of shared memory; the device allows ", m.smem_optin);
  if (m.variant.fused_wgrad) m.wgrad = codegen::mlp_wgrad_plan(spec, m.variant);
  {
    int max_blocks = 0, max_threads = 0, smem_per_sm = 0, reserved = 0;
    check_cuda(cudaDeviceGetAttribute(&max_blocks, cudaDevAttrMaxBlocksPerMultiprocessor, device),
               "cudaDeviceGetAttribute(blocks per SM)");
    check_cuda(cudaDeviceGetAttribute(&max_threads, cudaDevAttrMaxThreadsPerMultiProcessor, device),
               "cudaDeviceGetAttribute(threads per SM)");
    check_cuda(cudaDeviceGetAttribute(&smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device),
               "cudaDeviceGetAttribute(shared memory per SM)");
    check_cuda(cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device),
               "cudaDeviceGetAttribute(reserved shared memory per block)");
    const size_t per_cta = m.backward_smem + static_cast<size_t>(reserved);
    m.backward_ctas_per_sm_bound = std::max(
        1, std::min({max_blocks, max_threads / (m.variant.warps * 32), static_cast<int>(smem_per_sm / per_cta)}));
  }
  // The training module first, on a helper thread: it compiles while this one compiles the forward.
  const std::string training_source =
      codegen::generate_mlp_source(spec, m.variant, codegen::MlpModulePart::kTraining, m.options);
  const DeviceInfo dev = m.dev;
  const bool training_sm90a = m.variant.wgmma;  // (the wgmma backward needs the wgmma forward)
  m.training_binary = std::async(std::launch::async, [training_source, dev, training_sm90a] {
    return build_binary(training_source, dev, training_sm90a);
  });
  ModuleBinary fwd = build_binary(
      codegen::generate_mlp_source(spec, m.variant, codegen::MlpModulePart::kForward, m.options), m.dev,
      m.variant.wgmma);
  m.forward_kernels = load_module(fwd, {{"kfuse_mlp_forward", m.forward_smem}}, {"kfuse_mlp_pack"},
                                  m.variant.warps * 32, m.variant.name());
  m.info = fwd.info;
}

FusedMlp::~FusedMlp() {
  if (!impl_) return;
  if (impl_->training_binary.valid()) impl_->training_binary.wait();  // the helper thread must not outlive us
  if (impl_->cublas) {
    DeviceGuard guard(impl_->device);
    cublasDestroy(impl_->cublas);
  }
}

const MlpSpec& FusedMlp::spec() const { return impl_->spec; }
const MlpVariant& FusedMlp::variant() const { return impl_->variant; }
const MlpOptions& FusedMlp::options() const { return impl_->options; }
const MlpBuildInfo& FusedMlp::build_info() const { return impl_->info; }
int FusedMlp::device() const { return impl_->device; }

size_t FusedMlp::packed_weights_bytes() const { return static_cast<size_t>(impl_->layout.packed_bytes); }
size_t FusedMlp::stash_bytes(int64_t batch) const {
  return static_cast<size_t>(impl_->layout.stash_elements_per_row * batch * 2);
}
size_t FusedMlp::backward_workspace_bytes(int64_t batch) const {
  const Impl& m = *impl_;
  if (m.variant.fused_wgrad)
    return static_cast<size_t>(m.partials_bytes(batch) +
                               (m.wgrad.all_weights() ? 0 : m.layout.dz_elements_per_row * batch * 2));
  return static_cast<size_t>((m.layout.dz_elements_per_row * batch + batch) * 2);
}

void FusedMlp::pack_weights(const std::vector<const void*>& weights, const std::vector<const void*>& biases,
                            void* packed, Stream stream) const {
  const Impl& m = *impl_;
  const int L = m.spec.num_layers();
  KFUSE_CHECK(static_cast<int>(weights.size()) == L, InvalidArgument, "expected ", L, " weight pointers, got ",
              weights.size());
  KFUSE_CHECK(static_cast<int>(biases.size()) == L, InvalidArgument, "expected ", L,
              " bias pointers (nullptr where a layer has none), got ", biases.size());
  check_aligned(packed, "packed weight buffer");
  PackParams p{};
  for (int l = 0; l < L; ++l) {
    KFUSE_CHECK(weights[l] != nullptr, InvalidArgument, "weight of layer ", l, " is null");
    KFUSE_CHECK((biases[l] != nullptr) == m.spec.has_bias(l), InvalidArgument, "layer ", l,
                m.spec.has_bias(l) ? " has a bias but its pointer is null" : " has no bias but a bias pointer was given");
    p.w[l] = weights[l];
    p.b[l] = biases[l];
  }
  p.out = packed;
  p.bias_out = reinterpret_cast<float*>(static_cast<char*>(packed) + m.layout.bias_byte_offset);
  DeviceGuard guard(m.device);
  const int64_t elems = std::max(m.layout.fwd_region_halves, m.layout.bwd_region_halves);
  const long long blocks = std::min<long long>((elems + 255) / 256, 4LL * m.dev.sm_count);
  void* args[] = {&p};
  const DriverApi& api = DriverApi::get();
  api.check(api.cuLaunchKernel(m.forward_kernels->kernels.at("kfuse_mlp_pack").f, static_cast<unsigned>(blocks), 1, 1, 256, 1, 1, 0,
                               reinterpret_cast<CUstream>(stream), args, nullptr),
            "cuLaunchKernel (MLP weight packing)");
}

void FusedMlp::forward(const void* packed, const void* x, void* y, int64_t batch, Stream stream) const {
  const Impl& m = *impl_;
  m.check_batch(batch);
  check_aligned(packed, "packed weight buffer");
  check_aligned(x, "input");
  check_aligned(y, "output");
  FwdParams p{x, y, packed, reinterpret_cast<const float*>(static_cast<const char*>(packed) + m.layout.bias_byte_offset),
              nullptr, batch, m.num_blocks(batch)};
  DeviceGuard guard(m.device);
  m.launch(m.forward_kernels->kernels.at("kfuse_mlp_forward"), p.num_blocks, m.forward_smem, &p, stream);
}

void FusedMlp::forward_train(const void* packed, const void* x, void* y, void* stash, int64_t batch,
                             Stream stream) const {
  const Impl& m = *impl_;
  m.check_batch(batch);
  check_aligned(packed, "packed weight buffer");
  check_aligned(x, "input");
  check_aligned(y, "output");
  if (m.layout.stash_elements_per_row) check_aligned(stash, "stash");
  FwdParams p{x, y, packed, reinterpret_cast<const float*>(static_cast<const char*>(packed) + m.layout.bias_byte_offset),
              stash, batch, m.num_blocks(batch)};
  DeviceGuard guard(m.device);
  std::lock_guard<std::mutex> lock(m.training_mutex);
  m.launch(m.training_module().kernels.at("kfuse_mlp_forward_train"), p.num_blocks, m.forward_smem, &p, stream);
}

void FusedMlp::backward(const void* packed, const void* x, const void* y, const void* dy, const void* stash,
                        void* workspace, float* grads, void* dx, int64_t batch, Stream stream) const {
  backward(packed, x, y, dy, stash, workspace, grads, MlpGradDType::kFloat32, dx, batch, stream);
}

void FusedMlp::backward(const void* packed, const void* x, const void* y, const void* dy, const void* stash,
                        void* workspace, void* grads, MlpGradDType grads_dtype, void* dx, int64_t batch,
                        Stream stream) const {
  const Impl& m = *impl_;
  const MlpSpec& s = m.spec;
  const codegen::MlpLayout& lay = m.layout;
  m.check_batch(batch);
  check_aligned(packed, "packed weight buffer");
  check_aligned(x, "input");
  check_aligned(dy, "output gradient");
  check_aligned(workspace, "backward workspace");
  check_aligned(grads, "gradient buffer");
  if (lay.stash_elements_per_row) check_aligned(stash, "stash");
  if (s.output_activation.derivative_uses_y() && !s.output_activation.derivative_uses_x()) check_aligned(y, "output");
  if (dx) check_aligned(dx, "input gradient");

  DeviceGuard guard(m.device);
  std::lock_guard<std::mutex> lock(m.training_mutex);
  const LoadedKernels& training = m.training_module();
  const char* pk = static_cast<const char*>(packed);
  const bool fused = m.variant.fused_wgrad;
  const bool grads_16bit = grads_dtype == MlpGradDType::kSpecDType;
  char* dz_base = static_cast<char*>(workspace) + (fused ? m.partials_bytes(batch) : 0);
  BwdParams p{dy, y, stash, pk + lay.bwd_region_byte_offset, dz_base, dx, x,
              fused ? static_cast<float*>(workspace) : nullptr, batch, m.num_blocks(batch)};
  const long long grid = m.launch(training.kernels.at(dx ? "kfuse_mlp_backward_dx" : "kfuse_mlp_backward"),
                                  p.num_blocks, m.backward_smem, &p, stream);
  const DriverApi& api = DriverApi::get();

  if (fused) {
    // Every CTA wrote its partial gradients (the grid fits the workspace: training_module checked ctas_per_sm);
    // sum them in CTA order, 32 entries per reduction CTA.
    ReduceParams r{static_cast<const float*>(workspace), grads, static_cast<int>(grid), grads_16bit ? 1 : 0};
    void* args[] = {&r};
    const long long blocks = (m.wgrad.grad_floats + 31) / 32;
    api.check(api.cuLaunchKernel(training.kernels.at("kfuse_mlp_wgrad_reduce").f, static_cast<unsigned>(blocks), 1, 1,
                                 256, 1, 1, 0, reinterpret_cast<CUstream>(stream), args, nullptr),
              "cuLaunchKernel (MLP gradient reduction)");
    if (m.wgrad.all_weights()) return;
  }

  // Weight (and, without fused_wgrad, bias) gradients: GEMMs over the batch with fp32 output (cuBLAS splits the
  // long k itself), from the dz the backward kernel stored.
  if (!m.cublas) check_cublas(cublasCreate(&m.cublas), "cublasCreate");
  check_cublas(cublasSetStream(m.cublas, reinterpret_cast<cudaStream_t>(stream)), "cublasSetStream");
  const cudaDataType_t t = s.dtype == MlpDType::kFloat16 ? CUDA_R_16F : CUDA_R_16BF;
  // 16-bit gradients: cuBLAS rounds its float32 result once on the store (compute type 32F).
  const cudaDataType_t grad_t = grads_16bit ? t : CUDA_R_32F;
  char* const grads_base = static_cast<char*>(grads);
  const int grad_bytes = grads_16bit ? 2 : 4;
  const uint16_t one_bits = s.dtype == MlpDType::kFloat16 ? 0x3C00 : 0x3F80;
  const char* ones = dz_base + lay.dz_elements_per_row * batch * 2;
  if (!fused)
    api.check(api.cuMemsetD16Async(reinterpret_cast<CUdeviceptr>(ones), one_bits, static_cast<size_t>(batch),
                                   reinterpret_cast<CUstream>(stream)),
              "cuMemsetD16Async (ones)");
  const float alpha = 1.0f, beta = 0.0f;
  const int k = static_cast<int>(batch);
  int64_t offset = 0;
  for (int l = 0; l < s.num_layers(); ++l) {
    const int in = s.layer_in(l), out = s.layer_out(l);
    const void* h = l == 0 ? x : static_cast<const char*>(stash) + lay.stash_h_offset[l - 1] * batch * 2;
    const int ld_h = l == 0 ? s.input_width : s.layer_in_padded(l);
    const char* dz = dz_base + lay.dz_offset[l] * batch * 2;
    const int ld_dz = s.layer_out_padded(l);
    // Column-major view: dW^T (in x out) = h^T (in x batch) * dz (batch x out); row-major dW is PyTorch's layout.
    if (!fused || !m.wgrad.layers[l].weight)
      check_cublas(cublasGemmEx(m.cublas, CUBLAS_OP_N, CUBLAS_OP_T, in, out, k, &alpha, h, t, ld_h, dz, t, ld_dz,
                                &beta, grads_base + offset * grad_bytes, grad_t, in, CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT),
                   "cublasGemmEx (MLP weight gradient)");
    offset += int64_t(in) * out;
    if (s.has_bias(l) && !fused) {
      check_cublas(cublasGemmEx(m.cublas, CUBLAS_OP_N, CUBLAS_OP_N, out, 1, k, &alpha, dz, t, ld_dz, ones, t, k,
                                &beta, grads_base + offset * grad_bytes, grad_t, out, CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT),
                   "cublasGemmEx (MLP bias gradient)");
    }
    if (s.has_bias(l)) offset += out;
  }
}

}  // namespace kfuse
