// Reading and writing the safetensors format (https://github.com/huggingface/safetensors): 8 bytes little-endian
// header size, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {str: str}}, then the data.
// The reader checks everything the format promises (offsets in range, no overlap, no holes, sizes matching dtype
// and shape) and throws CheckpointError naming the file and the problem.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kfuse/tensor.h"

namespace kfuse {

enum class DType { F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL };

const char* dtype_name(DType d);  // safetensors' spelling: "F32", "BF16", ...
size_t dtype_size(DType d);
bool dtype_is_float(DType d);

struct SafetensorsTensor {
  DType dtype = DType::F32;
  Shape shape;
  std::vector<uint8_t> bytes;  // little-endian, row-major

  // The values converted to T; throws CheckpointError when the dtype is not a floating-point type.
  template <class T>
  std::vector<T> to_floats(const std::string& what) const;
};

struct SafetensorsFile {
  std::map<std::string, SafetensorsTensor> tensors;
  std::map<std::string, std::string> metadata;
};

SafetensorsFile read_safetensors(const std::string& path);
// Writes atomically (a temporary file renamed over `path`), tensors sorted by name as safetensors does.
void write_safetensors(const std::string& path, const SafetensorsFile& file);

template <class T>
SafetensorsTensor make_safetensors_tensor(const HostTensor<T>& t);  // F32 for float, F64 for double

}  // namespace kfuse
