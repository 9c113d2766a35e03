// Internal: the state of an EncoderGpu (its Impl), shared by the inference orchestration (encoder_gpu.cpp) and the
// training step (encoder_train.cpp). Not installed.
#pragma once

#include <algorithm>
#include <cstring>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/conv/conv_fixup.h"
#include "kernels/conv/cudnn_fused.h"
#include "kernels/conv/dense_conv.h"
#include "kernels/encoder/encoder_kernels.h"
#include "kernels/encoder/weight_layout.h"
#include "kernels/programmatic_launch.h"
#include "kfuse/encoder_gpu.h"
#include "kfuse/error.h"
#include "encoder/conv_selection.h"
#include "runtime/cuda_check.h"
#include "runtime/device_guard.h"
#include "runtime/launch_graph_cache.h"
#include "kfuse/encoder_options.h"
#include "encoder/encoder_forward_plan.h"
#include "encoder/encoder_weight_layout.h"
#include "encoder/weight_watch.h"
#include "runtime/half_bits.h"

namespace kfuse {
namespace gpu_detail {

using kernels::Conv2dProblem;
using kernels::ConvDType;
using kernels::ConvTile;

using kfuse::check_cuda;

enum Scalar { kB1a = 0, kB1b, kB2a, kScale, kB2b };

struct Geometry {
  int n, h, w;
  bool operator<(const Geometry& o) const { return std::tie(n, h, w) < std::tie(o.n, o.h, o.w); }
};

struct Activations {
  void* base = nullptr;
  std::vector<void*> x, a, h2, idt, o;  // per block; x[b]: the block's input when its shortcut is the identity
  // Training only: the block outputs the backward's ReLU masks read, NHWC; null where the next block has a shortcut
  // conv: its a = y + b1a (faithful where y > 0, squeeze_excite's a_next) holds the mask instead.
  std::vector<void*> y;
  void* x0 = nullptr;
  // Training: o holds conv2's raw output v and the squeeze-excite kernels (forward and backward) apply its FixUp
  // epilogue o = v * scale + b2b as they read it. A cuDNN conv2 then needs no epilogue pass over its output.
  bool conv2_raw = false;
  // Training: the backward reads h, h2 and o, so no block runs as the mma.sync fused kernel; the warpgroup-MMA one
  // (wgmma_block_applies) writes them as it goes.
  bool training = false;
  // Training, per block, or empty: where non-null, conv1 and its FixUp epilogue run as one cuDNN graph
  // (kernels/conv/cudnn_fused.h) that writes h = relu(conv1 + b1b) here beside h2 = h + b2a, and the backward's
  // ReLU mask is h > 0 (rather than h2 > b2a, which needs the CUTLASS epilogue's faithful rounding of h2).
  std::vector<void*> h;
  // Inference, per block, or null: a fused downsampling block of the group kernel's shape exchanges the squeeze's
  // partial sums through `partials` and synchronizes its groups on `sync` (zeroed once, at allocation).
  std::vector<float*> partials;
  std::vector<unsigned*> sync;
};

// The launch sequence of one geometry, captured once.
struct GraphKey {
  Geometry g;
  DType x_dtype;
  Shape x_strides;
  DType y_dtype;
  bool operator<(const GraphKey& o) const {
    return std::tie(g, x_dtype, x_strides, y_dtype) < std::tie(o.g, o.x_dtype, o.x_strides, o.y_dtype);
  }
};
struct Graph {
  cudaGraph_t graph = nullptr;  // kept: node parameters are patched through its nodes
  cudaGraphExec_t exec = nullptr;
  cudaGraphNode_t stem = nullptr, tail = nullptr;
  bool stem_in_block = false;  // the stem node is block 1's kernel (its FusedBlockArgs::stem), not the stem kernel
  kernels::StemArgs stem_args;
  kernels::SqueezeExciteArgs tail_args;
};

}  // namespace gpu_detail

using namespace gpu_detail;

// The training step's state (encoder_train.cpp): buffers per geometry, the device job tables. Opaque here.
struct TrainingState;
void destroy_training_state(TrainingState* t);

struct EncoderGpu::Impl {
  EncoderConfig config;
  std::unique_ptr<TrainingState, void (*)(TrainingState*)> training{nullptr, destroy_training_state};
  std::vector<EncoderConfig::Block> blocks;
  GpuPrecision precision;
  ConvDType dtype;
  int device;
  int kpad = 0;
  void* weights = nullptr;
  WeightLayout layout;
  size_t stem_w = 0;
  std::vector<BlockWeights> bw;  // = layout.blocks
  bool have_weights = false;
  float* input_affine = nullptr;  // [2][C]: scale then shift
  bool use_affine = false;
  bool use_graphs = true;
  EncoderOptions options;  // as given at construction, with the developer overrides applied
  // Programmatic dependent launch between the forward's kernels (kernels/programmatic_launch.h): on where the device
  // supports it (compute capability 9.0+) unless options.programmatic_launch is 0; turned off for good if a capture
  // with it fails.
  bool use_pdl = false;
  // Which kernel boundaries launch programmatically (options.programmatic_launch):
  //   1: every one after the stem that follows a single kfuse kernel;
  //   2: not conv2 of a block whose shortcut runs on the side branch: conv2's CTAs, resident early while conv1
  //      runs, take the SMs the concurrent shortcut needs (measured: 1 is 8% slower than no PDL at all);
  //   3 (default): none inside such a block, so only block 1's chain and the stem's successor (the best measured:
  //      ~1 us per early-launched boundary).
  int pdl_policy = 3;
  // Blocks that fit kernels::launch_fused_block run as that one kernel in the inference forward (options.fused_blocks).
  bool fuse_blocks = true;
  bool fuse_stem = true;  // false: the stem kernel even where block 1's kernel could compute it (options.fused_stem)
  // Where they apply (Hopper, 16 x 16 maps), such blocks run as the warpgroup-MMA kernel instead, in inference and in
  // the training forward (kernels::launch_fused_block_wgmma); options.wgmma_blocks.
  bool wgmma_blocks = true;
  // Where it applies (Hopper; 16 x 16 input maps for block 2's shape, 8 x 8 for block 3's), a downsampling block of
  // kernels::launch_fused_down_block_wgmma's shapes runs as that one kernel in the inference forward.
  // options.fused_down: 0 never, 2 block 2's shape only (one CTA per image), 1 (default) both.
  bool fuse_down = true;
  bool fuse_down_group = true;  // block 3's shape (a group of 4 CTAs per 4 images)
  // The inference forward's squeeze-excite kernels read the fc weights as T where they can (BlockWeights::fc_t).
  // options.se_weights_t false: always fp32.
  bool se_weights_t = true;
  // Where the last block's conv2 runs as the dense GEMM from a prepared filter (batch up to the SM count), that
  // filter carries the squeeze projection (kernels::launch_squeeze_projection) as extra rows: the GEMM computes fc1's
  // pre-activations with o and the squeeze-excite skips its squeeze and fc1 (options.se_projection;
  // H100, batch 128: squeeze-excite 4.0 against 5.3 us, back to back 65.4 against 66.6 us).
  bool se_projection = true;
  int cc_major = 0, cc_minor = 0;
  size_t smem_optin = 0;  // the device's shared memory per block with opt-in
  std::map<Geometry, Activations> activations;
  std::map<GraphKey, Graph> graphs;
  std::set<GraphKey> graph_warm;  // kinds of call run once eagerly (captured from their second call)
  // The training step's forward and backward, each replayed as a graph per (geometry, caller's pointers; the
  // backward also per stage range: a staged backward keeps one graph per stage). Sized by the constructor for three
  // geometries or pointer sets of a staged step.
  LaunchGraphCache train_graphs;
  // Two equal halves: the main stream's convolutions use the first, the shortcut branch's the second (split-K
  // semaphores must not be shared by kernels that may run at the same time).
  void* conv_workspace = nullptr;
  size_t conv_workspace_bytes = 0;  // per half
  // Device memory replaced by a larger allocation (the conv workspace, the pack job table): a CUDA graph that kfuse's
  // caller captured around a forward still holds its address (kfuse recaptures only its own graphs), so it stays
  // allocated until the encoder is destroyed. Growth is rare (a larger geometry's first call).
  std::vector<void*> retired_memory;
  // The shortcut convolution of a downsampling block runs on a side branch, concurrently with conv1 and conv2: the
  // late layers fill only 64-128 of the SMs each, so two of them share the machine. Fork/join through events, which
  // stream capture turns into parallel graph branches.
  cudaStream_t side = nullptr;
  std::vector<cudaEvent_t> fork_events, join_events;

