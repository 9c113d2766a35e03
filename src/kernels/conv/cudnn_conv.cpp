#include "kernels/conv/cudnn_conv.h"
#include "kernels/conv/device_handle_cache.h"

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>
#include <tuple>

#if KFUSE_HAVE_CUDNN
#include <cudnn.h>
#include <dlfcn.h>
#endif

namespace kfuse::kernels {

#if KFUSE_HAVE_CUDNN
namespace {

// The cuDNN entry points kfuse calls, resolved from the loaded libraries (the legacy convolution API: it picks the
// same engines as PyTorch's calls and needs a few descriptors only).
struct CudnnApi {
  decltype(&cudnnGetVersion) get_version = nullptr;
  decltype(&cudnnCreate) create = nullptr;
  decltype(&cudnnSetStream) set_stream = nullptr;
  decltype(&cudnnCreateTensorDescriptor) create_tensor = nullptr;
  decltype(&cudnnSetTensor4dDescriptor) set_tensor = nullptr;
  decltype(&cudnnCreateFilterDescriptor) create_filter = nullptr;
  decltype(&cudnnSetFilter4dDescriptor) set_filter = nullptr;
  decltype(&cudnnCreateConvolutionDescriptor) create_conv = nullptr;
  decltype(&cudnnSetConvolution2dDescriptor) set_conv = nullptr;
  decltype(&cudnnSetConvolutionMathType) set_math = nullptr;
  decltype(&cudnnGetConvolutionForwardAlgorithm_v7) fprop_algos = nullptr;
  decltype(&cudnnGetConvolutionForwardWorkspaceSize) fprop_workspace = nullptr;
  decltype(&cudnnConvolutionForward) fprop = nullptr;
  decltype(&cudnnGetConvolutionBackwardDataAlgorithm_v7) dgrad_algos = nullptr;
  decltype(&cudnnGetConvolutionBackwardDataWorkspaceSize) dgrad_workspace = nullptr;
  decltype(&cudnnConvolutionBackwardData) dgrad = nullptr;
  decltype(&cudnnGetConvolutionBackwardFilterAlgorithm_v7) wgrad_algos = nullptr;
  decltype(&cudnnGetConvolutionBackwardFilterWorkspaceSize) wgrad_workspace = nullptr;
  decltype(&cudnnConvolutionBackwardFilter) wgrad = nullptr;
  void* library = nullptr;  // libcudnn.so.9's dlopen handle (kernels/conv/cudnn_fused.cpp resolves the graph API in it)
  std::string error;  // empty once everything resolved
};

template <class F>
bool resolve(void* lib, const char* name, F& fn, std::string& error) {
  fn = lib ? reinterpret_cast<F>(dlsym(lib, name)) : nullptr;
  if (!fn && error.empty()) error = std::string("cuDNN has no symbol ") + name;
  return fn != nullptr;
}

const CudnnApi& api() {
  static const CudnnApi a = [] {
    CudnnApi r;
    if (const char* env = std::getenv("KFUSE_CUDNN"); env && std::string(env) == "off") {
      r.error = "disabled by KFUSE_CUDNN=off";
      return r;
    }
    // By soname first: inside a PyTorch process this is the copy PyTorch loaded.
    void* core = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_GLOBAL);
    if (!core) {
      r.error = std::string("libcudnn.so.9 not found (") + dlerror() + ")";
      return r;
    }
    // The convolution library from the same directory, so that the two always match.
    void* cnn = nullptr;
    Dl_info info{};
    if (void* sym = dlsym(core, "cudnnCreate"); sym && dladdr(sym, &info) && info.dli_fname) {
      std::string dir = info.dli_fname;
      dir = dir.substr(0, dir.find_last_of('/') + 1);
      cnn = dlopen((dir + "libcudnn_cnn.so.9").c_str(), RTLD_NOW | RTLD_GLOBAL);
    }
    if (!cnn) cnn = dlopen("libcudnn_cnn.so.9", RTLD_NOW | RTLD_GLOBAL);
    if (!cnn) {
      r.error = "libcudnn_cnn.so.9 not found next to libcudnn.so.9";
      return r;
    }
    r.library = core;
    std::string& e = r.error;
    resolve(core, "cudnnGetVersion", r.get_version, e);
    resolve(core, "cudnnCreate", r.create, e);
    resolve(core, "cudnnSetStream", r.set_stream, e);
    resolve(core, "cudnnCreateTensorDescriptor", r.create_tensor, e);
    resolve(core, "cudnnSetTensor4dDescriptor", r.set_tensor, e);
    resolve(core, "cudnnCreateFilterDescriptor", r.create_filter, e);
    resolve(core, "cudnnSetFilter4dDescriptor", r.set_filter, e);
    resolve(cnn, "cudnnCreateConvolutionDescriptor", r.create_conv, e);
    resolve(cnn, "cudnnSetConvolution2dDescriptor", r.set_conv, e);
    resolve(cnn, "cudnnSetConvolutionMathType", r.set_math, e);
    resolve(cnn, "cudnnGetConvolutionForwardAlgorithm_v7", r.fprop_algos, e);
    resolve(cnn, "cudnnGetConvolutionForwardWorkspaceSize", r.fprop_workspace, e);
    resolve(cnn, "cudnnConvolutionForward", r.fprop, e);
    resolve(cnn, "cudnnGetConvolutionBackwardDataAlgorithm_v7", r.dgrad_algos, e);
    resolve(cnn, "cudnnGetConvolutionBackwardDataWorkspaceSize", r.dgrad_workspace, e);
    resolve(cnn, "cudnnConvolutionBackwardData", r.dgrad, e);
    resolve(cnn, "cudnnGetConvolutionBackwardFilterAlgorithm_v7", r.wgrad_algos, e);
    resolve(cnn, "cudnnGetConvolutionBackwardFilterWorkspaceSize", r.wgrad_workspace, e);
    resolve(cnn, "cudnnConvolutionBackwardFilter", r.wgrad, e);
    if (e.empty() && r.get_version() < 90000) e = "cuDNN " + std::to_string(r.get_version()) + " is older than 9";
    return r;
  }();
  return a;
}

// Descriptors of one forward problem (x, y, w, conv); fprop, dgrad and wgrad share them. Never freed: a process meets a
// handful of shapes.
struct Descriptors {
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;
  bool ok = false;
  std::map<std::pair<int, int>, size_t> workspace;  // (op, algo) -> bytes (SIZE_MAX: unsupported), asked once
};

using ProblemKey = std::tuple<int, int, int, int, int, int, int, int, int, int, int, int>;

// One lock for the handles and descriptor caches and around each call (a cuDNN handle is not thread-safe). A launch
// holds it for microseconds (the calls only enqueue work); cudnn_fused.cpp's first use of a graph holds it for the
// seconds that building and timing its plans take, so other threads' cuDNN launches wait then.
std::mutex& mutex() {
  static std::mutex m;
  return m;
}

cudnnHandle_t handle_locked() {
  static std::map<int, cudnnHandle_t> handles;
  return current_device_handle(handles, [](cudnnHandle_t* h) { return api().create(h) == CUDNN_STATUS_SUCCESS; });
}

Descriptors& descriptors_locked(const Conv2dProblem& p, ConvDType dtype) {
  static std::map<ProblemKey, Descriptors> cache;
  const ProblemKey key{p.n, p.h, p.w, p.c, p.k, p.r, p.s, p.pad_h, p.pad_w, p.stride_h, p.stride_w, int(dtype)};
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  const CudnnApi& a = api();
  Descriptors d;
  const cudnnDataType_t t = dtype == ConvDType::kF16 ? CUDNN_DATA_HALF : CUDNN_DATA_BFLOAT16;
  d.ok = p.p() > 0 && p.q() > 0 && a.create_tensor(&d.x) == CUDNN_STATUS_SUCCESS &&
         a.create_tensor(&d.y) == CUDNN_STATUS_SUCCESS && a.create_filter(&d.w) == CUDNN_STATUS_SUCCESS &&
         a.create_conv(&d.conv) == CUDNN_STATUS_SUCCESS &&
         a.set_tensor(d.x, CUDNN_TENSOR_NHWC, t, p.n, p.c, p.h, p.w) == CUDNN_STATUS_SUCCESS &&
         a.set_tensor(d.y, CUDNN_TENSOR_NHWC, t, p.n, p.k, p.p(), p.q()) == CUDNN_STATUS_SUCCESS &&
         a.set_filter(d.w, t, CUDNN_TENSOR_NHWC, p.k, p.c, p.r, p.s) == CUDNN_STATUS_SUCCESS &&
         a.set_conv(d.conv, p.pad_h, p.pad_w, p.stride_h, p.stride_w, 1, 1, CUDNN_CROSS_CORRELATION,
                    CUDNN_DATA_FLOAT) == CUDNN_STATUS_SUCCESS &&
         a.set_math(d.conv, CUDNN_TENSOR_OP_MATH) == CUDNN_STATUS_SUCCESS;
  return cache.emplace(key, d).first->second;
}

// The workspace of one algorithm, asked of cuDNN once per (problem, op, algo): the launches run it on every call.
size_t workspace_locked(CudnnConvOp op, cudnnHandle_t h, Descriptors& d, int algo) {
  const auto key = std::make_pair(int(op), algo);
  if (const auto it = d.workspace.find(key); it != d.workspace.end()) return it->second;
  size_t bytes = 0;
  const CudnnApi& a = api();
  cudnnStatus_t s = CUDNN_STATUS_NOT_SUPPORTED;
  switch (op) {
    case CudnnConvOp::kFprop:
      s = a.fprop_workspace(h, d.x, d.w, d.conv, d.y, cudnnConvolutionFwdAlgo_t(algo), &bytes);
      break;
    case CudnnConvOp::kDgrad:
      s = a.dgrad_workspace(h, d.w, d.y, d.conv, d.x, cudnnConvolutionBwdDataAlgo_t(algo), &bytes);
      break;
    case CudnnConvOp::kWgrad:
      s = a.wgrad_workspace(h, d.x, d.y, d.conv, d.w, cudnnConvolutionBwdFilterAlgo_t(algo), &bytes);
      break;
  }
  return d.workspace[key] = s == CUDNN_STATUS_SUCCESS ? bytes : SIZE_MAX;
}

}  // namespace

