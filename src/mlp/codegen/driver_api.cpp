#include "mlp/codegen/driver_api.h"

#include <cuda_runtime.h>

#include "kfuse/error.h"

namespace kfuse::codegen {
namespace {

template <class Fn>
void resolve(Fn& fn, const char* symbol) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult status{};
  // 12000: the ABI of these entry points as of CUDA 12.0 (unchanged since); older drivers cannot run sm_80+
  // NVRTC output of this toolkit anyway.
  const cudaError_t e = cudaGetDriverEntryPointByVersion(symbol, &p, 12000, cudaEnableDefault, &status);
  if (e != cudaSuccess || status != cudaDriverEntryPointSuccess || !p) {
    cudaGetLastError();
    throw Unsupported(std::string("the CUDA driver entry point ") + symbol +
                      " is not available (no CUDA driver, or one older than CUDA 12.0): " + cudaGetErrorString(e));
  }
  fn = reinterpret_cast<Fn>(p);
}

}  // namespace

const DriverApi& DriverApi::get() {
  static const DriverApi api = [] {
    DriverApi a;
    resolve(a.cuModuleLoadData, "cuModuleLoadData");
    resolve(a.cuModuleUnload, "cuModuleUnload");
    resolve(a.cuModuleGetFunction, "cuModuleGetFunction");
    resolve(a.cuFuncSetAttribute, "cuFuncSetAttribute");
    resolve(a.cuOccupancyMaxActiveBlocksPerMultiprocessor, "cuOccupancyMaxActiveBlocksPerMultiprocessor");
    resolve(a.cuLaunchKernel, "cuLaunchKernel");
    resolve(a.cuMemsetD16Async, "cuMemsetD16Async");
    resolve(a.cuGetErrorString, "cuGetErrorString");
    return a;
  }();
  return api;
}

void DriverApi::check(CUresult r, const std::string& what) const {
  if (r == CUDA_SUCCESS) return;
  const char* msg = nullptr;
  if (cuGetErrorString) cuGetErrorString(r, &msg);
  throw Error(what + " failed: " + (msg ? msg : "CUDA driver error " + std::to_string(static_cast<int>(r))));
}

DriverModule::DriverModule(const std::string& image) {
  const DriverApi& api = DriverApi::get();
  api.check(api.cuModuleLoadData(&module_, image.c_str()), "cuModuleLoadData");
}

DriverModule::~DriverModule() {
  if (module_) DriverApi::get().cuModuleUnload(module_);
}

CUfunction DriverModule::function(const std::string& name) {
  auto it = functions_.find(name);
  if (it != functions_.end()) return it->second;
  CUfunction f = nullptr;
  const DriverApi& api = DriverApi::get();
  api.check(api.cuModuleGetFunction(&f, module_, name.c_str()), "cuModuleGetFunction(" + name + ")");
  functions_[name] = f;
  return f;
}

}  // namespace kfuse::codegen