  void ensure_side_stream() {
    if (side) return;
    check_cuda(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), "cudaStreamCreate");
    for (size_t i = 0; i < blocks.size(); ++i) {
      cudaEvent_t f, j;
      check_cuda(cudaEventCreateWithFlags(&f, cudaEventDisableTiming), "cudaEventCreate");
      check_cuda(cudaEventCreateWithFlags(&j, cudaEventDisableTiming), "cudaEventCreate");
      fork_events.push_back(f);
      join_events.push_back(j);
    }
  }

  // Parameters bound in device memory (set_weights_device): each forward and training forward starts with a check
  // of their bytes on the device, and the repack below runs where they changed (encoder/weight_watch.h), so that no
  // write to a parameter can leave the packed weights stale. Two watches, each with verdicts of its own, so that a
  // change reaches both: the inference forward's repacks what a forward reads; the training forward's everything,
  // the backward's flipped filters too (9.4 of the default network's 21.9 MB of packed layouts, which the inference
  // forward would otherwise rewrite after every optimizer step for nothing). The pack job table: one job per packed
  // array, the forward's first.
  WeightWatch watch, train_watch;
  std::vector<kernels::PackJob> pack_jobs;
  kernels::PackJob* d_pack_jobs = nullptr;
  size_t forward_jobs = 0;  // pack_jobs[0 .. forward_jobs) are what a forward reads; the rest only the backward

