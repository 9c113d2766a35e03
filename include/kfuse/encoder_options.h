// How the CUDA encoder (kfuse/encoder_gpu.h) builds its forward and its training step. The defaults are the
// measured fastest on sm_90 (PERF.md); the other settings exist for same-run A/B measurements and for the tests of
// each code path. Paths a setting turns on apply only where their kernels cover the shape (the engine falls back
// to the general path elsewhere), so every setting computes the same function.
#pragma once

namespace kfuse {

struct EncoderOptions {
  // Programmatic dependent launch between the forward's kernels (sm_90): 0 off; 1 at every kernel boundary of the
  // programmatic chain; 2 not before conv2 of a downsampling block; 3 also not before its conv1.
  int programmatic_launch = 3;
  bool fused_blocks = true;   // identity blocks as one kernel (the stride-1 layers)
  bool fused_stem = true;     // the stem inside block 1's kernel where that kernel computes it
  bool wgmma_blocks = true;   // block 1's kernel on Hopper's warpgroup MMAs (sm_90)
  int fused_down = 1;         // downsampling blocks as one kernel: 0 never; 1 blocks 2 and 3; 2 block 2 only
  bool se_weights_t = true;   // the inference squeeze-excite reads its fc weights in the network's dtype
  bool se_projection = true;  // the last block's fc1 pre-activations as extra rows of its conv2 GEMM
  bool wgrad_branch = true;   // training: the weight gradients on a side branch of the backward's graph
  int cudnn_fused = 1;        // training: cuDNN's fused conv + ReLU graphs: 0 never; 1 where conv1 runs in cuDNN; 2 all
};

}  // namespace kfuse