bool cudnn_available(std::string* why) {
  const CudnnApi& a = api();
  if (!a.error.empty()) {
    if (why) *why = a.error;
    return false;
  }
  std::lock_guard<std::mutex> lock(mutex());
  if (!handle_locked()) {
    if (why) *why = "cudnnCreate failed on the current device";
    return false;
  }
  return true;
}

std::vector<int> cudnn_conv_algorithms(CudnnConvOp op, const Conv2dProblem& p, ConvDType dtype, int max_count,
                                       size_t max_workspace) {
  std::vector<int> out;
  if (!cudnn_available()) return out;
  std::lock_guard<std::mutex> lock(mutex());
  cudnnHandle_t h = handle_locked();
  Descriptors& d = descriptors_locked(p, dtype);
  if (!d.ok) return out;
  const CudnnApi& a = api();
  constexpr int kMax = 16;
  int returned = 0;
  auto take = [&](int algo, cudnnStatus_t status, size_t memory) {
    if (status != CUDNN_STATUS_SUCCESS || memory > max_workspace || int(out.size()) >= max_count) return;
    for (int have : out)
      if (have == algo) return;
    if (workspace_locked(op, h, d, algo) <= max_workspace) out.push_back(algo);
  };
  if (op == CudnnConvOp::kFprop) {
    cudnnConvolutionFwdAlgoPerf_t perf[kMax];
    if (a.fprop_algos(h, d.x, d.w, d.conv, d.y, kMax, &returned, perf) != CUDNN_STATUS_SUCCESS) return out;
    for (int i = 0; i < returned; ++i) take(int(perf[i].algo), perf[i].status, perf[i].memory);
  } else if (op == CudnnConvOp::kDgrad) {
    cudnnConvolutionBwdDataAlgoPerf_t perf[kMax];
    if (a.dgrad_algos(h, d.w, d.y, d.conv, d.x, kMax, &returned, perf) != CUDNN_STATUS_SUCCESS) return out;
    for (int i = 0; i < returned; ++i) take(int(perf[i].algo), perf[i].status, perf[i].memory);
  } else {
    cudnnConvolutionBwdFilterAlgoPerf_t perf[kMax];
    if (a.wgrad_algos(h, d.x, d.y, d.conv, d.w, kMax, &returned, perf) != CUDNN_STATUS_SUCCESS) return out;
    for (int i = 0; i < returned; ++i) take(int(perf[i].algo), perf[i].status, perf[i].memory);
  }
  return out;
}

