// The autotuner's memory: which kernel variant won for a given (device, op, shape, dtype, layout, candidate set),
// kept in a JSON file across processes, as cuDNN's benchmark mode does within one process.
//
// File: $KFUSE_CACHE_DIR/tuning.json, else $XDG_CACHE_HOME/kfuse/tuning.json, else ~/.cache/kfuse/tuning.json.
// A corrupt or foreign file is ignored with a warning and rewritten; writers take an exclusive lock, merge with
// what is on disk and replace the file by an atomic rename, so concurrent processes never leave a torn file and
// never drop each other's entries.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace kfuse {

// Everything a tuning result depends on. Two keys are equal when every field is.
struct TuningKey {
  std::string device;      // e.g. "NVIDIA H100 80GB HBM3"
  int sm_count = 0;
  int cuda_runtime = 0;    // e.g. 13000
  int driver = 0;
  std::string op;          // e.g. "conv2d_fprop_fixup"
  std::string shape;       // e.g. "n128_h16_w16_c64_k64_r3_s3_p1_u1"
  std::string dtype;       // e.g. "f16"
  std::string layout;      // e.g. "nhwc"
  std::string candidates;  // checksum of the candidate set (see candidate_set_checksum)

  std::string str() const;  // canonical text form, the file's key
};

// A stable checksum (FNV-1a, hex) of the candidates' names in order: adding, removing or renaming a candidate
// invalidates every choice made among the old set.
std::string candidate_set_checksum(const std::vector<std::string>& names);

struct TuningChoice {
  std::string candidate;  // the winner's name
  double median_ms = 0;
  double spread_ms = 0;   // max - min of the winner's timings
  double default_ms = 0;  // the heuristic default's median, for reports
};

class TuningCache {
 public:
  using Warn = std::function<void(const std::string&)>;

  // Opens (does not create) the cache file at `path`; empty path = default_path(). Warnings (corrupt or foreign
  // file) go to `warn`, stderr by default.
  explicit TuningCache(std::string path = "", Warn warn = nullptr);

  static std::string default_path();
  const std::string& path() const { return path_; }

  std::optional<TuningChoice> get(const TuningKey& key) const;
  // Records a choice in memory; save() writes it.
  void put(const TuningKey& key, const TuningChoice& choice);
  // Merges this cache's entries into the file under an exclusive lock and replaces the file atomically. Entries of
  // other processes already on disk are kept (this process's entries win for equal keys). Throws kfuse::Error when
  // the folder cannot be created or written.
  void save();
  // Re-reads the file (entries put() since the last save() stay).
  void reload();
  size_t size() const { return entries_.size(); }

 private:
  std::map<std::string, TuningChoice> read_file(bool warn) const;
  std::string path_;
  Warn warn_;
  std::map<std::string, TuningChoice> entries_;
  std::map<std::string, TuningChoice> dirty_;
};

}  // namespace kfuse
