// The forward's launch sequence for one geometry, decided before any launch: EncoderGpu::Impl::launch executes it
// step by step, and EncoderGpu::launch_plan reports it (what the tests inspect to know which kernels ran).
#pragma once

#include <string>
#include <vector>

namespace kfuse::gpu_detail {

// How one residual block runs.
enum class BlockRoute {
  kFusedBlock,       // kernels::launch_fused_block: conv1, conv2 and the squeeze-excite with the image on chip
  kFusedBlockWgmma,  // the same as the Hopper warpgroup-MMA kernel (kernels::launch_fused_block_wgmma)
  kFusedDownBlock,   // kernels::launch_fused_down_block_wgmma: a downsampling block as one kernel
  kKernels,          // conv1 (the shortcut beside it), conv2, then the squeeze-excite with the join
};

struct BlockStep {
  BlockRoute route = BlockRoute::kKernels;
  int h = 0, w = 0;                       // the block's input maps
  bool with_stem = false;                 // the fused kernel computes the stem too (no stem kernel runs)
  bool shortcut_side_branch = false;      // kKernels: the shortcut convolution on the side stream
  bool conv1_cudnn_graph = false;         // kKernels: conv1 and its FixUp epilogue as one cuDNN graph (training)
  bool conv2_squeeze_projection = false;  // kKernels: conv2's GEMM also computes the squeeze's fc1 rows
};

struct ForwardPlan {
  bool stem_kernel = true;          // false: block 1's fused kernel computes the stem
  bool programmatic_chain = false;  // kernels may launch early (programmatic dependent launch), as the policy allows
  std::vector<BlockStep> blocks;
};

// The plan as EncoderGpu::launch_plan reports it: "stem" where the stem kernel runs, then one entry per block,
// "block<i>:" (from 1) and its route: "fused_block", "fused_block_wgmma" ("+stem" where it computes the stem),
// "fused_down_block", or its kernels, comma-separated: "shortcut" (side branch), "conv1" or "conv1_cudnn_graph",
// "conv2" or "conv2_squeeze_projection", "squeeze_excite".
std::vector<std::string> describe(const ForwardPlan& plan);

}  // namespace kfuse::gpu_detail
