#include "kernels/conv/cudnn_fused.h"

#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "kernels/conv/cudnn_conv.h"

#if KFUSE_HAVE_CUDNN_FRONTEND
#include <cudnn_frontend.h>

#include "kernels/timing/candidate_data.h"

// The frontend resolves cuDNN's backend entry points in this handle (NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING): the
// library cudnn_conv.cpp loaded, PyTorch's own copy inside a PyTorch process.
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}
#endif

namespace kfuse::kernels {

namespace {
// What the two graphs cover (checked before cuDNN or a GPU is asked); `pitch` is normalized (0: packed).
bool covered(CudnnFusedOp op, const Conv2dProblem& p, int& pitch, std::string* why) {
  auto refuse = [&](const std::string& reason) {
    if (why) *why = reason;
    return false;
  };
  if (p.n <= 0 || p.p() <= 0 || p.q() <= 0) return refuse("empty problem");
  if (p.c % 8 || p.k % 8)
    return refuse("channels must be multiples of 8 (C = " + std::to_string(p.c) + ", K = " + std::to_string(p.k) + ")");
  if (op == CudnnFusedOp::kDgradMask) {
    if (pitch == 0) pitch = p.c;
    if (p.stride_h != 1 || p.stride_w != 1) return refuse("the fused data gradient is for stride-1 convolutions");
    if (pitch < p.c || pitch % 8)
      return refuse("the fused data gradient's row pitch (" + std::to_string(pitch) +
                    ") must be a multiple of 8 and at least C = " + std::to_string(p.c));
  } else {
    pitch = 0;
  }
  return true;
}
}  // namespace

#if KFUSE_HAVE_CUDNN_FRONTEND
namespace {

namespace fe = cudnn_frontend;

// Tensor uids of the two graphs (the variant packs are keyed by them).
enum Uid : int64_t { kX = 1, kW, kB1b, kB2a, kH, kH2, kDy, kScale, kMaskSrc, kDpre, kSumDh, kSumDpre };

// Plans timed per op: the fastest was among the heuristic's first four for every encoder shape (H100, batch 2048).
constexpr int kPlansTried = 4;

struct Entry {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t plan = -1;  // the fastest plan, or -1: unsupported
  std::string why;
};

using Key = std::tuple<int, int, int, int, int, int, int, int, int, int, int, int, int, int, int>;

Key key_of(CudnnFusedOp op, const Conv2dProblem& p, ConvDType dtype, int pitch) {
  int dev = 0;
  cudaGetDevice(&dev);
  return Key{int(op), p.n, p.h, p.w, p.c, p.k, p.r, p.s, p.pad_h, p.pad_w, p.stride_h, p.stride_w, int(dtype), pitch,
             dev};
}

std::mutex& mutex() {
  static std::mutex m;
  return m;
}
// Never destroyed: a graph's destructor calls into cuDNN, which may already be unloaded at static destruction.
std::map<Key, Entry>& entries() {
  static auto* e = new std::map<Key, Entry>();
  return *e;
}

std::shared_ptr<fe::graph::Graph> new_graph(ConvDType dtype) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(dtype == ConvDType::kF16 ? fe::DataType_t::HALF : fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

// NHWC activations with rows of `pitch` elements (pitch >= c).
TensorPtr activation(fe::graph::Graph& g, Uid uid, int64_t n, int64_t c, int64_t h, int64_t w, int64_t pitch = 0) {
  if (pitch == 0) pitch = c;
  return g.tensor(fe::graph::Tensor_attributes().set_uid(uid).set_name("t" + std::to_string(uid)).set_dim(
      {n, c, h, w}).set_stride({pitch * h * w, 1, pitch * w, pitch}));
}
TensorPtr filter(fe::graph::Graph& g, const Conv2dProblem& p) {
  return g.tensor(fe::graph::Tensor_attributes().set_uid(kW).set_name("w").set_dim({p.k, p.c, p.r, p.s}).set_stride(
      {int64_t(p.c) * p.r * p.s, 1, int64_t(p.c) * p.s, p.c}));
}
// A device fp32 scalar: kfuse's FixUp scalars sit 4 bytes apart, hence the alignment of 4.
TensorPtr scalar(fe::graph::Graph& g, Uid uid) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_uid(uid)
                      .set_name("s" + std::to_string(uid))
                      .set_dim({1, 1, 1, 1})
                      .set_stride({1, 1, 1, 1})
                      .set_alignment(4)
                      .set_data_type(fe::DataType_t::FLOAT));
}
fe::graph::Pointwise_attributes pointwise(fe::PointwiseMode_t mode) {
  return fe::graph::Pointwise_attributes().set_mode(mode).set_compute_data_type(fe::DataType_t::FLOAT);
}

void build_conv_relu(fe::graph::Graph& g, const Conv2dProblem& p) {
  auto x = activation(g, kX, p.n, p.c, p.h, p.w);
  auto w = filter(g, p);
  auto acc = g.conv_fprop(x, w,
                          fe::graph::Conv_fprop_attributes()
                              .set_padding({p.pad_h, p.pad_w})
                              .set_stride({p.stride_h, p.stride_w})
                              .set_dilation({1, 1})
                              .set_compute_data_type(fe::DataType_t::FLOAT));
  auto pre = g.pointwise(acc, scalar(g, kB1b), pointwise(fe::PointwiseMode_t::ADD));
  auto h = g.pointwise(pre, pointwise(fe::PointwiseMode_t::RELU_FWD));
  h->set_output(true).set_uid(kH).set_name("h");
  auto h2 = g.pointwise(h, scalar(g, kB2a), pointwise(fe::PointwiseMode_t::ADD));
  h2->set_output(true).set_uid(kH2).set_name("h2");
  const int64_t pp = p.p(), qq = p.q();
  h->set_dim({p.n, p.k, pp, qq}).set_stride({p.k * pp * qq, 1, p.k * qq, p.k});
  h2->set_dim({p.n, p.k, pp, qq}).set_stride({p.k * pp * qq, 1, p.k * qq, p.k});
}

void build_dgrad_mask(fe::graph::Graph& g, const Conv2dProblem& p, int pitch) {
  auto dy = activation(g, kDy, p.n, p.k, p.p(), p.q());
  auto w = filter(g, p);
  auto dx = g.conv_dgrad(dy, w,
                         fe::graph::Conv_dgrad_attributes()
                             .set_padding({p.pad_h, p.pad_w})
                             .set_stride({p.stride_h, p.stride_w})
                             .set_dilation({1, 1})
                             .set_compute_data_type(fe::DataType_t::FLOAT));
  dx->set_dim({p.n, p.c, p.h, p.w});
  auto dh = g.pointwise(dx, scalar(g, kScale), pointwise(fe::PointwiseMode_t::MUL));
  auto d_pre = g.pointwise(dh, activation(g, kMaskSrc, p.n, p.c, p.h, p.w), pointwise(fe::PointwiseMode_t::RELU_BWD));
  d_pre->set_output(true).set_uid(kDpre).set_name("d_pre").set_dim({p.n, p.c, p.h, p.w}).set_stride(
      {int64_t(pitch) * p.h * p.w, 1, int64_t(pitch) * p.w, pitch});
  auto sum = [&](TensorPtr t, Uid uid) {
    auto r = g.reduction(t, fe::graph::Reduction_attributes().set_mode(fe::ReductionMode_t::ADD).set_compute_data_type(
                                fe::DataType_t::FLOAT));
    r->set_output(true).set_uid(uid).set_name("sum" + std::to_string(uid)).set_dim({1, p.c, 1, 1}).set_stride(
        {p.c, 1, p.c, p.c}).set_data_type(fe::DataType_t::FLOAT);
  };
  sum(dh, kSumDh);
  sum(d_pre, kSumDpre);
}

struct Stream {
  cudaStream_t s = nullptr;
  Stream() {
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) s = nullptr;
  }
  ~Stream() {
    if (s) cudaStreamSynchronize(s), cudaStreamDestroy(s);
  }
};
struct Event {
  cudaEvent_t e = nullptr;
  Event() {
    if (cudaEventCreate(&e) != cudaSuccess) e = nullptr;
  }
  ~Event() {
    if (e) cudaEventDestroy(e);
  }
};

