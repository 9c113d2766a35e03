// How FusedMlp (kfuse/mlp.h) writes its kernels. The defaults are the measured fastest on sm_90 (PERF.md); the
// other settings exist for same-run A/B measurements of each alternative and for the tests of its code path. Every
// setting computes the same function. A setting changes the generated source only of the kernels it applies to
// (the kernel cache is keyed by that source, so each setting's kernels are cached apart), and mma_bias also the
// wgmma forward's shared memory, hence which variants fit a device (mlp_candidate_variants and the others that
// take MlpOptions).
#pragma once

namespace kfuse {

struct MlpOptions {
  // The wgmma forward: a ReLU that feeds the next layer runs on the rounded 16-bit pairs (half the instructions;
  // exact, since rounding is monotone and keeps 0), except where the training forward stashes its fp32 output;
  // off: on the fp32 accumulators, as every other activation.
  bool packed_relu = true;
  // The mma.sync forward: the training forward writes the stash through each warp's shared-memory staging area, as
  // whole rows (coalesced); off: each fragment is stored directly (the staging area stays reserved either way).
  bool staged_stores = true;
  // The wgmma forward with resident weights: each layer's bias is one more K slice of its weights, multiplied by a
  // ones column of A to start the accumulators (fewer registers); off: the bias is loaded into the accumulators.
  bool mma_bias = true;

  bool operator==(const MlpOptions&) const = default;
};

}  // namespace kfuse
