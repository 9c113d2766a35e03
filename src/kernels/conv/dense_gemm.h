// The GEMMs of the dense convolutions (dense_conv.h) through cuBLAS and cuBLASLt: per-device handles kept for the
// process, fp32 accumulation, each call on the caller's stream with the caller's workspace (two streams of one graph
// may run dense convolutions at the same time, so cuBLAS's default workspace, shared by all calls, is never used).
// Host code only: the handles' caches live here, away from the gather kernels.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>
#include <library_types.h>

namespace kfuse::kernels {

// The workspace every call here needs (the caller's; carved from the end of a convolution's workspace).
constexpr size_t kDenseGemmWorkspace = size_t(8) << 20;

// C = op(A) op(B) in column-major terms (op = transpose where trans_*), cuBLAS's default algorithm
// (cublasGemmEx). cudaErrorNotSupported without a cuBLAS handle.
cudaError_t dense_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void* a, cudaDataType_t at,
                       int64_t lda, const void* b, cudaDataType_t bt, int64_t ldb, void* c, cudaDataType_t ct,
                       int64_t ldc, void* workspace, cudaStream_t stream);

// C[m x n] = A^T B with A [k x m], B [k x n], C [m x n], column-major, packed (lda = ldb = k, ldc = m), all of type t:
// the algorithms cuBLASLt's heuristic ranks for the shape on the current device (best first; at most 8, within the
// workspace, for 16-byte aligned pointers; 0 without a device or cuBLASLt), computed once per (device, shape, type),
// and the GEMM by the algorithm-th of them (cudaErrorNotSupported past the last).
int dense_gemm_tn_algorithms(int64_t m, int64_t n, int64_t k, cudaDataType_t t);
cudaError_t dense_gemm_tn(int algorithm, int64_t m, int64_t n, int64_t k, const void* a, const void* b, void* c,
                          cudaDataType_t t, void* workspace, cudaStream_t stream);

}  // namespace kfuse::kernels
