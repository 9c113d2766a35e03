// Orchestration of the training step (no kernel code here): device-side parameter packing, the training forward
// (the inference launch sequence, keeping every block's output; conv2 stores its raw output v, and the squeeze-excite
// kernels apply o = v * scale + b2b as they read it: no epilogue pass after a cuDNN conv2), and the backward, block
// by block from the last:
//
//   SE + residual backward  -> d_o, dz (= d identity), SE parameter gradients, sum d_o (b2b), sum dy (next b1a)
//   conv2 wgrad (h2, d_o)   -> G2;  dW2 = scale * G2,  d scale = <W2, G2>
//   conv2 dgrad             -> dh2 / scale = conv2^T(d_o)
//   ReLU-mask backward      -> d_pre1 = scale * dh2 where relu was active, sum dh2 (b2a), sum d_pre1 (b1b)
//   (where the tuner runs conv1 in cuDNN, the forward's conv1 + FixUp epilogue and these two steps are cuDNN graphs
//   instead, kernels/conv/cudnn_fused.h: no separate memory-bound pass after either convolution)
//   conv1 [+ shortcut]      -> the downsampling blocks keep [d_pre1 | dz] as one 2P-channel gradient and the two
//                              filters as one [2P][3][3][Cin] filter (the shortcut is a 3x3 conv with Wd/9 taps), so
//                              one wgrad and one strided dgrad serve both; identity blocks: conv1's dgrad plus dz
//   Every weight and data gradient runs the tuner's choice for its shape (backward_conv_selection.h): kfuse's CUTLASS
//   kernels (a stride-1 dgrad as a forward conv with flipped filters) or cuDNN's.
//   stem backward           -> dW_stem, sum da (block 1's b1a), and dL/dx when asked
//   gradient finalize       -> per block, KRSC sums (fp32, or T from cuDNN) into PyTorch's fp32 layouts
//
// The weight gradients (and their finalize) run on a side branch of the backward: nothing on the data-gradient path
// waits for them, so they fill the SMs that the memory-bound kernels and the data gradients' tails leave idle.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <set>
#include <unordered_map>

#include "kernels/conv/conv_backward.h"
#include "kernels/conv/cudnn_fused.h"
#include "kernels/encoder/backward_kernels.h"
#include "kernels/encoder/weight_layout.h"
#include "kfuse/encoder_gpu.h"
#include "encoder/backward_conv_selection.h"
#include "encoder/encoder_gpu_impl.h"
#include "encoder/encoder_training_state.h"

