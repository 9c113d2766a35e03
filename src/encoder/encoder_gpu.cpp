// Orchestration of the fused inference path (no kernel code here): packs weights, owns activations per input
// geometry, launches stem -> per block (conv1 [+ shortcut] -> conv2 -> squeeze-excite) and captures that sequence in
// a CUDA graph whose input and output pointers are patched on replay.
#include "kfuse/encoder_gpu.h"

#include "core/dev_overrides.h"
#include "kfuse/device.h"
#include "encoder/encoder_gpu_impl.h"

#include <cstdio>
#include <cstdlib>
#include <string>

namespace kfuse {

namespace {

// Captures the forward for (g, stem, tail) as a graph into `out`, its stem and tail nodes found as they are
// launched. Returns "" or why it failed.
std::string capture_forward(EncoderGpu::Impl& m, const Geometry& g, const kernels::StemArgs& stem,
                            const kernels::SqueezeExciteArgs& tail, Graph& out) {
  EncoderGpu::Impl::CapturedEnds ends;
  cudaGraphExec_t exec = nullptr;
  cudaGraph_t graph = nullptr;  // kept: the stem's and tail's parameters are read back when the caller's pointers move
  const std::string why =
      capture_graph(
          [&](cudaStream_t cs) {
            m.sync_weights(cs);
            m.launch(g, stem, tail, cs, &ends);
          },
          &exec, &graph);
  if (!why.empty()) return why;
  if (!ends.stem || !ends.tail) {
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    return "unexpected graph shape (no unique first and last kernel)";
  }
  out.exec = exec;
  out.graph = graph;
  out.stem = ends.stem;
  out.stem_in_block = ends.stem_in_block;
  out.tail = ends.tail;
  out.stem_args = stem;
  out.tail_args = tail;
  return "";
}

}  // namespace

EncoderGpu::EncoderGpu(const EncoderConfig& config, GpuPrecision precision, int device, const EncoderOptions& options)
    : impl_(new Impl) {
  config.validate();
  KFUSE_CHECK(config.base_planes % 16 == 0, InvalidArgument,
              "the CUDA path needs base_planes to be a multiple of 16, got ", config.base_planes);
  const DeviceInfo info = cuda_device_info(device);  // throws Unsupported without a device
  KFUSE_CHECK(info.major >= 8, Unsupported, "kfuse's CUDA kernels need compute capability 8.0 or newer; ", info.name,
              " has ", info.major, ".", info.minor);
  Impl& m = *impl_;
  m.config = config;
  m.blocks = config.blocks();
  m.train_graphs.set_capacity(3 * (m.blocks.size() + 2));  // per staged step: forward, every block, the stem
  m.precision = precision;
  m.dtype = precision == GpuPrecision::kFloat16 ? ConvDType::kF16 : ConvDType::kBF16;
  m.device = device;
  m.kpad = (16 * config.in_channels + 63) / 64 * 64;
  m.sm_count = info.sm_count;
  m.tuning_mode = tuning_mode_from_env();
  // The caller's options, with the developer's A/B overrides (core/dev_overrides.h) on top.
  const EncoderOptions o = m.options = with_dev_overrides(options);
  KFUSE_CHECK(o.programmatic_launch >= 0 && o.programmatic_launch <= 3, InvalidArgument,
              "EncoderOptions::programmatic_launch must be 0 .. 3, got ", o.programmatic_launch);
  KFUSE_CHECK(o.fused_down >= 0 && o.fused_down <= 2, InvalidArgument,
              "EncoderOptions::fused_down must be 0 .. 2, got ", o.fused_down);
  KFUSE_CHECK(o.cudnn_fused >= 0 && o.cudnn_fused <= 2, InvalidArgument,
              "EncoderOptions::cudnn_fused must be 0 .. 2, got ", o.cudnn_fused);
  m.use_pdl = o.programmatic_launch != 0 && kernels::pdl_supported(device);
  if (o.programmatic_launch != 0) m.pdl_policy = o.programmatic_launch;
  m.fuse_blocks = o.fused_blocks;
  m.fuse_stem = o.fused_stem;
  m.wgmma_blocks = o.wgmma_blocks;
  m.fuse_down = o.fused_down != 0;
  m.fuse_down_group = o.fused_down == 1;
  m.se_weights_t = o.se_weights_t;
  m.se_projection = o.se_projection;
  m.cc_major = info.major;
  m.cc_minor = info.minor;
  int optin = 0;
  check_cuda(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
             "cudaDeviceGetAttribute");
  m.smem_optin = static_cast<size_t>(optin);
  m.layout = plan_weights(config, m.blocks, m.kpad);
  m.stem_w = m.layout.stem_w;
  m.bw = m.layout.blocks;
  Impl::Device scope(device);
  check_cuda(cudaMalloc(reinterpret_cast<void**>(&m.input_affine), 2 * sizeof(float) * config.in_channels),
             "cudaMalloc");
  check_cuda(cudaMalloc(&m.weights, m.layout.bytes), "cudaMalloc (weights)");
}

EncoderGpu::~EncoderGpu() {
  if (!impl_) return;
  Impl& m = *impl_;
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(m.device);
  m.clear_graphs();
  m.training.reset();
  for (auto& [k, a] : m.activations) cudaFree(a.base);
  cudaFree(m.weights);
  cudaFree(m.d_pack_jobs);
  cudaFree(m.input_affine);
  cudaFree(m.conv_workspace);
  for (void* p : m.retired_memory) cudaFree(p);
  for (auto& [k, f] : m.prepared) cudaFree(f.data);
  for (cudaEvent_t e : m.fork_events) cudaEventDestroy(e);
  for (cudaEvent_t e : m.join_events) cudaEventDestroy(e);
  if (m.side) cudaStreamDestroy(m.side);
  cudaSetDevice(previous);
}

const EncoderConfig& EncoderGpu::config() const { return impl_->config; }
GpuPrecision EncoderGpu::precision() const { return impl_->precision; }
const EncoderOptions& EncoderGpu::options() const { return impl_->options; }
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
size_t EncoderGpu::graph_count() const { return impl_->graphs.size() + impl_->train_graphs.graph_count(); }
bool EncoderGpu::uses_programmatic_launch() const { return impl_->use_pdl; }

void EncoderGpu::set_weights(const EncoderParams<float>& params) {
  Impl& m = *impl_;
  KFUSE_CHECK(params.config() == m.config, InvalidArgument, "set_weights: parameters of ", params.config().to_string(),
              " given to an encoder of ", m.config.to_string());
  HostWeights hw(m.layout.bytes, m.precision);
  // Stem: W [P0, 16C, 1, 1] -> B[k][p] with zero rows up to kpad.
  {
    const HostTensor<float>& w = params.at("stem.1.weight");
    const int p0 = m.config.base_planes, k_real = 16 * m.config.in_channels;
    std::vector<float> b(size_t(m.kpad) * p0, 0.f);
    for (int k = 0; k < k_real; ++k)
      for (int p = 0; p < p0; ++p) b[size_t(k) * p0 + p] = w.at(p, k, 0, 0);
    hw.put_t(m.stem_w, b);
  }
  for (size_t i = 0; i < m.blocks.size(); ++i) {
    const auto& b = m.blocks[i];
    const BlockWeights& W = m.bw[i];
    const HostTensor<float>& w1 = params.at(b.prefix + "conv1.weight");
    const HostTensor<float>& w2 = params.at(b.prefix + "conv2.weight");
    hw.put_t(W.conv1, krsc(w1));
    hw.put_t(W.conv2, krsc(w2));
    hw.put_t(W.conv2_flip, flipped_crsk(w2));
    if (W.conv1_flip != kNone) hw.put_t(W.conv1_flip, flipped_crsk(w1));
    if (W.conv1_planes != kNone) hw.put_t(W.conv1_planes, tap_planes(w1));
    if (W.conv2_planes != kNone) hw.put_t(W.conv2_planes, tap_planes(w2));
    if (b.has_downsample) {
      const HostTensor<float>& wd = params.at(b.prefix + b.downsample_weight());
      hw.put_t(W.shortcut, b.stride > 1 ? pooled_shortcut_krsc(wd) : krsc(wd));
      if (W.down_stream != kNone) {
        const DownStreamOffsets o = down_stream_offsets(b);
        for (int r = 0; r < o.ranks; ++r) {
          const size_t at = W.down_stream + r * o.rank_bytes;
          const int64_t k0 = int64_t(r) * o.rank_planes;
          hw.put_t(at + o.shortcut, tap_planes(wd, k0, o.rank_planes));
          hw.put_t(at + o.conv1, tap_planes(w1, k0, o.rank_planes));
          hw.put_t(at + o.conv2, tap_planes(w2, k0, o.rank_planes));
        }
      }
    }
    hw.put_f32(W.fc1_w, params.at(b.prefix + "se.excite.0.weight").values());
    hw.put_f32(W.fc1_b, params.at(b.prefix + "se.excite.0.bias").values());
    hw.put_f32(W.fc2_w, params.at(b.prefix + "se.excite.2.weight").values());
    hw.put_f32(W.fc2_b, params.at(b.prefix + "se.excite.2.bias").values());
    hw.put_t(W.fc_t, params.at(b.prefix + "se.excite.0.weight").values());
    hw.put_t(W.fc_t + fc2_t_offset(b), params.at(b.prefix + "se.excite.2.weight").values());
    hw.put_f32(W.scalars, {params.scalar(b.prefix + "fixup_bias1a"), params.scalar(b.prefix + "fixup_bias1b"),
                           params.scalar(b.prefix + "fixup_bias2a"), params.scalar(b.prefix + "fixup_scale"),
                           params.scalar(b.prefix + "fixup_bias2b")});
  }
  Impl::Device scope(m.device);
  // Weights keep their address (allocated with the encoder), so captured graphs stay valid when the values change.
  // Forwards in flight on any stream (the caller's may be non-blocking) still read the old weights.
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  check_cuda(cudaMemcpy(m.weights, hw.bytes().data(), hw.bytes().size(), cudaMemcpyHostToDevice), "cudaMemcpy");
  if (m.watch.watching()) {  // these values hold until the next set_weights; graphs stop checking the old memory
    m.watch.unwatch();
    m.train_watch.unwatch();
    m.clear_graphs();
  }
  m.remake_prepared_filters(nullptr);
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
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
  // Captured graphs read the map from device memory, so new values need nothing more (a training loop sets them
  // after every update of its observation statistics: recapturing there cost every step its graphs). Whether there
  // is a map at all is baked in (a null scale pointer skips the math): switching it recaptures.
  const bool use = !scale.empty();
  if (use != m.use_affine) {
    m.use_affine = use;
    m.clear_graphs();
  }
}

void EncoderGpu::forward(const DeviceTensorView& x, const DeviceTensorView& y, cudaStream_t stream) {
  Impl& m = *impl_;
  KFUSE_CHECK(m.have_weights, InvalidArgument, "EncoderGpu::forward before set_weights");
  m.check_io(x, y);
  const Geometry g{int(x.shape[0]), int(x.shape[2]), int(x.shape[3])};
  Impl::Device scope(m.device);
  Activations& act = m.buffers(g);  // std::map: the reference stays valid
  m.tune_on_first_use(g, stream);
  m.ensure_workspace(g);
  m.ensure_prepared_filters(g, stream);

  const kernels::StemArgs stem = m.stem_args(x, act);
  kernels::SqueezeExciteArgs tail;
  tail.out_nchw = y.data;
  tail.out_f32 = y.dtype == DType::F32;

  // Without graphs, or inside a capture of the caller's (a graph launch cannot be captured with conditional nodes in
  // it): the launches themselves.
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &capturing), "cudaStreamIsCapturing");
  if (!m.use_graphs || capturing != cudaStreamCaptureStatusNone) {
    m.sync_weights(stream);
    m.launch(g, stem, tail, stream);
    return;
  }
  const GraphKey key{g, x.dtype, x.strides, y.dtype};
  auto it = m.graphs.find(key);
  if (it == m.graphs.end() && m.graph_warm.insert(key).second) {
    // First call of this kind: eager, so that lazy module loading and libraries' first-call work (cuDNN's, when the
    // tuner chose it) happen outside a capture; captured on the next call.
    m.sync_weights(stream);
    m.launch(g, stem, tail, stream);
    return;
  }
  if (it == m.graphs.end()) {
    Graph gr;
    std::string why = capture_forward(m, g, stem, tail, gr);
    if (!why.empty() && m.use_pdl) {
      // A driver that refuses programmatic edges in a capture: capture without them from now on.
      std::fprintf(stderr, "[kfuse] warning: capturing the forward with programmatic dependent launch failed (%s); "
                           "capturing without it\n", why.c_str());
      m.use_pdl = false;
      why = capture_forward(m, g, stem, tail, gr);
    }
    if (!why.empty()) throw Error("kfuse: capturing the forward as a CUDA graph failed: " + why);
    it = m.graphs.emplace(key, gr).first;
  }
  Graph& gr = it->second;
  // Patch the caller's pointers into the stem and the tail when they moved since the last replay.
  if (gr.stem_args.x != stem.x) {
    cudaKernelNodeParams p{};
    check_cuda(cudaGraphKernelNodeGetParams(gr.stem, &p), "cudaGraphKernelNodeGetParams");
    gr.stem_args.x = stem.x;
    kernels::FusedBlockArgs block;  // the stem inside block 1's kernel: its arguments with the new input
    void* args[] = {&gr.stem_args};
    if (gr.stem_in_block) {
      block = *static_cast<const kernels::FusedBlockArgs*>(p.kernelParams[0]);
      block.stem.x = stem.x;
      args[0] = &block;
    }
    p.kernelParams = args;
    check_cuda(cudaGraphExecKernelNodeSetParams(gr.exec, gr.stem, &p), "cudaGraphExecKernelNodeSetParams");
  }
  if (gr.tail_args.out_nchw != tail.out_nchw) {
    cudaKernelNodeParams p{};
    check_cuda(cudaGraphKernelNodeGetParams(gr.tail, &p), "cudaGraphKernelNodeGetParams");
    // The last block's squeeze-excite kernel.
    kernels::SqueezeExciteArgs patched = *static_cast<const kernels::SqueezeExciteArgs*>(p.kernelParams[0]);
    patched.out_nchw = tail.out_nchw;
    void* args[] = {&patched};
    p.kernelParams = args;
    check_cuda(cudaGraphExecKernelNodeSetParams(gr.exec, gr.tail, &p), "cudaGraphExecKernelNodeSetParams");
    gr.tail_args.out_nchw = tail.out_nchw;
  }
  check_cuda(cudaGraphLaunch(gr.exec, stream), "cudaGraphLaunch");
}

}  // namespace kfuse