// Device buffers with random contents for timing the plans; freed with the object.
struct Scratch {
  std::vector<void*> bufs;
  std::unordered_map<int64_t, void*> pack;
  bool ok = true;
  void add(int64_t uid, size_t elems, ValueType type, float scale, cudaStream_t stream) {
    const size_t bytes = elems * (type == ValueType::kF32 ? 4 : 2);
    void* p = nullptr;
    if (cudaMalloc(&p, bytes) != cudaSuccess) {
      ok = false;
      return;
    }
    bufs.push_back(p);
    pack[uid] = p;
    if (fill_uniform(p, elems, type, scale, uint32_t(uid), stream) != cudaSuccess) ok = false;
  }
  ~Scratch() {
    for (void* p : bufs) cudaFree(p);
  }
};

// Builds the graph, then times its first plans on random data and keeps the fastest (ties: the earlier). Returns
// false when the failure may be transient (out of memory for the scratch tensors): the caller then does not cache it.
bool prepare_locked(Entry& e, CudnnFusedOp op, const Conv2dProblem& p, ConvDType dtype, int pitch) {
  e.graph = new_graph(dtype);
  fe::graph::Graph& g = *e.graph;
  if (op == CudnnFusedOp::kConvRelu)
    build_conv_relu(g, p);
  else
    build_dgrad_mask(g, p, pitch);
  Stream stream;
  if (!stream.s) {
    e.why = "cudaStreamCreate failed";
    cudaGetLastError();
    return false;
  }
  const ValueType t = dtype == ConvDType::kF16 ? ValueType::kF16 : ValueType::kBF16;
  const size_t in = size_t(p.n) * p.h * p.w, out = size_t(p.n) * p.p() * p.q();
  Scratch s;
  s.add(kW, size_t(p.k) * p.r * p.s * p.c, t, 0.05f, stream.s);
  if (op == CudnnFusedOp::kConvRelu) {
    s.add(kX, in * p.c, t, 1.0f, stream.s);
    s.add(kB1b, 1, ValueType::kF32, 0.1f, stream.s);
    s.add(kB2a, 1, ValueType::kF32, 0.1f, stream.s);
    s.add(kH, out * p.k, t, 1.0f, stream.s);
    s.add(kH2, out * p.k, t, 1.0f, stream.s);
  } else {
    s.add(kDy, out * p.k, t, 1.0f, stream.s);
    s.add(kScale, 1, ValueType::kF32, 1.0f, stream.s);
    s.add(kMaskSrc, in * p.c, t, 1.0f, stream.s);
    s.add(kDpre, in * size_t(pitch), t, 1.0f, stream.s);
    s.add(kSumDh, p.c, ValueType::kF32, 1.0f, stream.s);
    s.add(kSumDpre, p.c, ValueType::kF32, 1.0f, stream.s);
  }
  Event e0, e1;
  if (!s.ok || !e0.e || !e1.e || cudaStreamSynchronize(stream.s) != cudaSuccess) {
    e.why = "could not allocate the scratch tensors for tuning";
    cudaGetLastError();
    return false;
  }
  {
    // The shared handle must not keep the tuning stream, which is destroyed on return (also when the frontend throws).
    struct ResetHandleStream {
      ~ResetHandleStream() { with_cudnn_handle(nullptr, [](cudnnHandle_t) { return true; }); }
    } reset;
    with_cudnn_handle(stream.s, [&](cudnnHandle_t handle) {
      auto status = g.validate();
      if (status.is_good()) status = g.build_operation_graph(handle);
      if (status.is_good()) status = g.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK});
      if (status.is_good()) status = g.check_support(handle);
      if (!status.is_good()) {
        e.why = "cuDNN: " + status.get_message();
        return false;
      }
      float best = 0.f;
      const int64_t count = g.get_execution_plan_count();
      for (int64_t i = 0, tried = 0; i < count && tried < kPlansTried; ++i) {
        if (!g.build_plan_at_index(i).is_good()) continue;
        int64_t ws = 0;
        if (!g.get_workspace_size_plan_at_index(i, ws).is_good() || ws != 0) continue;  // none needed one (probe)
        ++tried;
        bool ok = true;
        for (int r = 0; r < 2 && ok; ++r) ok = g.execute_plan_at_index(handle, s.pack, nullptr, i).is_good();
        constexpr int kRuns = 10;
        ok = ok && cudaEventRecord(e0.e, stream.s) == cudaSuccess;
        for (int r = 0; r < kRuns && ok; ++r) ok = g.execute_plan_at_index(handle, s.pack, nullptr, i).is_good();
        ok = ok && cudaEventRecord(e1.e, stream.s) == cudaSuccess && cudaEventSynchronize(e1.e) == cudaSuccess;
        float ms = 0.f;
        if (!ok || cudaEventElapsedTime(&ms, e0.e, e1.e) != cudaSuccess) {
          cudaGetLastError();
          continue;
        }
        if (e.plan < 0 || ms < best) best = ms, e.plan = i;
      }
      if (e.plan < 0) e.why = "cuDNN built no plan for it";
      return e.plan >= 0;
    });
    if (e.plan < 0 && e.why.empty()) e.why = "cuDNN is unavailable";
  }
  cudaStreamSynchronize(stream.s);
  cudaGetLastError();  // a failed plan's launch error must not surface in the caller's next CUDA call
  return true;
}

