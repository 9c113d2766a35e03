// The squeeze-excite backward's parameter phase (launch_se_backward_params, backward_kernels.h): a split-K kernel forms
// the parameter-gradient partials over chunks of images (dw1 = d_z1^T m, dw2 = d_z2^T r, and the bias sums), and a
// finalize kernel sums the chunk partials and the main kernel's per-CTA scalar partials in a fixed order (the same
// inputs give the same bits). Reads what the data phase (se_backward.cu) left in the workspace.
#include <algorithm>
#include <cstdint>

#include "kernels/encoder/backward_kernels.h"
#include "kernels/encoder/se_backward_plan.cuh"

namespace kfuse::kernels {
namespace {

using namespace se_backward_detail;

// --- parameter gradients: split over chunks of images, then a fixed-order sum ----------------------------------------

// Partial slab of chunk q (slab = 2 hidden p + hidden + p floats): [dw1 as [hidden][p]] [dw2 as [hidden][p]]
// [db1 [hidden]] [db2 [p]].
struct ParamParams {
  const float* m;    // [n][p]
  const float* dz2;  // [n][p]
  const float* r;    // [n][hidden]
  const float* dz1;  // [n][hidden]
  float* part;       // [q][slab]
  int n, p, hidden, chunk;
};

// Grid (ceil(p / 256), ceil(hidden / 8), q): thread = channel c, 8 hidden units j, images of chunk q in order.
__global__ void __launch_bounds__(kParamThreads) se_param_partial_kernel(const ParamParams a) {
  __shared__ float sd1[kParamN][kParamJ], sr[kParamN][kParamJ];
  const int t = threadIdx.x;
  const int c = blockIdx.x * kParamThreads + t;
  const int j0 = blockIdx.y * kParamJ;
  const int q = blockIdx.z;
  const int p = a.p, hid = a.hidden;
  const int n0 = q * a.chunk, n1 = min(a.n, n0 + a.chunk);
  float acc1[kParamJ], acc2[kParamJ], accb2 = 0.f, accb1 = 0.f;
#pragma unroll
  for (int k = 0; k < kParamJ; ++k) acc1[k] = 0.f, acc2[k] = 0.f;
  static_assert(kParamN * kParamJ == kParamThreads, "one staged value per thread");
  for (int nb = n0; nb < n1; nb += kParamN) {
    const int cnt = min(kParamN, n1 - nb);
    __syncthreads();
    {
      const int nn = t / kParamJ, jj = t % kParamJ, j = j0 + jj;
      const bool ok = nn < cnt && j < hid;
      sd1[nn][jj] = ok ? __ldg(a.dz1 + int64_t(nb + nn) * hid + j) : 0.f;
      sr[nn][jj] = ok ? __ldg(a.r + int64_t(nb + nn) * hid + j) : 0.f;
    }
    __syncthreads();
    if (c < p) {
#pragma unroll 4
      for (int nn = 0; nn < cnt; ++nn) {
        const float mc = __ldg(a.m + int64_t(nb + nn) * p + c);
        const float d2 = __ldg(a.dz2 + int64_t(nb + nn) * p + c);
        accb2 += d2;
#pragma unroll
        for (int k = 0; k < kParamJ; ++k) {
          acc1[k] = fmaf(sd1[nn][k], mc, acc1[k]);
          acc2[k] = fmaf(d2, sr[nn][k], acc2[k]);
        }
      }
    }
    if (blockIdx.x == 0 && t < kParamJ) {
      for (int nn = 0; nn < cnt; ++nn) accb1 += sd1[nn][t];
    }
  }
  const size_t hp = size_t(hid) * p;
  float* slab = a.part + size_t(q) * (2 * hp + hid + p);
  if (c < p) {
#pragma unroll
    for (int k = 0; k < kParamJ; ++k) {
      const int j = j0 + k;
      if (j < hid) {
        slab[size_t(j) * p + c] = acc1[k];
        slab[hp + size_t(j) * p + c] = acc2[k];
      }
    }
    if (blockIdx.y == 0) slab[2 * hp + hid + c] = accb2;
  }
  if (blockIdx.x == 0 && t < kParamJ && j0 + t < hid) slab[2 * hp + j0 + t] = accb1;
}

struct FinalParams {
  const float* part;  // [q][slab]
  const float* scal;  // [ctas][3]
  float *dw1, *db1, *dw2, *db2;
  float *sum_d_o, *sum_dz, *sum_dy;
  int p, hidden, q, ctas;
};

// Sums the q chunk partials of every parameter-gradient element in chunk order; block 0 also sums the per-CTA scalar
// partials (strided per thread, then a fixed tree).
__global__ void __launch_bounds__(kFinalThreads) se_finalize_kernel(const FinalParams a) {
  const size_t hp = size_t(a.hidden) * a.p;
  const size_t slab = 2 * hp + a.hidden + a.p;
  for (size_t idx = size_t(blockIdx.x) * kFinalThreads + threadIdx.x; idx < slab;
       idx += size_t(gridDim.x) * kFinalThreads) {
    float v = 0.f;
#pragma unroll 8
    for (int q = 0; q < a.q; ++q) v += __ldg(a.part + size_t(q) * slab + idx);
    if (idx < hp) {
      a.dw1[idx] = v;
    } else if (idx < 2 * hp) {
      const size_t k = idx - hp, j = k / a.p, c = k - j * a.p;
      a.dw2[c * a.hidden + j] = v;
    } else if (idx < 2 * hp + a.hidden) {
      a.db1[idx - 2 * hp] = v;
    } else {
      a.db2[idx - 2 * hp - a.hidden] = v;
    }
  }
  if (blockIdx.x != 0 || (!a.sum_d_o && !a.sum_dz && !a.sum_dy)) return;
  __shared__ float red[3][kFinalThreads];
  float v[3] = {0.f, 0.f, 0.f};
  for (int i = threadIdx.x; i < a.ctas; i += kFinalThreads) {
#pragma unroll
    for (int k = 0; k < 3; ++k) v[k] += __ldg(a.scal + size_t(i) * 3 + k);
  }
#pragma unroll
  for (int k = 0; k < 3; ++k) red[k][threadIdx.x] = v[k];
  __syncthreads();
  for (int half = kFinalThreads / 2; half > 0; half >>= 1) {
    if (int(threadIdx.x) < half) {
#pragma unroll
      for (int k = 0; k < 3; ++k) red[k][threadIdx.x] += red[k][threadIdx.x + half];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    if (a.sum_dy) *a.sum_dy = red[0][0];
    if (a.sum_dz) *a.sum_dz = red[1][0];
    if (a.sum_d_o) *a.sum_d_o = red[2][0];
  }
}

}  // namespace

cudaError_t launch_se_backward_params(const SeBackwardArgs& a, ConvDType dtype, void* workspace,
                                      cudaStream_t stream) {
  Setup su;
  cudaError_t err = setup(a, dtype, workspace, &su);
  if (err != cudaSuccess) return err;
  const MainParams& mp = su.mp;
  const WsLayout& wl = su.wl;
  // 3. parameter-gradient partials over chunks of images
  ParamParams pp{};
  pp.m = mp.ws_m, pp.dz2 = mp.ws_dz2, pp.r = mp.ws_r, pp.dz1 = mp.ws_dz1;
  pp.part = reinterpret_cast<float*>(static_cast<unsigned char*>(workspace) + wl.part);
  pp.n = a.n, pp.p = a.p, pp.hidden = a.hidden, pp.chunk = wl.chunk;
  {
    const dim3 grid((a.p + kParamThreads - 1) / kParamThreads, (a.hidden + kParamJ - 1) / kParamJ, wl.q);
    se_param_partial_kernel<<<grid, kParamThreads, 0, stream>>>(pp);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  // 4. fixed-order sums
  FinalParams fp{};
  fp.part = pp.part, fp.scal = mp.ws_scal;
  fp.dw1 = a.dw1, fp.db1 = a.db1, fp.dw2 = a.dw2, fp.db2 = a.db2;
  fp.sum_d_o = a.sum_d_o, fp.sum_dz = a.sum_dz, fp.sum_dy = a.sum_dy;
  fp.p = a.p, fp.hidden = a.hidden, fp.q = wl.q, fp.ctas = (a.n + su.pl.g - 1) / su.pl.g;
  {
    const size_t slab = 2 * size_t(a.hidden) * a.p + a.hidden + a.p;
    const int grid = int(std::min<size_t>((slab + kFinalThreads - 1) / kFinalThreads, 1024));
    se_finalize_kernel<<<grid, kFinalThreads, 0, stream>>>(fp);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace kfuse::kernels
