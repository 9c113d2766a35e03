// HostTensor: a dense, row-major (C-contiguous) array in host memory with a shape. It is the storage of the CPU
// reference and of parameters on the C++ side; nothing more (no strides, no views) so that indexing stays obvious.
#pragma once

#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "kfuse/error.h"

namespace kfuse {

using Shape = std::vector<int64_t>;

inline int64_t shape_numel(const Shape& shape) {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, [](int64_t a, int64_t b) { return a * b; });
}

inline std::string shape_str(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

template <class T>
class HostTensor {
 public:
  HostTensor() = default;
  explicit HostTensor(Shape shape, T fill = T(0)) : shape_(std::move(shape)) {
    for (int64_t d : shape_) KFUSE_CHECK(d >= 0, InvalidArgument, "negative dimension in shape ", shape_str(shape_));
    data_.assign(static_cast<size_t>(shape_numel(shape_)), fill);
  }

  const Shape& shape() const { return shape_; }
  int64_t dim(size_t i) const { return shape_.at(i); }
  size_t rank() const { return shape_.size(); }
  int64_t numel() const { return static_cast<int64_t>(data_.size()); }

  T* data() { return data_.data(); }
  const T* data() const { return data_.data(); }
  T& operator[](int64_t i) { return data_[static_cast<size_t>(i)]; }
  const T& operator[](int64_t i) const { return data_[static_cast<size_t>(i)]; }
  std::vector<T>& values() { return data_; }
  const std::vector<T>& values() const { return data_; }

  // Element (n, c, h, w) of a rank-4 NCHW tensor.
  T& at(int64_t n, int64_t c, int64_t h, int64_t w) { return data_[index4(n, c, h, w)]; }
  const T& at(int64_t n, int64_t c, int64_t h, int64_t w) const { return data_[index4(n, c, h, w)]; }

 private:
  size_t index4(int64_t n, int64_t c, int64_t h, int64_t w) const {
    return static_cast<size_t>(((n * shape_[1] + c) * shape_[2] + h) * shape_[3] + w);
  }
  Shape shape_;
  std::vector<T> data_;
};

}  // namespace kfuse