size_t cudnn_conv_workspace_bytes(CudnnConvOp op, const Conv2dProblem& p, ConvDType dtype, int algo) {
  if (!cudnn_available()) return SIZE_MAX;
  std::lock_guard<std::mutex> lock(mutex());
  Descriptors& d = descriptors_locked(p, dtype);
  return d.ok ? workspace_locked(op, handle_locked(), d, algo) : SIZE_MAX;
}

void* cudnn_library() { return api().error.empty() ? api().library : nullptr; }

bool with_cudnn_handle(cudaStream_t stream, const std::function<bool(cudnnHandle_t)>& fn) {
  if (!api().error.empty()) return false;
  std::lock_guard<std::mutex> lock(mutex());
  cudnnHandle_t h = handle_locked();
  if (!h || api().set_stream(h, stream) != CUDNN_STATUS_SUCCESS) return false;
  return fn(h);
}

namespace {
// `in` is dy (dgrad, wgrad) or x (fprop); `other` is w (fprop, dgrad) or x (wgrad).
cudaError_t run(CudnnConvOp op, const Conv2dProblem& p, ConvDType dtype, int algo, const void* in, const void* other,
                void* out, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (!in || !other || !out) return cudaErrorInvalidValue;
  if (!api().error.empty()) return cudaErrorNotSupported;
  std::lock_guard<std::mutex> lock(mutex());  // one lock per launch; descriptors and workspace sizes are cached
  cudnnHandle_t h = handle_locked();
  if (!h) return cudaErrorNotSupported;
  Descriptors& d = descriptors_locked(p, dtype);
  if (!d.ok) return cudaErrorNotSupported;
  const size_t need = workspace_locked(op, h, d, algo);
  if (need == SIZE_MAX) return cudaErrorNotSupported;
  if (need > workspace_bytes || (need > 0 && !workspace)) return cudaErrorInvalidValue;
  const CudnnApi& a = api();
  if (a.set_stream(h, stream) != CUDNN_STATUS_SUCCESS) return cudaErrorNotSupported;
  const float one = 1.0f, zero = 0.0f;
  cudnnStatus_t s = CUDNN_STATUS_NOT_SUPPORTED;
  switch (op) {
    case CudnnConvOp::kFprop:
      s = a.fprop(h, &one, d.x, in, d.w, other, d.conv, cudnnConvolutionFwdAlgo_t(algo), workspace, workspace_bytes,
                  &zero, d.y, out);
      break;
    case CudnnConvOp::kDgrad:
      s = a.dgrad(h, &one, d.w, other, d.y, in, d.conv, cudnnConvolutionBwdDataAlgo_t(algo), workspace,
                  workspace_bytes, &zero, d.x, out);
      break;
    case CudnnConvOp::kWgrad:
      s = a.wgrad(h, &one, d.x, other, d.y, in, d.conv, cudnnConvolutionBwdFilterAlgo_t(algo), workspace,
                  workspace_bytes, &zero, d.w, out);
      break;
  }
  if (s != CUDNN_STATUS_SUCCESS) return cudaErrorNotSupported;
  return cudaGetLastError();
}
}  // namespace

