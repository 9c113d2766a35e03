// The Hopper weight gradient of 3x3 / 64 -> 64 convolutions on small images (wgrad_wgmma.h). sm_90a only: wgmma.
//
// Shared memory, per stage (three where they fit, else two: one image computes while the next ones load):
//   x:  8 planes (one per 16-byte channel group), each the (h+2) x (w+2) haloed image, one 16-byte chunk per pixel;
//   dy: 8 planes of the h x w image, the same way.
// A plane is 16 bytes longer than a multiple of 128 bytes, so the 8 chunks of one pixel (one 128-byte global row)
// land in 8 different bank groups (conflict-free cp.async writes).
//
// The GEMM per image: dw_tap[k][c] += sum over pixels of dy[pixel][k] * x_tap[pixel][c], K = pixels. Both operands
// are "MN-major" for wgmma: 8 consecutive pixels of one plane are one 128-byte core matrix (8 K rows of 8 channels),
// the next 8 pixels of the row are the next core matrix along K (+128 bytes), the next 8 channels the next plane.
// A 16-pixel K step lies in one image row (w % 16 == 0), so x's core matrices for tap (r, s) start at halo pixel
// (y + r, x0 + s): the im2col is the descriptor's start address, no copy.
// A = dy^T (M = 64 output channels) goes to registers with ldmatrix.trans once per K step and is shared by the three
// taps s of the warpgroup's filter row r (wgmma's register-A form: B alone is read from shared memory, 6 KB per
// 3 MMAs instead of 12 KB).
//
// Speed (H100, batch 2048, 16 x 16): ~105 us against cuDNN's 99 and the CUTLASS 2.x split-K candidates' 242; the
// tensor pipe is active half the time, the loads (16-byte cp.async scattered into the planes) are what limits it
// (ncu: tensor pipe 50%, DRAM 40%, L2 74%). The tuner chooses among them.
#include "kernels/conv/wgrad_wgmma.h"

#include <cstdint>

#include "kernels/shared_memory_ptx.cuh"
#include "kernels/wgmma_ptx.cuh"