  // Everything derived from the parameters (with_backward: the backward's layouts too): the packed weights, then the
  // prepared filters from them. Its kernels return at once when *run_flag is 0 (null: always run).
  void repack(cudaStream_t stream, const unsigned* run_flag, bool with_backward) {
    const size_t count = with_backward ? pack_jobs.size() : forward_jobs;
    if (count > 0)
      check_cuda(kernels::launch_pack_params(d_pack_jobs, int(count), weights, dtype, stream, run_flag),
                 "parameter packing kernel");
    remake_prepared_filters(stream, run_flag);
  }
  // An inference forward's first step: what it reads brought up to date with the bound parameters, on `stream`.
  void sync_weights(cudaStream_t stream) {
    watch.check(stream, [this](cudaStream_t s, const unsigned* run_flag) { repack(s, run_flag, false); });
  }
  // A training forward's: everything, the backward's layouts included.
  void sync_training_weights(cudaStream_t stream) {
    train_watch.check(stream, [this](cudaStream_t s, const unsigned* run_flag) { repack(s, run_flag, true); });
  }

  void clear_graphs() {
    for (auto& [k, g] : graphs) {
      cudaGraphExecDestroy(g.exec);
      cudaGraphDestroy(g.graph);
    }
    graphs.clear();
    graph_warm.clear();
    train_graphs.clear();
  }

  const uint8_t* w8() const { return static_cast<const uint8_t*>(weights); }
  const void* wptr(size_t off) const { return w8() + off; }
  const float* fptr(size_t off) const { return reinterpret_cast<const float*>(w8() + off); }

  using Device = DeviceGuard;  // makes `device` current for a scope

  Activations& buffers(const Geometry& g);

