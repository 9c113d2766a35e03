// Orchestration of the fused inference path (no kernel code here): packs weights, owns activations per input
// geometry, launches stem -> per block (conv1 [+ shortcut] -> conv2 -> squeeze-excite) and captures that sequence in
// a CUDA graph whose input and output pointers are patched on replay.
#include "kfuse/encoder_gpu.h"

#include <cstring>

#include <map>
#include <memory>
#include <set>
#include <tuple>

#include "kernels/conv/conv_fixup.h"
#include "kernels/encoder/encoder_kernels.h"
#include "kfuse/device.h"
#include "runtime/conv_selection.h"
#include "runtime/half_bits.h"
#include "kfuse/error.h"

namespace kfuse {
namespace {

using kernels::Conv2dProblem;
using kernels::ConvDType;
using kernels::ConvTile;

void check_cuda(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) throw Error("kfuse: " + what + " failed: " + cudaGetErrorString(e));
}

// Host staging of the packed weights: every array 256-byte aligned in one device allocation.
class Packer {
 public:
  explicit Packer(GpuPrecision p) : precision_(p) {}
  size_t add_t(const std::vector<float>& v) {  // network storage type
    const size_t off = align();
    bytes_.resize(off + 2 * v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      const uint16_t b = float_to_bits(v[i], precision_ == GpuPrecision::kFloat16 ? ConvDType::kF16 : ConvDType::kBF16);
      std::memcpy(&bytes_[off + 2 * i], &b, 2);
    }
    return off;
  }
  size_t add_f32(const std::vector<float>& v) {
    const size_t off = align();
    bytes_.resize(off + 4 * v.size());
    if (!v.empty()) std::memcpy(&bytes_[off], v.data(), 4 * v.size());
    return off;
  }
  const std::vector<uint8_t>& bytes() const { return bytes_; }

 private:
  size_t align() {
    bytes_.resize((bytes_.size() + 255) / 256 * 256);
    return bytes_.size();
  }
  GpuPrecision precision_;
  std::vector<uint8_t> bytes_;
};

// [K, C, R, S] -> [K, R, S, C]
std::vector<float> krsc(const HostTensor<float>& w) {
  const int64_t K = w.dim(0), C = w.dim(1), R = w.dim(2), S = w.dim(3);
  std::vector<float> out(static_cast<size_t>(w.numel()));
  for (int64_t k = 0; k < K; ++k)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t r = 0; r < R; ++r)
        for (int64_t s = 0; s < S; ++s) out[((k * R + r) * S + s) * C + c] = w.at(k, c, r, s);
  return out;
}

// avgpool3x3(stride, pad 1, /9) followed by conv1x1(Wd) is exactly conv3x3(stride, pad 1) with Wd / 9 on every tap:
// one implicit GEMM instead of a pool pass plus a GEMM.
std::vector<float> pooled_shortcut_krsc(const HostTensor<float>& wd) {
  const int64_t K = wd.dim(0), C = wd.dim(1);
  std::vector<float> out(static_cast<size_t>(K * 9 * C));
  for (int64_t k = 0; k < K; ++k)
    for (int64_t t = 0; t < 9; ++t)
      for (int64_t c = 0; c < C; ++c) out[(k * 9 + t) * C + c] = wd.at(k, c, 0, 0) / 9.0f;
  return out;
}

struct BlockWeights {
  size_t conv1, conv2, shortcut, fc1_w, fc1_b, fc2_w, fc2_b, scalars;  // byte offsets
};
// scalars[5]: b1a, b1b, b2a, scale, b2b
enum Scalar { kB1a = 0, kB1b, kB2a, kScale, kB2b };

struct Geometry {
  int n, h, w;
  bool operator<(const Geometry& o) const { return std::tie(n, h, w) < std::tie(o.n, o.h, o.w); }
};

struct Activations {
  void* base = nullptr;
  std::vector<void*> x, a, h2, idt, o;  // per block; x[b]: the block's input when its shortcut is the identity
  void* x0 = nullptr;
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
  kernels::StemArgs stem_args;
  kernels::SqueezeExciteArgs tail_args;
};

}  // namespace

