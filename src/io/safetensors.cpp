#include "kfuse/safetensors.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

namespace kfuse {
namespace {

struct DTypeInfo {
  DType dtype;
  const char* name;
  size_t size;
  bool is_float;
};
constexpr DTypeInfo kDTypes[] = {
    {DType::F64, "F64", 8, true},  {DType::F32, "F32", 4, true}, {DType::F16, "F16", 2, true},
    {DType::BF16, "BF16", 2, true}, {DType::I64, "I64", 8, false}, {DType::I32, "I32", 4, false},
    {DType::I16, "I16", 2, false}, {DType::I8, "I8", 1, false},   {DType::U8, "U8", 1, false},
    {DType::BOOL, "BOOL", 1, false},
};
const DTypeInfo& info(DType d) {
  for (const auto& i : kDTypes)
    if (i.dtype == d) return i;
  throw Error("unknown dtype");
}

// Header sizes above this are rejected, as the safetensors library does: a corrupt size field must not make us
// allocate gigabytes.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h >> 15) << 31;
  const int exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  float v;
  if (exp == 0) {
    v = std::ldexp(float(mant), -24);  // zero or subnormal
  } else if (exp == 31) {
    v = mant ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    v = std::ldexp(float(mant | 0x400), exp - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  bits |= sign;
  std::memcpy(&v, &bits, 4);
  return v;
}

float bf16_to_float(uint16_t b) {
  const uint32_t bits = uint32_t(b) << 16;
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

}  // namespace

const char* dtype_name(DType d) { return info(d).name; }
size_t dtype_size(DType d) { return info(d).size; }
bool dtype_is_float(DType d) { return info(d).is_float; }

template <class T>
std::vector<T> SafetensorsTensor::to_floats(const std::string& what) const {
  KFUSE_CHECK(dtype_is_float(dtype), CheckpointError, what, " has dtype ", dtype_name(dtype),
              ", expected a floating-point dtype (F32, F16, BF16 or F64)");
  const size_t n = static_cast<size_t>(shape_numel(shape));
  std::vector<T> out(n);
  const uint8_t* p = bytes.data();
  for (size_t i = 0; i < n; ++i) {
    switch (dtype) {
      case DType::F64: { double v; std::memcpy(&v, p + 8 * i, 8); out[i] = static_cast<T>(v); break; }
      case DType::F32: { float v; std::memcpy(&v, p + 4 * i, 4); out[i] = static_cast<T>(v); break; }
      case DType::F16: { uint16_t v; std::memcpy(&v, p + 2 * i, 2); out[i] = static_cast<T>(half_to_float(v)); break; }
      case DType::BF16: { uint16_t v; std::memcpy(&v, p + 2 * i, 2); out[i] = static_cast<T>(bf16_to_float(v)); break; }
      default: break;
    }
  }
  return out;
}
template std::vector<float> SafetensorsTensor::to_floats(const std::string&) const;
template std::vector<double> SafetensorsTensor::to_floats(const std::string&) const;

template <class T>
SafetensorsTensor make_safetensors_tensor(const HostTensor<T>& t) {
  SafetensorsTensor s;
  s.dtype = sizeof(T) == 8 ? DType::F64 : DType::F32;
  s.shape = t.shape();
  s.bytes.resize(sizeof(T) * static_cast<size_t>(t.numel()));
  if (t.numel()) std::memcpy(s.bytes.data(), t.data(), s.bytes.size());
  return s;
}
template SafetensorsTensor make_safetensors_tensor(const HostTensor<float>&);
template SafetensorsTensor make_safetensors_tensor(const HostTensor<double>&);

SafetensorsFile read_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  KFUSE_CHECK(in, CheckpointError, "cannot open '", path, "': ", std::strerror(errno));
  in.seekg(0, std::ios::end);
  const uint64_t file_size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  const std::string where = "'" + path + "'";
  KFUSE_CHECK(file_size >= 8, CheckpointError, where, " is not a safetensors file: ", file_size,
              " bytes, shorter than the 8-byte header size");
  uint8_t size_bytes[8];
  in.read(reinterpret_cast<char*>(size_bytes), 8);
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | size_bytes[i];
  KFUSE_CHECK(header_size <= kMaxHeaderBytes, CheckpointError, where,
              " is not a safetensors file: its header size field says ", header_size, " bytes");
  KFUSE_CHECK(8 + header_size <= file_size, CheckpointError, where, " is truncated: the header needs ", header_size,
              " bytes but only ", file_size - 8, " follow the size field");
  std::string header(header_size, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_size));
  const uint64_t data_size = file_size - 8 - header_size;

  nlohmann::json j = nlohmann::json::parse(header, nullptr, /*allow_exceptions=*/false);
  KFUSE_CHECK(!j.is_discarded() && j.is_object(), CheckpointError, where,
              " is corrupt: its header is not a JSON object");

