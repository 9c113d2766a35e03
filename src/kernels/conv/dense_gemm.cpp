// cuBLAS / cuBLASLt GEMMs of the dense convolutions (dense_gemm.h).
#include "kernels/conv/dense_gemm.h"

#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include <cublasLt.h>
#include <cublas_v2.h>

#include "kernels/conv/device_handle_cache.h"

namespace kfuse::kernels {
namespace {

std::mutex& handle_mutex() {
  static std::mutex m;
  return m;
}

// The current device's handles (created once, kept for the process), or null. Call with handle_mutex() held.
cublasHandle_t handle_locked() {
  static std::map<int, cublasHandle_t> handles;
  return current_device_handle(handles, [](cublasHandle_t* h) { return cublasCreate(h) == CUBLAS_STATUS_SUCCESS; });
}
cublasLtHandle_t lt_handle_locked() {
  static std::map<int, cublasLtHandle_t> handles;
  return current_device_handle(handles,
                               [](cublasLtHandle_t* h) { return cublasLtCreate(h) == CUBLAS_STATUS_SUCCESS; });
}

// The descriptors of one A^T B shape and the heuristic's ranking of algorithms for it.
struct LtGemm {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  std::vector<cublasLtMatmulAlgo_t> algos;  // best first
};

bool lt_describe(LtGemm& g, int64_t m, int64_t n, int64_t k, cudaDataType_t t) {
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  return cublasLtMatmulDescCreate(&g.op, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
         cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)) == CUBLAS_STATUS_SUCCESS &&
         cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)) == CUBLAS_STATUS_SUCCESS &&
         cublasLtMatrixLayoutCreate(&g.a, t, uint64_t(k), uint64_t(m), k) == CUBLAS_STATUS_SUCCESS &&
         cublasLtMatrixLayoutCreate(&g.b, t, uint64_t(k), uint64_t(n), k) == CUBLAS_STATUS_SUCCESS &&
         cublasLtMatrixLayoutCreate(&g.c, t, uint64_t(m), uint64_t(n), m) == CUBLAS_STATUS_SUCCESS;
}

constexpr int kMaxAlgorithms = 8;

// The shape's entry on the current device (computed on first use; no algorithms where cuBLASLt fails), or null
// without a device or a handle. Call with handle_mutex() held.
const LtGemm* lt_gemm_locked(int64_t m, int64_t n, int64_t k, cudaDataType_t t) {
  static std::map<std::tuple<int, int64_t, int64_t, int64_t, int>, LtGemm> cache;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return nullptr;
  cublasLtHandle_t h = lt_handle_locked();
  if (!h) return nullptr;
  const auto key = std::make_tuple(dev, m, n, k, int(t));
  if (auto it = cache.find(key); it != cache.end()) return &it->second;
  LtGemm& g = cache[key];
  cublasLtMatmulPreference_t pref = nullptr;
  if (!lt_describe(g, m, n, k, t) || cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS) return &g;
  const uint64_t ws = kDenseGemmWorkspace;
  const uint32_t align = 16;  // the callers' pointers are 16-byte aligned, not the 256 bytes the heuristic assumes
  bool ok = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)) ==
            CUBLAS_STATUS_SUCCESS;
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    ok = ok && cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof(align)) == CUBLAS_STATUS_SUCCESS;
  cublasLtMatmulHeuristicResult_t results[kMaxAlgorithms] = {};
  int count = 0;
  if (ok && cublasLtMatmulAlgoGetHeuristic(h, g.op, g.a, g.b, g.c, g.c, pref, kMaxAlgorithms, results, &count) ==
                CUBLAS_STATUS_SUCCESS)
    for (int i = 0; i < count; ++i)
      if (results[i].state == CUBLAS_STATUS_SUCCESS && results[i].workspaceSize <= kDenseGemmWorkspace)
        g.algos.push_back(results[i].algo);
  cublasLtMatmulPreferenceDestroy(pref);
  return &g;
}

}  // namespace

cudaError_t dense_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void* a, cudaDataType_t at,
                       int64_t lda, const void* b, cudaDataType_t bt, int64_t ldb, void* c, cudaDataType_t ct,
                       int64_t ldc, void* workspace, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(handle_mutex());
  cublasHandle_t h = handle_locked();
  if (!h) return cudaErrorNotSupported;
  // cublasSetWorkspace per call: the handle is shared by the main and the side branch of a graph.
  if (cublasSetStream(h, stream) != CUBLAS_STATUS_SUCCESS ||
      cublasSetWorkspace(h, workspace, kDenseGemmWorkspace) != CUBLAS_STATUS_SUCCESS)
    return cudaErrorNotSupported;
  const float alpha = 1.0f, beta = 0.0f;
  const cublasStatus_t s = cublasGemmEx(h, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                        int(m), int(n), int(k), &alpha, a, at, int(lda), b, bt, int(ldb), &beta, c, ct,
                                        int(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  return s == CUBLAS_STATUS_SUCCESS ? cudaGetLastError() : cudaErrorLaunchFailure;
}

int dense_gemm_tn_algorithms(int64_t m, int64_t n, int64_t k, cudaDataType_t t) {
  std::lock_guard<std::mutex> lock(handle_mutex());
  const LtGemm* g = lt_gemm_locked(m, n, k, t);
  return g ? int(g->algos.size()) : 0;
}

cudaError_t dense_gemm_tn(int algorithm, int64_t m, int64_t n, int64_t k, const void* a, const void* b, void* c,
                          cudaDataType_t t, void* workspace, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(handle_mutex());
  const LtGemm* g = lt_gemm_locked(m, n, k, t);
  if (!g || algorithm < 0 || algorithm >= int(g->algos.size())) return cudaErrorNotSupported;
  const float alpha = 1.0f, beta = 0.0f;
  const cublasStatus_t s = cublasLtMatmul(lt_handle_locked(), g->op, &alpha, a, g->a, b, g->b, &beta, c, g->c, c, g->c,
                                          &g->algos[size_t(algorithm)], workspace, kDenseGemmWorkspace, stream);
  return s == CUBLAS_STATUS_SUCCESS ? cudaGetLastError() : cudaErrorLaunchFailure;
}

}  // namespace kfuse::kernels