struct EncoderGpu::Impl {
  EncoderConfig config;
  std::vector<EncoderConfig::Block> blocks;
  GpuPrecision precision;
  ConvDType dtype;
  int device;
  int kpad = 0;
  void* weights = nullptr;
  size_t stem_w = 0;
  std::vector<BlockWeights> bw;
  bool have_weights = false;
  float* input_affine = nullptr;  // [2][C]: scale then shift
  bool use_affine = false;
  bool use_graphs = true;
  std::map<Geometry, Activations> activations;
  std::map<GraphKey, Graph> graphs;
  // Two equal halves: the main stream's convolutions use the first, the shortcut branch's the second (split-K
  // semaphores must not be shared by kernels that may run at the same time).
  void* conv_workspace = nullptr;
  size_t conv_workspace_bytes = 0;  // per half
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

  void clear_graphs() {
    for (auto& [k, g] : graphs) {
      cudaGraphExecDestroy(g.exec);
      cudaGraphDestroy(g.graph);
    }
    graphs.clear();
  }

  const uint8_t* w8() const { return static_cast<const uint8_t*>(weights); }
  const void* wptr(size_t off) const { return w8() + off; }
  const float* fptr(size_t off) const { return reinterpret_cast<const float*>(w8() + off); }

  struct Device {  // makes `device` current for a scope
    int previous = 0;
    explicit Device(int d) {
      cudaGetDevice(&previous);
      check_cuda(cudaSetDevice(d), "cudaSetDevice");
    }
    ~Device() { cudaSetDevice(previous); }
  };

