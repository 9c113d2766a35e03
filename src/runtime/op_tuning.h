// What every GPU op tuned on scratch buffers shares (forward and backward convolutions): its tuning key, its report
// row, random inputs, and the measurement half of tuning: CandidateTimer, the measure / check pair that kfuse::tune
// (kfuse/tuner.h) takes, for candidates that each enqueue their launches on a stream and write one output that can be read back as floats.
// Every op tuned on scratch buffers (forward and backward convolutions) measures the same way:
// - candidate 0 (the op's default, the reference) runs first on a poisoned output; its result is the reference;
// - one measurement is `reps` back-to-back runs between two CUDA events (reps sized on the reference to ~100 us, so
//   that the events' resolution and launch gaps do not dominate), the time per run returned; a GPU-side delay
//   precedes the first event so that the launches' host-side work (cuDNN plans on the host) is not timed: in the
//   training step the GPU is busy while the host enqueues, so only GPU time counts;
// - check(i) compares candidate i's latest output with the reference: normwise relative difference <= rel_tol, and
//   every value finite (the output is poisoned with NaN before each measurement, so an unwritten element fails).
//   The reference is kept in fp32 on the GPU and the comparison runs there (kernels/timing/candidate_data.h): the
//   training batch's outputs are tens of millions of values, too many to copy back per candidate.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "kernels/conv/conv_fixup.h"  // ConvDType
#include "kernels/timing/candidate_data.h"
#include "kfuse/tuner.h"

namespace kfuse {

// The key of `op` on the current device: device name, SM count, CUDA runtime and driver, shape, dtype, NHWC / KRSC
// layout and the checksum of the candidate names.
TuningKey device_tuning_key(const std::string& op, const std::string& shape, kernels::ConvDType dtype,
                            const std::vector<std::string>& names);
// The report row of a tuning (or of the cached choice it found).
OpTuningReport tuning_report(const TuningKey& key, const std::vector<std::string>& names, const TuningResult& r,
                             const TuningCache& cache);
// `elems` uniform random values in [-scale, scale] of `dtype` (fp16 / bf16) at `dst`, generated on the GPU
// (synchronous).
void upload_random(void* dst, size_t elems, float scale, kernels::ConvDType dtype, uint32_t seed);

class CandidateTimer {
 public:
  using Launch = std::function<void(size_t candidate, cudaStream_t stream)>;
  // Fills the candidate's output with NaN (asynchronously, on `stream`).
  using Poison = std::function<void(size_t candidate, cudaStream_t stream)>;
  // Where the candidate writes its output (device memory) and in which type.
  struct Output {
    const void* data = nullptr;
    size_t elems = 0;
    kernels::ValueType type = kernels::ValueType::kF32;
  };
  using OutputOf = std::function<Output(size_t candidate)>;

  CandidateTimer(Launch launch, Poison poison, OutputOf output, double rel_tol);
  ~CandidateTimer();
  CandidateTimer(const CandidateTimer&) = delete;
  CandidateTimer& operator=(const CandidateTimer&) = delete;

  double measure(size_t candidate);
  bool check(size_t candidate);

 private:
  Launch launch_;
  Poison poison_;
  OutputOf output_;
  double rel_tol_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  float* ref_ = nullptr;     // candidate 0's output in fp32 (device)
  size_t ref_elems_ = 0;
  double* result_ = nullptr;  // compare_with_reference's three sums (device)
  int reps_ = 1;
  // Host microseconds per launch_ call of each candidate, as last measured: the GPU delay before a measurement must
  // outlast the host's enqueueing of its launches, or the host time leaks into the GPU time (cuDNN's calls take
  // 10-200 us each on the host). The last value, not the largest: a one-off slow call (a first call's lazy
  // loading) must not stretch every later delay.
  std::vector<double> host_us_per_launch_;
};

// Tunes one op whose candidate 0 is the reference: the cached choice for `key`, or a tuning whose timer
// `make_timer` builds on first need (cached choices need no buffers); `row` receives the report.
TuningResult tune_op(TuningCache& cache, const TuningKey& key, const std::vector<std::string>& names,
                     const std::function<std::unique_ptr<CandidateTimer>()>& make_timer, TuningMode mode,
                     const TunerOptions& options, OpTuningReport& row);

// Poison / Output helpers for CandidateTimer: `bytes` of 0xff (NaN in fp16, bf16 and fp32) at `out`; the same
// output of `elems` values of T (fp16 / bf16) for every candidate.
CandidateTimer::Poison poison_fn(void* out, size_t bytes);
CandidateTimer::OutputOf output_t_fn(const void* out, size_t elems, kernels::ConvDType dtype);
kernels::ValueType value_type(kernels::ConvDType dtype);

}  // namespace kfuse
