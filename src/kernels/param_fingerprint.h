// A fingerprint of device memory (a network's parameters) computed on the device, so that a captured forward can
// tell by itself whether the parameters changed since its last run, whatever wrote them: an optimizer, a copy from
// master weights through `.data`, a collective into the storage. No host synchronisation and no version counter is
// involved. Plain launcher, no CUTLASS.
//
// The fingerprint is a 64-bit sum over every 8-byte word w at global word index i of splitmix64(w + i * golden):
// order-independent (deterministic under any CTA schedule, one integer atomic per CTA), and for each index a
// bijection of the word, so a change of any single word always changes it. Several unrelated changes cancel with
// probability ~2^-64; constructed ones can (neighbours set to (w[i+1] + golden, w[i] - golden) keep the sum), which
// no optimizer or copy produces.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <cuda_runtime.h>

namespace kfuse::kernels {

// One piece of watched memory: `words` words of `word_bytes` bytes (16 where the region is 16-byte aligned and a
// multiple of 16 bytes long, else 2: every parameter dtype is a multiple of 2 bytes), the first at global word
// index `first_word` (16-byte words count as two 8-byte ones).
struct FingerprintChunk {
  const void* ptr = nullptr;
  int64_t words = 0;
  int64_t first_word = 0;
  int32_t word_bytes = 16;
  int32_t pad = 0;
};

// Device state, zero-initialised before first use. `changed` is the verdict of the last fingerprint: force set, or
// a fingerprint other than the stored one.
struct FingerprintState {
  unsigned long long sum;     // the running sum of the fingerprint in flight (0 between launches)
  unsigned long long stored;  // the fingerprint of the last launch
  unsigned int arrived;       // CTAs done with the launch in flight (0 between launches)
  unsigned int changed;       // 1 when the last launch found a change (the repack's run flag)
  unsigned int force;         // set by the host: the next launch reports a change whatever it finds
  unsigned int pad;
};

// A region of device memory to watch.
struct WatchedRegion {
  const void* ptr = nullptr;
  size_t bytes = 0;
};

// Splits the regions into chunks of at most `chunk_bytes` (a multiple of 16) for launch_param_fingerprint.
std::vector<FingerprintChunk> plan_fingerprint_chunks(const std::vector<WatchedRegion>& regions,
                                                      size_t chunk_bytes = 16 << 10);

// Fingerprints the chunks (device array of `count`) into `state` and sets state->changed; with `set_conditional`
// also sets the graph conditional `handle` to it (the launch must then be a node of that handle's graph).
cudaError_t launch_param_fingerprint(const FingerprintChunk* chunks, int count, FingerprintState* state,
                                     cudaGraphConditionalHandle handle, bool set_conditional, int sm_count,
                                     cudaStream_t stream);

}  // namespace kfuse::kernels
