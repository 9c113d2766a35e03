#include "runtime/op_tuning.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "kernels/timing/gpu_delay.h"
#include "kfuse/device.h"
#include "kfuse/error.h"
#include "runtime/cuda_check.h"

namespace kfuse {

TuningKey device_tuning_key(const std::string& op, const std::string& shape, kernels::ConvDType dtype,
                            const std::vector<std::string>& names) {
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  const DeviceInfo info = cuda_device_info(dev);
  TuningKey key;
  key.device = info.name;
  key.sm_count = info.sm_count;
  key.cuda_runtime = info.runtime_version;
  key.driver = info.driver_version;
  key.op = op;
  key.shape = shape;
  key.dtype = dtype == kernels::ConvDType::kF16 ? "f16" : "bf16";
  key.layout = "nhwc_krsc";
  key.candidates = candidate_set_checksum(names);
  return key;
}

OpTuningReport tuning_report(const TuningKey& key, const std::vector<std::string>& names, const TuningResult& r,
                             const TuningCache& cache) {
  OpTuningReport row;
  row.op = key.op;
  row.shape = key.shape;
  row.dtype = key.dtype;
  row.default_choice = names[0];
  row.choice = names[r.chosen];
  row.from_cache = r.from_cache;
  if (!r.candidates.empty()) {
    row.default_ms = r.candidates[0].median_ms;
    row.tuned_ms = r.candidates[r.chosen].median_ms;
    row.spread_ms = r.candidates[r.chosen].max_ms - r.candidates[r.chosen].min_ms;
    row.candidates = r.candidates;
    for (const CandidateReport& c : r.candidates)  // cuDNN's best where it is a candidate
      if (c.name.rfind("cudnn", 0) == 0 && !c.rejected && !(c.median_ms >= row.cudnn_ms)) row.cudnn_ms = c.median_ms;
  } else if (r.from_cache) {
    if (const auto c = cache.get(key)) {
      row.default_ms = c->default_ms;
      row.tuned_ms = c->median_ms;
      row.spread_ms = c->spread_ms;
    }
  }
  return row;
}

kernels::ValueType value_type(kernels::ConvDType dtype) {
  return dtype == kernels::ConvDType::kF16 ? kernels::ValueType::kF16 : kernels::ValueType::kBF16;
}

void upload_random(void* dst, size_t elems, float scale, kernels::ConvDType dtype, uint32_t seed) {
  check_cuda(kernels::fill_uniform(dst, elems, value_type(dtype), scale, seed, nullptr), "random fill (tuning)");
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize (tuning inputs)");
}

TuningResult tune_op(TuningCache& cache, const TuningKey& key, const std::vector<std::string>& names,
                     const std::function<std::unique_ptr<CandidateTimer>()>& make_timer, TuningMode mode,
                     const TunerOptions& options, OpTuningReport& row) {
  std::unique_ptr<CandidateTimer> timer;
  auto get = [&]() -> CandidateTimer& {
    if (!timer) timer = make_timer();
    return *timer;
  };
  const TuningResult r = kfuse::tune(
      cache, key, names, [&](size_t i) { return get().measure(i); }, [&](size_t i) { return get().check(i); }, 0,
      mode, options);
  row = tuning_report(key, names, r, cache);
  return r;
}

CandidateTimer::Poison poison_fn(void* out, size_t bytes) {
  return [out, bytes](size_t, cudaStream_t stream) {
    check_cuda(cudaMemsetAsync(out, 0xff, bytes, stream), "cudaMemset (tuning)");
  };
}

CandidateTimer::OutputOf output_t_fn(const void* out, size_t elems, kernels::ConvDType dtype) {
  const CandidateTimer::Output o{out, elems, value_type(dtype)};
  return [o](size_t) { return o; };
}

CandidateTimer::CandidateTimer(Launch launch, Poison poison, OutputOf output, double rel_tol)
    : launch_(std::move(launch)), poison_(std::move(poison)), output_(std::move(output)), rel_tol_(rel_tol) {
  check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate (tuning)");
  if (cudaEventCreate(&start_) != cudaSuccess || cudaEventCreate(&stop_) != cudaSuccess ||
      cudaMalloc(reinterpret_cast<void**>(&result_), 3 * sizeof(double)) != cudaSuccess) {
    // The destructor does not run for a constructor that throws: release what was created here.
    if (start_) cudaEventDestroy(start_);
    if (stop_) cudaEventDestroy(stop_);
    cudaStreamDestroy(stream_);
    throw Error("kfuse: cudaEventCreate / cudaMalloc failed (tuning)");
  }
}

CandidateTimer::~CandidateTimer() {
  if (start_) cudaEventDestroy(start_);
  if (stop_) cudaEventDestroy(stop_);
  if (stream_) cudaStreamDestroy(stream_);
  cudaFree(ref_);
  cudaFree(result_);
  start_ = stop_ = nullptr;
  stream_ = nullptr;
}

namespace {
// Longer than the host needs to enqueue one measurement's `reps` launches, by the host time measured so far.
uint32_t delay_us(int reps, double host_us_per_launch) {
  return uint32_t(std::min(100.0 + reps * std::max(40.0, 2.0 * host_us_per_launch), 20000.0));
}
}  // namespace

double CandidateTimer::measure(size_t i) {
  auto elapsed = [&] {
    check_cuda(cudaEventSynchronize(stop_), "cudaEventSynchronize (tuning)");
    float ms = 0;
    check_cuda(cudaEventElapsedTime(&ms, start_, stop_), "cudaEventElapsedTime (tuning)");
    return ms;
  };
  using Clock = std::chrono::steady_clock;
  // One timed run of `reps` launches behind a GPU delay. Returns false (and learns the host's cost) when the host
  // took longer to enqueue them than the delay lasted: the GPU then idled inside the timed interval.
  if (host_us_per_launch_.size() <= i) host_us_per_launch_.resize(i + 1, 0.0);
  auto timed = [&](int reps, float& ms) {
    const uint32_t delay = delay_us(reps, host_us_per_launch_[i]);
    check_cuda(kernels::launch_gpu_delay(stream_, delay), "GPU delay kernel (tuning)");
    const Clock::time_point t0 = Clock::now();
    check_cuda(cudaEventRecord(start_, stream_), "cudaEventRecord");
    for (int r = 0; r < reps; ++r) launch_(i, stream_);
    check_cuda(cudaEventRecord(stop_, stream_), "cudaEventRecord");
    const double host_us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    ms = elapsed();
    host_us_per_launch_[i] = host_us / reps;
    return host_us < 0.8 * delay;
  };
  if (!ref_ && i == 0) {
    poison_(0, stream_);
    launch_(0, stream_);
    const Output o = output_(0);
    check_cuda(cudaMalloc(reinterpret_cast<void**>(&ref_), std::max<size_t>(o.elems, 1) * sizeof(float)),
               "cudaMalloc (tuning reference)");
    ref_elems_ = o.elems;
    check_cuda(kernels::convert_to_f32(o.data, o.type, o.elems, ref_, stream_), "reference copy (tuning)");
    float ms = 0;
    for (int attempt = 0; attempt < 4 && !timed(1, ms); ++attempt) {
    }
    reps_ = std::clamp(int(std::ceil(0.1 / std::max(ms, 1e-4f))), 1, 50);
  }
  if (i != 0) poison_(i, stream_);
  // GPU time only: repeated, with a delay that has learnt the host's cost, until the host kept ahead of the GPU.
  float ms = 0;
  for (int attempt = 0; attempt < 4 && !timed(reps_, ms); ++attempt) {
  }
  return double(ms) / reps_;
}

bool CandidateTimer::check(size_t i) {
  const Output o = output_(i);
  if (!ref_ || o.elems != ref_elems_) return false;
  check_cuda(kernels::compare_with_reference(o.data, o.type, ref_, o.elems, result_, stream_), "comparison (tuning)");
  double r[3] = {0, 0, 0};
  check_cuda(cudaMemcpyAsync(r, result_, sizeof(r), cudaMemcpyDeviceToHost, stream_), "cudaMemcpy (tuning)");
  check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (tuning)");
  return r[2] == 0 && std::sqrt(r[0]) <= rel_tol_ * std::sqrt(r[1]) + 1e-30;
}

}  // namespace kfuse