namespace kfuse {

using kernels::GradJob;
using kernels::PackJob;
using kernels::PackKind;
using kernels::ParamDType;

void destroy_training_state(TrainingState* t) { delete t; }

namespace gpu_detail {
namespace {

ParamDType param_dtype(DType d) {
  switch (d) {
    case DType::F32: return ParamDType::kF32;
    case DType::F16: return ParamDType::kF16;
    case DType::BF16: return ParamDType::kBF16;
    default: throw InvalidArgument(std::string("kfuse: parameters must be F32, F16 or BF16, got ") + dtype_name(d));
  }
}
size_t param_dtype_bytes(ParamDType d) { return d == ParamDType::kF32 ? 4 : 2; }

}  // namespace
}  // namespace gpu_detail

namespace train_detail {

using namespace gpu_detail;

TrainingState& training(EncoderGpu::Impl& m) {
  if (!m.training) {
    m.training.reset(new TrainingState);
    TrainingState& t = *m.training;
    t.wgrad_branch = m.options.wgrad_branch;
    t.cudnn_fused = m.options.cudnn_fused == 0   ? TrainingState::CudnnFused::kOff
                    : m.options.cudnn_fused == 1 ? TrainingState::CudnnFused::kWhereCudnn
                                                 : TrainingState::CudnnFused::kAll;
    int64_t off = 0;
    const auto specs = m.config.parameter_specs();
    for (size_t i = 0; i < specs.size(); ++i) {
      t.index[specs[i].name] = i;
      t.grad_offset.push_back(off);
      int64_t numel = 1;
      for (int64_t d : specs[i].shape) numel *= d;
      t.param_numel.push_back(numel);
      off += numel;
    }
  }
  return *m.training;
}

// What the backward kernels cover (the forward and the packing cover more).
void check_trainable(const EncoderGpu::Impl& m) {
  KFUSE_CHECK(m.config.base_planes <= 64, Unsupported, "kfuse's training step supports base_planes up to 64, got ",
              m.config.base_planes);
  for (const auto& b : m.blocks)
    KFUSE_CHECK(!b.has_downsample || b.stride > 1, Unsupported, "kfuse's training step does not cover block '",
                b.prefix, "' (a 1x1 shortcut without stride)");
}

size_t param_index(const TrainingState& t, const std::string& name) {
  const auto it = t.index.find(name);
  if (it == t.index.end()) throw Error("kfuse: unknown parameter " + name + " (internal error)");
  return it->second;
}

void ensure_scratch(TrainingState& t, size_t bytes, size_t se_bytes) {
  bytes = align256(bytes);
  if (bytes <= t.scratch_bytes && se_bytes <= t.se_scratch_bytes) return;
  bytes = std::max(bytes, t.scratch_bytes);
  se_bytes = std::max(se_bytes, t.se_scratch_bytes);
  // Retired, not freed: a training step that kfuse's caller captured in a CUDA graph still holds its address.
  if (t.scratch) t.retired_memory.push_back(t.scratch);
  t.scratch = nullptr;
  t.scratch_bytes = t.se_scratch_bytes = 0;
  check_cuda(cudaMalloc(&t.scratch, 2 * bytes + se_bytes), "cudaMalloc (training scratch)");
  t.scratch_bytes = bytes;
  t.se_scratch_bytes = se_bytes;
}

void ensure_wgrad_events(TrainingState& t, size_t blocks) {
  while (t.wgrad_fork.size() < 2 * blocks) {
    cudaEvent_t e;
    check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
    t.wgrad_fork.push_back(e);
  }
  if (!t.wgrad_join) check_cuda(cudaEventCreateWithFlags(&t.wgrad_join, cudaEventDisableTiming), "cudaEventCreate");
}

BlockProblems block_problems(const EncoderConfig::Block& b, int n, int h, int w) {
  BlockProblems bp;
  bp.conv1 = Conv2dProblem{n, h, w, b.in_planes, b.planes, 3, 3, 1, 1, b.stride, b.stride};
  bp.conv1_cat = bp.conv1;
  if (b.has_downsample) bp.conv1_cat.k = 2 * b.planes;
  bp.conv2 = Conv2dProblem{n, h / b.stride, w / b.stride, b.planes, b.planes, 3, 3, 1, 1, 1, 1};
  bp.conv1_dgrad_fwd = Conv2dProblem{n, h, w, b.planes, b.in_planes, 3, 3, 1, 1, 1, 1};
  return bp;
}

std::vector<BlockProblems> geometry_problems(const EncoderGpu::Impl& m, const Geometry& g) {
  std::vector<BlockProblems> probs;
  int h = g.h / 4, w = g.w / 4;
  for (const auto& b : m.blocks) {
    probs.push_back(block_problems(b, g.n, h, w));
    h /= b.stride;
    w /= b.stride;
  }
  return probs;
}

WgradChoice wgrad_for(const EncoderGpu::Impl& m, const TrainingState& t, const Conv2dProblem& p) {
  const auto it = t.wgrad_choice.find(conv_shape_key(p));
  return it != t.wgrad_choice.end() ? it->second : wgrad_heuristic(p, m.dtype, m.sm_count);
}
DgradChoice dgrad_for(const EncoderGpu::Impl& m, const TrainingState& t, const Conv2dProblem& p) {
  const auto it = t.dgrad_choice.find(conv_shape_key(p));
  return it != t.dgrad_choice.end() ? it->second
                                    : dgrad_heuristic(p, m.dtype, m.choose(flipped_forward_problem(p), false));
}

}  // namespace train_detail

namespace {

using namespace gpu_detail;
using namespace train_detail;

// Tunes geometry g's backward convolutions (per block the weight gradients of conv2 and conv1 [+ shortcut] and the
// data gradients of both), appending one report row per op.
void tune_backward(EncoderGpu::Impl& m, TrainingState& t, const Geometry& g, TuningMode mode,
                   const EncoderGpu::TuneProgress& progress, std::vector<OpTuningReport>& rows) {
  if (!t.tuning_scratch) t.tuning_scratch = std::make_unique<BackwardConvTuningScratch>();
  if (!m.tuning_cache) m.tuning_cache = std::make_unique<TuningCache>();
  const std::vector<BlockProblems> probs = geometry_problems(m, g);
  const size_t total = rows.size() + 4 * probs.size();
  for (const BlockProblems& bp : probs) {
    for (const Conv2dProblem* p : {&bp.conv2, &bp.conv1_cat}) {
      OpTuningReport row;
      t.wgrad_choice[conv_shape_key(*p)] = t.tuning_scratch->tune_wgrad(*p, m.dtype, *m.tuning_cache, mode, row);
      rows.push_back(row);
      if (progress) progress(rows.size(), total, row);
      t.dgrad_choice[conv_shape_key(*p)] = t.tuning_scratch->tune_dgrad(
          *p, m.dtype, m.choose(flipped_forward_problem(*p), false), *m.tuning_cache, mode, row);
      rows.push_back(row);
      if (progress) progress(rows.size(), total, row);
    }
  }
  t.backward_tuned.insert(g);
  m.train_graphs.clear();  // captured steps may run other kernels, with other workspace sizes, than the new choices
}

// Tunes on first use, as the tuning mode says (never inside a stream capture).
void tune_backward_on_first_use(EncoderGpu::Impl& m, TrainingState& t, const Geometry& g, cudaStream_t stream) {
  if (t.backward_tuned.count(g) || m.tuning_mode == TuningMode::kOff) return;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
  if (capture != cudaStreamCaptureStatusNone) return;
  std::vector<OpTuningReport> rows;
  tune_backward(m, t, g, m.tuning_mode, nullptr, rows);
}

// Which blocks run the cuDNN graphs (TrainingState::cudnn_fused): fwd[i] conv1 + epilogue, bwd[i] also conv2's data
// gradient + ReLU mask (not where conv2's data gradient is the dense GEMM of 2 x 2 maps, which no cuDNN kernel
// matches). Builds and tunes the graphs: never inside a stream capture.
void choose_cudnn_fused(const EncoderGpu::Impl& m, const TrainingState& t, const Geometry& g, cudaStream_t stream,
                        std::vector<char>& fwd, std::vector<char>& bwd) {
  const size_t nb = m.blocks.size();
  fwd.assign(nb, 0);
  bwd.assign(nb, 0);
  if (t.cudnn_fused == TrainingState::CudnnFused::kOff) return;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
  if (capture != cudaStreamCaptureStatusNone) return;
  const std::vector<BlockProblems> probs = geometry_problems(m, g);
  for (size_t i = 0; i < nb; ++i) {
    const BlockProblems& bp = probs[i];
    const auto& b = m.blocks[i];
    // A block that runs as the warpgroup-MMA kernel writes h itself (no conv1 graph): it keeps h for the data
    // gradient's graph wherever that graph exists.
    const bool wgmma = m.wgmma_block_applies(i, bp.conv1.h, bp.conv1.w);
    if (!wgmma && t.cudnn_fused == TrainingState::CudnnFused::kWhereCudnn && !m.choose(bp.conv1, true).is_cudnn())
      continue;
    fwd[i] = wgmma || kernels::cudnn_fused_prepare(kernels::CudnnFusedOp::kConvRelu, bp.conv1, m.dtype);
    const DgradChoice d2 = dgrad_for(m, t, bp.conv2);
    const bool dense = d2.kind == DgradChoice::Kind::kFlippedForward && d2.fprop.dense;
    bwd[i] = fwd[i] && !dense &&
             kernels::cudnn_fused_prepare(kernels::CudnnFusedOp::kDgradMask, bp.conv2, m.dtype,
                                          b.has_downsample ? 2 * b.planes : b.planes);
  }
}

TrainBuffers& train_buffers(EncoderGpu::Impl& m, TrainingState& t, const Geometry& g, cudaStream_t stream) {
  auto it = t.buffers.find(g);
  if (it != t.buffers.end()) return it->second;
  std::vector<char> fused_fwd, fused_bwd;
  choose_cudnn_fused(m, t, g, stream, fused_fwd, fused_bwd);
  size_t total = 0;
  auto take = [&](size_t bytes) {
    const size_t off = total;
    total += align256(bytes);
    return off;
  };
  const size_t es = 2;
  struct Offs {
    size_t a, h2, o, y, idt, d_o, dh2, dcat, dz, dx, g1, g2, h, sums;
  };
  int h = g.h / 4, w = g.w / 4;
  const size_t zero = take(sizeof(float));
  const size_t x0 = take(es * g.n * h * w * m.config.base_planes);
  std::vector<Offs> offs;
  for (const auto& b : m.blocks) {
    const size_t in = size_t(g.n) * h * w * b.in_planes;
    const size_t out = size_t(g.n) * (h / b.stride) * (w / b.stride) * b.planes;
    Offs o{};
    o.a = take(es * in);
    o.h2 = take(es * out);
    o.o = take(es * out);
    // The block output is kept where the backward's mask cannot come from the next block's a (Activations::y).
    const bool last = offs.size() + 1 == m.blocks.size();
    o.y = last || !m.blocks[offs.size() + 1].has_downsample ? take(es * out) : kNone;
    o.idt = b.has_downsample ? take(es * out) : kNone;
    o.d_o = take(es * out);
    o.dh2 = take(es * out);
    o.dcat = take(es * out * (b.has_downsample ? 2 : 1));
    o.dz = b.has_downsample ? kNone : take(es * out);
    o.dx = take(es * in);
    o.g1 = take(4 * size_t(b.has_downsample ? 2 : 1) * b.planes * 9 * b.in_planes);
    o.g2 = take(4 * size_t(b.planes) * 9 * b.planes);
    const size_t i = offs.size();
    o.h = fused_fwd[i] ? take(es * out) : kNone;
    o.sums = fused_bwd[i] ? take(4 * 2 * size_t(b.planes)) : kNone;
    offs.push_back(o);
    h /= b.stride;
    w /= b.stride;
  }
  TrainBuffers tb;
  check_cuda(cudaMalloc(&tb.base, total), "cudaMalloc (training buffers, " + std::to_string(total >> 20) + " MiB)");
  auto at = [&](size_t off) {
    return off == kNone ? nullptr : static_cast<void*>(static_cast<uint8_t*>(tb.base) + off);
  };
  tb.act.base = nullptr;  // owned by tb.base
  tb.act.conv2_raw = true;
  tb.act.training = true;
  tb.act.x0 = at(x0);
  tb.zero = static_cast<float*>(at(zero));
  check_cuda(cudaMemsetAsync(tb.zero, 0, sizeof(float), stream), "cudaMemsetAsync (training buffers)");
  for (size_t i = 0; i < offs.size(); ++i) {
    const Offs& o = offs[i];
    tb.act.a.push_back(at(o.a));
    tb.act.h2.push_back(at(o.h2));
    tb.act.o.push_back(at(o.o));
    tb.act.y.push_back(at(o.y));
    tb.act.idt.push_back(at(o.idt));
    // An identity block's input is the previous block's output (the stem's for the first).
    tb.act.x.push_back(m.blocks[i].has_downsample ? nullptr : (i == 0 ? tb.act.x0 : at(offs[i - 1].y)));
    tb.d_o.push_back(at(o.d_o));
    tb.dh2.push_back(at(o.dh2));
    tb.dcat.push_back(at(o.dcat));
    tb.dz.push_back(at(o.dz));
    tb.dx.push_back(at(o.dx));
    tb.g1.push_back(static_cast<float*>(at(o.g1)));
    tb.g2.push_back(static_cast<float*>(at(o.g2)));
    tb.act.h.push_back(at(o.h));
    tb.sums.push_back(static_cast<float*>(at(o.sums)));
    tb.fused_dgrad.push_back(fused_bwd[i]);
  }
  return t.buffers.emplace(g, std::move(tb)).first->second;
}


}  // namespace

using namespace train_detail;

namespace {

// The packing job table for these parameters (parameter_specs order): one job per packed array.
std::vector<PackJob> pack_job_table(const EncoderGpu::Impl& m, const TrainingState& t,
                                    const std::vector<const void*>& params, ParamDType pd) {
  auto src = [&](const std::string& name) { return params[param_index(t, name)]; };
  std::vector<PackJob> jobs;
  auto add = [&](const void* s, size_t dst, int64_t count, PackKind kind, int k = 0, int c = 0, int r = 0,
                 int sz = 0) {
    PackJob j;
    j.src = s;
    j.dst_offset = int64_t(dst);
    j.count = count;
    j.kind = kind;
    j.src_dtype = pd;
    j.k = k, j.c = c, j.r = r, j.s = sz;
    jobs.push_back(j);
  };
  const int p0 = m.config.base_planes, kin = 16 * m.config.in_channels;
  add(src("stem.1.weight"), m.stem_w, int64_t(m.kpad) * p0, PackKind::kStem, p0, kin, m.kpad);
  for (size_t i = 0; i < m.blocks.size(); ++i) {
    const auto& b = m.blocks[i];
    const BlockWeights& W = m.bw[i];
    const int P = b.planes, C = b.in_planes, H = b.se_hidden;
    const void* w1 = src(b.prefix + "conv1.weight");
    const void* w2 = src(b.prefix + "conv2.weight");
    add(w1, W.conv1, int64_t(P) * 9 * C, PackKind::kKrsc, P, C, 3, 3);
    add(w2, W.conv2, int64_t(P) * 9 * P, PackKind::kKrsc, P, P, 3, 3);
    add(w2, W.conv2_flip, int64_t(P) * 9 * P, PackKind::kFlip, P, P, 3, 3);
    if (W.conv1_flip != kNone) add(w1, W.conv1_flip, int64_t(P) * 9 * C, PackKind::kFlip, P, C, 3, 3);
    if (W.conv1_planes != kNone) add(w1, W.conv1_planes, int64_t(P) * 9 * C, PackKind::kTapPlanes, P, C, 3, 3);
    if (W.conv2_planes != kNone) add(w2, W.conv2_planes, int64_t(P) * 9 * P, PackKind::kTapPlanes, P, P, 3, 3);
    if (b.has_downsample) {
      const void* wd = src(b.prefix + b.downsample_weight());
      if (b.stride > 1)
        add(wd, W.shortcut, int64_t(P) * 9 * C, PackKind::kPooled, P, C, 1, 1);
      else
        add(wd, W.shortcut, int64_t(P) * C, PackKind::kKrsc, P, C, 1, 1);
      if (W.down_stream != kNone) {
        const DownStreamOffsets o = down_stream_offsets(b);
        const int K = o.rank_planes;
        for (int r = 0; r < o.ranks; ++r) {
          const size_t at = W.down_stream + r * o.rank_bytes;
          add(wd, at + o.shortcut, int64_t(K) * C, PackKind::kTapPlanes, K, C, 1, 1);
          jobs.back().k0 = r * K;
          add(w1, at + o.conv1, int64_t(K) * 9 * C, PackKind::kTapPlanes, K, C, 3, 3);
          jobs.back().k0 = r * K;
          add(w2, at + o.conv2, int64_t(K) * 9 * P, PackKind::kTapPlanes, K, P, 3, 3);
          jobs.back().k0 = r * K;
        }
      }
    }
    add(src(b.prefix + "se.excite.0.weight"), W.fc1_w, int64_t(H) * P, PackKind::kCopyF32);
    add(src(b.prefix + "se.excite.0.bias"), W.fc1_b, H, PackKind::kCopyF32);
    add(src(b.prefix + "se.excite.2.weight"), W.fc2_w, int64_t(P) * H, PackKind::kCopyF32);
    add(src(b.prefix + "se.excite.2.bias"), W.fc2_b, P, PackKind::kCopyF32);
    // The inference forward's T copies (BlockWeights::fc_t): [k][c] as a 1x1 KRSC filter is the same order.
    add(src(b.prefix + "se.excite.0.weight"), W.fc_t, int64_t(H) * P, PackKind::kKrsc, H, P, 1, 1);
    add(src(b.prefix + "se.excite.2.weight"), W.fc_t + fc2_t_offset(b), int64_t(P) * H, PackKind::kKrsc, P, H, 1, 1);
    const char* scalars[5] = {"fixup_bias1a", "fixup_bias1b", "fixup_bias2a", "fixup_scale", "fixup_bias2b"};
    for (int s = 0; s < 5; ++s) add(src(b.prefix + scalars[s]), W.scalars + 4 * s, 1, PackKind::kCopyF32);
  }
  return jobs;
}

}  // namespace

void EncoderGpu::set_weights_device(const std::vector<const void*>& params, DType dtype, cudaStream_t stream) {
  Impl& m = *impl_;
  TrainingState& t = training(m);
  const ParamDType pd = param_dtype(dtype);
  KFUSE_CHECK(params.size() == t.grad_offset.size(), InvalidArgument, "set_weights_device: expected ",
              t.grad_offset.size(), " parameters, got ", params.size());
  for (size_t i = 0; i < params.size(); ++i)
    KFUSE_CHECK(params[i] != nullptr, InvalidArgument, "set_weights_device: parameter ", i, " is a null pointer");
  std::vector<PackJob> jobs = pack_job_table(m, t, params, pd);
  // The forward's jobs first; the flipped filters (kFlip: the backward's data-gradient convolutions) last.
  const size_t forward_jobs = size_t(
      std::stable_partition(jobs.begin(), jobs.end(), [](const PackJob& j) { return j.kind != PackKind::kFlip; }) -
      jobs.begin());
  Impl::Device scope(m.device);
  const bool same = jobs.size() == m.pack_jobs.size() &&
                    std::memcmp(jobs.data(), m.pack_jobs.data(), jobs.size() * sizeof(PackJob)) == 0;
  if (!same) {
    // The table changes only when a parameter moved (new storage or dtype): upload it synchronously (rare).
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // packs in flight read the old table
    if (m.d_pack_jobs == nullptr || jobs.size() > m.pack_jobs.size()) {
      if (m.d_pack_jobs) m.retired_memory.push_back(m.d_pack_jobs);  // a caller's graph may still read it
      m.d_pack_jobs = nullptr;
      check_cuda(cudaMalloc(&m.d_pack_jobs, jobs.size() * sizeof(PackJob)), "cudaMalloc (pack jobs)");
    }
    check_cuda(cudaMemcpy(m.d_pack_jobs, jobs.data(), jobs.size() * sizeof(PackJob), cudaMemcpyHostToDevice),
               "cudaMemcpy (pack jobs)");
    m.pack_jobs = jobs;
  }
  m.forward_jobs = forward_jobs;
  std::vector<kernels::WatchedRegion> regions;
  for (size_t i = 0; i < params.size(); ++i)
    regions.push_back({params[i], size_t(t.param_numel[i]) * param_dtype_bytes(pd)});
  // Captured graphs hold the watches' chunk tables and the job counts, or no check at all (weights from
  // set_weights): recapture them.
  const bool moved = m.watch.watch(regions, m.sm_count);
  if (m.train_watch.watch(regions, m.sm_count) || moved || !same) {
    m.clear_graphs();
    m.watch.invalidate();  // every verdict starts as "changed"
    m.train_watch.invalidate();
  }
  // The forwards repack from these parameters whenever they change; this call's stream needs nothing now.
  (void)stream;
  if (!m.have_weights) set_input_affine({}, {});
  m.have_weights = true;
}

uint64_t EncoderGpu::forward_train(const DeviceTensorView& x, const DeviceTensorView& y, cudaStream_t stream) {
  Impl& m = *impl_;
  KFUSE_CHECK(m.have_weights, InvalidArgument, "EncoderGpu::forward_train before set_weights_device");
  m.check_io(x, y);
  check_trainable(m);
  TrainingState& t = training(m);
  const Geometry g{int(x.shape[0]), int(x.shape[2]), int(x.shape[3])};
  Impl::Device scope(m.device);
  m.tune_on_first_use(g, stream);
  tune_backward_on_first_use(m, t, g, stream);
  m.ensure_workspace(g);
  TrainBuffers& tb = train_buffers(m, t, g, stream);
  const kernels::StemArgs stem = m.stem_args(x, tb.act);
  kernels::SqueezeExciteArgs tail;
  tail.out_nchw = y.data;
  tail.out_f32 = y.dtype == DType::F32;
  LaunchGraphCache::Key key{kForwardTrainGraph, g.n, g.h, g.w, int64_t(x.dtype), reinterpret_cast<int64_t>(x.data),
                            reinterpret_cast<int64_t>(y.data), int64_t(y.dtype)};
  key.insert(key.end(), x.strides.begin(), x.strides.end());
  tb.stash = 0;  // the previous forward's saved state is being overwritten: its backward must not run on it
  m.train_graphs.run(
      key, stream,
      [&](cudaStream_t s) {
        m.sync_training_weights(s);
        m.launch(g, tb.act, stem, tail, s);
      },
      m.use_graphs);
  tb.stash = t.next_stash++;
  tb.next_stage = 0;
  tb.y_dtype = y.dtype;
  return tb.stash;
}

std::vector<OpTuningReport> EncoderGpu::tune_training(int n, int h, int w, TuningMode mode,
                                                      const TuneProgress& progress) {
  Impl& m = *impl_;
  check_trainable(m);
  if (mode == TuningMode::kOff) mode = TuningMode::kOnFirstUse;
  std::vector<OpTuningReport> rows = tune(n, h, w, mode, progress);
  Impl::Device scope(m.device);
  tune_backward(m, training(m), Geometry{n, h, w}, mode, progress, rows);
  return rows;
}

bool EncoderGpu::stash_valid(uint64_t stash) const {
  const Impl& m = *impl_;
  if (!m.training || stash == 0) return false;
  for (const auto& [g, tb] : m.training->buffers)
    if (tb.stash == stash) return true;
  return false;
}

}  // namespace kfuse