  Activations& buffers(const Geometry& g) {
    auto it = activations.find(g);
    if (it != activations.end()) return it->second;
    const size_t es = 2;
    std::vector<size_t> sizes;  // element counts in allocation order
    Activations act;
    int h = g.h / 4, w = g.w / 4;
    size_t total = 0;
    auto take = [&](size_t elems) {
      const size_t off = total;
      total += (elems * es + 255) / 256 * 256;
      return off;
    };
    const size_t x0 = take(size_t(g.n) * h * w * config.base_planes);
    struct Offs {
      size_t x, a, h2, idt, o;
    };
    std::vector<Offs> offs;
    for (const auto& b : blocks) {
      const size_t in = size_t(g.n) * h * w * b.in_planes;
      const int ho = h / b.stride, wo = w / b.stride;
      const size_t out = size_t(g.n) * ho * wo * b.planes;
      Offs o{};
      o.x = b.has_downsample ? SIZE_MAX : take(in);
      o.a = take(in);
      o.h2 = take(out);
      o.idt = b.has_downsample ? take(out) : SIZE_MAX;
      o.o = take(out);
      offs.push_back(o);
      h = ho;
      w = wo;
    }
    check_cuda(cudaMalloc(&act.base, total), "cudaMalloc (activations)");
    auto at = [&](size_t off) { return off == SIZE_MAX ? nullptr : static_cast<void*>(static_cast<uint8_t*>(act.base) + off); };
    act.x0 = at(x0);
    for (const Offs& o : offs) {
      act.x.push_back(at(o.x));
      act.a.push_back(at(o.a));
      act.h2.push_back(at(o.h2));
      act.idt.push_back(at(o.idt));
      act.o.push_back(at(o.o));
    }
    // Block 1's identity is the stem output itself.
    if (!blocks.empty() && !blocks[0].has_downsample) act.x[0] = act.x0;
    return activations.emplace(g, std::move(act)).first->second;
  }

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
    return it != conv_choice.end() ? it->second : conv_heuristic(p, sm_count);
  }

  // Tunes the convolutions of geometry g (conv1 with its ReLU epilogue, conv2 and the shortcut without).
  std::vector<OpTuningReport> tune(const Geometry& g, TuningMode mode, const EncoderGpu::TuneProgress& progress) {
    if (!tuning_scratch) tuning_scratch = std::make_unique<ConvTuningScratch>();
    if (!tuning_cache) tuning_cache = std::make_unique<TuningCache>();
    std::vector<std::pair<Conv2dProblem, bool>> todo;
    int h = g.h / 4, w = g.w / 4;
    for (const auto& b : blocks) {
      const auto probs = problems(b, g.n, h, w);
      for (size_t j = 0; j < probs.size(); ++j) todo.emplace_back(probs[j], j == 0);
      h /= b.stride;
      w /= b.stride;
    }
    std::vector<OpTuningReport> rows;
    bool changed = false;
    for (const auto& [p, relu] : todo) {
      OpTuningReport row;
      const ConvConfig before = choose(p, relu);
      const ConvConfig c = tuning_scratch->tune(p, dtype, relu, *tuning_cache, mode, row);
      conv_choice[choice_key(p, relu)] = c;
      changed = changed || !(c == before);
      rows.push_back(row);
      if (progress) progress(rows.size(), todo.size(), rows.back());
    }
    tuned.insert(g);
    if (changed) {  // workspace sizes and captured kernels may be stale; graphs in flight must finish first
      check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      checked.clear();
      clear_graphs();
    }
    return rows;
  }

  void conv(const Conv2dProblem& p, const void* x, size_t w, void* y, const kernels::FixupEpilogue& e,
            cudaStream_t stream, bool side_branch = false) {
    const ConvConfig c = choose(p, e.relu);
    const size_t need = kernels::conv2d_fprop_fixup_workspace_bytes(p, dtype, c.tile, c.split_k);
    if (need > conv_workspace_bytes) throw Error("kfuse: conv workspace too small (internal error)");
    void* ws = conv_workspace ? static_cast<uint8_t*>(conv_workspace) + (side_branch ? conv_workspace_bytes : 0)
                              : nullptr;
    check_cuda(kernels::conv2d_fprop_fixup(p, dtype, c.tile, x, wptr(w), y, e, c.split_k, ws, conv_workspace_bytes,
                                           stream),
               "conv2d_fprop_fixup (" + c.name() + ", " + conv_shape_key(p) + ")");
  }

  std::map<Geometry, bool> checked;  // geometries whose convolutions were checked and sized

  void ensure_workspace(const Geometry& g) {
    if (checked.count(g)) return;
    size_t need = 0;
    int h = g.h / 4, w = g.w / 4;
    for (const auto& b : blocks) {
      const auto probs = problems(b, g.n, h, w);
      for (size_t j = 0; j < probs.size(); ++j) {
        const Conv2dProblem& p = probs[j];
        const ConvConfig c = choose(p, j == 0);
        if (!kernels::conv2d_fprop_fixup_can_implement(p, dtype, c.tile, c.split_k))
          throw InvalidArgument("kfuse: the fused conv kernels cannot run block '" + b.prefix + "' at this size");
        need = std::max(need, kernels::conv2d_fprop_fixup_workspace_bytes(p, dtype, c.tile, c.split_k));
      }
      h /= b.stride;
      w /= b.stride;
    }
    if (need > conv_workspace_bytes) {
      if (conv_workspace) cudaFree(conv_workspace);
      conv_workspace = nullptr;
      check_cuda(cudaMalloc(&conv_workspace, 2 * need), "cudaMalloc (conv workspace)");
      conv_workspace_bytes = need;
      // Captured graphs hold the old workspace address.
      clear_graphs();
    }
    checked[g] = true;
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

  // Launches the whole forward on `stream` (also used under stream capture).
  void launch(const Geometry& g, const kernels::StemArgs& stem_args, kernels::SqueezeExciteArgs tail,
              cudaStream_t stream) {
    Activations& act = buffers(g);
    check_cuda(kernels::launch_stem(stem_args, dtype, stream), "stem kernel");
    int h = g.h / 4, w = g.w / 4;
    for (size_t i = 0; i < blocks.size(); ++i) {
      const auto& b = blocks[i];
      const BlockWeights& W = bw[i];
      const float* s = fptr(W.scalars);
      const auto probs = problems(b, g.n, h, w);
      if (b.has_downsample) {  // fork: the shortcut needs only a[i], like conv1
        ensure_side_stream();
        check_cuda(cudaEventRecord(fork_events[i], stream), "cudaEventRecord");
        check_cuda(cudaStreamWaitEvent(side, fork_events[i], 0), "cudaStreamWaitEvent");
        conv(probs[2], act.a[i], W.shortcut, act.idt[i], kernels::FixupEpilogue{}, side, /*side_branch=*/true);
        check_cuda(cudaEventRecord(join_events[i], side), "cudaEventRecord");
      }
      kernels::FixupEpilogue e1{nullptr, s + kB1b, s + kB2a, true};  // h + b2a = relu(acc + b1b) + b2a
      conv(probs[0], act.a[i], W.conv1, act.h2[i], e1, stream);
      kernels::FixupEpilogue e2{s + kScale, s + kB2b, nullptr, false};  // o = acc * scale + b2b
      conv(probs[1], act.h2[i], W.conv2, act.o[i], e2, stream);
      if (b.has_downsample)  // join before the squeeze-excite, which reads the shortcut's output
        check_cuda(cudaStreamWaitEvent(stream, join_events[i], 0), "cudaStreamWaitEvent");

      kernels::SqueezeExciteArgs se = tail;  // out_nchw / out_f32 are the tail's; cleared below for inner blocks
      se.o = act.o[i];
      se.identity = b.has_downsample ? act.idt[i] : act.x[i];
      se.n = g.n;
      se.hw = (h / b.stride) * (w / b.stride);
      se.p = b.planes;
      se.hidden = b.se_hidden;
      se.w1 = fptr(W.fc1_w);
      se.b1 = fptr(W.fc1_b);
      se.w2 = fptr(W.fc2_w);
      se.b2 = fptr(W.fc2_b);
      se.y = nullptr;
      se.a_next = nullptr;
      se.next_b1a = nullptr;
      if (i + 1 < blocks.size()) {
        se.out_nchw = nullptr;
        se.a_next = act.a[i + 1];
        se.next_b1a = fptr(bw[i + 1].scalars) + kB1a;
        if (!blocks[i + 1].has_downsample) se.y = act.x[i + 1];
      }
      check_cuda(kernels::launch_squeeze_excite(se, dtype, stream), "squeeze-excite kernel");
      h /= b.stride;
      w /= b.stride;
    }
  }
};