namespace kfuse::kernels {
namespace {

constexpr int kThreads = 384;                 // compute: three warpgroups, filter rows r = 0, 1, 2 (+ one loading)
constexpr int kFilterElems = 64 * 3 * 3 * 64;  // KRSC
constexpr int kHopperSmem = 227 * 1024;        // Hopper's opt-in shared memory per block
constexpr int kSmemReserve = 1024;             // the kernel's static shared memory (stage barriers), rounded up
constexpr int kMaxStages = 3;

int round_up(int v, int m) { return (v + m - 1) / m * m; }

struct Layout {
  int x_plane, dy_plane, stage;
  explicit Layout(int h, int w)
      : x_plane(round_up((h + 2) * (w + 2) * 16, 128) + 16),
        dy_plane(round_up(h * w * 16, 128) + 16),
        stage(8 * (x_plane + dy_plane)) {}
  // Three stages where they fit (the producer then runs up to two images ahead), else two.
  int stages(int smem_limit) const { return kMaxStages * stage <= smem_limit ? kMaxStages : 2; }
  int smem(int smem_limit) const { return stages(smem_limit) * stage; }
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KFUSE_WGRAD_WGMMA_DEVICE 1
#endif

#ifdef KFUSE_WGRAD_WGMMA_DEVICE
using ptx::cp_async16;
using ptx::ldsm_x4_trans;
using ptx::smem_u32;

using ptx::fence_proxy_async;
using ptx::hold;
using ptx::mbar_arrive;
using ptx::mbar_init;
using ptx::mbar_wait;
using ptx::wgmma_commit;
using ptx::wgmma_fence;
using ptx::wgmma_wait;
// MN-major operand without swizzle: leading byte offset = the next 8 K rows (128 bytes: the next 8 pixels), stride
// byte offset = the next 8 MN columns (the next channel plane).
__device__ __forceinline__ uint64_t desc_mn(uint32_t addr, uint32_t plane_bytes) {
  return ptx::smem_desc(addr, 128, plane_bytes);
}

#define KFUSE_WGMMA_D32                                                                                             \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29," \
  "%30,%31}"
#define KFUSE_WGMMA_D32_OPERANDS                                                                                     \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),      \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),        \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),       \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

// d (64 x 64, fp32, the warpgroup's C layout) += A (registers, 64 x 16) * B (shared, MN-major, 16 x 64).
template <bool kBf16>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b) {
  if constexpr (kBf16) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " KFUSE_WGMMA_D32
                 ", {%32,%33,%34,%35}, %36, 1, 1, 1, 1;\n"
                 : KFUSE_WGMMA_D32_OPERANDS
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
  } else {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " KFUSE_WGMMA_D32
                 ", {%32,%33,%34,%35}, %36, 1, 1, 1, 1;\n"
                 : KFUSE_WGMMA_D32_OPERANDS
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
  }
}
// The loading warpgroup: eight threads copy the eight 16-byte chunks of one pixel, a pass of the warp four whole
// 128-byte pixel rows (coalesced reads; the 8 chunks land in 8 bank groups).
// Thread t copies chunk g = t % 8 of pixels t / 8, t / 8 + 16, ...: with w % 16 == 0 a step of 16 pixels keeps
// the column and moves a row every w / 16 steps, so the addresses advance by constants (no division: these
// warps share the schedulers with the MMA warps).
__device__ __forceinline__ void load_images(const uint16_t* __restrict__ dy, const uint16_t* __restrict__ x,
                                            uint64_t* full, uint64_t* empty, uint32_t base, int t, int n, int w,
                                            int hw, int pitch, int x_plane, int dy_plane, int stage_bytes, int stages,
                                            int stride) {
  const int g = t & 7, p_first = t >> 3;
  for (int it = 0, img = blockIdx.x; img < n; ++it, img += stride) {
    const int st = it % stages, use = it / stages;
    if (use > 0) mbar_wait(smem_u32(&empty[st]), (use - 1) & 1);
    const uint32_t xs = base + st * stage_bytes;
    uint32_t xd = xs + g * x_plane + ((p_first / w + 1) * pitch + p_first % w + 1) * 16;
    uint32_t dd = xs + 8 * x_plane + g * dy_plane + p_first * 16;
    const uint16_t* src_x = x + (static_cast<size_t>(img) * hw + p_first) * 64 + g * 8;
    const uint16_t* src_dy = dy + (static_cast<size_t>(img) * hw + p_first) * 64 + g * 8;
    for (int p = p_first, px = p_first % w; p < hw; p += 16) {
      cp_async16(xd, src_x);
      cp_async16(dd, src_dy);
      src_x += 16 * 64, src_dy += 16 * 64, dd += 16 * 16, xd += 16 * 16;
      if ((px += 16) >= w) px -= w, xd += 2 * 16;  // the next row: skip the two halo columns
    }
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(&full[st])) : "memory");
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// Four fragment buffers with fixed registers (K steps in groups of four). Step k's fragment is loaded during step
// k - 1, after that step's MMAs are issued and the wait (wait_group 3) that completes the MMAs of step k - 4, the
// buffer's previous reader; so the load's latency (shared memory is busy with the MMAs' B reads) is hidden by a
// step, and three steps of MMAs stay in flight.
constexpr int kBuffers = 4;

// One image's K steps (ksteps of 16 pixels) into acc: dy^T's fragments from a_addr, x's taps from b_addr. Releases
// the previous image's stage (pending) once its MMAs are complete.
template <bool kBf16>
__device__ __forceinline__ void image_mma(float (&acc)[3][32], uint32_t (&a)[kBuffers][4], uint32_t a_addr,
                                          uint32_t b_addr, uint64_t* empty, int& pending, int ksteps, int w,
                                          int x_plane) {
  int px = 0;
  // Step 0 uses buffer 0, last read by the previous image's step 4 * floor((ksteps - 1) / 4), which has
  // (ksteps - 1) % 4 groups of MMAs after it.
  switch ((ksteps - 1) & 3) {
    case 0: wgmma_wait<0>(); break;
    case 1: wgmma_wait<1>(); break;
    case 2: wgmma_wait<2>(); break;
    default: wgmma_wait<3>(); break;
  }
  hold(a[0]);
  ldsm_x4_trans(a[0], a_addr);
  for (int kb = 0; kb < ksteps; kb += kBuffers) {
#pragma unroll
    for (int j = 0; j < kBuffers; ++j) {
      const int k = kb + j;
      if (k == ksteps) break;  // a number of steps that is not a multiple of four
      const uint64_t desc = desc_mn(b_addr, x_plane);
      wgmma_fence();
#pragma unroll
      for (int s = 0; s < 3; ++s) wgmma_m64n64k16_rs<kBf16>(acc[s], a[j], desc + s);  // tap s: 16 bytes on
      wgmma_commit();
      a_addr += 16 * 16, b_addr += 16 * 16;
      if ((px += 16) == w) px = 0, b_addr += 2 * 16;
      wgmma_wait<kBuffers - 1>();  // steps k - 3 and before are complete
      if (k == kBuffers - 1 && pending >= 0) {  // so are the previous image's MMAs
        mbar_arrive(smem_u32(&empty[pending]));
        pending = -1;
      }
      if (k + 1 < ksteps) {
        hold(a[(j + 1) % kBuffers]);
        ldsm_x4_trans(a[(j + 1) % kBuffers], a_addr);
      }
    }
  }
}

// acc[s][4 j + e] of warp wq: output channel k = 16 wq + lane / 4 + 8 (e >> 1), input channel c = 8 j + 2 (lane % 4)
// + (e & 1).
__device__ __forceinline__ void store_partial(const float (&acc)[3][32], float* out, int wg, int wq, int lane) {
  const int g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int s = 0; s < 3; ++s)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int k = 16 * wq + g + 8 * hh, c = 8 * j + 2 * q;
        *reinterpret_cast<float2*>(out + ((k * 3 + wg) * 3 + s) * 64 + c) =
            make_float2(acc[s][4 * j + 2 * hh], acc[s][4 * j + 2 * hh + 1]);
      }
}
#endif  // KFUSE_WGRAD_WGMMA_DEVICE

