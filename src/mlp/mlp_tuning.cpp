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
#include "core/dev_overrides.h"
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

// The options that differ from the defaults, as " packed_relu=0 mma_bias=0" (empty for the defaults).
std::string options_suffix(const MlpOptions& o) {
  std::string s;
  if (!o.packed_relu) s += " packed_relu=0";
  if (!o.staged_stores) s += " staged_stores=0";
  if (!o.mma_bias) s += " mma_bias=0";
  return s;
}

std::vector<std::string> names_of(const std::vector<MlpVariant>& v) {
  std::vector<std::string> n;
  for (const MlpVariant& x : v) n.push_back(x.name());
  return n;
}

// The variants this device can run: every candidate (training) and the distinct forward tilings (inference).
std::vector<MlpVariant> device_candidates(const MlpSpec& spec, int device, const MlpOptions& options) {
  int optin = 0, cc_major = 0, cc_minor = 0;
  check_cuda(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
             "cudaDeviceGetAttribute(shared memory)");
  check_cuda(cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, device),
             "cudaDeviceGetAttribute(compute capability)");
  check_cuda(cudaDeviceGetAttribute(&cc_minor, cudaDevAttrComputeCapabilityMinor, device),
             "cudaDeviceGetAttribute(compute capability)");
  std::vector<MlpVariant> all =
      mlp_candidate_variants(spec, size_t(optin), mlp_wgmma_supported(cc_major, cc_minor), options);
  KFUSE_CHECK(!all.empty(), InvalidArgument, "no kernel variant can run ", spec.to_string());
  return all;
}

// One tuning of a spec at a batch: the candidates' engines and the random data they run on, both built on first
// need (cached choices need neither). A forward candidate runs on the engine of the first variant with its tiling
// (fwd_engine_index); a training candidate on its own.
class MlpTuningSession {
 public:
  MlpTuningSession(const MlpSpec& spec, int device, int64_t batch, const MlpOptions& options)
      : spec_(spec), device_(device), batch_(batch), dt_(storage(spec.dtype)), options_(options),
        all_(device_candidates(spec, device, options)), fwd_(forward_candidates(all_)), engines_(all_.size()) {
    for (const MlpVariant& f : fwd_)
      for (size_t i = 0; i < all_.size(); ++i)
        if (forward_tiling(all_[i]) == f) {
          fwd_engine_index_.push_back(i);
          break;
        }
  }

  const std::vector<MlpVariant>& all() const { return all_; }
  const std::vector<MlpVariant>& forward() const { return fwd_; }
  double tolerance() const { return spec_.dtype == MlpDType::kFloat16 ? 5e-3 : 2e-2; }

  // The inference forward of candidate i (a forward tiling), into an output of its own: the forward candidates
  // never overwrite the y the training candidates read.
  std::unique_ptr<CandidateTimer> forward_timer() {
    Data& d = prepare();
    auto y = std::make_shared<Buffer>(2 * size_t(batch_) * spec_.output_width);
    auto launch = [this, &d, y](size_t i, cudaStream_t s) {
      engine_at(fwd_engine_index_[i]).forward(d.packed->p, d.x->p, y->p, batch_, as_stream(s));
    };
    const size_t elems = size_t(batch_) * spec_.output_width;
    const kernels::ConvDType dt = dt_;
    auto output = [y, elems, dt](size_t) { return CandidateTimer::Output{y->p, elems, value_type(dt)}; };
    auto poison = [y, elems](size_t, cudaStream_t s) {
      check_cuda(cudaMemsetAsync(y->p, 0xff, 2 * elems, s), "cudaMemset (MLP tuning)");
    };
    return std::make_unique<CandidateTimer>(launch, poison, output, tolerance());
  }

  // A training step of candidate i: its training forward (its stash) and its backward.
  std::unique_ptr<CandidateTimer> train_timer() {
    Data& d = prepare();
    auto launch = [this, &d](size_t i, cudaStream_t s) {
      engine_at(i).forward_train(d.packed->p, d.x->p, d.y->p, d.stash->p, batch_, as_stream(s));
      engine_at(i).backward(d.packed->p, d.x->p, d.y->p, d.dy->p, d.stash->p, d.ws->p, static_cast<float*>(d.grads->p),
                            nullptr, batch_, as_stream(s));
    };
    const size_t n = size_t(spec_.num_parameters());
    void* g = d.grads->p;
    // The stash is poisoned too: a candidate's backward must read only what its own forward_train wrote (one with
    // recomputed activations leaves their arrays unwritten), and a stale read would see the last one's.
    auto poison_grads = poison_fn(g, 4 * n);
    void* const stash = d.stash->p;
    const size_t stash_bytes = engine_at(0).stash_bytes(batch_);
    auto poison = [poison_grads, stash, stash_bytes](size_t i, cudaStream_t s) {
      poison_grads(i, s);
      check_cuda(cudaMemsetAsync(stash, 0xff, stash_bytes, s), "cudaMemset (MLP tuning stash)");
    };
    auto output = [g, n](size_t) { return CandidateTimer::Output{g, n, kernels::ValueType::kF32}; };
    return std::make_unique<CandidateTimer>(launch, poison, output, tolerance());
  }