  // Kernel configuration per convolution: the tuner's choice when there is one, else the heuristic.
  int sm_count = 0;
  TuningMode tuning_mode = TuningMode::kOnFirstUse;
  std::map<std::string, ConvConfig> conv_choice;  // conv_shape_key + "/relu" or "/id"
  std::set<Geometry> tuned;                       // geometries whose convolutions went through the tuner
  std::unique_ptr<ConvTuningScratch> tuning_scratch;
  std::unique_ptr<TuningCache> tuning_cache;

  static std::string choice_key(const Conv2dProblem& p, bool relu) {
    return conv_shape_key(p) + (relu ? "/relu" : "/id");
  }
  ConvConfig choose(const Conv2dProblem& p, bool relu) const {
    const auto it = conv_choice.find(choice_key(p, relu));
    return it != conv_choice.end() ? it->second : conv_heuristic(p, sm_count, dtype);
  }

  // Tunes the convolutions of geometry g (conv1 with its ReLU epilogue, conv2 and the shortcut without).
  std::vector<OpTuningReport> tune(const Geometry& g, TuningMode mode, const EncoderGpu::TuneProgress& progress);

  // w: the KRSC filter's offset in the weights. A configuration that runs from a prepared filter
  // (ConvConfig::unrolled) uses the inference forward's (ensure_prepared_filters) where there is one; the training
  // forward, whose weights change every step, and a forward captured by the caller before one was made run it from
  // the KRSC filter instead (ensure_workspace sizes for both).
  void conv(const Conv2dProblem& p, const void* x, size_t w, void* y, const kernels::FixupEpilogue& e,
            cudaStream_t stream, bool side_branch, bool training);

  // Filters prepared ahead of time for the inference forward's convolutions (ConvConfig::unrolled), per
  // (configuration, problem, filter offset): made on the caller's stream before a geometry's first launch, remade in
  // place by set_weights and set_weights_device (so that captured graphs keep their addresses), freed with the
  // encoder.
  struct PreparedFilter {
    ConvConfig config;
    Conv2dProblem problem;
    size_t w = 0;  // the KRSC filter's offset in the weights
    void* data = nullptr;
    // The squeeze projection's rows after the unrolled filter (0: none) and, at rowsum_at bytes, w1's row sums;
    // block: whose fc1 they project.
    int extra_rows = 0;
    size_t rowsum_at = 0;
    size_t block = 0;
  };
  std::map<std::string, PreparedFilter> prepared;
  static std::string prepared_key(const ConvConfig& c, const Conv2dProblem& p, size_t w) {
    return c.name() + "/" + conv_shape_key(p) + "/" + std::to_string(w);
  }
  // The KRSC filter of problem j of block i (problems(): conv1, conv2, shortcut).
  size_t problem_filter(size_t i, size_t j) const {
    return j == 0 ? bw[i].conv1 : j == 1 ? bw[i].conv2 : bw[i].shortcut;
  }

  std::set<Geometry> prepared_for;  // geometries whose prepared filters exist for the current choices

  // The squeeze projection's rows for block i's conv2 problem p under configuration c, or 0: the last block (o goes
  // only to the NCHW output), conv2 as the dense GEMM from a prepared filter, the squeeze-excite's fast kernel at one
  // image per CTA (batch up to the SM count: one wave).
  static int projection_rows_max(const EncoderConfig::Block& b) {
    return b.se_hidden * 16 == b.planes && b.se_hidden % 8 == 0 ? b.se_hidden : 0;
  }
  int squeeze_projection_rows(size_t i, const ConvConfig& c, const Conv2dProblem& p) const {
    if (!se_projection || i + 1 != blocks.size() || !c.dense || !c.unrolled || p.n > sm_count) return 0;
    const int rows = projection_rows_max(blocks[i]);
    return (int64_t(p.p()) * p.q() * p.k + rows) % 8 == 0 ? rows : 0;
  }
  // Block i's conv2 prepared filter with the squeeze projection, or null (then conv2 and the squeeze-excite run as
  // usual).
  const PreparedFilter* squeeze_projection_for(size_t i, const Conv2dProblem& p) const {
    const ConvConfig c = choose(p, false);
    const auto it = prepared.find(prepared_key(c, p, problem_filter(i, 1)));
    return it != prepared.end() && it->second.extra_rows > 0 ? &it->second : nullptr;
  }
  // The projection rows and w1's row sums of prepared filter f (after its unrolled filter was made), on `stream`.
  void make_squeeze_projection(const PreparedFilter& f, cudaStream_t stream, const unsigned* run_flag = nullptr);

