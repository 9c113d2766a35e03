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
#include "runtime/backward_conv_selection.h"
#include "runtime/encoder_gpu_impl.h"

namespace kfuse {

using kernels::GradJob;
using kernels::PackJob;
using kernels::PackKind;
using kernels::ParamDType;

// The buffers of one training geometry: the forward's stash and the backward's gradients.
struct TrainBuffers {
  void* base = nullptr;
  Activations act;                               // forward: x0, a, h2, o (raw: conv2_raw), y (stash), idt (scratch)
  std::vector<void*> d_o, dh2, dcat, dz, dx;     // per block; dz only for identity blocks (else inside dcat)
  std::vector<float*> g1, g2;                    // KRSC weight-gradient sums (fp32, or T): conv1 [+ shortcut], conv2
  // Blocks whose forward runs conv1 as a cuDNN graph (act.h non-null): where fused_dgrad, conv2's data gradient and
  // the ReLU-mask backward are one cuDNN graph too, whose per-channel sums (2 x P floats) land in sums.
  std::vector<char> fused_dgrad;
  std::vector<float*> sums;
  // A device 0.0f: the ReLU-mask kernel's threshold where it reads h instead of h2 (set when the buffers are made,
  // so that no backward allocates or writes outside its stream).
  float* zero = nullptr;
  uint64_t stash = 0;                            // id of the forward whose values the buffers hold (0: none)
  DType y_dtype = DType::F32;
};

struct TrainingState {
  std::map<Geometry, TrainBuffers> buffers;
  uint64_t next_stash = 1;
  // Parameter order and flat-gradient offsets (parameter_specs order).
  std::unordered_map<std::string, size_t> index;
  std::vector<int64_t> grad_offset;
  std::vector<int64_t> param_numel;
  // Device job table of the gradients' layouts, re-uploaded only when its contents change.
  std::vector<GradJob> grad_jobs;
  GradJob* d_grad_jobs = nullptr;
  size_t grad_job_capacity = 0;
  // One scratch area for the backward's workspaces, in two equal halves: the main stream's launches use the first,
  // the weight-gradient branch's the second (the launches of one stream run one after another); then one area per
  // block for its squeeze-excite backward, whose two phases run on the two branches.
  void* scratch = nullptr;
  size_t scratch_bytes = 0;  // per half
  size_t se_scratch_bytes = 0;  // after the halves: one area per block for the squeeze-excite backward
  // The weight gradients run on a side branch (Impl::side): fork after the kernel that produces their dL/dout, one
  // join at the end of the step (events, which stream capture turns into parallel graph branches).
  // options.wgrad_branch false keeps everything on the main stream (the branch took a batch-2048 step from 3.008 to
  // 2.765 ms on H100).
  bool wgrad_branch = true;
  std::vector<cudaEvent_t> wgrad_fork;
  cudaEvent_t wgrad_join = nullptr;
  bool weights_from_device = false;
  // cuDNN graphs for conv1 + its FixUp epilogue and conv2's data gradient + the ReLU mask (kernels/conv/cudnn_fused.h):
  // options.cudnn_fused 1 (default) where the tuner runs conv1 in cuDNN anyway (it would pay a separate epilogue
  // pass), 2 in every block that cuDNN supports (for tests), 0 never (the graphs save ~85 us per batch-2048 step on
  // H100).
  enum class CudnnFused { kOff, kWhereCudnn, kAll } cudnn_fused = CudnnFused::kWhereCudnn;
  // Backward convolution choices per shape (conv_shape_key of the forward problem): the tuner's, else the heuristic.
  std::map<std::string, WgradChoice> wgrad_choice;
  std::map<std::string, DgradChoice> dgrad_choice;
  std::set<Geometry> backward_tuned;
  std::unique_ptr<BackwardConvTuningScratch> tuning_scratch;

