#include "mlp/codegen/kernel_cache.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "kfuse/error.h"
#include "kfuse/tuning_cache.h"

namespace kfuse::codegen {
namespace {
namespace fs = std::filesystem;
constexpr const char* kMagic = "kfuse-kernel-cache 1";
}  // namespace

std::string fnv1a64_hex(const std::string& data) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : data) h = (h ^ c) * 1099511628211ull;
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

std::string KernelCacheKey::str() const {
  return "src=" + source_hash + "|arch=" + arch + "|nvrtc=" + nvrtc + "|opts=" + options;
}

std::string KernelCacheKey::file_name() const { return fnv1a64_hex(str()) + "." + arch + ".bin"; }

std::string KernelCache::default_dir() {
  return (fs::path(TuningCache::default_path()).parent_path() / "kernels").string();
}

KernelCache::KernelCache(std::string dir, Warn warn)
    : dir_(dir.empty() ? default_dir() : std::move(dir)),
      warn_(warn ? std::move(warn) : Warn([](const std::string& m) { std::cerr << "kfuse: warning: " << m << "\n"; })) {}

std::string KernelCache::path_for(const KernelCacheKey& key) const {
  return (fs::path(dir_) / key.file_name()).string();
}

std::optional<std::string> KernelCache::load(const KernelCacheKey& key) const {
  const std::string path = path_for(key);
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  auto ignore = [&](const std::string& why) -> std::optional<std::string> {
    warn_("ignoring the kernel cache file '" + path + "' (" + why + "); the kernels will be compiled again");
    return std::nullopt;
  };
  std::string magic, key_line, size_line, sum_line;
  if (!std::getline(in, magic) || magic != kMagic) return ignore("not a kfuse kernel cache file");
  if (!std::getline(in, key_line) || key_line != key.str()) return ignore("written for another key");
  if (!std::getline(in, size_line) || !std::getline(in, sum_line)) return ignore("truncated header");
  size_t size = 0;
  try {
    size_t used = 0;
    size = std::stoull(size_line, &used);
    if (used != size_line.size()) return ignore("bad size field");
  } catch (const std::exception&) {
    return ignore("bad size field");
  }
  std::string payload(size, '\0');
  if (size && !in.read(payload.data(), static_cast<std::streamsize>(size))) return ignore("truncated payload");
  if (in.peek() != std::char_traits<char>::eof()) return ignore("trailing bytes");
  if (fnv1a64_hex(payload) != sum_line) return ignore("checksum mismatch: corrupt");
  return payload;
}

void KernelCache::store(const KernelCacheKey& key, const std::string& binary) const {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  KFUSE_CHECK(!ec, Error, "cannot create the kernel cache folder '", dir_, "': ", ec.message());
  const std::string path = path_for(key);
  // Unique per process and call: concurrent writers of one key each rename a complete file into place.
  static std::atomic<int> counter{0};
  const std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    KFUSE_CHECK(out, Error, "cannot write '", tmp, "': ", std::strerror(errno));
    out << kMagic << "\n" << key.str() << "\n" << binary.size() << "\n" << fnv1a64_hex(binary) << "\n";
    out.write(binary.data(), static_cast<std::streamsize>(binary.size()));
    out.flush();
    KFUSE_CHECK(out, Error, "writing '", tmp, "' failed");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::remove(tmp.c_str());
    throw Error("cannot replace '" + path + "': " + why);
  }
}

}  // namespace kfuse::codegen
