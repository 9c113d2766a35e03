// The fused MLP's kernel variants through the generic tuner (kfuse/tuner.h): the inference forward ("mlp_forward")
// and the training step ("mlp_train": training forward + backward of one variant) are two ops, each timed over the
// candidate variants (mlp_candidate_variants) on random weights and inputs of the tuned batch, checked against the
// heuristic default's output, cached per device / spec / batch. They are chosen separately: the packed weights and
// the buffers between them are laid out the same for every variant, so inference can take the forward's best
// tiling (e.g. a wgmma forward) while training takes the variant whose stash-writing forward and backward are
// fastest together (e.g. fused weight gradients, which need more warps; recomputed activations, whose forward
// leaves part of the stash unwritten: a training candidate always pairs its own forward_train with its backward).
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>

#include <cuda_runtime.h>

#include "kfuse/error.h"
#include "kfuse/mlp.h"
#include "runtime/cuda_check.h"
#include "runtime/device_guard.h"
#include "runtime/op_tuning.h"

namespace kfuse {
namespace {

kernels::ConvDType storage(MlpDType d) {
  return d == MlpDType::kFloat16 ? kernels::ConvDType::kF16 : kernels::ConvDType::kBF16;
}

// Device memory freed with the object.
struct Buffer {
  void* p = nullptr;
  explicit Buffer(size_t bytes) { check_cuda(cudaMalloc(&p, std::max<size_t>(bytes, 16)), "cudaMalloc (MLP tuning)"); }
  ~Buffer() { cudaFree(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

// The inference forward ignores fused_wgrad, recompute and wgmma_backward (they change only the backward and the training forward's
// stash): candidates that differ only there are one forward candidate.
MlpVariant forward_tiling(MlpVariant v) {
  v.fused_wgrad = false;
  v.recompute = 0;
  v.wgmma_backward = false;
  return v;
}
std::vector<MlpVariant> forward_candidates(const std::vector<MlpVariant>& all) {
  std::vector<MlpVariant> out;
  for (const MlpVariant& v : all)
    if (std::find(out.begin(), out.end(), forward_tiling(v)) == out.end()) out.push_back(forward_tiling(v));
  return out;
}

}  // namespace

MlpTuning tune_mlp(const MlpSpec& spec, int device, int64_t batch, TuningMode mode, const TunerOptions& options) {
  spec.validate();
  KFUSE_CHECK(batch >= 1 && batch < (int64_t(1) << 31), InvalidArgument, "MLP tuning batch must be in [1, 2^31), got ",
              batch);
  DeviceGuard guard(device);
  int optin = 0;
  check_cuda(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
             "cudaDeviceGetAttribute(shared memory)");
  int cc_major = 0, cc_minor = 0;
  check_cuda(cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, device),
             "cudaDeviceGetAttribute(compute capability)");
  check_cuda(cudaDeviceGetAttribute(&cc_minor, cudaDevAttrComputeCapabilityMinor, device),
             "cudaDeviceGetAttribute(compute capability)");
  const std::vector<MlpVariant> all =
      mlp_candidate_variants(spec, size_t(optin), mlp_wgmma_supported(cc_major, cc_minor));
  KFUSE_CHECK(!all.empty(), InvalidArgument, "no kernel variant can run ", spec.to_string());
  const std::vector<MlpVariant> fwd = forward_candidates(all);
  const kernels::ConvDType dt = storage(spec.dtype);
  const std::string shape = spec.to_string() + " batch " + std::to_string(batch);
  auto names_of = [](const std::vector<MlpVariant>& v) {
    std::vector<std::string> n;
    for (const MlpVariant& x : v) n.push_back(x.name());
    return n;
  };
  const std::vector<std::string> fwd_names = names_of(fwd), bwd_names = names_of(all);
  TuningKey fwd_key = device_tuning_key("mlp_forward", shape, dt, fwd_names);
  TuningKey bwd_key = device_tuning_key("mlp_train", shape, dt, bwd_names);
  fwd_key.layout = bwd_key.layout = "row_major";

  // Engines and random data, built on first need (cached choices need neither). A forward candidate runs on the
  // engine of the first variant with its tiling (fwd_engine_index); a backward candidate on its own.
  std::vector<std::unique_ptr<FusedMlp>> engines(all.size());
  auto engine_at = [&](size_t i) -> FusedMlp& {
    if (!engines[i]) engines[i] = std::make_unique<FusedMlp>(spec, device, all[i]);
    return *engines[i];
  };
  std::vector<size_t> fwd_engine_index;
  for (const MlpVariant& f : fwd) {
    for (size_t i = 0; i < all.size(); ++i) {
      if (forward_tiling(all[i]) == f) {
        fwd_engine_index.push_back(i);
        break;
      }
    }
  }
  struct Data {
    std::unique_ptr<Buffer> packed, x, y, dy, stash, grads, ws;
    std::vector<std::unique_ptr<Buffer>> layers;  // PyTorch-layout weights and biases, packed from
  };
  std::unique_ptr<Data> data;
  FusedMlp::Stream stream = nullptr;
  auto prepare = [&]() -> Data& {
    if (data) return *data;
    data = std::make_unique<Data>();
    FusedMlp& e0 = engine_at(0);
    std::vector<const void*> w, b;
    for (int l = 0; l < spec.num_layers(); ++l) {
      const size_t wn = size_t(spec.layer_out(l)) * spec.layer_in(l), bn = size_t(spec.layer_out(l));
      data->layers.push_back(std::make_unique<Buffer>(2 * wn));
      upload_random(data->layers.back()->p, wn, 1.0f / std::sqrt(float(spec.layer_in(l))), dt, 100u + l);
      w.push_back(data->layers.back()->p);
      if (spec.has_bias(l)) {
        data->layers.push_back(std::make_unique<Buffer>(2 * bn));
        upload_random(data->layers.back()->p, bn, 0.5f, dt, 200u + l);
        b.push_back(data->layers.back()->p);
      } else {
        b.push_back(nullptr);
      }
    }
    data->packed = std::make_unique<Buffer>(e0.packed_weights_bytes());
    e0.pack_weights(w, b, data->packed->p, stream);
    data->x = std::make_unique<Buffer>(2 * size_t(batch) * spec.input_width);
    data->y = std::make_unique<Buffer>(2 * size_t(batch) * spec.output_width);
    data->dy = std::make_unique<Buffer>(2 * size_t(batch) * spec.output_width);
    upload_random(data->x->p, size_t(batch) * spec.input_width, 1.0f, dt, 300u);
    upload_random(data->dy->p, size_t(batch) * spec.output_width, 1.0f, dt, 400u);
    data->stash = std::make_unique<Buffer>(e0.stash_bytes(batch));
    data->grads = std::make_unique<Buffer>(4 * size_t(spec.num_parameters()));
    size_t ws = 0;
    for (size_t i = 0; i < all.size(); ++i) ws = std::max(ws, engine_at(i).backward_workspace_bytes(batch));
    data->ws = std::make_unique<Buffer>(ws);
    // The stash and y every backward candidate reads: the default's training forward.
    e0.forward_train(data->packed->p, data->x->p, data->y->p, data->stash->p, batch, stream);
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize (MLP tuning)");
    return *data;
  };

  TuningCache cache;  // the user's tuning cache (KFUSE_CACHE_DIR moves it), as the encoder's
  MlpTuning out;
  const double tol = spec.dtype == MlpDType::kFloat16 ? 5e-3 : 2e-2;
  {
    auto make_timer = [&] {
      Data& d = prepare();
      // A separate output, so that the forward candidates never overwrite the y the backward reads.
      auto y = std::make_shared<Buffer>(2 * size_t(batch) * spec.output_width);
      auto launch = [&, y](size_t i, cudaStream_t s) {
        engine_at(fwd_engine_index[i]).forward(d.packed->p, d.x->p, y->p, batch, reinterpret_cast<FusedMlp::Stream>(s));
      };
      const size_t elems = size_t(batch) * spec.output_width;
      auto output = [y, elems, dt](size_t) { return CandidateTimer::Output{y->p, elems, value_type(dt)}; };
      auto poison = [y, elems](size_t, cudaStream_t s) {
        check_cuda(cudaMemsetAsync(y->p, 0xff, 2 * elems, s), "cudaMemset (MLP tuning)");
      };
      return std::make_unique<CandidateTimer>(launch, poison, output, tol);
    };
    OpTuningReport row;
    const TuningResult r = tune_op(cache, fwd_key, fwd_names, make_timer, mode, options, row);
    out.forward = fwd[r.chosen];
    out.rows.push_back(row);
  }
  {
    auto make_timer = [&] {
      Data& d = prepare();
      // A training step's kernels: the candidate's training forward (its stash) and its backward.
      auto launch = [&](size_t i, cudaStream_t s) {
        engine_at(i).forward_train(d.packed->p, d.x->p, d.y->p, d.stash->p, batch,
                                   reinterpret_cast<FusedMlp::Stream>(s));
        engine_at(i).backward(d.packed->p, d.x->p, d.y->p, d.dy->p, d.stash->p, d.ws->p,
                                static_cast<float*>(d.grads->p), nullptr, batch,
                                reinterpret_cast<FusedMlp::Stream>(s));
      };
      const size_t n = size_t(spec.num_parameters());
      void* g = d.grads->p;
      // The stash is poisoned too: a candidate's backward must read only what its own forward_train wrote (one
      // with recomputed activations leaves their arrays unwritten), and a stale read would see the last one's.
      auto poison_grads = poison_fn(g, 4 * n);
      void* const stash = d.stash->p;
      const size_t stash_bytes = engine_at(0).stash_bytes(batch);
      auto poison = [poison_grads, stash, stash_bytes](size_t i, cudaStream_t s) {
        poison_grads(i, s);
        check_cuda(cudaMemsetAsync(stash, 0xff, stash_bytes, s), "cudaMemset (MLP tuning stash)");
      };
      return std::make_unique<CandidateTimer>(launch, poison,
                                              [g, n](size_t) {
                                                return CandidateTimer::Output{g, n, kernels::ValueType::kF32};
                                              },
                                              tol);
    };
    OpTuningReport row;
    const TuningResult r = tune_op(cache, bwd_key, bwd_names, make_timer, mode, options, row);
    out.backward = all[r.chosen];
    out.rows.push_back(row);
  }
  return out;
}

}  // namespace kfuse