  // Once per geometry and set of choices (it runs on every forward call: the host path of a replay).
  void ensure_prepared_filters(const Geometry& g, cudaStream_t stream);
  // After the weights changed, on the stream that changed them (asynchronous); run_flag as for repack().
  void remake_prepared_filters(cudaStream_t stream, const unsigned* run_flag = nullptr);

  std::map<Geometry, bool> checked;  // geometries whose convolutions were checked and sized

  void ensure_workspace(const Geometry& g);

  // Makes each half of the conv workspace at least `need` bytes.
  void grow_conv_workspace(size_t need) {
    if (need <= conv_workspace_bytes) return;
    if (conv_workspace) retired_memory.push_back(conv_workspace);  // a caller's graph may still use it
    conv_workspace = nullptr;
    conv_workspace_bytes = 0;
    check_cuda(cudaMalloc(&conv_workspace, 2 * need), "cudaMalloc (conv workspace)");
    conv_workspace_bytes = need;
    clear_graphs();  // captured graphs hold the old workspace address
  }

  // conv1, conv2 and (when there is one) the shortcut of block b whose input is n x h x w.
  static std::vector<Conv2dProblem> problems(const EncoderConfig::Block& b, int n, int h, int w) {
    Conv2dProblem c1{n, h, w, b.in_planes, b.planes, 3, 3, 1, 1, b.stride, b.stride};
    Conv2dProblem c2{n, h / b.stride, w / b.stride, b.planes, b.planes, 3, 3, 1, 1, 1, 1};
    std::vector<Conv2dProblem> out{c1, c2};
    if (b.has_downsample) {
      Conv2dProblem sc = c1;
      if (b.stride == 1) sc.r = sc.s = 1, sc.pad_h = sc.pad_w = 0;
      out.push_back(sc);
    }
    return out;
  }

  // Validates a forward's input and output views (InvalidArgument naming the problem).
  void check_io(const DeviceTensorView& x, const DeviceTensorView& y) const {
    const Shape out_shape = config.output_shape(x.shape);  // rank, channels, spatial size
    KFUSE_CHECK(x.strides.size() == 4, InvalidArgument, "input strides must have 4 entries");
    KFUSE_CHECK(x.device == device && y.device == device, InvalidArgument, "input is on cuda:", x.device,
                " and output on cuda:", y.device, " but the encoder lives on cuda:", device);
    KFUSE_CHECK(x.dtype == DType::F32 || x.dtype == DType::F16 || x.dtype == DType::BF16 || x.dtype == DType::U8,
                InvalidArgument, "input dtype ", dtype_name(x.dtype), " is not supported (F32, F16, BF16 or U8)");
    const DType t = precision == GpuPrecision::kFloat16 ? DType::F16 : DType::BF16;
    KFUSE_CHECK(y.dtype == t || y.dtype == DType::F32, InvalidArgument, "output dtype ", dtype_name(y.dtype),
                " must be ", dtype_name(t), " or F32");
    KFUSE_CHECK(y.shape == out_shape, InvalidArgument, "output has shape ", shape_str(y.shape), ", expected ",
                shape_str(out_shape));
    const Shape packed{out_shape[1] * out_shape[2] * out_shape[3], out_shape[2] * out_shape[3], out_shape[3], 1};
    KFUSE_CHECK(y.strides == packed, InvalidArgument, "output must be a contiguous NCHW tensor");
    KFUSE_CHECK(x.data && y.data, InvalidArgument, "null input or output pointer");
  }

