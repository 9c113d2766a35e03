#include "runtime/launch_graph_cache.h"

#include <cstdio>
#include <exception>
#include <string>

#include "kfuse/error.h"
#include "runtime/cuda_check.h"

namespace kfuse {

namespace {
thread_local int own_capture_depth = 0;
}  // namespace

bool in_own_capture() { return own_capture_depth > 0; }

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
  if (it->second.uncapturable) {
    it->second.last_use = ++clock_;
    launch(stream);
    return;
  }
  if (!it->second.exec) {
    cudaGraphExec_t exec = nullptr;
    if (const std::string why = capture_graph(launch, &exec); !why.empty()) {
      // Not retried: the same sequence would fail the same way on every call. Runs eagerly instead.
      std::fprintf(stderr, "[kfuse] warning: a launch sequence could not be captured as a CUDA graph (%s); it runs "
                           "without one\n", why.c_str());
      Entry& e = entries_[key];
      e.uncapturable = true;
      e.last_use = ++clock_;
      launch(stream);
      return;
    }
    evict_oldest(/*graphs_only=*/true, capacity_);  // only entries with a graph: not this key
    entries_[key].exec = exec;
  }
  Entry& ready = entries_[key];
  ready.last_use = ++clock_;
  check_cuda(cudaGraphLaunch(ready.exec, stream), "cudaGraphLaunch");
}

std::string capture_graph(const std::function<void(cudaStream_t)>& launch, cudaGraphExec_t* exec,
                          cudaGraph_t* keep) {
  *exec = nullptr;
  if (keep) *keep = nullptr;
  cudaStream_t cs = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking), "cudaStreamCreate (capture)");
  cudaGraph_t graph = nullptr;
  if (cudaError_t err = cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal); err != cudaSuccess) {
    cudaStreamDestroy(cs);
    return std::string("cudaStreamBeginCapture: ") + cudaGetErrorString(err);
  }
  std::string why;
  ++own_capture_depth;
  try {
    launch(cs);
  } catch (const std::exception& e) {
    why = e.what();
  }
  --own_capture_depth;
  const cudaError_t end = cudaStreamEndCapture(cs, &graph);
  cudaStreamDestroy(cs);
  cudaGetLastError();  // a failed capture leaves its error behind; the eager run must not see it
  if (why.empty() && end != cudaSuccess) why = std::string("cudaStreamEndCapture: ") + cudaGetErrorString(end);
  if (why.empty() && graph) {
    if (cudaError_t inst = cudaGraphInstantiate(exec, graph, 0); inst != cudaSuccess) {
      cudaGetLastError();
      *exec = nullptr;
      why = std::string("cudaGraphInstantiate: ") + cudaGetErrorString(inst);
    }
  }
  if (why.empty() && !*exec) why = "empty capture";
  if (why.empty() && keep) {
    *keep = graph;
  } else if (graph) {
    cudaGraphDestroy(graph);  // the executable graph is self-contained
  }
  return why;
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
  ++epoch_;
}

size_t LaunchGraphCache::graph_count() const {
  size_t n = 0;
  for (const auto& [k, e] : entries_) n += e.exec != nullptr;
  return n;
}

}  // namespace kfuse
