// The backward of a wgmma-backward variant (MlpVariant::wgmma_backward; Hopper, compiled for sm_90a): what the
// source writer emits instead of the mma.sync backward kernels. Every row block, each warpgroup owns 64 rows:
//   1. it recomputes the first MlpVariant::recompute hidden outputs from x (the wgmma forward's chain, A in
//      registers, the weights resident) and stores each into its own shared tile, or, where the next layer's
//      weight gradient is external (cuBLAS), into the stash array cuBLAS reads; the training forward stashed the
//      others, and their tiles arrive by cp.async (the next row block's as soon as the last reader is done);
//   2. it runs the activation-gradient chain from dy: per layer (last to first) dz_l = dL/dh_l * f'(h_l), stored
//      into a dz tile (and, for an external layer, from there into the workspace), then two wgmma groups are
//      issued: the chain's next data gradient dz_l W_l (A = dz_l in registers, or the dz tile read K-major where
//      registers are short; B = the same resident weights read MN-major) and the layer's weight gradient (both operands from the tiles, MN-major: K = the 64 rows), accumulated in
//      registers for the CTA's life. The wait for the first leaves the second running under the next layer's
//      activation math.
// No CTA-wide barrier inside the row-block loop: a warpgroup reads only its own tiles (one 128-thread named barrier
// per layer publishes its dz tile). At the end the warpgroups add their accumulators in a fixed order into shared
// memory and each CTA writes one partial gradient vector (the fused_wgrad workspace layout), summed by the same
// reduction kernel as the mma.sync backward: deterministic, no atomics.
#pragma once

#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "mlp/codegen/mlp_layout.h"
#include "mlp/codegen/mlp_wgrad_plan.h"
#include "kfuse/mlp.h"

