// Where a fused MLP's data live, shared by the source writer (which bakes the offsets into the kernels) and the
// runtime (which sizes the buffers):
//   packed weights: the forward region (layer l as out_padded rows x (in_padded + 8) halves, the kernels' shared
//     memory layout, so resident weights load with one flat copy), the backward region (the transposes:
//     in_padded rows x (out_padded + 8)), then the biases as float32 (out_padded per layer, zero where absent);
//   stash (forward_train -> backward): per layer, arrays of `batch` rows: the activation output h (hidden layers)
//     and the pre-activation z where the activation's derivative needs x. The layout is the same for every
//     variant; one with recompute = r does not write (and its backward does not read) h of the first r layers,
//     whose arrays stay allocated (one stash_bytes for all variants);
//   backward workspace: per layer the activation gradient dz (batch x out_padded), then `batch` ones (bias
//     gradients as GEMVs).
// Array offsets of the stash and the workspace are "elements per row": the array starts at offset * batch.
#pragma once

#include <cstdint>
#include <vector>

#include "kfuse/mlp.h"

namespace kfuse::codegen {

struct MlpLayout {
  std::vector<int64_t> fwd_weight_offset;  // halves from the forward region's start
  std::vector<int64_t> bwd_weight_offset;  // halves from the backward region's start
  std::vector<int64_t> bias_offset;        // floats from the bias region's start
  int64_t fwd_region_halves = 0, bwd_region_halves = 0, bias_floats = 0;
  int64_t bwd_region_byte_offset = 0, bias_byte_offset = 0, packed_bytes = 0;

  std::vector<int64_t> stash_h_offset;  // -1 for the output layer (its output is the caller's y)
  std::vector<int64_t> stash_z_offset;  // -1 where the derivative needs no pre-activation
  int64_t stash_elements_per_row = 0;
  std::vector<int64_t> dz_offset;
  int64_t dz_elements_per_row = 0;  // the ones vector follows at dz_elements_per_row * batch
};

MlpLayout mlp_layout(const MlpSpec& spec);

// The forward kernels' per-warp staging area for coalesced stores (store_c_staged), after the weights in shared
// memory: 16 * m_tiles rows of stage_ld halves, stage_ld = the widest layer output (padded) + 8 (bank spread).
int forward_stage_ld(const MlpSpec& spec);
int64_t forward_stage_bytes_per_warp(const MlpSpec& spec, const MlpVariant& v);

// The shared memory of the wgmma forward (MlpVariant::wgmma), in bytes from its start:
//   every layer's weights, unpadded, in wgmma's K-major core-matrix layout: a core matrix is 8 output rows x 8 input
//   columns stored as 128 contiguous bytes; core matrices along K are 128 bytes apart (the descriptor's leading
//   byte offset), along N (in_padded + bias_k) * 16 bytes (its stride byte offset). bias_k = 16: each layer's bias
//   is one more K slice (column in_padded = the bias, the rest zeros), which the forward multiplies by a ones
//   column of A to start its accumulators (without MlpOptions::mma_bias: 0, the bias loaded into registers);
//   per warp its x tile: 16 * m_tiles rows of in_padded + 8 halves (the next row block's input, by cp.async);
//   per warp the store staging area (forward_stage_bytes_per_warp).
struct WgmmaForwardLayout {
  std::vector<int64_t> weight_offset;
  int bias_k = 16;
  int64_t x_tile_offset = 0, x_tile_bytes_per_warp = 0, x_tile_ld = 0;
  int64_t stage_offset = 0, smem_bytes = 0;
};
WgmmaForwardLayout wgmma_forward_layout(const MlpSpec& spec, const MlpVariant& v, const MlpOptions& options);

// The wgmma forward with streamed weights (MlpVariant::wgmma without weights_resident: wide networks whose weights
// do not fit in shared memory), in bytes from its start:
//   `stages` buffers of stage_bytes through which a row block's weights pass in `chunks` (a layer's columns k0 ..
//   k0 + kc, in the core-matrix layout of an n x kc matrix); the chunk `lookahead` places ahead is requested while
//   the warpgroups multiply the current one, and stages = lookahead + 2 (the chunk before the current one may
//   still be in the tensor cores);
//   per warpgroup its x tile (64 rows x in_padded) and its h tile (64 rows x the widest hidden layer), both A
//   operands of 16-byte units as the wgmma backward's tiles (mlp_wgmma_backward.h): unit (r, c) at ((r / 8) *
//   units + c) * 128 + (r % 8) * 16, units = the layer's K / 8.
struct WgmmaStreamChunk {
  int layer = 0, k0 = 0, kc = 0;
};
struct WgmmaStreamLayout {
  std::vector<WgmmaStreamChunk> chunks;  // one row block's sequence, layer by layer
  int64_t stage_bytes = 0;
  int stages = 0, lookahead = 0;
  int64_t x_tile_offset = 0, x_tile_bytes = 0;  // per warpgroup
  int64_t h_tile_offset = 0, h_tile_bytes = 0;  // per warpgroup
  int64_t smem_bytes = 0;
};
WgmmaStreamLayout wgmma_stream_layout(const MlpSpec& spec, const MlpVariant& v);

}  // namespace kfuse::codegen