// Grid: min(n, SMs) CTAs, image i to CTA i % grid; CTA b writes its partial gradient at partial + b * kFilterElems.
// Warps 0-11 (three warpgroups) compute; warpgroup 3 loads: the compute warps never issue copies, whose issue stalls
// once the SM's outstanding requests are at their limit (a first version, where all threads loaded the next image
// between two images' MMAs, took 138 us at batch 2048 against ~50 for the loads alone).
// Stage st's barriers: full[st] completes when an image's copies into it have landed (128 producer threads, each
// arriving when its own cp.async complete); empty[st] when the 384 compute threads have finished reading it.
// 512 threads (a fourth warpgroup loads): each SM sub-partition holds one warp of each warpgroup and 16K registers,
// so the launch gives 128 per thread and the warpgroups then trade them (setmaxnreg): the loaders keep 40, the compute
// warps take 152 (at 128 ptxas serializes their MMAs; 40 + 3 x 152 = 496 <= 512 registers per sub-partition lane).
template <bool kBf16>
__global__ void __launch_bounds__(kThreads + 128, 1)
    wgrad3x3_c64_kernel(const uint16_t* __restrict__ dy, const uint16_t* __restrict__ x, float* __restrict__ partial,
                        int n, int h, int w, int x_plane, int dy_plane, int stages) {
#ifdef KFUSE_WGRAD_WGMMA_DEVICE
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t full[kMaxStages], empty[kMaxStages];
  const uint32_t base = smem_u32(smem);
  const int tid = threadIdx.x, wg = tid >> 7, wq = (tid >> 5) & 3, lane = tid & 31;
  const int hw = h * w, pitch = w + 2;
  const int stage_bytes = 8 * (x_plane + dy_plane);
  const int stride = gridDim.x;

  // The halo stays zero: loads write only the interior.
  for (int i = tid; i < stages * stage_bytes / 16; i += blockDim.x)
    asm volatile("st.shared.v4.u32 [%0], {%1,%1,%1,%1};\n" ::"r"(base + 16 * i), "r"(0u) : "memory");
  if (tid < stages) {
    mbar_init(smem_u32(&full[tid]), 128);
    mbar_init(smem_u32(&empty[tid]), kThreads);
  }
  __syncthreads();

  if (tid >= kThreads) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    load_images(dy, x, full, empty, base, tid - kThreads, n, w, hw, pitch, x_plane, dy_plane, stage_bytes, stages,
                stride);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 152;\n" ::: "memory");

  float acc[3][32];
#pragma unroll
  for (int s = 0; s < 3; ++s)
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[s][i] = 0.f;

  // This lane's ldmatrix row of dy^T: x4 matrices 0..3 = (channels +0, pixels +0), (+8, +0), (+0, +8), (+8, +8).
  const uint32_t a_lane = (2 * wq + ((lane >> 3) & 1)) * dy_plane + ((lane & 7) + ((lane >> 4) << 3)) * 16;
  const int ksteps = hw / 16;
  uint32_t a[kBuffers][4] = {};
  // A stage is released (empty) once its MMAs are complete. With four steps or more per image that is known at the
  // next image's fourth step, so the MMAs need not drain at each image's end; with fewer, they drain.
  const bool defer_release = ksteps >= kBuffers;
  int pending = -1;  // the stage whose release waits for its MMAs
  for (int it = 0, img = blockIdx.x; img < n; ++it, img += stride) {
    const int st = it % stages, use = it / stages;
    mbar_wait(smem_u32(&full[st]), use & 1);
    fence_proxy_async();  // the copies were generic-proxy writes; the MMAs read through the async proxy
    // The addresses advance by constants, computed off the path from a wait to the next MMAs. b: tap (r = wg, s = 0)
    // of pixels (0, 0..15): halo pixel (y + r, x0 + s).
    const uint32_t xs = base + st * stage_bytes;
    image_mma<kBf16>(acc, a, xs + 8 * x_plane + a_lane, xs + wg * pitch * 16, empty, pending, ksteps, w, x_plane);
    if (defer_release) {
      pending = st;
    } else {
      wgmma_wait<0>();
#pragma unroll
      for (int j = 0; j < kBuffers; ++j) hold(a[j]);
      mbar_arrive(smem_u32(&empty[st]));  // this thread's MMAs have read the stage
    }
  }
  wgmma_wait<0>();
#pragma unroll
  for (int s = 0; s < 3; ++s) hold(acc[s]);
#pragma unroll
  for (int j = 0; j < kBuffers; ++j) hold(a[j]);
  store_partial(acc, partial + static_cast<size_t>(blockIdx.x) * kFilterElems, wg, wq, lane);
#else
  // Compiled for another architecture: never launched (wgrad_wgmma_can_implement requires compute capability 9.0).
  __trap();
#endif
}

