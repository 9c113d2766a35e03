// How the backward kernel of a fused_wgrad variant (MlpVariant::fused_wgrad) splits each layer's weight gradient
// among a CTA's warps, and what that costs in registers and shared memory. Shared by the source writer (which bakes
// the split into the kernel), the variant selection (register budget, shared memory) and the runtime (workspace).
//
// Per row block and layer l (last to first), the CTA puts dz_l (rows x out_l) and the layer's input h_{l-1}
// (rows x in_l; x for layer 0) into shared-memory tiles; then every warp adds its part of dW_l += dz_l^T h_{l-1}
// with mma.sync, both operands through ldmatrix.trans. The padded dW_l is a grid of 16x16 blocks: out-tiles (16
// output features, the mma's m) x in-pairs (16 input features, two mma n-tiles). The warps form a
// warps_out x warps_in grid; warp (i, j) owns out-tiles i, i + warps_out, ... and in-pairs j, j + warps_in, ...
// Its blocks stay in fp32 registers for the CTA's life: a row block's gradient never leaves the SM.
// The bias gradient db_l = dz_l^T 1 is one more mma per out-tile with a ones B operand, on the A fragments the warp
// loads anyway; the warps_in warps sharing an out-tile take turns over the row k-steps (k-step % warps_in == j), so
// that none does more mma than the others, and the CTA adds their partials at the end. Each CTA then writes one
// partial gradient vector (the `grads` layout) to the workspace and a reduction kernel sums them in CTA order:
// deterministic, no atomics.
#pragma once

#include <cstdint>
#include <vector>

#include "kfuse/mlp.h"

namespace kfuse::codegen {

// A thread's budget of fp32 weight-gradient accumulators (all layers): beyond it the backward kernel, which also
// holds the activation-gradient chain in registers, would spill.
constexpr int kMaxWgradAccumulatorFloats = 96;
// The shared memory a plan may take (the most any supported device gives one block: 227 KiB on sm_90); a device
// with less rejects the plans that exceed it (mlp_fused_wgrad_fits), so the generated source never depends on it.
constexpr int64_t kWgradSmemBudget = 227 * 1024;

// Where the accumulators of every layer do not fit the budget, the widest layers' weight gradients stay outside
// (weight = false, largest first until the rest fits; then, past the shared-memory budget, the layers with the
// widest input tiles): for those the backward kernel stores dz_l to the workspace
// and the runtime's cuBLAS GEMM makes dW_l from it. Their bias gradients stay inside (4 floats per out-tile),
// so that no layer's dz is read again for a bias GEMV.
struct WgradLayerPlan {
  int out_tiles = 0, in_pairs = 0;  // of the padded dW_l: out_padded / 16, in_padded / 16
  int warps_out = 1, warps_in = 1;  // warps_out * warps_in = warps; warp w is (w % warps_out, w / warps_out)
  int out_tiles_per_warp = 0;       // ceil(out_tiles / warps_out)
  int in_pairs_per_warp = 0;        // ceil(in_pairs / warps_in)
  bool bias = false;
  bool weight = true;  // dW_l accumulated in the kernel (else: dz_l stored, cuBLAS)
  // Two 16x8 accumulator tiles per block, one per out-tile for the bias; 4 floats per thread each.
  int weight_floats() const { return weight ? out_tiles_per_warp * in_pairs_per_warp * 8 : 0; }
  int accumulator_floats() const { return weight_floats() + (bias ? out_tiles_per_warp * 4 : 0); }
};

struct WgradPlan {
  std::vector<WgradLayerPlan> layers;
  int accumulator_floats = 0;  // per thread, all layers
  int k_steps = 0;             // 16-row mma k-steps per row block (rows_per_cta / 16)
  // Shared memory: the resident transposed weights, then two dz tiles and two input tiles (alternating by layer,
  // so that one barrier per layer suffices), each row padded by 8 halves against ldmatrix bank conflicts.
  int64_t dz_tile_offset = 0, dz_tile_bytes = 0;
  int64_t h_tile_offset = 0, h_tile_bytes = 0;  // input tiles: as wide as the widest input of a `weight` layer
                                                // that is not recomputed
  // MlpVariant::recompute: one tile per recomputed layer output (rows x (widest of them + 8) halves, kept for the
  // row block), then those layers' forward weights (the forward region's first fwd_weight_bytes, as packed).
  int recompute = 0;
  int64_t rc_tile_offset = 0, rc_tile_bytes = 0;
  int64_t fwd_weight_smem_offset = 0, fwd_weight_bytes = 0;
  // Whether layer l's input is a recomputed output (h_{l-1} with l - 1 < recompute): its weight gradient reads
  // that layer's recompute tile instead of an input tile.
  bool recomputed_input(int l) const { return l >= 1 && l - 1 < recompute; }
  int64_t smem_bytes = 0;
  // End of the kernel: the warps_in bias partials of layer l at float offset bias_scratch_offset[l] of shared
  // memory (warps_in x out_padded floats; the weights and tiles are dead by then).
  std::vector<int64_t> bias_scratch_offset;
  // The gradient vector (nn.Sequential order, true widths): float offsets of each layer's dW and db (-1: no bias).
  std::vector<int64_t> grad_weight_offset, grad_bias_offset;
  int64_t grad_floats = 0;
  // A CTA's partial gradient vector in the workspace: grad_floats, padded to whole 128-byte rows.
  int64_t partial_stride_floats = 0;
  bool all_weights() const {
    for (const WgradLayerPlan& l : layers)
      if (!l.weight) return false;
    return true;
  }
};

WgradPlan mlp_wgrad_plan(const MlpSpec& spec, const MlpVariant& variant);

}  // namespace kfuse::codegen