cudaError_t cudnn_conv_fprop(const Conv2dProblem& p, ConvDType dtype, int algo, const void* x, const void* w,
                             void* y, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  return run(CudnnConvOp::kFprop, p, dtype, algo, x, w, y, workspace, workspace_bytes, stream);
}

cudaError_t cudnn_conv_dgrad(const Conv2dProblem& p, ConvDType dtype, int algo, const void* dy, const void* w,
                             void* dx, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  return run(CudnnConvOp::kDgrad, p, dtype, algo, dy, w, dx, workspace, workspace_bytes, stream);
}

cudaError_t cudnn_conv_wgrad(const Conv2dProblem& p, ConvDType dtype, int algo, const void* dy, const void* x,
                             void* dw, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  return run(CudnnConvOp::kWgrad, p, dtype, algo, dy, x, dw, workspace, workspace_bytes, stream);
}

#else  // built without the cuDNN headers: no cuDNN candidates

void* cudnn_library() { return nullptr; }

bool cudnn_available(std::string* why) {
  if (why) *why = "kfuse was built without the cuDNN headers";
  return false;
}
std::vector<int> cudnn_conv_algorithms(CudnnConvOp, const Conv2dProblem&, ConvDType, int, size_t) { return {}; }
size_t cudnn_conv_workspace_bytes(CudnnConvOp, const Conv2dProblem&, ConvDType, int) { return SIZE_MAX; }
cudaError_t cudnn_conv_fprop(const Conv2dProblem&, ConvDType, int, const void*, const void*, void*, void*, size_t,
                             cudaStream_t) {
  return cudaErrorNotSupported;
}
cudaError_t cudnn_conv_dgrad(const Conv2dProblem&, ConvDType, int, const void*, const void*, void*, void*, size_t,
                             cudaStream_t) {
  return cudaErrorNotSupported;
}
cudaError_t cudnn_conv_wgrad(const Conv2dProblem&, ConvDType, int, const void*, const void*, void*, void*, size_t,
                             cudaStream_t) {
  return cudaErrorNotSupported;
}

#endif

}  // namespace kfuse::kernels
