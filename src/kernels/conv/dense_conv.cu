// Dense convolutions of small images (dense_conv.h): the filter unrolled by a gather kernel, one cuBLAS GEMM, and
// for the weight gradient a fold of the unrolled gradient back onto the filter's taps.
#include "kernels/conv/dense_conv.h"
#include "kernels/conv/device_handle_cache.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <mutex>

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace kfuse::kernels {
namespace {

// cuBLAS's own workspace, carved from the end of the caller's (cublasSetWorkspace per call: the handle is shared by
// the main and the side branch of a graph, and cuBLAS's default workspace would be shared with it).
constexpr size_t kCublasWorkspace = size_t(8) << 20;
constexpr size_t kMaxUnrolledBytes = size_t(256) << 20;

size_t up256(size_t b) { return (b + 255) / 256 * 256; }

struct Dims {
  int64_t kd, nd;  // GEMM depths: H * W * C (an image in), Ho * Wo * K (an image out)
};
Dims dims(const Conv2dProblem& p) { return {int64_t(p.h) * p.w * p.c, int64_t(p.p()) * p.q() * p.k}; }

// The problem's extents for device code (Conv2dProblem's are host functions).
struct Geo {
  int h, w, c, k, r, s, pad_h, pad_w, stride_h, stride_w, p, q;
};
Geo geo(const Conv2dProblem& p) {
  return {p.h, p.w, p.c, p.k, p.r, p.s, p.pad_h, p.pad_w, p.stride_h, p.stride_w, p.p(), p.q()};
}

// The tap of filter w that joins output pixel po = (ph, pw) and input pixel q = (qh, qw), or -1 (outside).
__device__ __forceinline__ int tap(const Geo& p, int ph, int pw, int qh, int qw) {
  const int r = qh - ph * p.stride_h + p.pad_h, s = qw - pw * p.stride_w + p.pad_w;
  return (r >= 0 && r < p.r && s >= 0 && s < p.s) ? r * p.s + s : -1;
}

// Wd[po][k][q][c] (row-major [nd][kd]) from w[k][r][s][c]: one thread per 8 channels (16 bytes), one (po, k) row
// per blockIdx.y (32-bit index arithmetic: 64-bit divisions made this gather 2x slower than its bytes).
__global__ void __launch_bounds__(256) unroll_filter_kernel(Geo p, const uint4* w, uint4* wd,
                                                            const unsigned* run_flag) {
  if (run_flag && *run_flag == 0) return;
  const int c8 = p.c / 8, row_vecs = p.h * p.w * c8;
  const int row = blockIdx.y, k = row % p.k, po = row / p.k;
  const int ph = po / p.q, pw = po % p.q;
  uint4* out = wd + int64_t(row) * row_vecs;
  const uint4* wk = w + int64_t(k) * p.r * p.s * c8;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < row_vecs; i += gridDim.x * blockDim.x) {
    const int cv = i % c8, q = i / c8;
    const int t = tap(p, ph, pw, q / p.w, q % p.w);
    out[i] = t < 0 ? make_uint4(0, 0, 0, 0) : wk[t * c8 + cv];
  }
}

// dw[k][r][s][c] = sum over the (po, q) pairs of tap (r, s) of dWd[po][k][q][c] (fp32, [nd][kd]): one thread per 4
// channels of one (k, r, s), the pairs in a fixed order.
__global__ void __launch_bounds__(256) fold_filter_kernel(Geo p, const float4* dwd, float4* dw) {
  const int c4 = p.c / 4;
  const int64_t total = int64_t(p.k) * p.r * p.s * c4;
  const int64_t kd4 = int64_t(p.h) * p.w * c4;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int cv = int(i % c4);
    const int rs = int((i / c4) % (p.r * p.s));
    const int k = int(i / (int64_t(c4) * p.r * p.s));
    const int r = rs / p.s, s = rs % p.s;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int ph = 0; ph < p.p; ++ph)
      for (int pw = 0; pw < p.q; ++pw) {
        const int qh = ph * p.stride_h - p.pad_h + r, qw = pw * p.stride_w - p.pad_w + s;
        if (qh < 0 || qh >= p.h || qw < 0 || qw >= p.w) continue;
        const int64_t row = int64_t(ph * p.q + pw) * p.k + k;
        const float4 v = dwd[row * kd4 + int64_t(qh * p.w + qw) * c4 + cv];
        acc.x += v.x, acc.y += v.y, acc.z += v.z, acc.w += v.w;
      }
    dw[i] = acc;
  }
}