namespace kfuse::codegen {

// How one layer's weight gradient is one wgmma per 16 rows and 64-row M tile:
//   normal:     [dW_l db_l] = dz_l^T [h_{l-1} 1]: M = out_padded rounded up to 64 (the dz tile's columns past
//               out_padded are zero), N = in_padded + 8 (a unit of ones after the inputs: its columns are db_l);
//   transposed: dW_l^T = h_{l-1}^T dz_l: M = in_padded (a multiple of 64), N = out_padded; db_l from each thread's
//               running sums of its rows of dz_l;
//   external:   dW_l is a cuBLAS GEMM after the kernel (where every layer's accumulators would not fit the register
//               budget: the widest layers first): the kernel stores dz_l to the workspace and, while it recomputes,
//               h_{l-1} to its stash array; only db_l = dz_l^T 1 stays inside (N = 8, the x tile's ones unit).
// Of normal and transposed the one with fewer accumulators is taken: the narrow output layer (16 wide in the bench)
// is transposed.
struct WgmmaBackwardLayerPlan {
  bool external = false;
  bool transposed = false;
  int m_tiles = 1;      // 64-row M tiles
  int n = 0;            // the MMA's N (0: no MMA, an external layer without bias)
  int bias_floats = 0;  // transposed with a bias: out_padded / 4 running sums per thread
  int accumulator_floats() const { return m_tiles * n / 2 + bias_floats; }
};

// The per-thread accumulator budget (all layers; the chain needs ~70-100 registers beside them).
constexpr int kMaxWgmmaWgradAccumulatorFloats = 160;

// Shared memory, bytes from its start:
//   every layer's weights once, in the wgmma forward's K-major core-matrix layout (no bias slice): the recompute
//   reads them as the forward does, the chain's data gradients dz_l W_l read the same core matrices as an MN-major
//   B operand (K = the layer's outputs, N = its inputs);
//   per warpgroup: two x tiles (row blocks alternate between them: the next one's x arrives by cp.async while the
//   last weight gradient still reads the other), one tile per hidden output that a layer's weight gradient inside
//   the kernel takes as input (the others go to the stash), two dz tiles (alternating by layer).
//   A tile holds the warpgroup's 64 rows in 16-byte units (8 consecutive columns of a row); unit (r, c) sits at
//   ((r / 8) * units + c) * 128 + (r % 8) * 16, i.e. 8-row groups of core matrices: the same tile is an MN-major
//   wgmma operand (K = rows; descriptor leading byte offset = units * 128, the next 8 rows; stride byte offset 128,
//   the next 8 columns) and an ldmatrix source of A fragments. The weights are such tiles too (rows = outputs).
//   Input tiles (x, h) have one more unit of ones;
//   at the end the CTA's gradient sums (the partial vector's layout), then per transposed layer with a bias the
//   warps' bias sums (warps x out_padded floats), reuse the memory from its start.
struct WgmmaBackwardPlan {
  std::vector<WgmmaBackwardLayerPlan> layers;
  int accumulator_floats = 0;
  int warpgroups = 0;
  std::vector<int64_t> weight_offset;  // every layer
  int64_t warpgroup_offset = 0, warpgroup_bytes = 0;
  // Relative to a warpgroup's region:
  int x_units = 0;
  int64_t x_tile_offset = 0, x_tile_bytes = 0;
  std::vector<int> h_units;             // hidden layer j's output tile
  std::vector<int64_t> h_tile_offset;   // -1: no tile (layer j + 1 is external: h_j lives in its stash array)
  int dz_units = 0;
  int64_t dz_tile_offset = 0, dz_tile_bytes = 0;
  // The end-of-kernel reduction (floats from the start): the partial vector, then the bias sums (-1: none).
  int64_t grad_floats = 0;
  std::vector<int64_t> bias_sum_offset;
  int64_t smem_bytes = 0;
  // The chain's A: the dz tile (a K-major shared operand) where some layer is wider than 64, so that its dz
  // fragments (32+ registers) are not held while the MMAs run (width 128: no spills, -4%); else the fragments in
  // registers (width 64: the shared operand cost +12%, measured).
  bool chain_a_shared = false;
  bool has_h_tile(int j) const { return h_tile_offset[j] >= 0; }
};

// The shared memory a wgmma backward may take: what sm_90 gives one block.
constexpr int64_t kWgmmaBackwardSmemBudget = 227 * 1024;

// Why `v` cannot take the wgmma backward for `spec` ("" where it can): it needs the wgmma forward, fused weight
// gradients, one 16-row tile per warp, whole warpgroups, an orientation for every
// layer inside the kernel, and a set of external layers (widest first) that brings the accumulators within the
// budget and the shared memory within kWgmmaBackwardSmemBudget. The device's own limit is the caller's check
// (mlp_backward_smem_bytes).
std::string wgmma_backward_problem(const MlpSpec& spec, const MlpVariant& v);
WgmmaBackwardPlan wgmma_backward_plan(const MlpSpec& spec, const MlpVariant& v);
// Which layers' weight gradients are external (cuBLAS): what mlp_wgrad_plan marks `weight = false`.
std::vector<bool> wgmma_backward_external_layers(const MlpSpec& spec, const MlpVariant& v);

// The MMA widths the backward kernels use, for write_wgmma_library: register A with K-major B (the recompute),
// the chain's (A = the dz tile K-major, B = the weights MN-major), the weight gradients' (both MN-major).
void wgmma_backward_widths(const MlpSpec& spec, const WgmmaBackwardPlan& plan, std::set<int>& register_a,
                           std::set<int>& chain_ss, std::set<int>& shared_a);

// The kernel kfuse_mlp_backward (dx = false) or kfuse_mlp_backward_dx, with the BwdParams of mlp_codegen.h and the
// partial vector's layout of `wgrad` (mlp_wgrad_plan; its external layers' entries are left to cuBLAS).
void write_wgmma_backward(std::ostringstream& os, const MlpSpec& spec, const MlpVariant& v, const MlpLayout& m,
                          const WgradPlan& wgrad, bool dx);

}  // namespace kfuse::codegen
