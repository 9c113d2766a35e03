#include "kernels/programmatic_launch.h"


namespace kfuse::kernels {

namespace {
thread_local bool g_requested = false;  // per thread: captures and launches of other threads are unaffected
}  // namespace

bool pdl_requested() { return g_requested; }

PdlScope::PdlScope(bool on) : previous_(g_requested) { g_requested = on; }
PdlScope::~PdlScope() { g_requested = previous_; }

bool pdl_supported(int device) {
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    (void)cudaGetLastError();  // a failed query leaves no error behind
    return false;
  }
  return major >= 9;
}

}  // namespace kfuse::kernels
