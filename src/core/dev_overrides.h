// Developer A/B overrides: the KFUSE_* environment variables, other than the user's three (KFUSE_CACHE_DIR,
// KFUSE_TUNE, KFUSE_CUDNN), that override an option for a same-run measurement or a test of one code path. They are
// read here and nowhere else, when an engine (or an MLP tuning) is made, and every benchmark JSON records them
// (python/kfuse/benchmark.py). A malformed value throws InvalidArgument naming the variable.
#pragma once

#include "kfuse/encoder_options.h"
#include "kfuse/mlp_options.h"

namespace kfuse {

// `options` with the encoder's overrides applied: KFUSE_PDL (0-3), KFUSE_FUSED_BLOCK, KFUSE_FUSED_STEM,
// KFUSE_WGMMA_BLOCK, KFUSE_FUSED_DOWN (0-2), KFUSE_SE_WEIGHTS_T, KFUSE_SE_PROJECTION,
// KFUSE_WGRAD_BRANCH (0 / 1) and KFUSE_CUDNN_FUSED (0, 1 or all).
EncoderOptions with_dev_overrides(EncoderOptions options);

// `options` with the generated MLP kernels' overrides applied (each 0 / 1): KFUSE_MLP_PACKED_RELU (ReLU on packed
// fp16 pairs), KFUSE_MLP_STAGED_STORES (stash stores through shared memory), KFUSE_MLP_MMA_BIAS (the bias as an
// extra K step of the MMA). FusedMlp and tune_mlp apply them once, when made; the source writer only sees options.
MlpOptions with_dev_overrides(MlpOptions options);

}  // namespace kfuse