  SafetensorsFile file;
  struct Extent {
    uint64_t begin, end;
    std::string name;
  };
  std::vector<Extent> extents;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& e = it.value();
    if (name == "__metadata__") {
      KFUSE_CHECK(e.is_object(), CheckpointError, where, " is corrupt: __metadata__ is not an object");
      for (auto m = e.begin(); m != e.end(); ++m) {
        KFUSE_CHECK(m.value().is_string(), CheckpointError, where, " is corrupt: __metadata__['", m.key(),
                    "'] is not a string");
        file.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string what = where + ": tensor '" + name + "'";
    KFUSE_CHECK(e.is_object() && e.contains("dtype") && e.contains("shape") && e.contains("data_offsets"),
                CheckpointError, what, " lacks dtype, shape or data_offsets");
    KFUSE_CHECK(e["dtype"].is_string(), CheckpointError, what, " has a non-string dtype");
    const std::string dname = e["dtype"].get<std::string>();
    const DTypeInfo* di = nullptr;
    for (const auto& d : kDTypes)
      if (dname == d.name) di = &d;
    KFUSE_CHECK(di, CheckpointError, what, " has dtype '", dname, "', which kfuse does not read");
    SafetensorsTensor t;
    t.dtype = di->dtype;
    KFUSE_CHECK(e["shape"].is_array(), CheckpointError, what, " has a shape that is not a list");
    uint64_t numel = 1;
    for (const auto& d : e["shape"]) {
      KFUSE_CHECK(d.is_number_unsigned() || (d.is_number_integer() && d.get<int64_t>() >= 0), CheckpointError, what,
                  " has a shape entry that is not a non-negative integer");
      const uint64_t v = d.get<uint64_t>();
      KFUSE_CHECK(v < (uint64_t{1} << 40) && numel * std::max<uint64_t>(v, 1) < (uint64_t{1} << 40), CheckpointError,
                  what, " has an implausible shape");
      numel *= v;
      t.shape.push_back(static_cast<int64_t>(v));
    }
    const auto& off = e["data_offsets"];
    KFUSE_CHECK(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() && off[1].is_number_unsigned(),
                CheckpointError, what, " has data_offsets that are not two non-negative integers");
    const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    KFUSE_CHECK(begin <= end && end <= data_size, CheckpointError, where, " is truncated or corrupt: tensor '", name,
                "' occupies bytes [", begin, ", ", end, ") but the data section has ", data_size, " bytes");
    KFUSE_CHECK(end - begin == numel * di->size, CheckpointError, what, " is corrupt: ", end - begin,
                " bytes for shape ", shape_str(t.shape), " of ", dname, " (expected ", numel * di->size, ")");
    extents.push_back({begin, end, name});
    t.bytes.resize(end - begin);
    in.seekg(static_cast<std::streamoff>(8 + header_size + begin));
    in.read(reinterpret_cast<char*>(t.bytes.data()), static_cast<std::streamsize>(end - begin));
    KFUSE_CHECK(in, CheckpointError, where, ": reading tensor '", name, "' failed");
    file.tensors.emplace(name, std::move(t));
  }
  // The format promises a data section covered exactly once: no overlaps, no holes.
  std::sort(extents.begin(), extents.end(), [](const Extent& a, const Extent& b) { return a.begin < b.begin; });
  uint64_t covered = 0;
  for (const Extent& e : extents) {
    KFUSE_CHECK(e.begin == covered, CheckpointError, where, " is corrupt: tensor '", e.name, "' starts at byte ",
                e.begin, " but the previous tensor ends at ", covered, " (overlap or hole)");
    covered = e.end;
  }
  KFUSE_CHECK(covered == data_size, CheckpointError, where, " is corrupt: ", data_size - covered,
              " bytes after the last tensor belong to none");
  return file;
}

void write_safetensors(const std::string& path, const SafetensorsFile& file) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!file.metadata.empty()) header["__metadata__"] = file.metadata;
  uint64_t offset = 0;
  for (const auto& [name, t] : file.tensors) {
    const uint64_t n = static_cast<uint64_t>(shape_numel(t.shape)) * dtype_size(t.dtype);
    KFUSE_CHECK(t.bytes.size() == n, InvalidArgument, "tensor '", name, "' holds ", t.bytes.size(),
                " bytes but its shape ", shape_str(t.shape), " of ", dtype_name(t.dtype), " needs ", n);
    header[name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keep the data 8-byte aligned, as safetensors does

  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    KFUSE_CHECK(out, Error, "cannot write '", tmp, "': ", std::strerror(errno));
    uint8_t size_bytes[8];
    for (int i = 0; i < 8; ++i) size_bytes[i] = static_cast<uint8_t>(uint64_t(text.size()) >> (8 * i));
    out.write(reinterpret_cast<const char*>(size_bytes), 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const auto& [name, t] : file.tensors)
      out.write(reinterpret_cast<const char*>(t.bytes.data()), static_cast<std::streamsize>(t.bytes.size()));
    out.flush();
    KFUSE_CHECK(out, Error, "writing '", tmp, "' failed");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::remove(tmp.c_str());
    throw Error("cannot move '" + tmp + "' to '" + path + "': " + why);
  }
}

}  // namespace kfuse
