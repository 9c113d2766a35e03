// The forward of a wgmma variant (MlpVariant::wgmma; Hopper, compiled for sm_90a): what the source writer emits
// instead of the mma.sync forward body. Each layer of a 64-row chain is one group of wgmma instructions (K / 16 of
// them), A = the chain's activations in registers, B = the layer's weights resident in shared memory in the
// core-matrix layout (mlp_layout.h WgmmaForwardLayout). A warp owns the same rows as in the mma.sync forward (16 *
// m_tiles consecutive rows of the row block; chain c is tile c of the warpgroup's four warps), so the stash, y
// and every helper that stores them are shared with it. Each warp prefetches its next rows of x into its own
// shared tile with cp.async while the chains run, so that no warp waits on DRAM at a row block's start.
#pragma once

#include <set>
#include <sstream>

#include "mlp/codegen/mlp_layout.h"
#include "kfuse/mlp.h"

namespace kfuse::codegen {

// Device helpers for wgmma (fence, commit, wait, descriptors, the core-matrix copy, the wgmma backward's tiles) and
// the MMA functions: `wgmma_mma` (A in registers, B K-major) for each N in `register_a`, `wgmma_mma_chain` (A
// K-major and B MN-major in shared memory) and `wgmma_mma_mn` (A in registers, B MN-major) for each N in
// `chain_ss`, `wgmma_mma_ss` (both operands MN-major in shared memory) for each N in `shared_a`, `wgmma_mma_kk`
// (both K-major in shared memory) for each N in `shared_k`. Needs the device library before it.
void write_wgmma_library(std::ostringstream& os, const std::set<int>& register_a, const std::set<int>& chain_ss,
                         const std::set<int>& shared_a, const std::set<int>& shared_k = {});

// `template <bool TRAIN> forward_body(const FwdParams&)` of a wgmma variant (the caller declares FwdParams, the
// activation functors and the kernels that call it).
void write_wgmma_forward_body(std::ostringstream& os, const MlpSpec& spec, const MlpVariant& v, const MlpLayout& m,
                              const MlpOptions& options);
// The same with the weights streamed through shared memory in chunks (MlpVariant::wgmma without weights_resident;
// mlp_layout.h WgmmaStreamLayout): one 64-row chain per warpgroup, every warpgroup multiplying the same chunk.
void write_wgmma_stream_forward_body(std::ostringstream& os, const MlpSpec& spec, const MlpVariant& v,
                                     const MlpLayout& m);

}  // namespace kfuse::codegen
