// The forward's launch sequence (EncoderGpu::Impl::launch), shared by the inference forward (encoder_gpu.cpp) and
// the training forward (encoder_train.cpp): the stem, then per block its fused kernel where one covers the block, else
// conv1 (the shortcut beside it), conv2 and the squeeze-excite with the join.
//
// Programmatic dependent launch: every kernel after the stem that follows exactly one kfuse kernel on `stream`
// launches early and waits on the device (the kernels keep the contract of kernels/programmatic_launch.h). Not the
// shortcut where it starts a side branch from an event, nor the squeeze-excite that joins it: a programmatic edge
// joins one kernel to the next in a stream, and an event wait has no kernel of its own.
#include "encoder/encoder_gpu_impl.h"

namespace kfuse {

void EncoderGpu::Impl::launch(const Geometry& g, Activations& act, const kernels::StemArgs& stem_args,
                              kernels::SqueezeExciteArgs tail, cudaStream_t stream, CapturedEnds* ends) {
  const ForwardPlan plan = plan_forward(g, act);
  if (plan.stem_kernel) {
    check_cuda(kernels::launch_stem(stem_args, dtype, stream), "stem kernel");
    if (ends) ends->stem = last_captured_node(stream);
  }
  const bool chain = plan.programmatic_chain;
  kernels::PdlScope programmatic(chain);
  for (size_t i = 0; i < blocks.size(); ++i) {
    const BlockStep& s = plan.blocks[i];
    switch (s.route) {
      case BlockRoute::kFusedBlock:
      case BlockRoute::kFusedBlockWgmma: launch_fused_block(g, act, i, s, stem_args, chain, stream, ends); break;
      case BlockRoute::kFusedDownBlock: launch_fused_down_block(g, act, i, s, chain, stream); break;
      case BlockRoute::kKernels: launch_block_kernels(g, act, i, s, tail, chain, stream); break;
    }
  }
  if (ends) ends->tail = last_captured_node(stream);
}

void EncoderGpu::Impl::launch_fused_block(const Geometry& g, Activations& act, size_t i, const BlockStep& s,
                                          const kernels::StemArgs& stem_args, bool chain, cudaStream_t stream,
                                          CapturedEnds* ends) {
  const bool wgmma = s.route == BlockRoute::kFusedBlockWgmma;
  const auto& b = blocks[i];
  const BlockWeights& W = bw[i];
  kernels::FusedBlockArgs fb;
  fb.a = act.a[i];
  fb.identity = act.x[i];
  fb.w1 = wptr(wgmma ? W.conv1_planes : W.conv1);
  fb.w2 = wptr(wgmma ? W.conv2_planes : W.conv2);
  fb.scalars = fptr(W.scalars);
  fb.fc1_w = fptr(W.fc1_w);
  fb.fc1_b = fptr(W.fc1_b);
  fb.fc2_w = fptr(W.fc2_w);
  fb.fc2_b = fptr(W.fc2_b);
  fb.planes = b.planes;
  fb.hidden = b.se_hidden;
  fb.n = g.n, fb.h = s.h, fb.w = s.w;
  fb.a_next = act.a[i + 1];
  fb.next_b1a = fptr(bw[i + 1].scalars) + kB1a;
  if (!blocks[i + 1].has_downsample) fb.y = act.x[i + 1];
  if (!act.y.empty() && act.y[i]) fb.y = act.y[i];
  if (act.training) {  // the backward's stash
    fb.h_out = i < act.h.size() ? act.h[i] : nullptr;
    fb.h2_out = act.h2[i];
    fb.v_out = act.o[i];
  }
  if (s.with_stem) fb.a = nullptr, fb.stem = stem_args;
  kernels::PdlScope fused_scope(chain && !s.with_stem);  // with the stem: the graph's first kernel, nothing before it
  if (wgmma)
    check_cuda(kernels::launch_fused_block_wgmma(fb, dtype, sm_count, stream), "fused block kernel (wgmma)");
  else
    check_cuda(kernels::launch_fused_block(fb, dtype, stream), "fused block kernel");
  if (s.with_stem && ends) ends->stem = last_captured_node(stream), ends->stem_in_block = true;
}

void EncoderGpu::Impl::launch_fused_down_block(const Geometry& g, Activations& act, size_t i, const BlockStep& s,
                                               bool chain, cudaStream_t stream) {
  const auto& b = blocks[i];
  const BlockWeights& W = bw[i];
  kernels::FusedDownBlockArgs db;
  db.a = act.a[i];
  db.filters = wptr(W.down_stream);
  db.scalars = fptr(W.scalars);
  db.fc1_w = fptr(W.fc1_w);
  db.fc1_b = fptr(W.fc1_b);
  db.fc2_w = fptr(W.fc2_w);
  db.fc2_b = fptr(W.fc2_b);
  db.in_planes = b.in_planes, db.planes = b.planes, db.hidden = b.se_hidden;
  db.n = g.n, db.h = s.h, db.w = s.w;
  db.a_next = act.a[i + 1];
  db.next_b1a = fptr(bw[i + 1].scalars) + kB1a;
  if (!blocks[i + 1].has_downsample) db.y = act.x[i + 1];
  db.h2 = act.h2[i];
  db.partials = i < act.partials.size() ? act.partials[i] : nullptr;
  db.sync = i < act.sync.size() ? act.sync[i] : nullptr;
  // Programmatic launch after block 1's kernel (its filter stream loading while that one finishes) measured slower:
  // 94.8 against 82.4 us back to back (H100, not understood). Only inside a programmatic chain.
  kernels::PdlScope down_scope(chain);
  check_cuda(kernels::launch_fused_down_block_wgmma(db, dtype, stream), "fused downsampling block kernel");
}

void EncoderGpu::Impl::launch_block_kernels(const Geometry& g, Activations& act, size_t i, const BlockStep& step,
                                            const kernels::SqueezeExciteArgs& tail, bool chain, cudaStream_t stream) {
  const auto& b = blocks[i];
  const BlockWeights& W = bw[i];
  const float* s = fptr(W.scalars);
  const int h = step.h, w = step.w;
  const auto probs = problems(b, g.n, h, w);
  // The shortcut as a convolution on a side branch, beside conv1 and conv2.
  const bool side_branch = step.shortcut_side_branch;
  if (side_branch) {  // fork: the shortcut needs only a[i], like conv1
    kernels::PdlScope off(false);
    ensure_side_stream();
    check_cuda(cudaEventRecord(fork_events[i], stream), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(side, fork_events[i], 0), "cudaStreamWaitEvent");
    conv(probs[2], act.a[i], W.shortcut, act.idt[i], kernels::FixupEpilogue{}, side, /*side_branch=*/true,
         act.training);
    check_cuda(cudaEventRecord(join_events[i], side), "cudaEventRecord");
  }
  kernels::FixupEpilogue e1{nullptr, s + kB1b, s + kB2a, true};  // h + b2a = relu(acc + b1b) + b2a
  if (step.conv1_cudnn_graph) {
    check_cuda(kernels::cudnn_fused_conv_relu(probs[0], dtype, act.a[i], wptr(W.conv1), s + kB1b, s + kB2a, act.h[i],
                                              act.h2[i], stream),
               "conv1 with its FixUp epilogue (cuDNN graph, " + conv_shape_key(probs[0]) + ")");
  } else {
    kernels::PdlScope conv1_scope(chain && (pdl_policy < 3 || !b.has_downsample));
    conv(probs[0], act.a[i], W.conv1, act.h2[i], e1, stream, false, act.training);
  }
  // o = acc * scale + b2b, or raw: applied by the squeeze-excite as it reads o. Raw also where a library runs conv2
  // (cuDNN, cuBLAS), whose FixUp epilogue would be a pass of its own over o.
  const bool raw2 = act.conv2_raw || choose(probs[1], false).is_library();
  kernels::FixupEpilogue e2{s + kScale, s + kB2b, nullptr, false};
  if (raw2) e2 = kernels::FixupEpilogue{};
  // The last block's conv2 with the squeeze projection's rows (fc1's pre-activations after each image's o).
  const PreparedFilter* proj = step.conv2_squeeze_projection ? squeeze_projection_for(i, probs[1]) : nullptr;
  if (proj) {
    void* ws = conv_workspace;  // the main stream's half
    check_cuda(kernels::dense_conv_fprop_unrolled(probs[1], dtype, act.h2[i], proj->data, act.o[i], ws,
                                                  conv_workspace_bytes, stream, proj->extra_rows),
               "conv2 with the squeeze projection (dense GEMM, " + conv_shape_key(probs[1]) + ")");
  } else {
    kernels::PdlScope conv2_scope(chain && (pdl_policy < 2 || !b.has_downsample));
    conv(probs[1], act.h2[i], W.conv2, act.o[i], e2, stream, false, act.training);
  }
  if (side_branch)  // join before the squeeze-excite, which reads the shortcut's output
    check_cuda(cudaStreamWaitEvent(stream, join_events[i], 0), "cudaStreamWaitEvent");

  const kernels::SqueezeExciteArgs se = squeeze_excite_args(g, act, i, h, w, tail, raw2, proj);
  kernels::PdlScope join(chain && !b.has_downsample);
  check_cuda(kernels::launch_squeeze_excite(se, dtype, stream), "squeeze-excite kernel");
}

kernels::SqueezeExciteArgs EncoderGpu::Impl::squeeze_excite_args(const Geometry& g, const Activations& act, size_t i,
                                                                 int h, int w, const kernels::SqueezeExciteArgs& tail,
                                                                 bool raw2, const PreparedFilter* proj) const {
  const auto& b = blocks[i];
  const BlockWeights& W = bw[i];
  const float* s = fptr(W.scalars);
  kernels::SqueezeExciteArgs se = tail;  // out_nchw / out_f32 are the tail's; cleared below for inner blocks
  se.o = act.o[i];
  se.o_scale = raw2 ? s + kScale : nullptr;
  se.o_shift = raw2 ? s + kB2b : nullptr;
  se.identity = b.has_downsample ? act.idt[i] : act.x[i];
  se.n = g.n;
  se.hw = (h / b.stride) * (w / b.stride);
  se.p = b.planes;
  se.hidden = b.se_hidden;
  se.w1 = fptr(W.fc1_w);
  se.b1 = fptr(W.fc1_b);
  se.w2 = fptr(W.fc2_w);
  se.b2 = fptr(W.fc2_b);
  se.w1_t = se_weights_t && !act.training ? wptr(W.fc_t) : nullptr;  // the training step's gates stay fp32's
  se.w2_t = se_weights_t && !act.training ? wptr(W.fc_t + fc2_t_offset(b)) : nullptr;
  if (proj) {
    se.o_stride = int64_t(se.hw) * se.p + proj->extra_rows;
    se.pre_hidden = static_cast<const uint8_t*>(act.o[i]) + size_t(se.hw) * se.p * 2;
    se.w1_rowsum = reinterpret_cast<const float*>(static_cast<const uint8_t*>(proj->data) + proj->rowsum_at);
  }
  se.y = nullptr;
  se.a_next = nullptr;
  se.next_b1a = nullptr;
  if (i + 1 < blocks.size()) {
    se.out_nchw = nullptr;
    se.a_next = act.a[i + 1];
    se.next_b1a = fptr(bw[i + 1].scalars) + kB1a;
    if (!blocks[i + 1].has_downsample) se.y = act.x[i + 1];
  }
  if (!act.y.empty() && act.y[i]) se.y = act.y[i];
  return se;
}

}  // namespace kfuse
