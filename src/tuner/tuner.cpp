#include "kfuse/tuner.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "kfuse/error.h"

namespace kfuse {

TuningMode tuning_mode_from_env() {
  const char* v = std::getenv("KFUSE_TUNE");
  if (!v || !*v || !std::strcmp(v, "on") || !std::strcmp(v, "1")) return TuningMode::kOnFirstUse;
  if (!std::strcmp(v, "off") || !std::strcmp(v, "0")) return TuningMode::kOff;
  if (!std::strcmp(v, "retune")) return TuningMode::kRetune;
  throw InvalidArgument(std::string("KFUSE_TUNE must be off, on or retune, got '") + v + "'");
}

TuningResult select_candidate(const std::vector<std::string>& names, const std::function<double(size_t)>& measure,
                              const std::function<bool(size_t)>& check, size_t default_index,
                              const TunerOptions& options) {
  const size_t n = names.size();
  KFUSE_CHECK(n > 0 && default_index < n, InvalidArgument, "select_candidate: ", n, " candidates, default index ",
              default_index);
  KFUSE_CHECK(options.repeats >= 1 && options.warmup >= 0, InvalidArgument, "select_candidate: repeats must be >= 1");
  TuningResult r;
  r.candidates.resize(n);
  for (size_t i = 0; i < n; ++i) r.candidates[i].name = names[i];

  // The reference runs first so that every other candidate's output can be compared with it.
  measure(default_index);
  for (size_t i = 0; i < n; ++i) {
    if (i == default_index) continue;
    measure(i);
    r.candidates[i].rejected = !check(i);
  }
  for (int w = 1; w < options.warmup; ++w)
    for (size_t i = 0; i < n; ++i)
      if (!r.candidates[i].rejected) measure(i);

  // Interleaved rounds with a rotating start: clock and thermal drift, and cache state left by the previous
  // candidate, spread evenly over all candidates instead of favouring whoever runs first.
  std::vector<std::vector<double>> t(n);
  for (int round = 0; round < options.repeats; ++round)
    for (size_t k = 0; k < n; ++k) {
      const size_t i = (k + static_cast<size_t>(round)) % n;
      if (!r.candidates[i].rejected) t[i].push_back(measure(i));
    }
  double best = 0;
  bool have = false;
  for (size_t i = 0; i < n; ++i) {
    if (r.candidates[i].rejected) continue;
    std::vector<double>& v = t[i];
    std::sort(v.begin(), v.end());
    CandidateReport& c = r.candidates[i];
    c.median_ms = v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
    c.min_ms = v.front();
    c.max_ms = v.back();
    if (!have || c.median_ms < best) {
      best = c.median_ms;
      r.chosen = i;
      have = true;
    }
  }
  return r;
}

TuningResult tune(TuningCache& cache, const TuningKey& key, const std::vector<std::string>& names,
                  const std::function<double(size_t)>& measure, const std::function<bool(size_t)>& check,
                  size_t default_index, TuningMode mode, const TunerOptions& options) {
  KFUSE_CHECK(key.candidates == candidate_set_checksum(names), InvalidArgument,
              "tune: the key's candidate checksum does not match the candidate names");
  TuningResult r;
  if (mode == TuningMode::kOff) {
    r.chosen = default_index;
    return r;
  }
  if (mode == TuningMode::kOnFirstUse) {
    if (const auto c = cache.get(key)) {
      const auto it = std::find(names.begin(), names.end(), c->candidate);
      if (it != names.end()) {
        r.chosen = static_cast<size_t>(it - names.begin());
        r.from_cache = true;
        return r;
      }
    }
  }
  r = select_candidate(names, measure, check, default_index, options);
  const CandidateReport& w = r.candidates[r.chosen];
  cache.put(key, {w.name, w.median_ms, w.max_ms - w.min_ms, r.candidates[default_index].median_ms});
  try {
    cache.save();
  } catch (const Error& e) {  // an unwritable cache folder costs the persistence, not the tuning result
    std::fprintf(stderr, "kfuse: warning: tuning result not saved: %s\n", e.what());
  }
  return r;
}

}  // namespace kfuse
