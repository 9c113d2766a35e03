// The data side of tuning on the GPU: random inputs for the candidates and the comparison of a candidate's output
// with the reference candidate's. Both used to run on the host (a std::mt19937 fill, a copy back and a float64 loop
// per candidate), which for the training batch's tensors (tens of millions of elements) cost most of a whole
// network's tuning time; on the GPU they take microseconds.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace kfuse::kernels {

enum class ValueType { kF16, kBF16, kF32 };

// `elems` values of `type` at `dst`, uniform in [-scale, scale], a pure function of (seed, index): the same inputs
// in every process. Asynchronous on `stream`.
cudaError_t fill_uniform(void* dst, size_t elems, ValueType type, float scale, uint32_t seed, cudaStream_t stream);

// dst[i] = float(src[i]) for `elems` values of `type` (the reference kept in fp32). Asynchronous on `stream`.
cudaError_t convert_to_f32(const void* src, ValueType type, size_t elems, float* dst, cudaStream_t stream);

// How `out` (of `type`) differs from the fp32 reference `ref`: result[0] = sum (out - ref)^2, result[1] = sum ref^2,
// result[2] = the number of non-finite outputs (NaN poison left unwritten included). `result` is 3 device doubles,
// zeroed here first. Asynchronous on `stream`.
cudaError_t compare_with_reference(const void* out, ValueType type, const float* ref, size_t elems, double* result,
                                   cudaStream_t stream);

}  // namespace kfuse::kernels