EncoderGpu::EncoderGpu(const EncoderConfig& config, GpuPrecision precision, int device) : impl_(new Impl) {
  config.validate();
  KFUSE_CHECK(config.base_planes % 16 == 0, InvalidArgument,
              "the CUDA path needs base_planes to be a multiple of 16, got ", config.base_planes);
  const DeviceInfo info = cuda_device_info(device);  // throws Unsupported without a device
  KFUSE_CHECK(info.major >= 8, Unsupported, "kfuse's CUDA kernels need compute capability 8.0 or newer; ", info.name,
              " has ", info.major, ".", info.minor);
  Impl& m = *impl_;
  m.config = config;
  m.blocks = config.blocks();
  m.precision = precision;
  m.dtype = precision == GpuPrecision::kFloat16 ? ConvDType::kF16 : ConvDType::kBF16;
  m.device = device;
  m.kpad = (16 * config.in_channels + 63) / 64 * 64;
  m.sm_count = info.sm_count;
  m.tuning_mode = tuning_mode_from_env();
  Impl::Device scope(device);
  check_cuda(cudaMalloc(reinterpret_cast<void**>(&m.input_affine), 2 * sizeof(float) * config.in_channels),
             "cudaMalloc");
}

EncoderGpu::~EncoderGpu() {
  if (!impl_) return;
  Impl& m = *impl_;
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(m.device);
  m.clear_graphs();
  for (auto& [k, a] : m.activations) cudaFree(a.base);
  cudaFree(m.weights);
  cudaFree(m.input_affine);
  cudaFree(m.conv_workspace);
  for (cudaEvent_t e : m.fork_events) cudaEventDestroy(e);
  for (cudaEvent_t e : m.join_events) cudaEventDestroy(e);
  if (m.side) cudaStreamDestroy(m.side);
  cudaSetDevice(previous);
}

