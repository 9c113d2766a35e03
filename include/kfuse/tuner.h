// The autotuner any op can use: per shape, time every candidate kernel variant (interleaved, median of several
// runs), reject the ones whose output disagrees with the reference candidate, choose the fastest, and remember the
// choice in the TuningCache so that later processes start with zero tuning time.
//
// The op supplies the measurement (e.g. CUDA events around one launch, on rotating inputs) and the check; the tuner
// owns the protocol, so every op is tuned the same way.
#pragma once

#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "kfuse/tuning_cache.h"

namespace kfuse {

enum class TuningMode {
  kOff,         // never time: the op's heuristic default (cached choices are not consulted either)
  kOnFirstUse,  // use the cached choice; tune and cache when there is none (default)
  kRetune,      // tune again and overwrite the cached choice
};
// KFUSE_TUNE=off|on|retune (default on).
TuningMode tuning_mode_from_env();

struct TunerOptions {
  int warmup = 2;    // untimed runs of every candidate first
  int repeats = 15;  // timed runs of every candidate, interleaved round-robin with a rotating start
};

struct CandidateReport {
  std::string name;
  double median_ms = 0, min_ms = 0, max_ms = 0;
  bool rejected = false;  // its output disagreed with the reference candidate's
};

// One op's line in a tuning table (`kfuse tune`, model.tune()): what the heuristic would run, what the tuner chose.
// Times are medians in ms (NaN where unknown, e.g. cudnn_ms where cuDNN has no equivalent).
struct OpTuningReport {
  std::string op, shape, dtype;
  std::string default_choice, choice;
  double default_ms = std::numeric_limits<double>::quiet_NaN();
  double tuned_ms = std::numeric_limits<double>::quiet_NaN();
  double spread_ms = std::numeric_limits<double>::quiet_NaN();
  double cudnn_ms = std::numeric_limits<double>::quiet_NaN();
  bool from_cache = false;
  std::vector<CandidateReport> candidates;  // empty when the choice came from the cache
};

struct TuningResult {
  size_t chosen = 0;
  bool from_cache = false;
  std::vector<CandidateReport> candidates;  // empty when the choice came from the cache or mode is off
};

// Times and checks `names.size()` candidates. measure(i) runs candidate i once and returns its time in ms; check(i)
// says whether candidate i's latest output agrees with the reference (candidate `default_index` is the reference
// and is never rejected). Returns the fastest accepted candidate by median.
TuningResult select_candidate(const std::vector<std::string>& names, const std::function<double(size_t)>& measure,
                              const std::function<bool(size_t)>& check, size_t default_index,
                              const TunerOptions& options = {});

// The cached choice for `key` (whose candidates field must be candidate_set_checksum(names)), or a fresh tuning
// stored in `cache` (and saved) according to `mode`.
TuningResult tune(TuningCache& cache, const TuningKey& key, const std::vector<std::string>& names,
                  const std::function<double(size_t)>& measure, const std::function<bool(size_t)>& check,
                  size_t default_index, TuningMode mode, const TunerOptions& options = {});

}  // namespace kfuse