 private:
  struct Data {
    std::unique_ptr<Buffer> packed, x, y, dy, stash, grads, ws;
    std::vector<std::unique_ptr<Buffer>> layers;  // PyTorch-layout weights and biases, packed from
  };

  static FusedMlp::Stream as_stream(cudaStream_t s) { return reinterpret_cast<FusedMlp::Stream>(s); }

  FusedMlp& engine_at(size_t i) {
    if (!engines_[i]) engines_[i] = std::make_unique<FusedMlp>(spec_, device_, all_[i], options_);
    return *engines_[i];
  }

  // Random weights in PyTorch's layouts, packed by the first engine (every variant packs them alike).
  void upload_weights(Data& d) {
    std::vector<const void*> w, b;
    for (int l = 0; l < spec_.num_layers(); ++l) {
      const size_t wn = size_t(spec_.layer_out(l)) * spec_.layer_in(l), bn = size_t(spec_.layer_out(l));
      d.layers.push_back(std::make_unique<Buffer>(2 * wn));
      upload_random(d.layers.back()->p, wn, 1.0f / std::sqrt(float(spec_.layer_in(l))), dt_, 100u + l);
      w.push_back(d.layers.back()->p);
      b.push_back(nullptr);
      if (spec_.has_bias(l)) {
        d.layers.push_back(std::make_unique<Buffer>(2 * bn));
        upload_random(d.layers.back()->p, bn, 0.5f, dt_, 200u + l);
        b.back() = d.layers.back()->p;
      }
    }
    d.packed = std::make_unique<Buffer>(engine_at(0).packed_weights_bytes());
    engine_at(0).pack_weights(w, b, d.packed->p, nullptr);
  }

  Data& prepare() {
    if (data_) return *data_;
    data_ = std::make_unique<Data>();
    Data& d = *data_;
    upload_weights(d);
    const size_t in = size_t(batch_) * spec_.input_width, out = size_t(batch_) * spec_.output_width;
    d.x = std::make_unique<Buffer>(2 * in);
    d.y = std::make_unique<Buffer>(2 * out);
    d.dy = std::make_unique<Buffer>(2 * out);
    upload_random(d.x->p, in, 1.0f, dt_, 300u);
    upload_random(d.dy->p, out, 1.0f, dt_, 400u);
    d.stash = std::make_unique<Buffer>(engine_at(0).stash_bytes(batch_));
    d.grads = std::make_unique<Buffer>(4 * size_t(spec_.num_parameters()));
    size_t ws = 0;
    for (size_t i = 0; i < all_.size(); ++i) ws = std::max(ws, engine_at(i).backward_workspace_bytes(batch_));
    d.ws = std::make_unique<Buffer>(ws);
    // The stash and y every training candidate's backward reads before its own forward: the default's.
    engine_at(0).forward_train(d.packed->p, d.x->p, d.y->p, d.stash->p, batch_, nullptr);
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize (MLP tuning)");
    return d;
  }

  const MlpSpec& spec_;
  const int device_;
  const int64_t batch_;
  const kernels::ConvDType dt_;
  const MlpOptions options_;
  const std::vector<MlpVariant> all_, fwd_;
  std::vector<size_t> fwd_engine_index_;
  std::vector<std::unique_ptr<FusedMlp>> engines_;
  std::unique_ptr<Data> data_;
};

}  // namespace

MlpTuning tune_mlp(const MlpSpec& spec, int device, int64_t batch, TuningMode mode, const TunerOptions& options,
                   const MlpOptions& mlp_options) {
  spec.validate();
  KFUSE_CHECK(batch >= 1 && batch < (int64_t(1) << 31), InvalidArgument, "MLP tuning batch must be in [1, 2^31), got ",
              batch);
  DeviceGuard guard(device);
  const MlpOptions effective = with_dev_overrides(mlp_options);
  MlpTuningSession session(spec, device, batch, effective);
  // Other options time other kernels: their choice is cached apart, and the defaults' key stays what it was.
  const std::string shape = spec.to_string() + " batch " + std::to_string(batch) + options_suffix(effective);
  const kernels::ConvDType dt = storage(spec.dtype);
  const std::vector<std::string> fwd_names = names_of(session.forward()), train_names = names_of(session.all());
  TuningKey fwd_key = device_tuning_key("mlp_forward", shape, dt, fwd_names);
  TuningKey train_key = device_tuning_key("mlp_train", shape, dt, train_names);
  fwd_key.layout = train_key.layout = "row_major";

  TuningCache cache;  // the user's tuning cache (KFUSE_CACHE_DIR moves it), as the encoder's
  MlpTuning out;
  out.rows.resize(2);
  const TuningResult f =
      tune_op(cache, fwd_key, fwd_names, [&] { return session.forward_timer(); }, mode, options, out.rows[0]);
  out.forward = session.forward()[f.chosen];
  const TuningResult t =
      tune_op(cache, train_key, train_names, [&] { return session.train_timer(); }, mode, options, out.rows[1]);
  out.backward = session.all()[t.chosen];
  return out;
}

}  // namespace kfuse
