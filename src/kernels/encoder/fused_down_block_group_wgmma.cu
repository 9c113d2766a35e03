// Block 3 of the encoder (128 -> 256 channels, stride 2, the pooled shortcut, 8 x 8 -> 4 x 4 maps) as one kernel on
// Hopper warpgroup MMAs (sm_90a), for inference: the shortcut (3x3 average pool + 1x1 conv), conv1 + FixUp, conv2 +
// FixUp, the squeeze-excitation and the residual join; 4 cooperating CTAs per 4 images.
//
// Why. Block 3 ran as four kernels (conv1 and the shortcut side by side, conv2, the squeeze-excite): ~28 us of the
// forward's ~80 at batch 128 for 3.8 GFLOP, each convolution bound by its tiles re-streaming both operands from L2
// (measured: the SMs' L2 ingress). Block 2's kernel (fused_down_block_wgmma.cu) keeps an image on chip and streams
// only the filters, but here one image is only 16 output pixels and the filters are 1.8 MB: one CTA per image would
// stream 1.8 MB per SM. So a group of 4 CTAs takes 4 images (M = 64 rows: the minimum of a warpgroup MMA) and
// splits the 256 output channels (64 each): every CTA streams a quarter of the filters (448 KB, as block 2's kernel)
// and the two things a channel slice cannot compute alone go through L2: conv2's input h2 (each CTA writes its 64
// channels, then loads the other 192) and the squeeze's fc1 (each CTA's partial sums over its channels).
//
// Why not a thread block cluster with distributed shared memory (the first version): a cluster of 4 must sit in one
// GPC, and at one CTA per SM only 30 such clusters fit on a 132-SM H100 (cudaOccupancyMaxActiveClusters), so batch
// 128 (32 groups) ran in two waves: 29.9 us against 15 us for one. Plain CTAs fill 128 SMs in one wave. A CTA takes
// its (group, rank) from a ticket counter as it starts, so a CTA that waits for its group only waits for CTAs that
// were dispatched before it and run (forward progress at any batch size, with no co-residency assumption).
//
// How:
//   - M = 4 images x 16 output pixels (warp w of a warpgroup: image w % 4), N = the CTA's 64 output channels, K = taps
//     x input channels; wgmma m64n64k16 with A from registers and B (the filters) from shared memory. Register A is
//     what makes a 4-pixel-wide output work: block 2's trick (each tap's im2col a descriptor start address) needs
//     8-pixel rows, but ldmatrix takes any address per row, so each lane points its row at the tap's input pixel, or
//     at a zero pixel where the tap falls in the padding.
//   - Two compute warpgroups. Warpgroup 0 runs conv1 over its 9 taps; then warpgroup 1 multiplies the same taps' A
//     fragments with the shortcut's 1x1 filter (resident, the same on every tap: the 3x3 average pool is the sum over
//     the taps, / 9 at the end, with no pool pass, which on 4 warps took 4.8 us of the first version's 25) while
//     warpgroup 0 writes h2 and the group exchanges it. (Side by side the two ran at half speed each: these
//     register-A MMAs share the tensor cores at ~60-80 clocks per m64n64k16. A pool summed from the fragments in
//     fp32 registers measured slower still: ~4 us.)
//     conv2's 18 chunks alternate between the warpgroups (input channels 0-127 / 128-255), whose two accumulators are
//     summed through shared memory, each warpgroup keeping 32 of the 64 channels for the epilogue.
//   - Activations pixel-major with swizzled 16-byte chunks (chunk c of pixel p at c ^ f(p), f chosen so that the 8
//     rows of each ldmatrix / stmatrix matrix hit 8 different bank groups for every tap, stride 2 included).
//   - The filters (per CTA: the shortcut's 1x1, conv1's 9 taps, conv2's 9 taps x 2 input halves; 28 chunks of 16 KB,
//     fused_down_block_filter_ranks() slices of tap planes, weight_layout.h kTapPlanes): the shortcut's chunk to its
//     own buffer, the others through a ring of 6 stages as in block 2's kernel (one producer thread, bulk copies on
//     full barriers, an empty barrier per stage). The next chunk's A fragments load while a chunk's MMAs run.
//   - h2 = T(T(relu(acc + b1b)) + b2a) into this CTA's channels of the local h2 image and of args.h2 (global), each
//     warp its own rows and then a release increment of the group's counter; once the counter shows the group's 16
//     increments, the other 192 channels from args.h2 (cp.async through L2). The counters only grow (a fixed number
//     of increments per group and launch: the generation is old / that number), so replays need no reset.
//   - Squeeze-excite per warp (image, 32 channels): channel sums over lanes, fc1's partial sums over the CTA's 64
//     channels to args.partials, the same counter handshake, the 4 ranks' sums in rank order 0..3 (the same bits in
//     every CTA), ReLU, the warp's 32 gates, the join y = relu(o * gate + identity) and a_next = T(y + next_b1a).
//   - Loops over taps stay rolled (a pair of taps per iteration, for the two register buffers): the first version,
//     unrolled, lost 21% of its stall samples to instruction fetch.
// Numerics as block 2's kernel: the same rules, fixed reduction orders, no atomic arithmetic on data (the same input
// gives the same bits). Shared memory: 96 KB ring + 16 KB shortcut filter + 64 KB image (later v, the identity and conv2's
// exchange) + 32 KB h2 + 8.3 KB squeeze-excite weights + 3.8 KB squeeze-excite scratch + a zero pixel, barriers.
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/encoder/encoder_kernels.h"
#include "kernels/encoder/fused_down_block_group_phases.cuh"
#include "kernels/programmatic_launch.h"

