#include "kfuse/tuning_cache.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kfuse/error.h"

namespace kfuse {
namespace {

namespace fs = std::filesystem;
constexpr const char* kFormat = "kfuse-tuning-cache";
constexpr int kVersion = 1;

// Holds an exclusive flock on `<cache>.lock` for the scope.
class FileLock {
 public:
  explicit FileLock(const std::string& path) {
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    KFUSE_CHECK(fd_ >= 0, Error, "cannot open lock file '", path, "': ", std::strerror(errno));
    while (::flock(fd_, LOCK_EX) != 0) {
      if (errno != EINTR) {
        ::close(fd_);
        throw Error("cannot lock '" + path + "': " + std::strerror(errno));
      }
    }
  }
  ~FileLock() {
    ::flock(fd_, LOCK_UN);
    ::close(fd_);
  }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace

std::string TuningKey::str() const {
  std::ostringstream os;
  os << device << "|sm" << sm_count << "|cuda" << cuda_runtime << "|drv" << driver << "|" << op << "|" << shape << "|"
     << dtype << "|" << layout << "|" << candidates;
  return os.str();
}

std::string candidate_set_checksum(const std::vector<std::string>& names) {
  uint64_t h = 1469598103934665603ull;
  for (const std::string& n : names) {
    for (unsigned char c : n) h = (h ^ c) * 1099511628211ull;
    h = (h ^ 0xffu) * 1099511628211ull;  // separator: {"ab"} and {"a","b"} differ
  }
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

std::string TuningCache::default_path() {
  if (const char* d = std::getenv("KFUSE_CACHE_DIR"); d && *d) return (fs::path(d) / "tuning.json").string();
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return (fs::path(x) / "kfuse" / "tuning.json").string();
  const char* home = std::getenv("HOME");
  return (fs::path(home && *home ? home : "/tmp") / ".cache" / "kfuse" / "tuning.json").string();
}

TuningCache::TuningCache(std::string path, Warn warn)
    : path_(path.empty() ? default_path() : std::move(path)),
      warn_(warn ? std::move(warn) : Warn([](const std::string& m) { std::cerr << "kfuse: warning: " << m << "\n"; })) {
  entries_ = read_file(true);
}

std::map<std::string, TuningChoice> TuningCache::read_file(bool warn) const {
  std::map<std::string, TuningChoice> out;
  std::ifstream in(path_, std::ios::binary);
  if (!in) return out;  // no cache yet
  std::stringstream text;
  text << in.rdbuf();
  const nlohmann::json j = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  auto ignore = [&](const std::string& why) {
    if (warn) warn_("ignoring the tuning cache '" + path_ + "' (" + why + "); it will be rebuilt");
    return std::map<std::string, TuningChoice>{};
  };
  if (j.is_discarded() || !j.is_object()) return ignore("not a JSON object: corrupt or truncated");
  if (j.value("format", "") != kFormat) return ignore("not a kfuse tuning cache");
  if (j.value("version", 0) != kVersion)
    return ignore("version " + std::to_string(j.value("version", 0)) + ", this kfuse reads " + std::to_string(kVersion));
  const auto it = j.find("entries");
  if (it == j.end() || !it->is_object()) return ignore("no entries object");
  for (auto e = it->begin(); e != it->end(); ++e) {
    const nlohmann::json& v = e.value();
    if (!v.is_object() || !v.contains("candidate") || !v["candidate"].is_string() || !v.contains("median_ms") ||
        !v["median_ms"].is_number())
      return ignore("entry '" + e.key() + "' is malformed");
    TuningChoice c;
    c.candidate = v["candidate"].get<std::string>();
    c.median_ms = v["median_ms"].get<double>();
    c.spread_ms = v.value("spread_ms", 0.0);
    c.default_ms = v.value("default_ms", 0.0);
    out[e.key()] = c;
  }
  return out;
}

std::optional<TuningChoice> TuningCache::get(const TuningKey& key) const {
  const auto it = entries_.find(key.str());
  if (it == entries_.end()) return std::nullopt;
  return it->second;
}

void TuningCache::put(const TuningKey& key, const TuningChoice& choice) {
  entries_[key.str()] = choice;
  dirty_[key.str()] = choice;
}

void TuningCache::reload() {
  entries_ = read_file(true);
  for (const auto& [k, v] : dirty_) entries_[k] = v;
}

void TuningCache::save() {
  const fs::path file(path_);
  std::error_code ec;
  if (file.has_parent_path()) fs::create_directories(file.parent_path(), ec);
  KFUSE_CHECK(!ec, Error, "cannot create the tuning cache folder '", file.parent_path().string(), "': ", ec.message());
  FileLock lock(path_ + ".lock");
  // Merge under the lock: another process may have saved since we read.
  std::map<std::string, TuningChoice> merged = read_file(false);
  for (const auto& [k, v] : dirty_) merged[k] = v;

  nlohmann::json entries = nlohmann::json::object();
  for (const auto& [k, c] : merged)
    entries[k] = {{"candidate", c.candidate}, {"median_ms", c.median_ms}, {"spread_ms", c.spread_ms},
                  {"default_ms", c.default_ms}};
  const nlohmann::json j = {{"format", kFormat}, {"version", kVersion}, {"entries", entries}};
  const std::string tmp = path_ + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    KFUSE_CHECK(out, Error, "cannot write '", tmp, "': ", std::strerror(errno));
    out << j.dump(1) << "\n";
    out.flush();
    KFUSE_CHECK(out, Error, "writing '", tmp, "' failed");
  }
  if (std::rename(tmp.c_str(), path_.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::remove(tmp.c_str());
    throw Error("cannot replace '" + path_ + "': " + why);
  }
  entries_ = std::move(merged);
  dirty_.clear();
}

}  // namespace kfuse