cudaError_t run(CudnnFusedOp op, const Conv2dProblem& p, ConvDType dtype, int pitch,
                std::unordered_map<int64_t, void*>& pack, cudaStream_t stream) {
  const Entry* e = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex());
    const auto it = entries().find(key_of(op, p, dtype, pitch));
    if (it == entries().end() || it->second.plan < 0) return cudaErrorNotSupported;
    e = &it->second;  // entries are never erased: the pointer stays valid
  }
  for (const auto& [uid, ptr] : pack)
    if (!ptr) return cudaErrorInvalidValue;
  const bool ok = with_cudnn_handle(stream, [&](cudnnHandle_t handle) {
    try {  // the frontend reports some failures as exceptions (a backend entry point it cannot resolve)
      return e->graph->execute_plan_at_index(handle, pack, nullptr, e->plan).is_good();
    } catch (const std::exception&) {
      return false;
    }
  });
  return ok ? cudaGetLastError() : cudaErrorNotSupported;
}

}  // namespace

bool cudnn_fused_prepare(CudnnFusedOp op, const Conv2dProblem& p, ConvDType dtype, int pitch, std::string* why) {
  if (!covered(op, p, pitch, why)) return false;
  void* lib = cudnn_library();
  if (!lib) {
    std::string reason;
    cudnn_available(&reason);
    if (why) *why = reason.empty() ? "cuDNN is unavailable" : reason;
    return false;
  }
  std::lock_guard<std::mutex> lock(mutex());
  fe::cudnn_dlhandle = lib;
  auto [it, inserted] = entries().try_emplace(key_of(op, p, dtype, pitch));
  if (inserted) {
    Entry& e = it->second;
    bool keep = true;
    try {
      keep = prepare_locked(e, op, p, dtype, pitch);
    } catch (const std::exception& ex) {  // the frontend throws for some failures (a library it cannot load)
      e.plan = -1;
      e.why = std::string("cuDNN frontend: ") + ex.what();
      cudaGetLastError();
    }
    if (!keep) {  // transient (out of memory): not remembered, the next call tries again
      const std::string reason = e.why;
      entries().erase(it);
      if (why) *why = reason;
      return false;
    }
  }
  if (why) *why = it->second.why;
  return it->second.plan >= 0;
}