namespace kfuse::kernels {
namespace {

using namespace down_group;

template <class T, bool kBf16>
__global__ void __launch_bounds__(kThreads, 1) fused_down_block_group_kernel(const FusedDownBlockArgs p) {
#ifdef KFUSE_FUSED_DOWN_GROUP_DEVICE
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t base = smem_u32(smem);
  const uint32_t ring = base + kRingOff, scf = base + kScOff, img = base + kImgOff, zero = base + kZeroOff,
                 h2 = base + kH2Off, fc = base + kFcOff, full0 = base + kBarOff, empty0 = full0 + 8 * kStages,
                 sc_full = empty0 + 8 * kStages, image_ready = sc_full + 8, conv1_done = image_ready + 8,
                 shortcut_done = conv1_done + 8;
  const uint32_t vt = img + kVOff, idt = img + kIdtTileOff, xchg = img + kXchgOff;
  float* const se = reinterpret_cast<float*>(smem + kSeOff);
  const float* const fc1_w = reinterpret_cast<const float*>(smem + kFcOff + kFc1W);
  const float* const fc1_b = reinterpret_cast<const float*>(smem + kFcOff + kFc1B);
  const float* const fc2_w = reinterpret_cast<const float*>(smem + kFcOff + kFc2W);
  const float* const fc2_b = reinterpret_cast<const float*>(smem + kFcOff + kFc2B);
  const int tid = threadIdx.x;
  unsigned* const sync = p.sync;  // [0] the ticket counter, [1 + 2 group] h2's, [2 + 2 group] the partial sums'

  const int ticket = init_barriers_and_ticket(sync, smem, full0, zero, tid);
  const int rank = ticket % kRanks, group = ticket / kRanks, image0 = group * kImages;

  if (tid >= kCompute) {
    // The producer: the filters are parameters, never written by the kernels before this one, so the stream starts
    // before the programmatic wait.
    // (A device function of its own, this loop compiles differently: it stays in the kernel.)
    if (tid == kCompute) {
      const char* src = static_cast<const char*>(p.filters) + size_t(rank) * kChunks * kChunkBytes;
      ptx::mbar_arrive_expect_tx(sc_full, kChunkBytes);
      ptx::bulk_copy_g2s(scf, src, kChunkBytes, sc_full);
      for (int c = 1; c < kChunks; ++c) {
        const int s = (c - 1) % kStages, use = (c - 1) / kStages;
        if (c == kFirstChunks) ptx::mbar_wait(image_ready, 0);  // the image first (block 2's kernel: measured)
        if (use > 0) ptx::mbar_wait(empty0 + 8 * s, (use - 1) & 1);
        ptx::mbar_arrive_expect_tx(full0 + 8 * s, kChunkBytes);
        ptx::bulk_copy_g2s(ring + s * kChunkBytes, src + size_t(c) * kChunkBytes, kChunkBytes, full0 + 8 * s);
      }
    }
    return;
  }
  load_se_weights(p, fc, rank, tid);
  pdl_wait_for_predecessor();
  pdl_allow_successor();
  load_images(p, image0, img, image_ready, tid);
  ptx::named_barrier(1, kCompute);

  const int lane = tid & 31, warp = tid >> 5, wg = warp >> 2, w4 = warp & 3, q = lane & 3, mi = lane >> 3,
            hi = mi >> 1;
  const int pl = 8 * (mi & 1) + (lane & 7);
  const LaneRow lr{w4, pl, pl >> 2, pl & 3, 16 * w4 + pl};
  const FilterRing fr{ring, full0, empty0, lane};
  uint32_t a[2][8][4];
  float acc[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = 0.f;

  // conv1's taps, then the shortcut's on the same A fragments, one after the other on the tensor cores (side by side,
  // each ran at half speed: 4.5 us for both): warpgroup 0 multiplies them with conv1's filter; warpgroup 1 then with
  // the shortcut's 1x1 filter while warpgroup 0 writes h2 and the group exchanges it.
  const float b1b = __ldg(p.scalars + 1), scale = __ldg(p.scalars + 3), b2b = __ldg(p.scalars + 4);
  const FaithfulPost h2_post = faithful_post<T>(__ldg(p.scalars + 2));  // b2a
  unsigned h2_target = 0;
  if (wg == 0)
    h2_target = conv1_and_publish_h2<T, kBf16>(p, acc, a, fr, lr, img, zero, h2, conv1_done, b1b, h2_post, rank, group,
                                               image0, hi, tid);
  else
    shortcut_to_identity<T, kBf16>(acc, a, lr, img, zero, scf, idt, conv1_done, sc_full, shortcut_done, hi, lane);
  if (tid == 0) group_wait(sync + 1 + 2 * group, h2_target);
  ptx::named_barrier(1, kCompute);  // the group's slices of h2 are in args.h2; the input image is free
  gather_h2(p, h2, rank, image0, tid);
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = 0.f;
  ptx::cp_async_wait<0>();
  ptx::named_barrier(1, kCompute);  // all 256 channels of h2 are in

  // conv2: warpgroup g takes the chunks of input half g (chunk 10 + 2 t + g: tap t, channels 128 g .. 128 g + 127).
  {
    auto chunk = [&](int t) { return kConv2Chunk + 2 * t + wg; };
    conv_taps<kBf16>(
        acc, a, 16 * wg, hi, [&](int t) { return lr.conv2(h2, zero, t); }, [&](int t) { return fr.chunk(chunk(t)); },
        [&](int t) { fr.wait(chunk(t)); }, [&](int t) { fr.release(chunk(t)); });
  }
  float mine[16];
  sum_halves(acc, mine, xchg, wg, tid);

  store_v_and_means<T>(mine, vt, se, lr, wg, hi, lane, q, scale, b2b);
  const float* const mean = se + kMean / 4 + w4 * kPr;
  ptx::named_barrier(1, kCompute);  // both warpgroups' means of the image are in
  fc1_partials(p, fc1_w, mean, group, rank, wg, w4, lane);
  group_handshake(sync + 2 + 2 * group, tid);
  load_group_partials(p, se, group, tid);
  ptx::named_barrier(1, kCompute);
  float* const hid = se + kHid / 4 + warp * kHidden;
  float* const gates = se + kGate / 4 + warp * 32;
  warp_gates(se, hid, gates, fc1_b, fc2_w, fc2_b, wg, w4, lane);
  excite_join_store<T>(p, gates, vt, idt, image0, rank, wg, w4, lane, scale, b2b);
#else
  // Compiled for another architecture: never launched (fused_down_block_group_smem_bytes requires compute
  // capability 9.0).
  __trap();
#endif
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace

int fused_down_block_groups(int n) { return (n + kImages - 1) / kImages; }

int fused_down_block_group_ranks(int in_planes, int planes, int hidden) {
  return in_planes == kCin && planes == kP && hidden == kHidden ? kRanks : 0;
}

size_t fused_down_block_group_smem_bytes(int in_planes, int planes, int hidden, int h, int w, int cc_major,
                                           int cc_minor) {
  return in_planes == kCin && planes == kP && hidden == kHidden && h == 2 * kOutW && w == 2 * kOutW &&
                 cc_major == 9 && cc_minor == 0
             ? kSmemBytes
             : 0;
}

cudaError_t launch_fused_down_block_group_wgmma(const FusedDownBlockArgs& p, ConvDType dtype, size_t smem,
                                               cudaStream_t stream) {
  if (!p.h2 || !p.partials || !p.sync || !aligned16(p.h2) || !aligned16(p.partials) || !aligned16(p.fc1_w) ||
      !aligned16(p.fc1_b) || !aligned16(p.fc2_w) || !aligned16(p.fc2_b))
    return cudaErrorInvalidValue;
  const auto kernel = dtype == ConvDType::kF16 ? fused_down_block_group_kernel<__half, false>
                                               : fused_down_block_group_kernel<__nv_bfloat16, true>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (err != cudaSuccess) return err;
  err = launch_kernel(kernel, dim3(fused_down_block_groups(p.n) * kRanks), dim3(kThreads), smem, stream, true, p);
  return err != cudaSuccess ? err : cudaGetLastError();
}

}  // namespace kfuse::kernels
