// The library handle (cuBLAS, cuDNN) of the current CUDA device, created on first use and kept for the process.
#pragma once

#include <map>

#include <cuda_runtime.h>

namespace kfuse::kernels {

// `handles` is the caller's per-device cache; `create(&h)` makes a handle and returns whether it succeeded. A failed
// creation is remembered as null (not retried on every call). Call with the caller's lock held: neither the cache
// nor the handles are thread-safe.
template <class Handle, class Create>
Handle current_device_handle(std::map<int, Handle>& handles, Create create) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return nullptr;
  auto it = handles.find(dev);
  if (it != handles.end()) return it->second;
  Handle h = nullptr;
  if (!create(&h)) h = nullptr;
  handles[dev] = h;
  return h;
}

}  // namespace kfuse::kernels