cudaError_t cudnn_fused_conv_relu(const Conv2dProblem& p, ConvDType dtype, const void* x, const void* w,
                                  const float* b1b, const float* b2a, void* h, void* h2, cudaStream_t stream) {
  std::unordered_map<int64_t, void*> pack{{kX, const_cast<void*>(x)},       {kW, const_cast<void*>(w)},
                                          {kB1b, const_cast<float*>(b1b)}, {kB2a, const_cast<float*>(b2a)},
                                          {kH, h},                          {kH2, h2}};
  return run(CudnnFusedOp::kConvRelu, p, dtype, 0, pack, stream);
}

cudaError_t cudnn_fused_dgrad_mask(const Conv2dProblem& p, ConvDType dtype, const void* dy, const void* w,
                                   const float* scale, const void* h, void* d_pre, int pitch, float* sums,
                                   cudaStream_t stream) {
  if (pitch == 0) pitch = p.c;
  std::unordered_map<int64_t, void*> pack{{kDy, const_cast<void*>(dy)},      {kW, const_cast<void*>(w)},
                                          {kScale, const_cast<float*>(scale)}, {kMaskSrc, const_cast<void*>(h)},
                                          {kDpre, d_pre},                        {kSumDh, sums},
                                          {kSumDpre, sums ? sums + p.c : nullptr}};
  return run(CudnnFusedOp::kDgradMask, p, dtype, pitch, pack, stream);
}

#else  // built without cuDNN's graph API headers

bool cudnn_fused_prepare(CudnnFusedOp op, const Conv2dProblem& p, ConvDType, int pitch, std::string* why) {
  if (!covered(op, p, pitch, why)) return false;
  if (why) *why = "kfuse was built without cuDNN's graph API (cudnn_frontend.h)";
  return false;
}
cudaError_t cudnn_fused_conv_relu(const Conv2dProblem&, ConvDType, const void*, const void*, const float*,
                                  const float*, void*, void*, cudaStream_t) {
  return cudaErrorNotSupported;
}
cudaError_t cudnn_fused_dgrad_mask(const Conv2dProblem&, ConvDType, const void*, const void*, const float*,
                                   const void*, void*, int, float*, cudaStream_t) {
  return cudaErrorNotSupported;
}

#endif

}  // namespace kfuse::kernels
