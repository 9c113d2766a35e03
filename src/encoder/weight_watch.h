// Keeps an engine's derived weight arrays (packed layouts, prepared filters) in step with parameters that live in
// the caller's device memory, whatever writes them. Every forward starts with check(): a fingerprint of the
// parameters' bytes on the device (kernels/param_fingerprint.h), and the repack only where it changed. Inside a
// stream capture the repack becomes the body of a conditional graph node that the fingerprint kernel switches, so a
// replay with unchanged parameters pays the fingerprint alone; eagerly, the repack's kernels read the verdict as a run
// flag and return at once when nothing changed. No host synchronisation on either path. (Measured on an H100, batch-128
// forward back to back: the IF node 77.6 us against 83.1 with the three skipping repack kernels in line.)
//
// The verdict compares with the fingerprint its own consumers saw last. kfuse's own launches (eager, and the graphs
// it captures, whose repacks all cover every derived array) share one slot. A capture that kfuse's caller started
// around a kfuse launch (torch.cuda.graph, torch.compile's CUDA graphs) gets a slot of its own: its repack covers
// only the arrays that existed when it was captured, so it must not consume a change that kfuse's graphs still have
// to see. The owner runs one check at a time (one stream at a time, as for the engine's other buffers).
#pragma once

#include <functional>
#include <vector>

#include <cuda_runtime.h>

#include "kernels/param_fingerprint.h"

namespace kfuse {

class WeightWatch {
 public:
  // Launches the repack on `stream`; its kernels must skip themselves when *run_flag is 0.
  using Repack = std::function<void(cudaStream_t stream, const unsigned* run_flag)>;

  WeightWatch() = default;
  ~WeightWatch();
  WeightWatch(const WeightWatch&) = delete;
  WeightWatch& operator=(const WeightWatch&) = delete;

  // Watches `regions` (device memory on the current device) from now on. Where they differ from the regions watched
  // so far, waits for the device (forwards in flight read the old chunk table), uploads a new table (the old one
  // stays allocated until the watch is destroyed: graphs captured by the caller may still read it) and makes the next
  // check of every slot report a change. Returns whether they differed.
  bool watch(const std::vector<kernels::WatchedRegion>& regions, int sm_count);
  // Nothing to watch (the weights came from the host): check() does nothing.
  void unwatch();
  bool watching() const { return count_ > 0; }
  // The next check of every slot reports a change (synchronous: waits for the device).
  void invalidate();
  // On `stream`: the fingerprint, then `repack` where the parameters changed since this slot's last check (or since
  // watch / invalidate). Captured as a conditional node when `stream` is capturing. `sm_count` (0: watch()'s) sizes
  // the fingerprint's grid: 8 CTAs per SM.
  void check(cudaStream_t stream, const Repack& repack, int sm_count = 0);

 private:
  static constexpr int kSlots = 16;  // slot 0: kfuse's own launches; 1..15: captures by the caller, round robin
  bool check_captured(cudaStream_t stream, const Repack& repack, int sm_count, kernels::FingerprintState* state);
  bool probe_conditional_nodes();
  std::vector<kernels::WatchedRegion> regions_;
  kernels::FingerprintChunk* chunks_ = nullptr;  // device
  std::vector<kernels::FingerprintChunk*> retired_;
  int count_ = 0, sm_count_ = 1;
  kernels::FingerprintState* states_ = nullptr;  // device, kSlots
  int next_caller_slot_ = 1;
  cudaStream_t body_stream_ = nullptr;  // captures conditional bodies
  int conditional_nodes_ = -1;          // -1: not probed yet; 0: the driver refuses them; 1: available
};

}  // namespace kfuse
