// Does e4m3 pay where the encoder is bound by its weights? Block 4's conv2 at batch 128 runs as one dense GEMM over
// the unrolled 2048 x 2048 filter plus the squeeze projection's 32 rows (kernels/conv/dense_conv.h): 8 MB of fp16
// weights read for 1.1 GFLOP, so it is memory-bound (6.1 us, ~1.5 TB/s; PERF.md), and an e4m3 filter halves the bytes.
// Times cuBLASLt's best heuristic algorithm for that GEMM in fp16 and in e4m3 (per-tensor scales, fp16 output, fp32
// accumulation), at batches 128, 1024 and 2048; also block 4's conv1 written as a dense GEMM (2048 x 4096, 44% zeros)
// for comparison. GPU time per launch, 50 launches back to back, median of 5 rounds (CUDA events); random inputs.
// Build and run (GPU machine, one line):
//   g++ -O2 -std=c++17 -I/usr/local/cuda/include dev/fp8_conv_bench/fp8_dense_gemm.cpp
//       -L/usr/local/cuda/lib64 -lcublasLt -lcudart -o build-gpu/fp8_dense_gemm && build-gpu/fp8_dense_gemm
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "bench_util.h"

#define CL(x)                                                                                   \
  do {                                                                                          \
    cublasStatus_t s = (x);                                                                     \
    if (s != CUBLAS_STATUS_SUCCESS) {                                                           \
      std::printf("%s:%d %s: cublas status %d\n", __FILE__, __LINE__, #x, int(s));              \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

using namespace fp8_bench;

namespace {

constexpr size_t kWorkspace = 32u << 20;

// Row-major y[n][m] = x[n][k] W^T with W row-major [m][k]: column-major y^T = op_T(W) x^T, the "TN" form cuBLASLt's
// fp8 kernels require. Returns the GPU time per launch (us) of the best heuristic algorithm, or -1 where there is none.
double time_gemm(cublasLtHandle_t lt, int m, int n, int k, bool fp8, std::mt19937& rng, void* workspace) {
  const cudaDataType_t in = fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16F;
  const size_t in_bytes = fp8 ? 1 : 2;
  void* w = random_device_bytes(size_t(m) * k * in_bytes, rng, fp8);
  void* x = random_device_bytes(size_t(n) * k * in_bytes, rng, fp8);
  void* y = nullptr;
  void* c = nullptr;  // C apart from D: the in-place form (C == D) is one suspect of the e4m3 refusals
  CK(cudaMalloc(&y, size_t(m) * n * 2));
  CK(cudaMalloc(&c, size_t(m) * n * 2));
  float* scales = nullptr;  // a, b: the dequantization scales (per tensor)
  CK(cudaMalloc(&scales, 2 * sizeof(float)));
  const float one[2] = {1.0f, 1.0f};
  CK(cudaMemcpy(scales, one, sizeof(one), cudaMemcpyHostToDevice));

  cublasLtMatmulDesc_t op;
  CL(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  CL(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  CL(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  if (fp8) {
    const float* sa = scales;
    const float* sb = scales + 1;
    CL(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa)));
    CL(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb)));
  }
  cublasLtMatrixLayout_t a_l, b_l, y_l;
  CL(cublasLtMatrixLayoutCreate(&a_l, in, k, m, k));  // W^T stored as k x m, column-major
  CL(cublasLtMatrixLayoutCreate(&b_l, in, k, n, k));
  CL(cublasLtMatrixLayoutCreate(&y_l, CUDA_R_16F, m, n, m));
  cublasLtMatmulPreference_t pref;
  CL(cublasLtMatmulPreferenceCreate(&pref));
  CL(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &kWorkspace,
                                          sizeof(kWorkspace)));
  cublasLtMatmulHeuristicResult_t best[8];
  int found = 0;
  CL(cublasLtMatmulAlgoGetHeuristic(lt, op, a_l, b_l, y_l, y_l, pref, 8, best, &found));
  double us = -1;
  const float alpha = 1.0f, beta = 0.0f;
  for (int i = 0; i < found; ++i) {  // the heuristics' first few, the fastest kept
    auto matmul = [&] {
      return cublasLtMatmul(lt, op, &alpha, w, a_l, x, b_l, &beta, c, y_l, y, y_l, &best[i].algo, workspace,
                            kWorkspace, nullptr);
    };
    // The heuristic may offer algorithms that then refuse the problem (status 15, not supported): skip those.
    if (const cublasStatus_t s = matmul(); s != CUBLAS_STATUS_SUCCESS) {
      std::printf("  (%s m=%d n=%d k=%d: algorithm %d of %d refused, cublas status %d)\n", fp8 ? "e4m3" : "fp16", m,
                  n, k, i, found, int(s));
      continue;
    }
    const double t = median_us([&] { return matmul() == CUBLAS_STATUS_SUCCESS ? cudaSuccess : cudaErrorUnknown; });
    if (us < 0 || t < us) us = t;
  }
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(a_l);
  cublasLtMatrixLayoutDestroy(b_l);
  cublasLtMatrixLayoutDestroy(y_l);
  cublasLtMatmulDescDestroy(op);
  for (void* p : {w, x, y, c, static_cast<void*>(scales)}) CK(cudaFree(p));
  return us;
}

}  // namespace

int main() {
  struct Gemm {
    const char* name;
    int m, k;
  };
  const Gemm gemms[] = {
      {"block4 conv2 dense (+32 projection rows)", 2080, 2048},
      {"block4 conv1 as a dense GEMM", 2048, 4096},
  };
  cublasLtHandle_t lt;
  CL(cublasLtCreate(&lt));
  void* workspace = nullptr;
  CK(cudaMalloc(&workspace, kWorkspace));
  std::mt19937 rng(7);
  std::printf("%-42s %6s %10s %10s %8s %12s\n", "gemm", "batch", "fp16 us", "e4m3 us", "ratio", "fp16 TB/s");
  for (int n : {128, 1024, 2048}) {
    for (const Gemm& g : gemms) {
      const double f16 = time_gemm(lt, g.m, n, g.k, false, rng, workspace);
      const double f8 = time_gemm(lt, g.m, n, g.k, true, rng, workspace);
      const double bytes = 2.0 * (double(g.m) * g.k + double(n) * g.k + double(n) * g.m);
      std::printf("%-42s %6d %10.2f %10.2f %8.3f %12.2f\n", g.name, n, f16, f8, f16 > 0 && f8 > 0 ? f8 / f16 : 0.0,
                  f16 > 0 ? bytes / (f16 * 1e-6) / 1e12 : 0.0);
    }
  }
  CK(cudaFree(workspace));
  cublasLtDestroy(lt);
  return 0;
}