// dw[i] = sum over the CTAs' partials in CTA order (fixed: reproducible), four floats per thread.
__global__ void sum_partials_kernel(const float4* __restrict__ partial, float4* __restrict__ dw, int parts) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= kFilterElems / 4) return;
  float4 s = partial[i];
#pragma unroll 8
  for (int b = 1; b < parts; ++b) {
    const float4 v = partial[static_cast<size_t>(b) * (kFilterElems / 4) + i];
    s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
  }
  dw[i] = s;
}

struct DeviceInfo {
  int sms = 0, major = 0, minor = 0, smem_optin = 0;
};
// The current device's properties (queried per call: cheap, and correct when the caller switches devices).
bool device_info(DeviceInfo& d) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  return cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess &&
         cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
         cudaDeviceGetAttribute(&d.minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess &&
         cudaDeviceGetAttribute(&d.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) == cudaSuccess;
}

std::string problem_reason(const Conv2dProblem& p, ConvDType dtype) {
  if (dtype != ConvDType::kF16 && dtype != ConvDType::kBF16) return "fp16 or bf16 only";
  if (p.c != 64 || p.k != 64) return "64 input and 64 output channels only";
  if (p.r != 3 || p.s != 3 || p.pad_h != 1 || p.pad_w != 1 || p.stride_h != 1 || p.stride_w != 1)
    return "3x3 filters, stride 1, padding 1 only";
  if (p.n < 1 || p.h < 1 || p.w < 1) return "empty batch or image";
  if (p.w % 16 != 0) return "the image width must be a multiple of 16";
  if (2 * Layout(p.h, p.w).stage > kHopperSmem - kSmemReserve) return "the image is too large for two stages in shared memory";
  return "";
}

