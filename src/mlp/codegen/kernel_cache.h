// The disk cache of compiled kernels: one file per (source, architecture, NVRTC version, options), so that a later
// process loads an MLP's kernels without compiling. Same conventions as the tuning cache (kfuse/tuning_cache.h):
// the folder is `kernels/` beside tuning.json ($KFUSE_CACHE_DIR, else $XDG_CACHE_HOME/kfuse, else ~/.cache/kfuse);
// files are written to a temporary name and renamed into place (atomic: readers never see a torn file); a corrupt
// or foreign file is ignored with a warning and rewritten by the next store.
//
// File: "kfuse-kernel-cache 1\n", the key's text, the payload's size and FNV-1a checksum (one line each), then the
// payload bytes. The key text is compared in full, so a hash collision of file names cannot load a wrong binary.
#pragma once

#include <functional>
#include <optional>
#include <string>

namespace kfuse::codegen {

struct KernelCacheKey {
  std::string source_hash;  // fnv1a64_hex of the generated source
  std::string arch;         // "sm_90", "compute_80"
  std::string nvrtc;        // NVRTC version, "13.0"
  std::string options;      // NVRTC options
  std::string str() const;  // one line
  std::string file_name() const;  // "<hash of str()>.<arch>.bin"
};

std::string fnv1a64_hex(const std::string& data);

class KernelCache {
 public:
  using Warn = std::function<void(const std::string&)>;
  // Empty dir = default_dir(). Warnings go to `warn`, stderr by default.
  explicit KernelCache(std::string dir = "", Warn warn = nullptr);
  static std::string default_dir();
  const std::string& dir() const { return dir_; }
  std::string path_for(const KernelCacheKey& key) const;

  // The cached binary, or nothing (absent; or corrupt / foreign / other key: warned and ignored).
  std::optional<std::string> load(const KernelCacheKey& key) const;
  // Writes atomically. Throws kfuse::Error when the folder cannot be created or written.
  void store(const KernelCacheKey& key, const std::string& binary) const;

 private:
  std::string dir_;
  Warn warn_;
};

}  // namespace kfuse::codegen
