// The squeeze-excite backward's host side (se_backward_plan.cuh): the workspace layout, the main kernel's shared-
// memory plan for G images per CTA, the argument checks and the parameters both phases launch with.
#include <algorithm>
#include <atomic>
#include <cstdint>

#include "kernels/encoder/se_backward_plan.cuh"

namespace kfuse::kernels::se_backward_detail {
namespace {

size_t up256(size_t b) { return (b + 255) / 256 * 256; }
size_t up16(size_t b) { return (b + 15) / 16 * 16; }

// Shared-memory layout of the main kernel for G images per CTA; false if it does not fit.
//   [dz stage (cached): G hw p T] [region: dy stage (staged modes) | po, pd: [sl_col][rho_p][G] fp32, contract
//   partials [kThreads][G], r1, d1: [hidden][G], red: [kWarps][3]] (the dy stage is dead before the region's
//   other uses begin).
bool plan_main(const SeBackwardArgs& a, int g, bool cached, bool stage_dy, Plan* pl) {
  const int c8 = a.p / 8;
  if (int64_t(g) * c8 > kThreads) return false;
  Plan l;
  l.g = g;
  l.cached = cached;
  l.dy_mode = !a.dy_nchw ? kDyNhwc
              : stage_dy ? (a.dy_f32 ? kDyStagedF32 : kDyStagedT)
                         : (a.dy_f32 ? kDyNchwF32 : kDyNchwT);
  const int s = kThreads / g;
  l.sl_rows = s / c8;
  l.prereduce = 32 % (g * c8) == 0;
  l.sl_col = l.prereduce ? kWarps : l.sl_rows;
  const size_t rho_p = g > 1 ? size_t(a.p) + a.p / 8 : size_t(a.p);
  const size_t img_elems = size_t(g) * a.hw * a.p;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t o = off;
    off = up16(off + bytes);
    return o;
  };
  l.off_stage = uint32_t(take(cached ? img_elems * 2 : 0));
  const size_t region = off;
  l.off_po = uint32_t(take(size_t(l.sl_col) * rho_p * g * 4));
  l.off_pd = uint32_t(take(size_t(l.sl_col) * rho_p * g * 4));
  l.off_y = uint32_t(take(size_t(kThreads) * g * 4));
  l.off_r1 = uint32_t(take(size_t(a.hidden) * g * 4));
  l.off_d1 = uint32_t(take(size_t(a.hidden) * g * 4));
  l.off_red = uint32_t(take(size_t(kWarps) * 3 * 4));
  size_t end = off;
  if (l.dy_mode == kDyStagedT || l.dy_mode == kDyStagedF32) {
    l.off_dyst = uint32_t(region);
    end = std::max(end, region + img_elems * (a.dy_f32 ? 4 : 2));
  }
  l.smem = end;
  if (end > kMaxSmem) return false;
  *pl = l;
  return true;
}

bool aligned(const void* p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) & (a - 1)) == 0; }

// Everything launch_se_backward rejects, without any CUDA call.
bool valid_args(const SeBackwardArgs& a, ConvDType dtype) {
  if (dtype != ConvDType::kF16 && dtype != ConvDType::kBF16) return false;
  if (!a.y || !a.dy || !a.o || !a.w1 || !a.b1 || !a.w2 || !a.b2 || !a.d_o || !a.dz || !a.dw1 || !a.db1 || !a.dw2 ||
      !a.db2)
    return false;
  if (a.n < 1 || a.hw < 1 || a.hidden < 1 || a.p < 8 || a.p > kMaxP || a.p % 8 != 0) return false;
  if (a.dz_pitch < a.p || a.dz_pitch % 8 != 0) return false;
  if (a.dy_f32 && !a.dy_nchw) return false;
  if (!a.o_scale != !a.o_shift) return false;
  for (const void* ptr : {a.y, a.dy, a.o, static_cast<const void*>(a.d_o), static_cast<const void*>(a.dz)})
    if (!aligned(ptr, 16)) return false;
  for (const void* ptr : {static_cast<const void*>(a.w1), static_cast<const void*>(a.b1),
                          static_cast<const void*>(a.w2), static_cast<const void*>(a.b2),
                          static_cast<const void*>(a.dw1), static_cast<const void*>(a.db1),
                          static_cast<const void*>(a.dw2), static_cast<const void*>(a.db2),
                          static_cast<const void*>(a.sum_d_o), static_cast<const void*>(a.sum_dz),
                          static_cast<const void*>(a.sum_dy)})
    if (!aligned(ptr, 4)) return false;
  Plan pl;
  return plan_main(a, 1, false, false, &pl);  // the smallest configuration must fit (bounds hidden)
}

// SM count of the current device (cached per device; 132 if the query fails).
int sm_count(int dev) {
  static std::atomic<int> cache[64];  // 0 = not queried yet
  int n = 0;
  if (dev >= 0 && dev < 64 && (n = cache[dev].load(std::memory_order_relaxed)) > 0) return n;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) {
    (void)cudaGetLastError();
    return 132;
  }
  if (dev >= 0 && dev < 64) cache[dev].store(n, std::memory_order_relaxed);
  return n;
}

