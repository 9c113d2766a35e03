#include "runtime/launch_graph_cache.h"

#include "kfuse/error.h"
#include "runtime/cuda_check.h"

namespace kfuse {

void LaunchGraphCache::run(const Key& key, cudaStream_t stream, const Launch& launch, bool enabled) {
  if (!enabled) {
    launch(stream);
    return;
  }
  // A caller already capturing (its own CUDA graph around kfuse) gets the launches themselves.
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &status), "cudaStreamIsCapturing");
  if (status != cudaStreamCaptureStatusNone) {
    launch(stream);
    return;
  }
  auto it = entries_.find(key);
  if (it == entries_.end()) {  // first sight: warm up eagerly
    evict_oldest(/*graphs_only=*/false, 2 * capacity_);  // warm-only entries are cheap, but not unbounded
    launch(stream);
    entries_[key].last_use = ++clock_;
    return;
  }
  Entry& e = it->second;
  if (!e.exec) {
    cudaStream_t cs = nullptr;
    check_cuda(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking), "cudaStreamCreate (capture)");
    cudaGraph_t graph = nullptr;
    if (cudaError_t err = cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal); err != cudaSuccess) {
      cudaStreamDestroy(cs);
      check_cuda(err, "cudaStreamBeginCapture");
    }
    try {
      launch(cs);
    } catch (...) {
      cudaStreamEndCapture(cs, &graph);
      if (graph) cudaGraphDestroy(graph);
      cudaStreamDestroy(cs);
      throw;
    }
    const cudaError_t end = cudaStreamEndCapture(cs, &graph);
    cudaStreamDestroy(cs);
    check_cuda(end, "cudaStreamEndCapture");
    cudaGraphExec_t exec = nullptr;
    const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);  // the executable graph is self-contained
    check_cuda(inst, "cudaGraphInstantiate");
    evict_oldest(/*graphs_only=*/true, capacity_);  // only entries with a graph: not this key
    entries_[key].exec = exec;
  }
  Entry& ready = entries_[key];
  ready.last_use = ++clock_;
  check_cuda(cudaGraphLaunch(ready.exec, stream), "cudaGraphLaunch");
}

void LaunchGraphCache::evict_oldest(bool graphs_only, size_t limit) {
  for (;;) {
    size_t count = 0;
    auto oldest = entries_.end();
    for (auto i = entries_.begin(); i != entries_.end(); ++i) {
      if (graphs_only && !i->second.exec) continue;
      ++count;
      if (oldest == entries_.end() || i->second.last_use < oldest->second.last_use) oldest = i;
    }
    if (count < limit || oldest == entries_.end()) return;
    if (oldest->second.exec) cudaGraphExecDestroy(oldest->second.exec);
    entries_.erase(oldest);
  }
}

void LaunchGraphCache::clear() {
  for (auto& [k, e] : entries_)
    if (e.exec) cudaGraphExecDestroy(e.exec);
  entries_.clear();
}

size_t LaunchGraphCache::graph_count() const {
  size_t n = 0;
  for (const auto& [k, e] : entries_) n += e.exec != nullptr;
  return n;
}

}  // namespace kfuse
