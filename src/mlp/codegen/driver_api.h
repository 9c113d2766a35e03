// The CUDA driver API entry points the fused MLP uses (module loading and launches), resolved at run time through
// cudaGetDriverEntryPointByVersion: libkfuse has no link-time dependency on libcuda (CI machines have no driver),
// and <cuda.h> is used for its types only.
#pragma once

#include <cuda.h>

#include <map>
#include <string>

namespace kfuse::codegen {

struct DriverApi {
  CUresult (*cuModuleLoadData)(CUmodule*, const void*) = nullptr;
  CUresult (*cuModuleUnload)(CUmodule) = nullptr;
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*cuFuncSetAttribute)(CUfunction, CUfunction_attribute, int) = nullptr;
  CUresult (*cuOccupancyMaxActiveBlocksPerMultiprocessor)(int*, CUfunction, int, size_t) = nullptr;
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void**, void**) = nullptr;
  CUresult (*cuMemsetD16Async)(CUdeviceptr, unsigned short, size_t, CUstream) = nullptr;
  CUresult (*cuGetErrorString)(CUresult, const char**) = nullptr;

  // Resolved once; throws kfuse::Unsupported when the driver (or an entry point) is missing.
  static const DriverApi& get();
  // Throws kfuse::Error "<what> failed: <driver's message>" unless r == CUDA_SUCCESS.
  void check(CUresult r, const std::string& what) const;
};

// A module loaded into the current context (the device's primary context: make it current first) with its
// kernels looked up by name. Unloaded on destruction (the context must still exist; the process's end is fine).
class DriverModule {
 public:
  // `image`: CUBIN or PTX (NUL-terminated text) as the driver takes it.
  explicit DriverModule(const std::string& image);
  ~DriverModule();
  DriverModule(const DriverModule&) = delete;
  DriverModule& operator=(const DriverModule&) = delete;
  CUfunction function(const std::string& name);

 private:
  CUmodule module_ = nullptr;
  std::map<std::string, CUfunction> functions_;
};

}  // namespace kfuse::codegen