  static kernels::InputDType input_dtype(DType d) {
    return d == DType::F32 ? kernels::InputDType::kF32
           : d == DType::F16 ? kernels::InputDType::kF16
           : d == DType::BF16 ? kernels::InputDType::kBF16
                              : kernels::InputDType::kU8;
  }

  // The stem's arguments for input x into the buffers act.
  kernels::StemArgs stem_args(const DeviceTensorView& x, Activations& act) const {
    kernels::StemArgs stem;
    stem.x = x.data;
    stem.x_dtype = input_dtype(x.dtype);
    stem.stride_n = x.strides[0];
    stem.stride_c = x.strides[1];
    stem.stride_h = x.strides[2];
    stem.stride_w = x.strides[3];
    stem.n = int(x.shape[0]);
    stem.c = config.in_channels;
    stem.h = int(x.shape[2]);
    stem.w = int(x.shape[3]);
    stem.in_scale = use_affine ? input_affine : nullptr;
    stem.in_shift = use_affine ? input_affine + config.in_channels : nullptr;
    stem.weight = wptr(stem_w);
    stem.kpad = kpad;
    stem.p0 = config.base_planes;
    stem.b1a = fptr(bw[0].scalars) + kB1a;
    stem.x0 = act.x0;
    stem.a0 = act.a[0];
    return stem;
  }

  // Tunes geometry g's convolutions on first use, as the tuning mode says (never inside a stream capture).
  void tune_on_first_use(const Geometry& g, cudaStream_t stream) {
    if (tuned.count(g) || tuning_mode == TuningMode::kOff) return;
    // Tuning synchronizes and allocates: never inside someone's stream capture (the heuristic runs instead).
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    check_cuda(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
    if (capture == cudaStreamCaptureStatusNone) tune(g, tuning_mode, nullptr);
  }

  // Whether any convolution of geometry g runs through cuDNN or cuBLAS, whose launches (a memset, several kernels)
  // kfuse does not see: then no launch of the forward is programmatic.
  // Blocks that the inference forward runs as one fused kernel launch no convolution of their own.
  bool any_cudnn(const Geometry& g, bool training) const {
    int h = g.h / 4, w = g.w / 4;
    for (size_t i = 0; i < blocks.size(); ++i) {
      const auto& b = blocks[i];
      const bool fused = !training && (down_block_applies(i, h, w) || wgmma_block_applies(i, h, w) ||
                                       fused_block_applies(i, h, w));
      const auto probs = problems(b, g.n, h, w);
      for (size_t j = 0; j < probs.size() && !fused; ++j)
        if (choose(probs[j], j == 0).is_library()) return true;
      h /= b.stride;
      w /= b.stride;
    }
    return false;
  }

  // The graph nodes that carry the caller's pointers: the stem (the first kernel after the weights' check) and the last
  // squeeze-excite (the graph's only leaf), taken from the capture as they are launched.
  struct CapturedEnds {
    cudaGraphNode_t stem = nullptr, tail = nullptr;
    bool stem_in_block = false;
  };
  // The node just captured on `stream` (null when it is not capturing or the last operation left several).
  static cudaGraphNode_t last_captured_node(cudaStream_t stream) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    const cudaGraphNode_t* nodes = nullptr;
    const cudaGraphEdgeData* edges = nullptr;  // asked for: without it, programmatic edges make the query fail
    size_t count = 0;
    check_cuda(cudaStreamGetCaptureInfo(stream, &status, nullptr, nullptr, &nodes, &edges, &count),
               "cudaStreamGetCaptureInfo");
    return status == cudaStreamCaptureStatusActive && count == 1 ? nodes[0] : nullptr;
  }

