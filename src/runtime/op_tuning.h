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
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "kernels/conv/conv_fixup.h"  // ConvDType
#include "kfuse/tuner.h"

namespace kfuse {

// The key of `op` on the current device: device name, SM count, CUDA runtime and driver, shape, dtype, NHWC / KRSC
// layout and the checksum of the candidate names.
TuningKey device_tuning_key(const std::string& op, const std::string& shape, kernels::ConvDType dtype,
                            const std::vector<std::string>& names);
// The report row of a tuning (or of the cached choice it found).
OpTuningReport tuning_report(const TuningKey& key, const std::vector<std::string>& names, const TuningResult& r,
                             const TuningCache& cache);
// `elems` uniform random values in [-scale, scale] of `dtype` (fp16 / bf16) at `dst` (synchronous).
void upload_random(void* dst, size_t elems, float scale, kernels::ConvDType dtype, uint32_t seed);

class CandidateTimer {
 public:
  using Launch = std::function<void(size_t candidate, cudaStream_t stream)>;
  // Fills the candidate's output with NaN (asynchronously, on `stream`).
  using Poison = std::function<void(size_t candidate, cudaStream_t stream)>;
  // The candidate's output as floats (waits for `stream`).
  using Read = std::function<std::vector<double>(size_t candidate, cudaStream_t stream)>;

  CandidateTimer(Launch launch, Poison poison, Read read, double rel_tol);
  ~CandidateTimer();
  CandidateTimer(const CandidateTimer&) = delete;
  CandidateTimer& operator=(const CandidateTimer&) = delete;

  double measure(size_t candidate);
  bool check(size_t candidate);

 private:
  Launch launch_;
  Poison poison_;
  Read read_;
  double rel_tol_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  std::vector<double> ref_;
  int reps_ = 1;
};

// Tunes one op whose candidate 0 is the reference: the cached choice for `key`, or a tuning whose timer
// `make_timer` builds on first need (cached choices need no buffers); `row` receives the report.
TuningResult tune_op(TuningCache& cache, const TuningKey& key, const std::vector<std::string>& names,
                     const std::function<std::unique_ptr<CandidateTimer>()>& make_timer, TuningMode mode,
                     const TunerOptions& options, OpTuningReport& row);

// Poison / Read functions for CandidateTimer: `bytes` of 0xff (NaN in fp16, bf16 and fp32) at `out`; `elems`
// values of T (fp16 / bf16) or of fp32 at `out` read back.
CandidateTimer::Poison poison_fn(void* out, size_t bytes);
CandidateTimer::Read read_t_fn(const void* out, size_t elems, kernels::ConvDType dtype);
CandidateTimer::Read read_f32_fn(const void* out, size_t elems);

}  // namespace kfuse
