// The forward plan (encoder_forward_plan.h): made from the engine's options, the device, the tuner's choices and the
// geometry's buffers, and reported by EncoderGpu::launch_plan.
#include "encoder/encoder_forward_plan.h"

#include "encoder/encoder_gpu_impl.h"
#include "encoder/encoder_training_state.h"

namespace kfuse {
namespace gpu_detail {

namespace {
std::string block_kernels(const BlockStep& s) {
  std::string out = s.shortcut_side_branch ? "shortcut," : "";
  out += s.conv1_cudnn_graph ? "conv1_cudnn_graph," : "conv1,";
  out += s.conv2_squeeze_projection ? "conv2_squeeze_projection," : "conv2,";
  return out + "squeeze_excite";
}

std::string route_name(const BlockStep& s) {
  switch (s.route) {
    case BlockRoute::kFusedBlock: return "fused_block";
    case BlockRoute::kFusedBlockWgmma: return s.with_stem ? "fused_block_wgmma+stem" : "fused_block_wgmma";
    case BlockRoute::kFusedDownBlock: return "fused_down_block";
    case BlockRoute::kKernels: break;
  }
  return block_kernels(s);
}
}  // namespace

std::vector<std::string> describe(const ForwardPlan& plan) {
  std::vector<std::string> out;
  if (plan.stem_kernel) out.emplace_back("stem");
  for (size_t i = 0; i < plan.blocks.size(); ++i)
    out.push_back("block" + std::to_string(i + 1) + ":" + route_name(plan.blocks[i]));
  return out;
}

}  // namespace gpu_detail

BlockStep EncoderGpu::Impl::plan_block(const Geometry& g, const Activations& act, size_t i, int h, int w,
                                       bool stem_fused) const {
  BlockStep s;
  s.h = h, s.w = w;
  // The training forward's fused block writes the backward's stash (h where kept, h2, conv2's raw output).
  if (wgmma_block_applies(i, h, w) && (!act.training || act.conv2_raw)) {
    s.route = BlockRoute::kFusedBlockWgmma;
    s.with_stem = i == 0 && stem_fused;  // (stem_in_block holds only where block 1's wgmma kernel applies)
    return s;
  }
  if (!act.training && fused_block_applies(i, h, w)) {
    s.route = BlockRoute::kFusedBlock;
    return s;
  }
  if (!act.training && down_block_applies(i, h, w)) {
    s.route = BlockRoute::kFusedDownBlock;
    return s;
  }
  s.shortcut_side_branch = blocks[i].has_downsample;
  s.conv1_cudnn_graph = i < act.h.size() && act.h[i] != nullptr;
  s.conv2_squeeze_projection = !act.training && squeeze_projection_for(i, problems(blocks[i], g.n, h, w)[1]) != nullptr;
  return s;
}

ForwardPlan EncoderGpu::Impl::plan_forward(const Geometry& g, const Activations& act) const {
  ForwardPlan plan;
  const bool stem_fused = stem_in_block(g, act.training);
  plan.stem_kernel = !stem_fused;
  const bool fused_cudnn = std::any_of(act.h.begin(), act.h.end(), [](void* p) { return p != nullptr; });
  plan.programmatic_chain = use_pdl && !any_cudnn(g, act.training) && !fused_cudnn;
  int h = g.h / 4, w = g.w / 4;
  for (size_t i = 0; i < blocks.size(); ++i) {
    plan.blocks.push_back(plan_block(g, act, i, h, w, stem_fused));
    h /= blocks[i].stride;
    w /= blocks[i].stride;
  }
  return plan;
}

std::vector<std::string> EncoderGpu::launch_plan(int n, int h, int w, bool training) const {
  const Impl& m = *impl_;
  KFUSE_CHECK(n >= 1, InvalidArgument, "launch_plan: n must be >= 1, got ", n);
  m.config.output_shape({1, m.config.in_channels, h, w});  // validates H and W
  const Geometry g{n, h, w};
  if (!training) return describe(m.plan_forward(g, Activations{}));
  // The training step: its buffers' choices once its first forward_train made them, else the defaults.
  const TrainBuffers* tb = nullptr;
  if (m.training) {
    const auto it = m.training->buffers.find(g);
    if (it != m.training->buffers.end()) tb = &it->second;
  }
  Activations defaults;
  defaults.training = defaults.conv2_raw = true;
  std::vector<std::string> out = describe(m.plan_forward(g, tb ? tb->act : defaults));
  for (size_t i = m.blocks.size(); i-- > 0;) {  // the backward, last block first
    const bool fused = tb && i < tb->fused_dgrad.size() && tb->fused_dgrad[i];
    out.push_back("block" + std::to_string(i + 1) + ":backward" + (fused ? "_dgrad2_cudnn_graph" : ""));
  }
  return out;
}

}  // namespace kfuse
