// Internal: what the squeeze-excite backward's two phases (se_backward.cu: the weight transposes and the per-image
// pass; se_backward_params.cu: the parameter gradients) share: the launch constants, the main kernel's parameters,
// the workspace layout and the plan, all derived from the arguments and the SM count (setup()).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/encoder/backward_kernels.h"

namespace kfuse::kernels::se_backward_detail {

constexpr int kThreads = 512;                // main kernel
constexpr int kWarps = kThreads / 32;
constexpr int kMaxImagesPerCta = 8;
constexpr int64_t kTargetElemsPerCta = 16384; // G * hw * p: ~4 vectors per thread per tensor
constexpr size_t kDefaultSmem = 48 * 1024;
constexpr size_t kMaxSmem = 99 * 1024;        // sm_86 / sm_89 opt-in limit per block (sm_80: 163 KB, sm_90: 227 KB)
constexpr int kMaxP = 2048;
constexpr int kParamThreads = 256;            // parameter-gradient partials: one thread per channel
constexpr int kParamJ = 8;                    //   hidden units per CTA
constexpr int kParamN = 32;                   //   images staged per step
constexpr int kFinalThreads = 256;

// Where the main kernel reads dy from.
enum DyMode : int {
  kDyNhwc = 0,       // NHWC T, 16-byte loads
  kDyStagedT = 1,    // NCHW T, copied and transposed into shared memory first
  kDyStagedF32 = 2,  // NCHW fp32, the same
  kDyNchwT = 3,      // NCHW T, element loads (too large to stage)
  kDyNchwF32 = 4,    // NCHW fp32, element loads
};

// Everything the main kernel needs; shared-memory offsets (bytes) come from the host's plan (plan_main).
struct MainParams {
  const void* y;
  const float* y_offset;  // null: the ReLU was active where y > 0; else where y > T(*y_offset)
  const void* dy;
  const void* o;
  const float* o_scale;  // null: o is the SE input itself; else o = T(o * scale + shift)
  const float* o_shift;
  const float* w1;   // [hidden][p]
  const float* w1t;  // [p][hidden] (workspace)
  const float* b1;
  const float* w2;   // [p][hidden]
  const float* w2t;  // [hidden][p] (workspace)
  const float* b2;
  void* d_o;
  void* dz;
  float* ws_m;    // [n][p]
  float* ws_dz2;  // [n][p]
  float* ws_r;    // [n][hidden]
  float* ws_dz1;  // [n][hidden]
  float* ws_scal; // [ctas][3]: sum dy, sum dz, sum d_o
  int n, hw, p, hidden, dz_pitch;
  int dy_mode;
  int cached;     // dz kept in the shared-memory stage (else re-read from global memory)
  int sums;       // write the per-CTA scalar partials
  int sl_rows;    // row slices of an image in the elementwise passes: (kThreads / G) / (p / 8)
  int sl_col;     // slices of the column partials after the warp pre-reduce
  int prereduce;  // G * p / 8 divides 32: the lanes of one column are summed by shuffles first
  uint32_t off_stage, off_dyst, off_po, off_pd, off_y, off_r1, off_d1, off_red;
};

struct WsLayout {
  size_t w1t, w2t, m, dz2, r, dz1, part, scal, total;
  int q, chunk;
};

struct Plan {
  int g = 1;
  bool cached = false;
  int dy_mode = kDyNhwc;
  int sl_rows = 0, sl_col = 0, prereduce = 0;
  size_t smem = 0;
  uint32_t off_stage = 0, off_dyst = 0, off_po = 0, off_pd = 0, off_y = 0, off_r1 = 0, off_d1 = 0, off_red = 0;
};

// What both phases derive from the arguments: the device, the main kernel's plan and parameters, the workspace
// layout.
struct Setup {
  int dev = 0;
  Plan pl;
  WsLayout wl;
  MainParams mp;
};
// Returns cudaErrorInvalidValue for arguments launch_se_backward rejects.
cudaError_t setup(const SeBackwardArgs& a, ConvDType dtype, void* workspace, Setup* s);
// Depends on n, p, hidden only (the main grid has at most n CTAs).
WsLayout ws_layout(int n, int p, int hidden);

}  // namespace kfuse::kernels::se_backward_detail