int grid_size(const Conv2dProblem& p, const DeviceInfo& d) { return p.n < d.sms ? p.n : d.sms; }

// Why problem p cannot run on the current device ("" if it can); d receives the device's properties.
std::string refusal(const Conv2dProblem& p, ConvDType dtype, DeviceInfo& d) {
  std::string reason = problem_reason(p, dtype);
  if (!reason.empty()) return reason;
  if (!device_info(d)) return "no CUDA device";
  if (d.major != 9 || d.minor != 0) return "needs compute capability 9.0 (sm_90a wgmma)";
  if (2 * Layout(p.h, p.w).stage > d.smem_optin - kSmemReserve) return "the device's shared memory is too small";
  return "";
}

}  // namespace

bool wgrad_wgmma_can_implement(const Conv2dProblem& p, ConvDType dtype, std::string* why) {
  DeviceInfo d;
  const std::string reason = refusal(p, dtype, d);
  if (why != nullptr) *why = reason;
  return reason.empty();
}

size_t wgrad_wgmma_workspace_bytes(const Conv2dProblem& p, ConvDType dtype) {
  DeviceInfo d;
  if (!problem_reason(p, dtype).empty() || !device_info(d)) return 0;
  return static_cast<size_t>(grid_size(p, d)) * kFilterElems * sizeof(float);
}

cudaError_t wgrad_wgmma(const Conv2dProblem& p, ConvDType dtype, const void* dy, const void* x, float* dw,
                        void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  DeviceInfo d;
  if (!refusal(p, dtype, d).empty()) return cudaErrorInvalidValue;
  auto aligned = [](const void* ptr) { return ptr != nullptr && reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  if (!aligned(dy) || !aligned(x) || !aligned(dw) || !aligned(workspace)) return cudaErrorInvalidValue;
  const int grid = grid_size(p, d);
  if (workspace_bytes < static_cast<size_t>(grid) * kFilterElems * sizeof(float)) return cudaErrorInvalidValue;
  const Layout l(p.h, p.w);
  const int limit = d.smem_optin - kSmemReserve;
  const int smem = l.smem(limit);
  auto kernel = dtype == ConvDType::kBF16 ? wgrad3x3_c64_kernel<true> : wgrad3x3_c64_kernel<false>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  float* partial = static_cast<float*>(workspace);
  kernel<<<grid, kThreads + 128, smem, stream>>>(static_cast<const uint16_t*>(dy), static_cast<const uint16_t*>(x),
                                                 partial, p.n, p.h, p.w, l.x_plane, l.dy_plane,
                                                 l.stages(limit));
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  constexpr int kSumThreads = 128, kVectors = kFilterElems / 4;
  sum_partials_kernel<<<(kVectors + kSumThreads - 1) / kSumThreads, kSumThreads, 0, stream>>>(
      reinterpret_cast<const float4*>(partial), reinterpret_cast<float4*>(dw), grid);
  return cudaGetLastError();
}

}  // namespace kfuse::kernels
