// Phase timing inside a kernel, for development builds only (cmake -DKFUSE_PHASE_STAMPS=ON; scripts/device_bundle.sh
// passes KFUSE_CMAKE_ARGS through). Profilers time whole kernels; the fused kernels spend their time in phases (load,
// MMAs, epilogues, exchanges) that only the kernel itself can time. Thread 0 of every CTA reads the global timer at
// each KFUSE_STAMP, and KFUSE_PRINT_PHASES prints, for CTAs 0 and 77, each phase's duration in microseconds (stamp i
// minus stamp i - 1, named by stamp i) as "[phases] <kernel> cta <c> <name> <us>" lines. Built without the option, the
// macros are empty: no registers, no code.
#pragma once

#ifdef KFUSE_PHASE_STAMPS
#include <cstdio>

namespace kfuse::kernels {
template <int N>
struct PhaseStamps {
  unsigned long long at[N] = {};
  const char* name[N] = {};
  __device__ __forceinline__ void stamp(int i, const char* phase) {
    if (threadIdx.x != 0) return;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(at[i])::"memory");
    name[i] = phase;
  }
  __device__ void print(const char* kernel) const {
    if (threadIdx.x != 0 || (blockIdx.x != 0 && blockIdx.x != 77)) return;
    for (int i = 1; i < N; ++i)
      if (at[i] && at[i - 1]) printf("[phases] %s cta %d %s %.2f\n", kernel, int(blockIdx.x), name[i], 1e-3 * double(at[i] - at[i - 1]));
  }
};
}  // namespace kfuse::kernels

#define KFUSE_PHASES(n) ::kfuse::kernels::PhaseStamps<n> kfuse_phases_
#define KFUSE_STAMP(i, phase) kfuse_phases_.stamp(i, phase)
#define KFUSE_PRINT_PHASES(kernel) kfuse_phases_.print(kernel)
#else
#define KFUSE_PHASES(n) static_assert(true)
#define KFUSE_STAMP(i, phase) static_cast<void>(0)
#define KFUSE_PRINT_PHASES(kernel) static_cast<void>(0)
#endif
