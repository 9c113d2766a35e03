// The training step's backward (EncoderGpu::backward), block by block from the last (the dataflow is drawn at the top
// of encoder_train.cpp): the launch arguments are planned once per call, then the launches run, replayed as a CUDA
// graph per geometry and caller's pointers. The weight gradients (and their finalize) run on a side branch: nothing
// on the data-gradient path waits for them, so they fill the SMs that the memory-bound kernels and the data
// gradients' tails leave idle.
#include <algorithm>
#include <cstring>

#include "kernels/conv/conv_backward.h"
#include "kernels/conv/cudnn_fused.h"
#include "kernels/encoder/backward_kernels.h"
#include "encoder/encoder_training_state.h"

namespace kfuse {

using namespace train_detail;

namespace train_detail {

struct BlockConvs {
  WgradChoice wgrad2, wgrad1;  // conv2; conv1 [+ shortcut]
  DgradChoice dgrad2, dgrad1;
};

// Everything the backward's launches need, planned before the first one (one scratch allocation serves them all).
struct BackwardPlan {
  std::vector<BlockProblems> probs;
  std::vector<BlockConvs> convs;
  std::vector<kernels::SeBackwardArgs> se;
  std::vector<kernels::ReluMaskBackwardArgs> mask;
  std::vector<size_t> se_ws_offset;  // per block: its own area, its parameter phase may still run when the next starts
  size_t se_ws_total = 0;
  kernels::StemBackwardArgs stem;
  // Gradient finalize jobs; a block's are contiguous, job_first[i] .. job_first[i + 1], finalized as soon as its
  // weight gradients are done, on their branch.
  std::vector<GradJob> jobs;
  std::vector<int> job_first;
  size_t scratch = 0;  // bytes of the largest workspace
};

}  // namespace train_detail

// Plans by key (LaunchGraphCache::Key of the backward without its stage range), made in one epoch of the training
// graph cache: everything a plan holds is baked into the captured launches too, so whatever makes those stale clears
// the cache and with it the plans.
struct BackwardPlanCache {
  static constexpr size_t kMaxPlans = 32;
  uint64_t epoch = ~uint64_t(0);
  std::map<LaunchGraphCache::Key, BackwardPlan> plans;
};

namespace {

float* grad_of(const TrainingState& t, float* grads, const std::string& name) {
  return grads + t.grad_offset[param_index(t, name)];
}

// The buffers that hold the stash `stash`, and their geometry.
TrainBuffers& stashed(TrainingState& t, uint64_t stash, Geometry& g) {
  TrainBuffers* found = nullptr;
  for (auto& [geo, tb] : t.buffers)
    if (tb.stash == stash && stash != 0) found = &tb, g = geo;
  KFUSE_CHECK(found != nullptr, InvalidArgument,
              "backward: the forward's saved state is gone (another forward_train of the same input geometry "
              "replaced it); run forward_train again");
  return *found;
}

void check_backward_views(const EncoderGpu::Impl& m, const TrainBuffers& tb, const Geometry& g,
                          const DeviceTensorView& x, const DeviceTensorView& dy, const DeviceTensorView* dx) {
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
  if (!dx) return;
  KFUSE_CHECK(dx->shape == x.shape, InvalidArgument, "backward: input gradient has shape ", shape_str(dx->shape),
              ", expected ", shape_str(x.shape));
  const Shape xp{x.shape[1] * x.shape[2] * x.shape[3], x.shape[2] * x.shape[3], x.shape[3], 1};
  KFUSE_CHECK(dx->strides == xp && dx->data && dx->device == m.device, InvalidArgument,
              "backward: input gradient must be a contiguous NCHW tensor on cuda:", m.device);
  KFUSE_CHECK(dx->dtype == DType::F32 || dx->dtype == DType::F16 || dx->dtype == DType::BF16, InvalidArgument,
              "backward: input gradient dtype ", dtype_name(dx->dtype), " is not F32, F16 or BF16");
}

// The backward convolutions' kernels per block, checked against the block's shapes.
std::vector<BlockConvs> choose_backward_convs(const EncoderGpu::Impl& m, const TrainingState& t,
                                              const std::vector<BlockProblems>& probs) {
  std::vector<BlockConvs> convs(probs.size());
  for (size_t i = 0; i < probs.size(); ++i) {
    const BlockProblems& bp = probs[i];
    BlockConvs& c = convs[i];
    c.wgrad2 = wgrad_for(m, t, bp.conv2);
    c.wgrad1 = wgrad_for(m, t, bp.conv1_cat);
    c.dgrad2 = dgrad_for(m, t, bp.conv2);
    c.dgrad1 = dgrad_for(m, t, bp.conv1_cat);
    KFUSE_CHECK(
        wgrad_can_implement(c.wgrad2, bp.conv2, m.dtype) && wgrad_can_implement(c.wgrad1, bp.conv1_cat, m.dtype),
        InvalidArgument, "kfuse: the weight-gradient kernels cannot run block '", m.blocks[i].prefix, "' at this size");
    KFUSE_CHECK(
        dgrad_can_implement(c.dgrad2, bp.conv2, m.dtype) && dgrad_can_implement(c.dgrad1, bp.conv1_cat, m.dtype),
        InvalidArgument, "kfuse: the data-gradient kernels cannot run block '", m.blocks[i].prefix, "' at this size");
  }
  return convs;
}

// Block i's squeeze-excite backward (ho x wo: its output maps; dy: the step's output gradient).
kernels::SeBackwardArgs se_backward_args(const EncoderGpu::Impl& m, const TrainingState& t, const TrainBuffers& tb,
                                         const Geometry& g, size_t i, int ho, int wo, const DeviceTensorView& dy,
                                         float* grads) {
  const auto& b = m.blocks[i];
  const BlockWeights& W = m.bw[i];
  const bool last = i + 1 == m.blocks.size();
  kernels::SeBackwardArgs s;
  s.y = tb.act.y[i];
  if (!s.y) {  // the mask from the next block's a = y + b1a (Activations::y)
    s.y = tb.act.a[i + 1];
    s.y_offset = m.fptr(m.bw[i + 1].scalars) + kB1a;
  }
  s.dy = last ? dy.data : tb.dx[i + 1];
  s.dy_nchw = last;
  s.dy_f32 = last && dy.dtype == DType::F32;
  s.o = tb.act.o[i];  // conv2's raw output: the kernel applies x scale + b2b (Activations::conv2_raw)
  s.o_scale = m.fptr(W.scalars) + kScale;
  s.o_shift = m.fptr(W.scalars) + kB2b;
  s.n = g.n, s.hw = ho * wo, s.p = b.planes, s.hidden = b.se_hidden;
  s.w1 = m.fptr(W.fc1_w), s.b1 = m.fptr(W.fc1_b), s.w2 = m.fptr(W.fc2_w), s.b2 = m.fptr(W.fc2_b);
  s.d_o = tb.d_o[i];
  s.dz = b.has_downsample ? static_cast<uint8_t*>(tb.dcat[i]) + 2 * b.planes : tb.dz[i];
  s.dz_pitch = b.has_downsample ? 2 * b.planes : b.planes;
  s.dw1 = grad_of(t, grads, b.prefix + "se.excite.0.weight");
  s.db1 = grad_of(t, grads, b.prefix + "se.excite.0.bias");
  s.dw2 = grad_of(t, grads, b.prefix + "se.excite.2.weight");
  s.db2 = grad_of(t, grads, b.prefix + "se.excite.2.bias");
  s.sum_d_o = grad_of(t, grads, b.prefix + "fixup_bias2b");
  // dy of this block is dx of the next; when the next block has a shortcut conv, that is all of d(its a).
  s.sum_dy =
      !last && m.blocks[i + 1].has_downsample ? grad_of(t, grads, m.blocks[i + 1].prefix + "fixup_bias1a") : nullptr;
  return s;
}

// Block i's ReLU-mask backward (ho x wo: its output maps).
kernels::ReluMaskBackwardArgs relu_mask_args(const EncoderGpu::Impl& m, const TrainingState& t, const TrainBuffers& tb,
                                             const Geometry& g, size_t i, int ho, int wo, float* grads) {
  const auto& b = m.blocks[i];
  const BlockWeights& W = m.bw[i];
  kernels::ReluMaskBackwardArgs r;
  r.dh = tb.dh2[i];
  r.h2 = tb.act.h2[i];
  r.b2a = m.fptr(W.scalars) + kB2a;
  if (tb.act.h[i]) {  // the cuDNN graph's forward: the mask is h > 0 (TrainBuffers::fused_dgrad)
    r.h2 = tb.act.h[i];
    r.b2a = tb.zero;
  }
  r.scale = m.fptr(W.scalars) + kScale;  // the data gradient leaves conv2's scale out
  r.pixels = int64_t(g.n) * ho * wo;
  r.c = b.planes;
  r.d_pre = tb.dcat[i];
  r.d_pre_pitch = b.has_downsample ? 2 * b.planes : b.planes;
  r.sum_dh = grad_of(t, grads, b.prefix + "fixup_bias2a");
  r.sum_d_pre = grad_of(t, grads, b.prefix + "fixup_bias1b");
  return r;
}

// Per block: the squeeze-excite and ReLU-mask arguments, and the workspaces of every launch.
void plan_blocks(const EncoderGpu::Impl& m, const TrainingState& t, const TrainBuffers& tb, const Geometry& g,
                 const DeviceTensorView& dy, float* grads, BackwardPlan& plan) {
  int h = g.h / 4, w = g.w / 4;
  for (size_t i = 0; i < m.blocks.size(); ++i) {
    const auto& b = m.blocks[i];
    const int ho = h / b.stride, wo = w / b.stride;
    plan.se.push_back(se_backward_args(m, t, tb, g, i, ho, wo, dy, grads));
    plan.se_ws_offset.push_back(plan.se_ws_total);
    plan.se_ws_total += align256(kernels::se_backward_workspace_bytes(plan.se.back()));
    plan.mask.push_back(relu_mask_args(m, t, tb, g, i, ho, wo, grads));
    size_t& scratch = plan.scratch;
    scratch = std::max(scratch, kernels::relu_mask_backward_workspace_bytes(plan.mask.back()));
    const BlockProblems& bp = plan.probs[i];
    const BlockConvs& c = plan.convs[i];
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

void plan_stem(const EncoderGpu::Impl& m, const TrainingState& t, TrainBuffers& tb, const DeviceTensorView& x,
               const DeviceTensorView* dx, float* grads, BackwardPlan& plan) {
  kernels::StemBackwardArgs& sb = plan.stem;
  const kernels::StemArgs fwd = m.stem_args(x, tb.act);
  sb.x = fwd.x, sb.x_dtype = fwd.x_dtype;
  sb.stride_n = fwd.stride_n, sb.stride_c = fwd.stride_c, sb.stride_h = fwd.stride_h, sb.stride_w = fwd.stride_w;
  sb.n = fwd.n, sb.c = fwd.c, sb.h = fwd.h, sb.w = fwd.w;
  sb.in_scale = fwd.in_scale, sb.in_shift = fwd.in_shift;
  sb.weight = fwd.weight, sb.kpad = fwd.kpad, sb.p0 = fwd.p0;
  sb.x0 = tb.act.x0;
  sb.da = tb.dx[0];
  sb.dz = m.blocks[0].has_downsample ? nullptr : tb.dz[0];
  sb.dw = grad_of(t, grads, "stem.1.weight");
  sb.sum_da = grad_of(t, grads, m.blocks[0].prefix + "fixup_bias1a");
  if (dx) {
    sb.dinput = dx->data;
    sb.dinput_dtype = EncoderGpu::Impl::input_dtype(dx->dtype);
  }
  plan.scratch = std::max(plan.scratch, kernels::stem_backward_workspace_bytes(sb));
}

// The gradient finalize jobs (their destinations move with `grads`: rebuilt per call, uploaded when changed).
void plan_gradient_jobs(const EncoderGpu::Impl& m, const TrainingState& t, const TrainBuffers& tb, float* grads,
                        BackwardPlan& plan) {
  for (size_t i = 0; i < m.blocks.size(); ++i) {
    const auto& b = m.blocks[i];
    const BlockWeights& W = m.bw[i];
    plan.job_first.push_back(int(plan.jobs.size()));
    GradJob j1;
    j1.g = tb.g1[i], j1.g_is_t = plan.convs[i].wgrad1.writes_t();
    j1.dst = grad_of(t, grads, b.prefix + "conv1.weight"), j1.kind = 0;
    j1.k = b.planes, j1.c = b.in_planes, j1.r = 3, j1.s = 3;
    plan.jobs.push_back(j1);
    if (b.has_downsample) {
      GradJob jd;
      jd.g = static_cast<const uint8_t*>(j1.g) + size_t(b.planes) * 9 * b.in_planes * (j1.g_is_t ? 2 : 4);
      jd.g_is_t = j1.g_is_t;
      jd.dst = grad_of(t, grads, b.prefix + b.downsample_weight());
      jd.kind = 1, jd.k = b.planes, jd.c = b.in_planes, jd.r = 3, jd.s = 3;
      plan.jobs.push_back(jd);
    }
    GradJob j2;
    j2.g = tb.g2[i], j2.g_is_t = plan.convs[i].wgrad2.writes_t();
    j2.dst = grad_of(t, grads, b.prefix + "conv2.weight"), j2.kind = 0;
    j2.alpha = m.fptr(W.scalars) + kScale;
    j2.dot_w = m.wptr(W.conv2);
    j2.dst_dot = grad_of(t, grads, b.prefix + "fixup_scale");
    j2.k = b.planes, j2.c = b.planes, j2.r = 3, j2.s = 3;
    plan.jobs.push_back(j2);
  }
  plan.job_first.push_back(int(plan.jobs.size()));
  plan.scratch = std::max(plan.scratch, kernels::grad_finalize_workspace_bytes(int(plan.jobs.size())));
}

// The scratch and the job table on the device, for `plan`; captured graphs bake their addresses in, so they are
// dropped when either moves.
void provide_backward_memory(EncoderGpu::Impl& m, TrainingState& t, const BackwardPlan& plan, cudaStream_t stream) {
  const void* const scratch_before = t.scratch;
  const GradJob* const jobs_before = t.d_grad_jobs;
  ensure_scratch(t, std::max<size_t>(plan.scratch, 256), plan.se_ws_total);
  const std::vector<GradJob>& jobs = plan.jobs;
  if (jobs.size() > t.grad_job_capacity) {
    if (t.d_grad_jobs) t.retired_memory.push_back(t.d_grad_jobs);  // a caller's graph may still read it
    t.d_grad_jobs = nullptr;
    check_cuda(cudaMalloc(&t.d_grad_jobs, jobs.size() * sizeof(GradJob)), "cudaMalloc (gradient jobs)");
    t.grad_job_capacity = jobs.size();
    t.grad_jobs.clear();
  }
  if (jobs.size() != t.grad_jobs.size() ||
      std::memcmp(jobs.data(), t.grad_jobs.data(), jobs.size() * sizeof(GradJob)) != 0) {
    // Ordered on the stream; the source is copied out before cudaMemcpyAsync returns (pageable memory).
    check_cuda(
        cudaMemcpyAsync(t.d_grad_jobs, jobs.data(), jobs.size() * sizeof(GradJob), cudaMemcpyHostToDevice, stream),
        "cudaMemcpyAsync (gradient jobs)");
    t.grad_jobs = jobs;
  }
  if (t.scratch != scratch_before || t.d_grad_jobs != jobs_before) m.train_graphs.clear();
}

// Where the backward's launches go: the main stream (data gradients), the weight-gradient branch and their halves of
// the scratch.
struct BackwardStreams {
  cudaStream_t main, wgrad;
  void *ws, *wws;
  size_t wsb;
};

// Block ii's launches, from the squeeze-excite backward to d(its input).
void launch_block_backward(EncoderGpu::Impl& m, TrainingState& t, TrainBuffers& tb, const BackwardPlan& plan, size_t ii,
                           float* grads, const BackwardStreams& s) {
  const auto& b = m.blocks[ii];
  const BlockWeights& W = m.bw[ii];
  const BlockProblems& bp = plan.probs[ii];
  const BlockConvs& c = plan.convs[ii];
  const std::string where = " (block '" + b.prefix + "')";
  auto wflip = [&](size_t off) { return off == kNone ? nullptr : m.wptr(off); };  // flipped filters: stride 1 only
  // The weight gradients run on the side branch: the launches there run in order, one at a time, on its half of the
  // scratch.
  auto fork_wgrad = [&](size_t event) {
    if (!t.wgrad_branch) return;
    check_cuda(cudaEventRecord(t.wgrad_fork[event], s.main), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(m.side, t.wgrad_fork[event], 0), "cudaStreamWaitEvent");
  };
  void* const se_ws = static_cast<uint8_t*>(t.scratch) + 2 * t.scratch_bytes + plan.se_ws_offset[ii];
  check_cuda(kernels::launch_se_backward_data(plan.se[ii], m.dtype, se_ws, s.main), "squeeze-excite backward" + where);
  fork_wgrad(2 * ii);
  // The squeeze-excite's parameter gradients and scalar sums: nothing else reads them either.
  check_cuda(kernels::launch_se_backward_params(plan.se[ii], m.dtype, se_ws, s.wgrad),
             "squeeze-excite parameter gradients" + where);
  check_cuda(run_wgrad(c.wgrad2, bp.conv2, m.dtype, tb.d_o[ii], tb.act.h2[ii], tb.g2[ii], s.wws, s.wsb, s.wgrad),
             "conv2 weight gradient (" + c.wgrad2.name() + ")" + where);
  if (tb.fused_dgrad[ii]) {
    // d_pre = h > 0 ? scale * conv2^T(d_o) : 0, into [d_pre | dz], and the per-channel sums: one cuDNN graph.
    check_cuda(
        kernels::cudnn_fused_dgrad_mask(bp.conv2, m.dtype, tb.d_o[ii], m.wptr(W.conv2), m.fptr(W.scalars) + kScale,
                                        tb.act.h[ii], tb.dcat[ii], plan.mask[ii].d_pre_pitch, tb.sums[ii], s.main),
        "conv2 data gradient with the ReLU mask (cuDNN graph)" + where);
    fork_wgrad(2 * ii + 1);
    check_cuda(kernels::launch_sum_pair_finalize(tb.sums[ii], b.planes, plan.mask[ii].sum_dh, plan.mask[ii].sum_d_pre,
                                                 s.wgrad),
               "FixUp bias gradients" + where);
  } else {
    // dh2 / scale = conv2^T(d_o); the ReLU-mask backward applies the scale.
    check_cuda(run_dgrad(c.dgrad2, bp.conv2, m.dtype, tb.d_o[ii], m.wptr(W.conv2), wflip(W.conv2_flip), tb.dh2[ii],
                         s.ws, s.wsb, s.main),
               "conv2 data gradient (" + c.dgrad2.name() + ")" + where);
    check_cuda(kernels::launch_relu_mask_backward(plan.mask[ii], m.dtype, s.ws, s.main), "ReLU mask backward" + where);
    fork_wgrad(2 * ii + 1);
  }
  check_cuda(run_wgrad(c.wgrad1, bp.conv1_cat, m.dtype, tb.dcat[ii], tb.act.a[ii], tb.g1[ii], s.wws, s.wsb, s.wgrad),
             "conv1 weight gradient (" + c.wgrad1.name() + ")" + where);
  check_cuda(kernels::launch_grad_finalize(t.d_grad_jobs + plan.job_first[ii],
                                           plan.job_first[ii + 1] - plan.job_first[ii], m.dtype, s.wws, s.wgrad),
             "gradient finalize" + where);
  // d a = [conv1 | shortcut]^T([d_pre1 | dz]): one data gradient over the concatenated filters.
  check_cuda(run_dgrad(c.dgrad1, bp.conv1_cat, m.dtype, tb.dcat[ii], m.wptr(W.conv1), wflip(W.conv1_flip), tb.dx[ii],
                       s.ws, s.wsb, s.main),
             "conv1 data gradient (" + c.dgrad1.name() + ")" + where);
  if (!b.has_downsample && ii > 0) {  // dx = d a + dz; d b1a = sum of d a (block 1: the stem's)
    check_cuda(kernels::launch_add_and_sum(tb.dx[ii], tb.dz[ii], tb.dx[ii],
                                           int64_t(bp.conv1.n) * bp.conv1.h * bp.conv1.w * b.in_planes,
                                           grad_of(t, grads, b.prefix + "fixup_bias1a"), m.dtype, s.ws, s.main),
               "identity gradient" + where);
  }
}

// Stages first .. last of the backward (EncoderConfig::backward_stage_of_parameters) as one launch sequence on
// `main`, the weight gradients of the blocks among them on the side branch, joined back before the sequence ends.
void launch_backward_stages(EncoderGpu::Impl& m, TrainingState& t, TrainBuffers& tb, const BackwardPlan& plan,
                            float* grads, int first, int last, cudaStream_t main) {
  const int blocks = int(m.blocks.size());
  void* ws_side = static_cast<uint8_t*>(t.scratch) + t.scratch_bytes;
  const BackwardStreams s{main, t.wgrad_branch ? m.side : main, t.scratch, t.wgrad_branch ? ws_side : t.scratch,
                          t.scratch_bytes};
  for (int stage = first; stage <= last && stage < blocks; ++stage)
    launch_block_backward(m, t, tb, plan, size_t(blocks - 1 - stage), grads, s);
  if (last == blocks) check_cuda(kernels::launch_stem_backward(plan.stem, m.dtype, s.ws, main), "stem backward");
  if (t.wgrad_branch && first < blocks) {  // join: the sequence ends when its weight gradients are final
    check_cuda(cudaEventRecord(t.wgrad_join, m.side), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(main, t.wgrad_join, 0), "cudaStreamWaitEvent");
  }
}

// The plan of a backward call keyed `key` (geometry and caller's pointers): made on first sight, then reused while
// the training graphs' epoch lasts (a staged backward asks once per stage).
const BackwardPlan& planned_backward(EncoderGpu::Impl& m, TrainingState& t, TrainBuffers& tb, const Geometry& g,
                                     const DeviceTensorView& x, const DeviceTensorView& dy, float* grads,
                                     const DeviceTensorView* dx, const LaunchGraphCache::Key& key) {
  if (!t.backward_plans) t.backward_plans = std::make_shared<BackwardPlanCache>();
  BackwardPlanCache& cache = *t.backward_plans;
  if (cache.epoch != m.train_graphs.epoch() || cache.plans.size() >= BackwardPlanCache::kMaxPlans) {
    cache.plans.clear();
    cache.epoch = m.train_graphs.epoch();
  }
  if (const auto it = cache.plans.find(key); it != cache.plans.end()) return it->second;
  BackwardPlan plan;
  plan.probs = geometry_problems(m, g);
  plan.convs = choose_backward_convs(m, t, plan.probs);
  plan_blocks(m, t, tb, g, dy, grads, plan);
  plan_stem(m, t, tb, x, dx, grads, plan);
  plan_gradient_jobs(m, t, tb, grads, plan);
  return cache.plans.emplace(key, std::move(plan)).first->second;
}

// backward() and backward_stage(): stages first .. last, planned, then launched (replayed as a CUDA graph per
// geometry, caller's pointers and stage range).
void run_backward(EncoderGpu::Impl& m, uint64_t stash, const DeviceTensorView& x, const DeviceTensorView& dy,
                  float* grads, const DeviceTensorView* dx, int first, int last, cudaStream_t stream) {
  TrainingState& t = training(m);
  KFUSE_CHECK(grads != nullptr, InvalidArgument, "backward: null gradient buffer");
  Geometry g{};
  TrainBuffers& tb = stashed(t, stash, g);
  check_backward_views(m, tb, g, x, dy, dx);
  // Each stage reads the data gradient the stage before it left in the buffers.
  KFUSE_CHECK(first == 0 || tb.next_stage == first, InvalidArgument, "backward_stage: stage ", first,
              " cannot run now (next in order: ", tb.next_stage, "); run the stages in order from 0");
  tb.next_stage = last + 1;
  EncoderGpu::Impl::Device scope(m.device);

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
  const BackwardPlan& plan = planned_backward(m, t, tb, g, x, dy, grads, dx, key);
  provide_backward_memory(m, t, plan, stream);
  key.push_back(first);  // the graph's key: the plan's and the stage range
  key.push_back(last);
  m.ensure_side_stream();
  ensure_wgrad_events(t, m.blocks.size());
  // The launches go to the lambda's stream: the caller's, or the capture stream when the graph is recorded.
  m.train_graphs.run(
      key, stream, [&](cudaStream_t main) { launch_backward_stages(m, t, tb, plan, grads, first, last, main); },
      m.use_graphs);
}

}  // namespace

void EncoderGpu::backward(uint64_t stash, const DeviceTensorView& x, const DeviceTensorView& dy, float* grads,
                          const DeviceTensorView* dx, cudaStream_t stream) {
  run_backward(*impl_, stash, x, dy, grads, dx, 0, backward_stages() - 1, stream);
}

int EncoderGpu::backward_stages() const { return impl_->config.backward_stages(); }

std::vector<int> EncoderGpu::backward_stage_of_parameters() const {
  return impl_->config.backward_stage_of_parameters();
}

void EncoderGpu::backward_stage(int stage, uint64_t stash, const DeviceTensorView& x, const DeviceTensorView& dy,
                                float* grads, const DeviceTensorView* dx, cudaStream_t stream) {
  KFUSE_CHECK(stage >= 0 && stage < backward_stages(), InvalidArgument, "backward_stage: stage ", stage,
              " is not in [0, ", backward_stages(), ")");
  run_backward(*impl_, stash, x, dy, grads, dx, stage, stage, stream);
}

}  // namespace kfuse