const EncoderConfig& EncoderGpu::config() const { return impl_->config; }
GpuPrecision EncoderGpu::precision() const { return impl_->precision; }
void EncoderGpu::set_tuning_mode(TuningMode mode) { impl_->tuning_mode = mode; }
TuningMode EncoderGpu::tuning_mode() const { return impl_->tuning_mode; }

std::vector<OpTuningReport> EncoderGpu::tune(int n, int h, int w, TuningMode mode, const TuneProgress& progress) {
  Impl& m = *impl_;
  KFUSE_CHECK(n >= 1, InvalidArgument, "tune: batch must be >= 1, got ", n);
  m.config.output_shape({n, m.config.in_channels, h, w});  // validates H and W
  Impl::Device scope(m.device);
  return m.tune(Geometry{n, h, w}, mode == TuningMode::kOff ? TuningMode::kOnFirstUse : mode, progress);
}

void EncoderGpu::set_use_graphs(bool on) { impl_->use_graphs = on; }
size_t EncoderGpu::graph_count() const { return impl_->graphs.size(); }

void EncoderGpu::set_weights(const EncoderParams<float>& params) {
  Impl& m = *impl_;
  KFUSE_CHECK(params.config() == m.config, InvalidArgument, "set_weights: parameters of ", params.config().to_string(),
              " given to an encoder of ", m.config.to_string());
  Packer pk(m.precision);
  // Stem: W [P0, 16C, 1, 1] -> B[k][p] with zero rows up to kpad.
  {
    const HostTensor<float>& w = params.at("stem.1.weight");
    const int p0 = m.config.base_planes, k_real = 16 * m.config.in_channels;
    std::vector<float> b(size_t(m.kpad) * p0, 0.f);
    for (int k = 0; k < k_real; ++k)
      for (int p = 0; p < p0; ++p) b[size_t(k) * p0 + p] = w.at(p, k, 0, 0);
    m.stem_w = pk.add_t(b);
  }
  m.bw.clear();
  for (const auto& b : m.blocks) {
    BlockWeights W{};
    W.conv1 = pk.add_t(krsc(params.at(b.prefix + "conv1.weight")));
    W.conv2 = pk.add_t(krsc(params.at(b.prefix + "conv2.weight")));
    if (b.has_downsample) {
      const HostTensor<float>& wd = params.at(b.prefix + b.downsample_weight());
      W.shortcut = pk.add_t(b.stride > 1 ? pooled_shortcut_krsc(wd) : krsc(wd));
    }
    W.fc1_w = pk.add_f32(params.at(b.prefix + "se.excite.0.weight").values());
    W.fc1_b = pk.add_f32(params.at(b.prefix + "se.excite.0.bias").values());
    W.fc2_w = pk.add_f32(params.at(b.prefix + "se.excite.2.weight").values());
    W.fc2_b = pk.add_f32(params.at(b.prefix + "se.excite.2.bias").values());
    W.scalars = pk.add_f32({params.scalar(b.prefix + "fixup_bias1a"), params.scalar(b.prefix + "fixup_bias1b"),
                            params.scalar(b.prefix + "fixup_bias2a"), params.scalar(b.prefix + "fixup_scale"),
                            params.scalar(b.prefix + "fixup_bias2b")});
    m.bw.push_back(W);
  }
  Impl::Device scope(m.device);
  // Weights keep their address, so captured graphs stay valid when the values change.
  static_assert(sizeof(size_t) == 8);
  if (m.weights == nullptr) check_cuda(cudaMalloc(&m.weights, pk.bytes().size()), "cudaMalloc (weights)");
  // Forwards in flight on any stream (the caller's may be non-blocking) still read the old weights.
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  check_cuda(cudaMemcpy(m.weights, pk.bytes().data(), pk.bytes().size(), cudaMemcpyHostToDevice), "cudaMemcpy");
  if (!m.have_weights) set_input_affine({}, {});
  m.have_weights = true;
}