  // Whether block i, whose input is h x w, runs as one fused kernel in the inference forward: an identity shortcut,
  // 64 -> 64 channels, hidden = 4, an image small enough for the kernel and the device's shared memory, and a next
  // block (the last block's squeeze-excite writes the caller's NCHW output; the fused kernel does not).
  bool fused_block_applies(size_t i, int h, int w) const {
    if (!fusable_block(i)) return false;
    const size_t smem = kernels::fused_block_smem_bytes(h, w);
    return smem != 0 && smem <= smem_optin;
  }
  // Whether block i, whose input is h x w, runs as the Hopper warpgroup-MMA kernel (inference and training forward).
  bool wgmma_block_applies(size_t i, int h, int w) const {
    if (!wgmma_blocks || !fusable_block(i)) return false;
    const size_t smem = kernels::fused_block_wgmma_smem_bytes(h, w, cc_major, cc_minor);
    return smem != 0 && smem <= smem_optin;
  }
  // Whether block i, whose input is h x w, runs as the fused downsampling kernel in the inference forward (with a
  // next block, which takes its a_next).
  bool down_block_applies(size_t i, int h, int w) const {
    if (!fuse_down || i + 1 >= blocks.size() || bw[i].down_stream == kNone) return false;
    const auto& b = blocks[i];
    if (!fuse_down_group && down_stream_offsets(b).ranks > 1) return false;
    const size_t smem =
        kernels::fused_down_block_smem_bytes(b.in_planes, b.planes, b.se_hidden, h, w, cc_major, cc_minor);
    return smem != 0 && smem <= smem_optin;
  }
  bool fusable_block(size_t i) const { return fuse_blocks && i + 1 < blocks.size() && fusable_block_shape(blocks[i]); }
  // Whether the inference forward of geometry g computes the stem inside block 1's warpgroup-MMA kernel: that kernel
  // applies, and every CTA has at most one image (it stages the stem's weights in its second image buffer).
  bool stem_in_block(const Geometry& g, bool training) const {
    return fuse_stem && !training && g.n <= sm_count && wgmma_block_applies(0, g.h / 4, g.w / 4);
  }

  // The forward's launch sequence on the buffers `act` (encoder/encoder_forward_plan.cpp): what launch() runs.
  ForwardPlan plan_forward(const Geometry& g, const Activations& act) const;
  BlockStep plan_block(const Geometry& g, const Activations& act, size_t i, int h, int w, bool stem_fused) const;

  // Launches the whole forward on `stream` (also used under stream capture); encoder/encoder_forward.cpp.
  void launch(const Geometry& g, const kernels::StemArgs& stem_args, kernels::SqueezeExciteArgs tail,
              cudaStream_t stream, CapturedEnds* ends = nullptr) {
    launch(g, buffers(g), stem_args, tail, stream, ends);
  }
  // The same on the buffers `act` (the training step's, which also keep every block's output in act.y).
  void launch(const Geometry& g, Activations& act, const kernels::StemArgs& stem_args,
              kernels::SqueezeExciteArgs tail, cudaStream_t stream, CapturedEnds* ends = nullptr);

  // One block of launch() as its plan step says: one fused kernel (a stride-1 block, with the stem where the step
  // says so; a downsampling block) ...
  void launch_fused_block(const Geometry& g, Activations& act, size_t i, const BlockStep& s,
                          const kernels::StemArgs& stem_args, bool chain, cudaStream_t stream, CapturedEnds* ends);
  void launch_fused_down_block(const Geometry& g, Activations& act, size_t i, const BlockStep& s, bool chain,
                               cudaStream_t stream);
  // ... or conv1 (the shortcut beside it on the side branch), conv2, then the squeeze-excite and join.
  void launch_block_kernels(const Geometry& g, Activations& act, size_t i, const BlockStep& s,
                            const kernels::SqueezeExciteArgs& tail, bool chain, cudaStream_t stream);
  // The squeeze-excite's arguments for block i (raw2: conv2 wrote its raw output; proj: the squeeze projection's
  // filter, where conv2 computed fc1's pre-activations).
  kernels::SqueezeExciteArgs squeeze_excite_args(const Geometry& g, const Activations& act, size_t i, int h, int w,
                                                 const kernels::SqueezeExciteArgs& tail, bool raw2,
                                                 const PreparedFilter* proj) const;
};

}  // namespace kfuse
