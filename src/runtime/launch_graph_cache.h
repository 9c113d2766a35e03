// Replays a host-expensive launch sequence as a CUDA graph, one per key (the caller's pointers and everything else
// baked into the launches). The training step's forward and backward are ~30 launches each, and cuDNN's calls take
// tens of microseconds of host time apiece: issued one by one they leave the GPU waiting; as a graph the host cost
// is one cudaGraphLaunch.
//
// The first run of a key is eager (a warm-up: lazy module loading and libraries' first-call work do not belong in
// a capture), the second is captured on a private stream and launched, later ones replay. The cache holds at most
// `capacity` graphs and evicts the least recently used (an executable graph destroyed in flight is freed when it
// completes). The owner clears it whenever anything baked into the launches changes (buffers reallocated, kernel
// choices retuned, job tables moved).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <cuda_runtime.h>

namespace kfuse {

// Captures `launch` on a private stream (the caller's streams never see a capture in progress) and instantiates it
// into *exec. With `keep`, the captured graph is handed to the caller as well (who destroys it: a graph whose nodes'
// parameters are patched later); else it is destroyed. Returns why not (empty on success; then *exec is set); a
// failure leaves no CUDA error behind and nothing to free.
std::string capture_graph(const std::function<void(cudaStream_t)>& launch, cudaGraphExec_t* exec,
                          cudaGraph_t* keep = nullptr);
// Whether this thread is inside capture_graph's launch (a capture of kfuse's own, as opposed to one its caller
// started around kfuse's launches).
bool in_own_capture();

class LaunchGraphCache {
 public:
  using Key = std::vector<int64_t>;
  using Launch = std::function<void(cudaStream_t)>;

  explicit LaunchGraphCache(size_t capacity = 8) : capacity_(capacity) {}
  ~LaunchGraphCache() { clear(); }
  LaunchGraphCache(const LaunchGraphCache&) = delete;
  LaunchGraphCache& operator=(const LaunchGraphCache&) = delete;

  // Runs `launch`'s sequence on `stream` (eagerly, or as the key's graph). Throws kfuse::Error on CUDA failures of
  // the launches. A capture that fails (something in the sequence cannot be captured) is not retried: the key runs
  // eagerly from then on, with one warning on stderr. `enabled` false: always eager (and nothing is remembered).
  void run(const Key& key, cudaStream_t stream, const Launch& launch, bool enabled = true);
  void clear();
  // Counts the clear() calls: whatever the owner derived from the state that a clear invalidates (e.g. a launch
  // plan) is current while the epoch it was made in is.
  uint64_t epoch() const { return epoch_; }
  void set_capacity(size_t capacity) { capacity_ = capacity; }
  size_t graph_count() const;

 private:
  struct Entry {
    cudaGraphExec_t exec = nullptr;  // null: seen once, not captured yet
    bool uncapturable = false;       // its capture failed once: eager from then on
    uint64_t last_use = 0;
  };
  // Drops least recently used entries (with a graph only, or any) until fewer than `limit` remain of that kind.
  void evict_oldest(bool graphs_only, size_t limit);
  std::map<Key, Entry> entries_;
  size_t capacity_;
  uint64_t epoch_ = 0;
  uint64_t clock_ = 0;
};

}  // namespace kfuse
