// The forward plan's report (encoder/encoder_forward_plan.h), which EncoderGpu::launch_plan returns and the GPU tests
// read to know which kernels ran: every route and option in its documented words.
#include <gtest/gtest.h>

#include "encoder/encoder_forward_plan.h"

namespace kfuse::gpu_detail {
namespace {

BlockStep step(BlockRoute route) {
  BlockStep s;
  s.route = route;
  return s;
}

TEST(ForwardPlan, DescribesEveryRoute) {
  ForwardPlan plan;
  plan.stem_kernel = false;
  plan.blocks = {step(BlockRoute::kFusedBlockWgmma), step(BlockRoute::kFusedDownBlock),
                 step(BlockRoute::kFusedBlock), step(BlockRoute::kKernels)};
  plan.blocks[0].with_stem = true;
  plan.blocks[3].shortcut_side_branch = true;
  plan.blocks[3].conv2_squeeze_projection = true;
  const std::vector<std::string> want = {"block1:fused_block_wgmma+stem", "block2:fused_down_block",
                                         "block3:fused_block",
                                         "block4:shortcut,conv1,conv2_squeeze_projection,squeeze_excite"};
  EXPECT_EQ(describe(plan), want);
}

TEST(ForwardPlan, NamesTheStemKernelAndCudnnGraphs) {
  ForwardPlan plan;
  plan.blocks = {step(BlockRoute::kFusedBlockWgmma), step(BlockRoute::kKernels)};
  plan.blocks[1].conv1_cudnn_graph = true;
  const std::vector<std::string> want = {"stem", "block1:fused_block_wgmma",
                                         "block2:conv1_cudnn_graph,conv2,squeeze_excite"};
  EXPECT_EQ(describe(plan), want);
}

}  // namespace
}  // namespace kfuse::gpu_detail
