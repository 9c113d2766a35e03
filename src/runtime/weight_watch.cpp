#include "runtime/weight_watch.h"

#include <cstdio>
#include <cstring>

#include "runtime/cuda_check.h"

namespace kfuse {

WeightWatch::~WeightWatch() {
  cudaFree(chunks_);
  cudaFree(state_);
  if (body_stream_) cudaStreamDestroy(body_stream_);
}

bool WeightWatch::watch(const std::vector<kernels::WatchedRegion>& regions, int sm_count) {
  sm_count_ = sm_count;
  const bool same = regions.size() == regions_.size() &&
                    std::memcmp(regions.data(), regions_.data(), regions.size() * sizeof(regions[0])) == 0;
  if (same && count_ > 0) return false;
  const std::vector<kernels::FingerprintChunk> chunks = kernels::plan_fingerprint_chunks(regions);
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // checks in flight read the old table
  if (int(chunks.size()) > capacity_) {
    cudaFree(chunks_);
    chunks_ = nullptr;
    check_cuda(cudaMalloc(&chunks_, chunks.size() * sizeof(chunks[0])), "cudaMalloc (fingerprint chunks)");
    capacity_ = int(chunks.size());
  }
  if (!chunks.empty())
    check_cuda(cudaMemcpy(chunks_, chunks.data(), chunks.size() * sizeof(chunks[0]), cudaMemcpyHostToDevice),
               "cudaMemcpy (fingerprint chunks)");
  if (!body_stream_)  // made here: a capture in progress may forbid it
    check_cuda(cudaStreamCreateWithFlags(&body_stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  count_ = int(chunks.size());
  regions_ = regions;
  invalidate();
  return true;
}

void WeightWatch::unwatch() {
  regions_.clear();
  count_ = 0;
}

void WeightWatch::invalidate() {
  if (!state_) check_cuda(cudaMalloc(&state_, sizeof(*state_)), "cudaMalloc (fingerprint state)");
  kernels::FingerprintState s{};
  s.force = 1;
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  check_cuda(cudaMemcpy(state_, &s, sizeof(s), cudaMemcpyHostToDevice), "cudaMemcpy (fingerprint state)");
}

void WeightWatch::check(cudaStream_t stream, const Repack& repack) {
  if (count_ == 0) return;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
  if (capture == cudaStreamCaptureStatusActive && conditional_nodes_ && check_captured(stream, repack)) return;
  check_cuda(kernels::launch_param_fingerprint(chunks_, count_, state_, 0, false, sm_count_, stream),
             "parameter fingerprint kernel");
  repack(stream, &state_->changed);
}

// The fingerprint kernel sets a conditional handle of the graph being captured; the repack is captured into the
// body of an IF node after it. False (nothing added) where the driver refuses conditional nodes.
bool WeightWatch::check_captured(cudaStream_t stream, const Repack& repack) {
  cudaStreamCaptureStatus status;
  cudaGraph_t graph = nullptr;
  if (cudaStreamGetCaptureInfo(stream, &status, nullptr, &graph) != cudaSuccess) return false;
  cudaGraphConditionalHandle handle;
  if (cudaGraphConditionalHandleCreate(&handle, graph, 0, 0) != cudaSuccess) {
    cudaGetLastError();
    conditional_nodes_ = false;
    std::fprintf(stderr, "[kfuse] warning: no conditional graph nodes: captured forwards repack on every replay "
                         "(their kernels skip themselves when the parameters did not change)\n");
    return false;
  }
  check_cuda(kernels::launch_param_fingerprint(chunks_, count_, state_, handle, true, sm_count_, stream),
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
  repack(body_stream_, &state_->changed);
  cudaGraph_t body = nullptr;
  check_cuda(cudaStreamEndCapture(body_stream_, &body), "cudaStreamEndCapture (repack)");
  return true;
}

}  // namespace kfuse