  ~TrainingState() {
    for (auto& [g, b] : buffers) cudaFree(b.base);
    cudaFree(d_grad_jobs);
    cudaFree(scratch);
    for (cudaEvent_t e : wgrad_fork) cudaEventDestroy(e);
    if (wgrad_join) cudaEventDestroy(wgrad_join);
  }
};

void destroy_training_state(TrainingState* t) { delete t; }

namespace gpu_detail {
namespace {

size_t align256(size_t b) { return (b + 255) / 256 * 256; }

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

namespace {

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

// The first element of a training graph's key: which launch sequence it is.
enum : int64_t { kForwardTrainGraph = 0, kBackwardGraph = 1 };

// Two halves of `bytes` each (TrainingState::scratch), then `se_bytes` for the squeeze-excite backward's areas.
void ensure_scratch(TrainingState& t, size_t bytes, size_t se_bytes) {
  bytes = align256(bytes);
  if (bytes <= t.scratch_bytes && se_bytes <= t.se_scratch_bytes) return;
  bytes = std::max(bytes, t.scratch_bytes);
  se_bytes = std::max(se_bytes, t.se_scratch_bytes);
  cudaFree(t.scratch);  // synchronizes with the device: nothing in flight still uses the old area
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

// Problems of block b whose input is n x h x w (forward conventions of conv_backward.h).
struct BlockProblems {
  Conv2dProblem conv1;      // a -> h2 (k = P)
  Conv2dProblem conv1_cat;  // a -> [conv1 | shortcut] (k = 2P for downsampling blocks, else = conv1)
  Conv2dProblem conv2;      // h2 -> o
  Conv2dProblem conv1_dgrad_fwd;  // identity blocks: dcat (P) -> da (Cin) as a forward conv with flipped filters
};
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

// The backward convolutions' kernels: the tuner's choice for the shape, else the heuristic.
WgradChoice wgrad_for(const EncoderGpu::Impl& m, const TrainingState& t, const Conv2dProblem& p) {
  const auto it = t.wgrad_choice.find(conv_shape_key(p));
  return it != t.wgrad_choice.end() ? it->second : wgrad_heuristic(p, m.dtype, m.sm_count);
}
DgradChoice dgrad_for(const EncoderGpu::Impl& m, const TrainingState& t, const Conv2dProblem& p) {
  const auto it = t.dgrad_choice.find(conv_shape_key(p));
  return it != t.dgrad_choice.end() ? it->second
                                    : dgrad_heuristic(p, m.dtype, m.choose(flipped_forward_problem(p), false));
}

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

void EncoderGpu::set_weights_device(const std::vector<const void*>& params, DType dtype, cudaStream_t stream) {
  Impl& m = *impl_;
  TrainingState& t = training(m);
  const ParamDType pd = param_dtype(dtype);
  KFUSE_CHECK(params.size() == t.grad_offset.size(), InvalidArgument, "set_weights_device: expected ",
              t.grad_offset.size(), " parameters, got ", params.size());
  for (size_t i = 0; i < params.size(); ++i)
    KFUSE_CHECK(params[i] != nullptr, InvalidArgument, "set_weights_device: parameter ", i, " is a null pointer");
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
      if (W.shortcut_kc != kNone) add(wd, W.shortcut_kc, int64_t(P) * C, PackKind::kKrsc, P, C, 1, 1);
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
      cudaFree(m.d_pack_jobs);
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

std::pair<int, int> EncoderGpu::cudnn_fused_count(int n, int h, int w) const {
  const Impl& m = *impl_;
  if (!m.training) return {0, 0};
  const auto it = m.training->buffers.find(Geometry{n, h, w});
  if (it == m.training->buffers.end()) return {0, 0};
  int fwd = 0, bwd = 0;
  for (size_t i = 0; i < it->second.act.h.size(); ++i) {
    fwd += it->second.act.h[i] != nullptr;
    bwd += it->second.fused_dgrad[i] != 0;
  }
  return {fwd, bwd};
}

bool EncoderGpu::stash_valid(uint64_t stash) const {
  const Impl& m = *impl_;
  if (!m.training || stash == 0) return false;
  for (const auto& [g, tb] : m.training->buffers)
    if (tb.stash == stash) return true;
  return false;
}

void EncoderGpu::backward(uint64_t stash, const DeviceTensorView& x, const DeviceTensorView& dy, float* grads,
                          const DeviceTensorView* dx, cudaStream_t stream) {
  Impl& m = *impl_;
  TrainingState& t = training(m);
  KFUSE_CHECK(grads != nullptr, InvalidArgument, "backward: null gradient buffer");
  TrainBuffers* found = nullptr;
  Geometry g{};
  for (auto& [geo, tb] : t.buffers)
    if (tb.stash == stash && stash != 0) found = &tb, g = geo;
  KFUSE_CHECK(found != nullptr, InvalidArgument,
              "backward: the forward's saved state is gone (another forward_train of the same input geometry "
              "replaced it); run forward_train again");
  TrainBuffers& tb = *found;
  KFUSE_CHECK(x.shape.size() == 4 && x.shape[0] == g.n && x.shape[2] == g.h && x.shape[3] == g.w, InvalidArgument,
              "backward: input of shape ", shape_str(x.shape), " is not the forward's");
  KFUSE_CHECK(x.strides.size() == 4 && x.data, InvalidArgument, "backward: bad input view");
  const Shape out_shape = m.config.output_shape(x.shape);
  KFUSE_CHECK(dy.shape == out_shape, InvalidArgument, "backward: output gradient has shape ", shape_str(dy.shape),
              ", expected ", shape_str(out_shape));
  const Shape packed{out_shape[1] * out_shape[2] * out_shape[3], out_shape[2] * out_shape[3], out_shape[3], 1};
  KFUSE_CHECK(dy.strides == packed && dy.data, InvalidArgument, "backward: output gradient must be contiguous NCHW");
  KFUSE_CHECK(dy.dtype == tb.y_dtype, InvalidArgument, "backward: output gradient is ", dtype_name(dy.dtype),
              " but the forward's output was ", dtype_name(tb.y_dtype));
  KFUSE_CHECK(dy.device == m.device && x.device == m.device, InvalidArgument,
              "backward: tensors must be on cuda:", m.device);
  if (dx) {
    KFUSE_CHECK(dx->shape == x.shape, InvalidArgument, "backward: input gradient has shape ", shape_str(dx->shape),
                ", expected ", shape_str(x.shape));
    const Shape xp{x.shape[1] * x.shape[2] * x.shape[3], x.shape[2] * x.shape[3], x.shape[3], 1};
    KFUSE_CHECK(dx->strides == xp && dx->data && dx->device == m.device, InvalidArgument,
                "backward: input gradient must be a contiguous NCHW tensor on cuda:", m.device);
    KFUSE_CHECK(dx->dtype == DType::F32 || dx->dtype == DType::F16 || dx->dtype == DType::BF16, InvalidArgument,
                "backward: input gradient dtype ", dtype_name(dx->dtype), " is not F32, F16 or BF16");
  }
  Impl::Device scope(m.device);
  const size_t nb = m.blocks.size();
  auto grad = [&](const std::string& name) { return grads + t.grad_offset[param_index(t, name)]; };

  // Geometry per block and the backward convolutions' kernels; every workspace comes from one scratch area (the
  // launches on one stream use it one at a time).
  const std::vector<BlockProblems> probs = geometry_problems(m, g);
  struct BlockConvs {
    WgradChoice wgrad2, wgrad1;  // conv2; conv1 [+ shortcut]
    DgradChoice dgrad2, dgrad1;
  };
  std::vector<BlockConvs> convs(nb);
  for (size_t i = 0; i < nb; ++i) {
    const BlockProblems& bp = probs[i];
    BlockConvs& c = convs[i];
    c.wgrad2 = wgrad_for(m, t, bp.conv2);
    c.wgrad1 = wgrad_for(m, t, bp.conv1_cat);
    c.dgrad2 = dgrad_for(m, t, bp.conv2);
    c.dgrad1 = dgrad_for(m, t, bp.conv1_cat);
    KFUSE_CHECK(wgrad_can_implement(c.wgrad2, bp.conv2, m.dtype) &&
                    wgrad_can_implement(c.wgrad1, bp.conv1_cat, m.dtype),
                InvalidArgument, "kfuse: the weight-gradient kernels cannot run block '", m.blocks[i].prefix,
                "' at this size");
    KFUSE_CHECK(dgrad_can_implement(c.dgrad2, bp.conv2, m.dtype) &&
                    dgrad_can_implement(c.dgrad1, bp.conv1_cat, m.dtype),
                InvalidArgument, "kfuse: the data-gradient kernels cannot run block '", m.blocks[i].prefix,
                "' at this size");
  }

  // --- launch arguments, sized first so that one scratch allocation serves them all ---------------------------
  const uint8_t* W8 = static_cast<const uint8_t*>(m.weights);
  auto wp = [&](size_t off) { return static_cast<const void*>(W8 + off); };
  auto fp = [&](size_t off) { return reinterpret_cast<const float*>(W8 + off); };
  auto wflip = [&](size_t off) { return off == kNone ? nullptr : wp(off); };  // flipped filters: stride 1 only
  std::vector<kernels::SeBackwardArgs> se(nb);
  std::vector<kernels::ReluMaskBackwardArgs> mask(nb);
  size_t scratch = 0;
  std::vector<size_t> se_ws_offset(nb);
  size_t se_ws_total = 0;
  {
    int h = g.h / 4, w = g.w / 4;
    for (size_t i = 0; i < nb; ++i) {
      const auto& b = m.blocks[i];
      const BlockWeights& W = m.bw[i];
      const int ho = h / b.stride, wo = w / b.stride;
      kernels::SeBackwardArgs& s = se[i];
      const bool last = i + 1 == nb;
      s.y = tb.act.y[i];
      if (!s.y) {  // the mask from the next block's a = y + b1a (Activations::y)
        s.y = tb.act.a[i + 1];
        s.y_offset = fp(m.bw[i + 1].scalars) + kB1a;
      }
      s.dy = last ? dy.data : tb.dx[i + 1];
      s.dy_nchw = last;
      s.dy_f32 = last && dy.dtype == DType::F32;
      s.o = tb.act.o[i];  // conv2's raw output: the kernel applies x scale + b2b (Activations::conv2_raw)
      s.o_scale = fp(W.scalars) + kScale;
      s.o_shift = fp(W.scalars) + kB2b;
      s.n = g.n, s.hw = ho * wo, s.p = b.planes, s.hidden = b.se_hidden;
      s.w1 = fp(W.fc1_w), s.b1 = fp(W.fc1_b), s.w2 = fp(W.fc2_w), s.b2 = fp(W.fc2_b);
      s.d_o = tb.d_o[i];
      s.dz = b.has_downsample ? static_cast<uint8_t*>(tb.dcat[i]) + 2 * b.planes : tb.dz[i];
      s.dz_pitch = b.has_downsample ? 2 * b.planes : b.planes;
      s.dw1 = grad(b.prefix + "se.excite.0.weight");
      s.db1 = grad(b.prefix + "se.excite.0.bias");
      s.dw2 = grad(b.prefix + "se.excite.2.weight");
      s.db2 = grad(b.prefix + "se.excite.2.bias");
      s.sum_d_o = grad(b.prefix + "fixup_bias2b");
      // dy of this block is dx of the next; when the next block has a shortcut conv, that is all of d(its a).
      s.sum_dy = !last && m.blocks[i + 1].has_downsample ? grad(m.blocks[i + 1].prefix + "fixup_bias1a") : nullptr;
      se_ws_offset[i] = se_ws_total;  // its own area: its parameter phase may still run when the next block's starts
      se_ws_total += align256(kernels::se_backward_workspace_bytes(s));

      kernels::ReluMaskBackwardArgs& r = mask[i];
      r.dh = tb.dh2[i];
      r.h2 = tb.act.h2[i];
      r.b2a = fp(W.scalars) + kB2a;
      if (tb.act.h[i]) {  // the cuDNN graph's forward: the mask is h > 0 (TrainBuffers::fused_dgrad)
        r.h2 = tb.act.h[i];
        r.b2a = tb.zero;
      }
      r.scale = fp(W.scalars) + kScale;  // the data gradient below leaves conv2's scale out
      r.pixels = int64_t(g.n) * ho * wo;
      r.c = b.planes;
      r.d_pre = tb.dcat[i];
      r.d_pre_pitch = b.has_downsample ? 2 * b.planes : b.planes;
      r.sum_dh = grad(b.prefix + "fixup_bias2a");
      r.sum_d_pre = grad(b.prefix + "fixup_bias1b");
      scratch = std::max(scratch, kernels::relu_mask_backward_workspace_bytes(r));

      const BlockProblems& bp = probs[i];
      const BlockConvs& c = convs[i];
      scratch = std::max({scratch, wgrad_workspace_bytes(c.wgrad2, bp.conv2, m.dtype),
                          wgrad_workspace_bytes(c.wgrad1, bp.conv1_cat, m.dtype),
                          dgrad_workspace_bytes(c.dgrad2, bp.conv2, m.dtype),
                          dgrad_workspace_bytes(c.dgrad1, bp.conv1_cat, m.dtype)});
      if (!b.has_downsample && i > 0)
        scratch = std::max(scratch, kernels::add_and_sum_workspace_bytes(int64_t(g.n) * h * w * b.in_planes));
      h = ho;
      w = wo;
    }
  }
  kernels::StemBackwardArgs sb;
  {
    const kernels::StemArgs fwd = m.stem_args(x, tb.act);
    sb.x = fwd.x, sb.x_dtype = fwd.x_dtype;
    sb.stride_n = fwd.stride_n, sb.stride_c = fwd.stride_c, sb.stride_h = fwd.stride_h, sb.stride_w = fwd.stride_w;
    sb.n = fwd.n, sb.c = fwd.c, sb.h = fwd.h, sb.w = fwd.w;
    sb.in_scale = fwd.in_scale, sb.in_shift = fwd.in_shift;
    sb.weight = fwd.weight, sb.kpad = fwd.kpad, sb.p0 = fwd.p0;
    sb.x0 = tb.act.x0;
    sb.da = tb.dx[0];
    sb.dz = m.blocks[0].has_downsample ? nullptr : tb.dz[0];
    sb.dw = grad("stem.1.weight");
    sb.sum_da = grad(m.blocks[0].prefix + "fixup_bias1a");
    if (dx) {
      sb.dinput = dx->data;
      sb.dinput_dtype = Impl::input_dtype(dx->dtype);
    }
    scratch = std::max(scratch, kernels::stem_backward_workspace_bytes(sb));
  }
  // Gradient finalize jobs (their destinations move with `grads`: rebuilt per call, uploaded when changed).
  // A block's jobs are contiguous, from job_first[i] to job_first[i + 1]: each block's are finalized as soon as its
  // weight gradients are done, on their branch.
  std::vector<GradJob> jobs;
  std::vector<int> job_first;
  for (size_t i = 0; i < nb; ++i) {
    const auto& b = m.blocks[i];
    const BlockWeights& W = m.bw[i];
    job_first.push_back(int(jobs.size()));
    GradJob j1;
    j1.g = tb.g1[i], j1.g_is_t = convs[i].wgrad1.writes_t(), j1.dst = grad(b.prefix + "conv1.weight"), j1.kind = 0;
    j1.k = b.planes, j1.c = b.in_planes, j1.r = 3, j1.s = 3;
    jobs.push_back(j1);
    if (b.has_downsample) {
      GradJob jd;
      jd.g = static_cast<const uint8_t*>(j1.g) + size_t(b.planes) * 9 * b.in_planes * (j1.g_is_t ? 2 : 4);
      jd.g_is_t = j1.g_is_t;
      jd.dst = grad(b.prefix + b.downsample_weight());
      jd.kind = 1, jd.k = b.planes, jd.c = b.in_planes, jd.r = 3, jd.s = 3;
      jobs.push_back(jd);
    }
    GradJob j2;
    j2.g = tb.g2[i], j2.g_is_t = convs[i].wgrad2.writes_t(), j2.dst = grad(b.prefix + "conv2.weight"), j2.kind = 0;
    j2.alpha = fp(W.scalars) + kScale;
    j2.dot_w = wp(W.conv2);
    j2.dst_dot = grad(b.prefix + "fixup_scale");
    j2.k = b.planes, j2.c = b.planes, j2.r = 3, j2.s = 3;
    jobs.push_back(j2);
  }
  job_first.push_back(int(jobs.size()));
  scratch = std::max(scratch, kernels::grad_finalize_workspace_bytes(int(jobs.size())));
  const void* const scratch_before = t.scratch;
  const GradJob* const jobs_before = t.d_grad_jobs;
  ensure_scratch(t, std::max<size_t>(scratch, 256), se_ws_total);

  if (jobs.size() > t.grad_job_capacity) {
    cudaFree(t.d_grad_jobs);
    t.d_grad_jobs = nullptr;
    check_cuda(cudaMalloc(&t.d_grad_jobs, jobs.size() * sizeof(GradJob)), "cudaMalloc (gradient jobs)");
    t.grad_job_capacity = jobs.size();
    t.grad_jobs.clear();
  }
  if (jobs.size() != t.grad_jobs.size() ||
      std::memcmp(jobs.data(), t.grad_jobs.data(), jobs.size() * sizeof(GradJob)) != 0) {
    // Ordered on the stream; the source is copied out before cudaMemcpyAsync returns (pageable memory).
    check_cuda(cudaMemcpyAsync(t.d_grad_jobs, jobs.data(), jobs.size() * sizeof(GradJob), cudaMemcpyHostToDevice,
                               stream),
               "cudaMemcpyAsync (gradient jobs)");
    t.grad_jobs = jobs;
  }

  if (t.scratch != scratch_before || t.d_grad_jobs != jobs_before) m.train_graphs.clear();  // addresses baked in

  // --- the backward, from the last block (replayed as a graph per geometry and caller's pointers) -------------
  LaunchGraphCache::Key key{kBackwardGraph,
                            g.n,
                            g.h,
                            g.w,
                            int64_t(x.dtype),
                            reinterpret_cast<int64_t>(x.data),
                            reinterpret_cast<int64_t>(dy.data),
                            int64_t(dy.dtype),
                            reinterpret_cast<int64_t>(grads),
                            dx ? reinterpret_cast<int64_t>(dx->data) : 0,
                            dx ? int64_t(dx->dtype) : -1};
  key.insert(key.end(), x.strides.begin(), x.strides.end());
  m.ensure_side_stream();
  ensure_wgrad_events(t, nb);
  // The launches go to the lambda's stream: the caller's, or the capture stream when the graph is recorded.
  m.train_graphs.run(key, stream, [&](cudaStream_t stream) {
    void* ws = t.scratch;
    void* ws_side = static_cast<uint8_t*>(t.scratch) + t.scratch_bytes;
    const size_t wsb = t.scratch_bytes;
    cudaStream_t wstream = t.wgrad_branch ? m.side : stream;
    void* const wws = t.wgrad_branch ? ws_side : ws;
    // The weight gradients run on the side branch: nothing on the main path waits for them, so they fill the SMs
    // that the memory-bound kernels (squeeze-excite, ReLU mask, stem backward) and the tails of the data gradients
    // leave idle. The side branch's launches run in order, one at a time, on its half of the scratch.
    auto fork_wgrad = [&](size_t event) {
      if (!t.wgrad_branch) return;
      check_cuda(cudaEventRecord(t.wgrad_fork[event], stream), "cudaEventRecord");
      check_cuda(cudaStreamWaitEvent(m.side, t.wgrad_fork[event], 0), "cudaStreamWaitEvent");
    };
    for (size_t ii = nb; ii-- > 0;) {
      const auto& b = m.blocks[ii];
      const BlockWeights& W = m.bw[ii];
      const BlockProblems& bp = probs[ii];
      const std::string where = " (block '" + b.prefix + "')";
      const BlockConvs& c = convs[ii];
      void* const se_ws = static_cast<uint8_t*>(t.scratch) + 2 * t.scratch_bytes + se_ws_offset[ii];
      check_cuda(kernels::launch_se_backward_data(se[ii], m.dtype, se_ws, stream), "squeeze-excite backward" + where);
      fork_wgrad(2 * ii);
      // The squeeze-excite's parameter gradients and scalar sums: nothing else reads them either.
      check_cuda(kernels::launch_se_backward_params(se[ii], m.dtype, se_ws, wstream),
                 "squeeze-excite parameter gradients" + where);
      check_cuda(run_wgrad(c.wgrad2, bp.conv2, m.dtype, tb.d_o[ii], tb.act.h2[ii], tb.g2[ii], wws, wsb, wstream),
                 "conv2 weight gradient (" + c.wgrad2.name() + ")" + where);
      if (tb.fused_dgrad[ii]) {
        // d_pre = h > 0 ? scale * conv2^T(d_o) : 0, into [d_pre | dz], and the per-channel sums: one cuDNN graph.
        check_cuda(kernels::cudnn_fused_dgrad_mask(bp.conv2, m.dtype, tb.d_o[ii], wp(W.conv2),
                                                   fp(W.scalars) + kScale, tb.act.h[ii], tb.dcat[ii],
                                                   mask[ii].d_pre_pitch, tb.sums[ii], stream),
                   "conv2 data gradient with the ReLU mask (cuDNN graph)" + where);
        fork_wgrad(2 * ii + 1);
        check_cuda(kernels::launch_sum_pair_finalize(tb.sums[ii], b.planes, mask[ii].sum_dh, mask[ii].sum_d_pre,
                                                     wstream),
                   "FixUp bias gradients" + where);
      } else {
        // dh2 / scale = conv2^T(d_o); the ReLU-mask backward applies the scale.
        check_cuda(run_dgrad(c.dgrad2, bp.conv2, m.dtype, tb.d_o[ii], wp(W.conv2), wflip(W.conv2_flip),
                             tb.dh2[ii], ws, wsb, stream),
                   "conv2 data gradient (" + c.dgrad2.name() + ")" + where);
        check_cuda(kernels::launch_relu_mask_backward(mask[ii], m.dtype, ws, stream), "ReLU mask backward" + where);
        fork_wgrad(2 * ii + 1);
      }
      check_cuda(run_wgrad(c.wgrad1, bp.conv1_cat, m.dtype, tb.dcat[ii], tb.act.a[ii], tb.g1[ii], wws, wsb,
                           wstream),
                 "conv1 weight gradient (" + c.wgrad1.name() + ")" + where);
      check_cuda(kernels::launch_grad_finalize(t.d_grad_jobs + job_first[ii], job_first[ii + 1] - job_first[ii],
                                               m.dtype, wws, wstream),
                 "gradient finalize" + where);
      // d a = [conv1 | shortcut]^T([d_pre1 | dz]): one data gradient over the concatenated filters.
      check_cuda(run_dgrad(c.dgrad1, bp.conv1_cat, m.dtype, tb.dcat[ii], wp(W.conv1), wflip(W.conv1_flip),
                           tb.dx[ii], ws, wsb, stream),
                 "conv1 data gradient (" + c.dgrad1.name() + ")" + where);
      if (!b.has_downsample && ii > 0) {  // dx = d a + dz; d b1a = sum of d a (block 1: the stem's)
        check_cuda(kernels::launch_add_and_sum(tb.dx[ii], tb.dz[ii], tb.dx[ii],
                                               int64_t(bp.conv1.n) * bp.conv1.h * bp.conv1.w * b.in_planes,
                                               grad(b.prefix + "fixup_bias1a"), m.dtype, ws, stream),
                   "identity gradient" + where);
      }
    }
    check_cuda(kernels::launch_stem_backward(sb, m.dtype, ws, stream), "stem backward");
    if (t.wgrad_branch) {  // join: the step ends when every weight gradient is final
      check_cuda(cudaEventRecord(t.wgrad_join, m.side), "cudaEventRecord");
      check_cuda(cudaStreamWaitEvent(stream, t.wgrad_join, 0), "cudaStreamWaitEvent");
    }
  }, m.use_graphs);
}

}  // namespace kfuse