void EncoderGpu::set_input_affine(const std::vector<float>& scale, const std::vector<float>& shift) {
  Impl& m = *impl_;
  const size_t c = size_t(m.config.in_channels);
  KFUSE_CHECK(scale.size() == shift.size() && (scale.empty() || scale.size() == c), InvalidArgument,
              "input affine map needs ", c, " scales and shifts, got ", scale.size(), " and ", shift.size());
  std::vector<float> v(2 * c);
  for (size_t i = 0; i < c; ++i) {
    v[i] = scale.empty() ? 1.f : scale[i];
    v[c + i] = shift.empty() ? 0.f : shift[i];
  }
  Impl::Device scope(m.device);
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // forwards in flight read the old map
  check_cuda(cudaMemcpy(m.input_affine, v.data(), 2 * c * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
  m.use_affine = !scale.empty();
  // use_affine is baked into captured graphs (a null scale pointer skips the math): recapture.
  m.clear_graphs();
}

void EncoderGpu::forward(const DeviceTensorView& x, const DeviceTensorView& y, cudaStream_t stream) {
  Impl& m = *impl_;
  KFUSE_CHECK(m.have_weights, InvalidArgument, "EncoderGpu::forward before set_weights");
  const Shape out_shape = m.config.output_shape(x.shape);  // rank, channels, spatial size
  KFUSE_CHECK(x.strides.size() == 4, InvalidArgument, "input strides must have 4 entries");
  KFUSE_CHECK(x.device == m.device && y.device == m.device, InvalidArgument, "input is on cuda:", x.device,
              " and output on cuda:", y.device, " but the encoder lives on cuda:", m.device);
  KFUSE_CHECK(x.dtype == DType::F32 || x.dtype == DType::F16 || x.dtype == DType::BF16 || x.dtype == DType::U8,
              InvalidArgument, "input dtype ", dtype_name(x.dtype), " is not supported (F32, F16, BF16 or U8)");
  const DType t = m.precision == GpuPrecision::kFloat16 ? DType::F16 : DType::BF16;
  KFUSE_CHECK(y.dtype == t || y.dtype == DType::F32, InvalidArgument, "output dtype ", dtype_name(y.dtype),
              " must be ", dtype_name(t), " or F32");
  KFUSE_CHECK(y.shape == out_shape, InvalidArgument, "output has shape ", shape_str(y.shape), ", expected ",
              shape_str(out_shape));
  const Shape packed{out_shape[1] * out_shape[2] * out_shape[3], out_shape[2] * out_shape[3], out_shape[3], 1};
  KFUSE_CHECK(y.strides == packed, InvalidArgument, "output must be a contiguous NCHW tensor");
  KFUSE_CHECK(x.data && y.data, InvalidArgument, "null input or output pointer");

  const Geometry g{int(x.shape[0]), int(x.shape[2]), int(x.shape[3])};
  Impl::Device scope(m.device);
  Activations& act = m.buffers(g);  // std::map: the reference stays valid
  if (!m.tuned.count(g) && m.tuning_mode != TuningMode::kOff) {
    // Tuning synchronizes and allocates: never inside someone's stream capture (the heuristic runs instead).
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    check_cuda(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
    if (capture == cudaStreamCaptureStatusNone) m.tune(g, m.tuning_mode, nullptr);
  }
  m.ensure_workspace(g);

  kernels::StemArgs stem;
  stem.x = x.data;
  stem.x_dtype = x.dtype == DType::F32 ? kernels::InputDType::kF32
                 : x.dtype == DType::F16 ? kernels::InputDType::kF16
                 : x.dtype == DType::BF16 ? kernels::InputDType::kBF16
                                          : kernels::InputDType::kU8;
  stem.stride_n = x.strides[0];
  stem.stride_c = x.strides[1];
  stem.stride_h = x.strides[2];
  stem.stride_w = x.strides[3];
  stem.n = g.n;
  stem.c = m.config.in_channels;
  stem.h = g.h;
  stem.w = g.w;
  stem.in_scale = m.use_affine ? m.input_affine : nullptr;
  stem.in_shift = m.use_affine ? m.input_affine + m.config.in_channels : nullptr;
  stem.weight = m.wptr(m.stem_w);
  stem.kpad = m.kpad;
  stem.p0 = m.config.base_planes;
  stem.b1a = m.fptr(m.bw[0].scalars) + kB1a;
  stem.x0 = act.x0;
  stem.a0 = act.a[0];
  kernels::SqueezeExciteArgs tail;
  tail.out_nchw = y.data;
  tail.out_f32 = y.dtype == DType::F32;

  if (!m.use_graphs) {
    m.launch(g, stem, tail, stream);
    return;
  }
  const GraphKey key{g, x.dtype, x.strides, y.dtype};
  auto it = m.graphs.find(key);
  if (it == m.graphs.end()) {
    // Capture on a private stream, so that the caller's stream never sees a capture in progress.
    cudaStream_t cs;
    check_cuda(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking), "cudaStreamCreate");
    cudaGraph_t graph = nullptr;
    check_cuda(cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    try {
      m.launch(g, stem, tail, cs);
    } catch (...) {
      cudaStreamEndCapture(cs, &graph);
      if (graph) cudaGraphDestroy(graph);
      cudaStreamDestroy(cs);
      throw;
    }
    check_cuda(cudaStreamEndCapture(cs, &graph), "cudaStreamEndCapture");
    cudaStreamDestroy(cs);
    Graph gr;
    gr.stem_args = stem;
    gr.tail_args = tail;
    // The stem is the graph's only root kernel and the last squeeze-excite its only leaf: their parameters are the
    // ones that carry the caller's pointers.
    size_t count = 0;
    check_cuda(cudaGraphGetNodes(graph, nullptr, &count), "cudaGraphGetNodes");
    std::vector<cudaGraphNode_t> nodes(count);
    check_cuda(cudaGraphGetNodes(graph, nodes.data(), &count), "cudaGraphGetNodes");
    for (cudaGraphNode_t node : nodes) {
      cudaGraphNodeType type;
      cudaGraphNodeGetType(node, &type);
      if (type != cudaGraphNodeTypeKernel) continue;
      size_t deps = 0, dependents = 0;
      cudaGraphNodeGetDependencies(node, nullptr, nullptr, &deps);
      cudaGraphNodeGetDependentNodes(node, nullptr, nullptr, &dependents);
      if (deps == 0) gr.stem = node;
      if (dependents == 0) gr.tail = node;
    }
    if (!gr.stem || !gr.tail) {
      cudaGraphDestroy(graph);
      throw Error("kfuse: unexpected graph shape (no unique first and last kernel)");
    }
    gr.graph = graph;
    if (cudaError_t e = cudaGraphInstantiate(&gr.exec, graph, 0); e != cudaSuccess) {
      cudaGraphDestroy(graph);
      check_cuda(e, "cudaGraphInstantiate");
    }
    it = m.graphs.emplace(key, gr).first;
  }
  Graph& gr = it->second;
  // Patch the caller's pointers into the stem and the tail when they moved since the last replay.
  if (gr.stem_args.x != stem.x) {
    cudaKernelNodeParams p{};
    check_cuda(cudaGraphKernelNodeGetParams(gr.stem, &p), "cudaGraphKernelNodeGetParams");
    gr.stem_args.x = stem.x;
    void* args[] = {&gr.stem_args};
    p.kernelParams = args;
    check_cuda(cudaGraphExecKernelNodeSetParams(gr.exec, gr.stem, &p), "cudaGraphExecKernelNodeSetParams");
  }
  if (gr.tail_args.out_nchw != tail.out_nchw) {
    cudaKernelNodeParams p{};
    check_cuda(cudaGraphKernelNodeGetParams(gr.tail, &p), "cudaGraphKernelNodeGetParams");
    auto* captured = static_cast<kernels::SqueezeExciteArgs*>(p.kernelParams[0]);
    kernels::SqueezeExciteArgs patched = *captured;
    patched.out_nchw = tail.out_nchw;
    void* args[] = {&patched};
    p.kernelParams = args;
    check_cuda(cudaGraphExecKernelNodeSetParams(gr.exec, gr.tail, &p), "cudaGraphExecKernelNodeSetParams");
    gr.tail_args.out_nchw = tail.out_nchw;
  }
  check_cuda(cudaGraphLaunch(gr.exec, stream), "cudaGraphLaunch");
}

}  // namespace kfuse