int grid_for(int64_t threads) {
  return int(std::min<int64_t>((threads + 255) / 256, 132 * 16));
}

std::mutex& handle_mutex() {
  static std::mutex m;
  return m;
}

// The current device's handle (created once, kept for the process), or null.
cublasHandle_t handle_locked() {
  static std::map<int, cublasHandle_t> handles;
  return current_device_handle(handles, [](cublasHandle_t* h) { return cublasCreate(h) == CUBLAS_STATUS_SUCCESS; });
}

cudaDataType_t cuda_type(ConvDType t) { return t == ConvDType::kF16 ? CUDA_R_16F : CUDA_R_16BF; }

// C = op(A) op(B) in cuBLAS's column-major terms, fp32 accumulation, on `stream` with `ws` as cuBLAS's workspace.
cudaError_t gemm(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, const void* a,
                 cudaDataType_t at, int64_t lda, const void* b, cudaDataType_t bt, int64_t ldb, void* c,
                 cudaDataType_t ct, int64_t ldc, void* ws, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(handle_mutex());
  cublasHandle_t h = handle_locked();
  if (!h) return cudaErrorNotSupported;
  if (cublasSetStream(h, stream) != CUBLAS_STATUS_SUCCESS ||
      cublasSetWorkspace(h, ws, kCublasWorkspace) != CUBLAS_STATUS_SUCCESS)
    return cudaErrorNotSupported;
  const float alpha = 1.0f, beta = 0.0f;
  const cublasStatus_t s =
      cublasGemmEx(h, ta, tb, int(m), int(n), int(k), &alpha, a, at, int(lda), b, bt, int(ldb), &beta, c, ct,
                   int(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  return s == CUBLAS_STATUS_SUCCESS ? cudaGetLastError() : cudaErrorLaunchFailure;
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

// A launcher's arguments: p runs densely, every pointer is non-null and 16-byte aligned, the workspace holds `need`.
bool valid_args(const Conv2dProblem& p, ConvDType dtype, std::initializer_list<const void*> ptrs,
                size_t workspace_bytes = 0, size_t need = 0) {
  if (!dense_conv_can_implement(p, dtype) || workspace_bytes < need) return false;
  for (const void* q : ptrs)
    if (!q || !aligned16(q)) return false;
  return true;
}

}  // namespace

bool dense_conv_can_implement(const Conv2dProblem& p, ConvDType dtype) {
  (void)dtype;
  if (p.n < 1 || p.h < 1 || p.w < 1 || p.c < 8 || p.k < 8 || p.c % 8 || p.k % 8 || p.r < 1 || p.s < 1) return false;
  if (p.p() < 1 || p.q() < 1 || p.h * p.w > p.r * p.s) return false;
  const Dims d = dims(p);
  if (d.kd > INT32_MAX || d.nd > 65535) return false;  // the gather's grid.y
  return size_t(d.kd) * size_t(d.nd) * 4 <= kMaxUnrolledBytes;  // fp32: the weight gradient's
}

size_t dense_conv_unrolled_filter_bytes(const Conv2dProblem& p, ConvDType) {
  const Dims d = dims(p);
  return up256(size_t(d.kd) * d.nd * 2);
}

cudaError_t dense_conv_unroll_filter(const Conv2dProblem& p, ConvDType dtype, const void* w, void* wd,
                                     cudaStream_t stream, const unsigned* run_flag) {
  if (!valid_args(p, dtype, {w, wd})) return cudaErrorInvalidValue;
  const Dims d = dims(p);
  const dim3 grid(unsigned((d.kd / 8 + 255) / 256), unsigned(d.nd));
  unroll_filter_kernel<<<grid, 256, 0, stream>>>(geo(p), static_cast<const uint4*>(w), static_cast<uint4*>(wd),
                                                  run_flag);
  return cudaGetLastError();
}

size_t dense_conv_fprop_unrolled_workspace_bytes(const Conv2dProblem&, ConvDType) { return kCublasWorkspace; }

cudaError_t dense_conv_fprop_unrolled(const Conv2dProblem& p, ConvDType dtype, const void* x, const void* wd, void* y,
                                      void* workspace, size_t workspace_bytes, cudaStream_t stream, int extra_rows) {
  const size_t need = dense_conv_fprop_unrolled_workspace_bytes(p, dtype);
  if (!valid_args(p, dtype, {x, wd, y, workspace}, workspace_bytes, need)) return cudaErrorInvalidValue;
  const Dims d = dims(p);
  const int64_t rows = d.nd + extra_rows;
  if (extra_rows < 0 || rows % 8 != 0) return cudaErrorInvalidValue;
  // Row-major y[n][rows] = x[n][kd] Wd^T, Wd row-major [rows][kd]: column-major y^T = op_T(Wd) x^T.
  const cudaDataType_t t = cuda_type(dtype);
  return gemm(CUBLAS_OP_T, CUBLAS_OP_N, rows, p.n, d.kd, wd, t, d.kd, x, t, d.kd, y, t, rows, workspace, stream);
}

size_t dense_conv_fprop_workspace_bytes(const Conv2dProblem& p, ConvDType dtype) {
  return dense_conv_unrolled_filter_bytes(p, dtype) + kCublasWorkspace;
}

cudaError_t dense_conv_fprop(const Conv2dProblem& p, ConvDType dtype, const void* x, const void* w, void* y,
                             void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (!valid_args(p, dtype, {x, w, y, workspace}, workspace_bytes, dense_conv_fprop_workspace_bytes(p, dtype)))
    return cudaErrorInvalidValue;
  auto* wd = static_cast<uint8_t*>(workspace);
  const size_t wd_bytes = dense_conv_unrolled_filter_bytes(p, dtype);
  if (const cudaError_t e = dense_conv_unroll_filter(p, dtype, w, wd, stream); e != cudaSuccess) return e;
  return dense_conv_fprop_unrolled(p, dtype, x, wd, y, wd + wd_bytes, workspace_bytes - wd_bytes, stream);
}

size_t dense_conv_wgrad_workspace_bytes(const Conv2dProblem& p, ConvDType) {
  const Dims d = dims(p);
  return up256(size_t(d.kd) * d.nd * 4) + kCublasWorkspace;
}

cudaError_t dense_conv_wgrad(const Conv2dProblem& p, ConvDType dtype, const void* dy, const void* x, float* dw,
                             void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (!valid_args(p, dtype, {dy, x, dw, workspace}, workspace_bytes, dense_conv_wgrad_workspace_bytes(p, dtype)))
    return cudaErrorInvalidValue;
  const Dims d = dims(p);
  auto* dwd = static_cast<float*>(workspace);
  void* cublas_ws = static_cast<uint8_t*>(workspace) + up256(size_t(d.kd) * d.nd * 4);
  // Row-major dWd[nd][kd] = dy^T x (sum over the batch): column-major dWd^T = x^T op_T(dy^T).
  const cudaDataType_t t = cuda_type(dtype);
  if (const cudaError_t e = gemm(CUBLAS_OP_N, CUBLAS_OP_T, d.kd, d.nd, p.n, x, t, d.kd, dy, t, d.nd, dwd, CUDA_R_32F,
                                 d.kd, cublas_ws, stream);
      e != cudaSuccess)
    return e;
  fold_filter_kernel<<<grid_for(int64_t(p.k) * p.r * p.s * p.c / 4), 256, 0, stream>>>(
      geo(p), reinterpret_cast<const float4*>(dwd), reinterpret_cast<float4*>(dw));
  return cudaGetLastError();
}

}  // namespace kfuse::kernels