// Images per CTA: up to ~kTargetElemsPerCta elements (and G * p / 8 <= kThreads), but no fewer CTAs than SMs.
// Prefers the dz stage and the dy stage; falls back to fewer images, then to G = 1 without them.
Plan choose_plan(const SeBackwardArgs& a, int sms) {
  int gmax = 1;
  while (gmax < kMaxImagesPerCta && int64_t(2 * gmax) * a.p / 8 <= kThreads &&
         int64_t(2 * gmax) * a.hw * a.p <= kTargetElemsPerCta && int64_t(2 * gmax) * sms <= a.n)
    gmax *= 2;
  Plan pl;
  for (int g = gmax; g >= 1; g /= 2)
    if (plan_main(a, g, true, a.dy_nchw, &pl)) return pl;
  if (plan_main(a, 1, true, false, &pl)) return pl;
  if (plan_main(a, 1, false, a.dy_nchw, &pl)) return pl;
  plan_main(a, 1, false, false, &pl);  // fits: checked by valid_args
  return pl;
}

}  // namespace

WsLayout ws_layout(int n, int p, int hidden) {
  WsLayout l{};
  const size_t hp = size_t(hidden) * p;
  // Parameter-gradient chunks: enough CTAs to fill a GPU (~264 of 256 threads), at least 8 images per chunk.
  const int64_t tiles = int64_t((p + kParamThreads - 1) / kParamThreads) * ((hidden + kParamJ - 1) / kParamJ);
  int64_t q = std::clamp<int64_t>((264 + tiles - 1) / tiles, 1, 64);
  q = std::min<int64_t>(q, (n + 7) / 8);
  q = std::max<int64_t>(q, 1);
  l.chunk = int((n + q - 1) / q);
  l.q = (n + l.chunk - 1) / l.chunk;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t o = off;
    off = up256(off + bytes);
    return o;
  };
  l.w1t = take(hp * 4);
  l.w2t = take(hp * 4);
  l.m = take(size_t(n) * p * 4);
  l.dz2 = take(size_t(n) * p * 4);
  l.r = take(size_t(n) * hidden * 4);
  l.dz1 = take(size_t(n) * hidden * 4);
  l.part = take(size_t(l.q) * (2 * hp + hidden + p) * 4);
  l.scal = take(size_t(n) * 3 * 4);
  l.total = off;
  return l;
}


// The main kernel's parameters for these arguments (the same in both phases: the plan depends only on the arguments
// and the device's SM count).
MainParams main_params(const SeBackwardArgs& a, const Plan& pl, const WsLayout& wl, unsigned char* ws) {
  MainParams mp{};
  mp.y = a.y, mp.y_offset = a.y_offset, mp.dy = a.dy, mp.o = a.o, mp.o_scale = a.o_scale, mp.o_shift = a.o_shift;
  mp.w1 = a.w1, mp.w1t = reinterpret_cast<float*>(ws + wl.w1t), mp.b1 = a.b1;
  mp.w2 = a.w2, mp.w2t = reinterpret_cast<float*>(ws + wl.w2t), mp.b2 = a.b2;
  mp.d_o = a.d_o, mp.dz = a.dz;
  mp.ws_m = reinterpret_cast<float*>(ws + wl.m);
  mp.ws_dz2 = reinterpret_cast<float*>(ws + wl.dz2);
  mp.ws_r = reinterpret_cast<float*>(ws + wl.r);
  mp.ws_dz1 = reinterpret_cast<float*>(ws + wl.dz1);
  mp.ws_scal = reinterpret_cast<float*>(ws + wl.scal);
  mp.n = a.n, mp.hw = a.hw, mp.p = a.p, mp.hidden = a.hidden, mp.dz_pitch = a.dz_pitch;
  mp.dy_mode = pl.dy_mode;
  mp.cached = pl.cached;
  mp.sums = a.sum_d_o || a.sum_dz || a.sum_dy;
  mp.sl_rows = pl.sl_rows, mp.sl_col = pl.sl_col, mp.prereduce = pl.prereduce;
  mp.off_stage = pl.off_stage, mp.off_dyst = pl.off_dyst, mp.off_po = pl.off_po, mp.off_pd = pl.off_pd;
  mp.off_y = pl.off_y, mp.off_r1 = pl.off_r1, mp.off_d1 = pl.off_d1, mp.off_red = pl.off_red;
  return mp;
}

cudaError_t setup(const SeBackwardArgs& a, ConvDType dtype, void* workspace, Setup* s) {
  if (!valid_args(a, dtype) || !workspace || !aligned(workspace, 16)) return cudaErrorInvalidValue;
  if (const cudaError_t err = cudaGetDevice(&s->dev); err != cudaSuccess) return err;
  s->pl = choose_plan(a, sm_count(s->dev));
  s->wl = ws_layout(a.n, a.p, a.hidden);
  s->mp = main_params(a, s->pl, s->wl, static_cast<unsigned char*>(workspace));
  return cudaSuccess;
}

}  // namespace kfuse::kernels::se_backward_detail
