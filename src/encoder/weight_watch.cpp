#include "encoder/weight_watch.h"

#include <cstdio>
#include <cstring>

#include "runtime/cuda_check.h"
#include "runtime/launch_graph_cache.h"

namespace kfuse {

WeightWatch::~WeightWatch() {
  cudaFree(chunks_);
  for (auto* c : retired_) cudaFree(c);
  cudaFree(states_);
  if (body_stream_) cudaStreamDestroy(body_stream_);
}

bool WeightWatch::watch(const std::vector<kernels::WatchedRegion>& regions, int sm_count) {
  sm_count_ = sm_count;
  const bool same = regions.size() == regions_.size() &&
                    std::memcmp(regions.data(), regions_.data(), regions.size() * sizeof(regions[0])) == 0;
  if (same && count_ > 0) return false;
  const std::vector<kernels::FingerprintChunk> chunks = kernels::plan_fingerprint_chunks(regions);
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // checks in flight read the old table
  if (chunks_) retired_.push_back(chunks_);
  chunks_ = nullptr;
  count_ = 0;
  regions_.clear();
  if (!chunks.empty()) {
    check_cuda(cudaMalloc(&chunks_, chunks.size() * sizeof(chunks[0])), "cudaMalloc (fingerprint chunks)");
    check_cuda(cudaMemcpy(chunks_, chunks.data(), chunks.size() * sizeof(chunks[0]), cudaMemcpyHostToDevice),
               "cudaMemcpy (fingerprint chunks)");
  }
  if (!body_stream_)  // made here: a capture in progress may forbid it
    check_cuda(cudaStreamCreateWithFlags(&body_stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  if (conditional_nodes_ < 0) conditional_nodes_ = probe_conditional_nodes();
  invalidate();
  count_ = int(chunks.size());
  regions_ = regions;
  return true;
}

void WeightWatch::unwatch() {
  regions_.clear();
  count_ = 0;
}

void WeightWatch::invalidate() {
  if (!states_) check_cuda(cudaMalloc(&states_, kSlots * sizeof(*states_)), "cudaMalloc (fingerprint state)");
  std::vector<kernels::FingerprintState> s(kSlots, kernels::FingerprintState{});
  for (auto& slot : s) slot.force = 1;
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  check_cuda(cudaMemcpy(states_, s.data(), kSlots * sizeof(s[0]), cudaMemcpyHostToDevice),
             "cudaMemcpy (fingerprint state)");
}

void WeightWatch::check(cudaStream_t stream, const Repack& repack, int sm_count) {
  if (count_ == 0) return;
  if (sm_count <= 0) sm_count = sm_count_;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
  kernels::FingerprintState* state = states_;
  if (capture == cudaStreamCaptureStatusActive && !in_own_capture()) {
    state = states_ + next_caller_slot_;
    next_caller_slot_ = next_caller_slot_ + 1 < kSlots ? next_caller_slot_ + 1 : 1;
  }
  if (capture == cudaStreamCaptureStatusActive && conditional_nodes_ == 1 &&
      check_captured(stream, repack, sm_count, state))
    return;
  check_cuda(kernels::launch_param_fingerprint(chunks_, count_, state, 0, false, sm_count, stream),
             "parameter fingerprint kernel");
  repack(stream, &state->changed);
}

// Ends the body's capture however its launches end: a body stream left capturing would fail every later capture.
namespace {
struct BodyCapture {
  cudaStream_t stream;
  bool open = true;
  cudaError_t end() {
    open = false;
    cudaGraph_t body = nullptr;
    return cudaStreamEndCapture(stream, &body);
  }
  ~BodyCapture() {
    if (!open) return;
    cudaGraph_t body = nullptr;
    cudaStreamEndCapture(stream, &body);
    cudaGetLastError();
  }
};
}  // namespace

// The fingerprint kernel sets a conditional handle of the graph being captured; the repack is captured into the
// body of an IF node after it. False (nothing added) where the handle cannot be made.
bool WeightWatch::check_captured(cudaStream_t stream, const Repack& repack, int sm_count,
                                 kernels::FingerprintState* state) {
  cudaStreamCaptureStatus status;
  cudaGraph_t graph = nullptr;
  if (cudaStreamGetCaptureInfo(stream, &status, nullptr, &graph) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  cudaGraphConditionalHandle handle;
  if (cudaGraphConditionalHandleCreate(&handle, graph, 0, 0) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  check_cuda(kernels::launch_param_fingerprint(chunks_, count_, state, handle, true, sm_count, stream),
             "parameter fingerprint kernel");
  const cudaGraphNode_t* deps = nullptr;
  size_t ndeps = 0;
  check_cuda(cudaStreamGetCaptureInfo(stream, &status, nullptr, &graph, &deps, nullptr, &ndeps),
             "cudaStreamGetCaptureInfo");
  cudaGraphNodeParams params{};
  params.type = cudaGraphNodeTypeConditional;
  params.conditional.handle = handle;
  params.conditional.type = cudaGraphCondTypeIf;
  params.conditional.size = 1;
  cudaGraphNode_t node;
  check_cuda(cudaGraphAddNode(&node, graph, deps, nullptr, ndeps, &params), "cudaGraphAddNode (conditional)");
  check_cuda(cudaStreamUpdateCaptureDependencies(stream, &node, nullptr, 1, cudaStreamSetCaptureDependencies),
             "cudaStreamUpdateCaptureDependencies");
  check_cuda(cudaStreamBeginCaptureToGraph(body_stream_, params.conditional.phGraph_out[0], nullptr, nullptr, 0,
                                           cudaStreamCaptureModeRelaxed),
             "cudaStreamBeginCaptureToGraph (repack)");
  BodyCapture body{body_stream_};
  repack(body_stream_, &state->changed);
  check_cuda(body.end(), "cudaStreamEndCapture (repack)");
  return true;
}

// Whether this driver instantiates a graph with an IF node (CUDA 12.4+ drivers), tried once outside any capture so
// that a refusal never surfaces in the middle of one.
bool WeightWatch::probe_conditional_nodes() {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  bool ok = cudaGraphCreate(&graph, 0) == cudaSuccess;
  cudaGraphConditionalHandle handle;
  ok = ok && cudaGraphConditionalHandleCreate(&handle, graph, 0, cudaGraphCondAssignDefault) == cudaSuccess;
  cudaGraphNodeParams params{};
  params.type = cudaGraphNodeTypeConditional;
  params.conditional.handle = handle;
  params.conditional.type = cudaGraphCondTypeIf;
  params.conditional.size = 1;
  cudaGraphNode_t node;
  ok = ok && cudaGraphAddNode(&node, graph, nullptr, nullptr, 0, &params) == cudaSuccess;
  ok = ok && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess;
  if (exec) cudaGraphExecDestroy(exec);
  if (graph) cudaGraphDestroy(graph);
  cudaGetLastError();
  if (!ok)
    std::fprintf(stderr, "[kfuse] warning: no conditional graph nodes: captured forwards repack on every replay "
                         "(their kernels skip themselves when the parameters did not change)\n");
  return ok;
}

}  // namespace kfuse
