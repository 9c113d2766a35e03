#include "mlp/codegen/mlp_layout.h"

#include <algorithm>
#include <string>

namespace kfuse::codegen {

MlpLayout mlp_layout(const MlpSpec& spec) {
  MlpLayout m;
  const int L = spec.num_layers();
  for (int l = 0; l < L; ++l) {
    const int64_t n = spec.layer_out_padded(l), k = spec.layer_in_padded(l);
    m.fwd_weight_offset.push_back(m.fwd_region_halves);
    m.fwd_region_halves += n * (k + 8);
    m.bwd_weight_offset.push_back(m.bwd_region_halves);
    m.bwd_region_halves += k * (n + 8);
    m.bias_offset.push_back(m.bias_floats);
    m.bias_floats += n;
  }
  // Every region starts 16-byte aligned (cp.async copies 16 bytes): the counts above are multiples of 8 halves.
  m.bwd_region_byte_offset = m.fwd_region_halves * 2;
  m.bias_byte_offset = m.bwd_region_byte_offset + m.bwd_region_halves * 2;
  m.packed_bytes = m.bias_byte_offset + (m.bias_floats * 4 + 15) / 16 * 16;

  for (int l = 0; l < L; ++l) {
    const int64_t n = spec.layer_out_padded(l);
    if (l < L - 1) {
      m.stash_h_offset.push_back(m.stash_elements_per_row);
      m.stash_elements_per_row += n;
    } else {
      m.stash_h_offset.push_back(-1);
    }
    const Activation& a = spec.layer_activation(l);
    if (!a.is_identity() && a.derivative_uses_x()) {
      m.stash_z_offset.push_back(m.stash_elements_per_row);
      m.stash_elements_per_row += n;
    } else {
      m.stash_z_offset.push_back(-1);
    }
    m.dz_offset.push_back(m.dz_elements_per_row);
    m.dz_elements_per_row += n;
  }
  return m;
}

int forward_stage_ld(const MlpSpec& spec) {
  int w = 0;
  for (int l = 0; l < spec.num_layers(); ++l) w = std::max(w, spec.layer_out_padded(l));
  return w + 8;
}

int64_t forward_stage_bytes_per_warp(const MlpSpec& spec, const MlpVariant& v) {
  return int64_t(16) * v.m_tiles * forward_stage_ld(spec) * 2;
}

WgmmaForwardLayout wgmma_forward_layout(const MlpSpec& spec, const MlpVariant& v, const MlpOptions& options) {
  WgmmaForwardLayout w;
  w.bias_k = options.mma_bias ? 16 : 0;
  int64_t at = 0;
  for (int l = 0; l < spec.num_layers(); ++l) {
    w.weight_offset.push_back(at);
    at += int64_t(spec.layer_out_padded(l)) * (spec.layer_in_padded(l) + w.bias_k) * 2;  // multiples of 512 bytes
  }
  w.x_tile_offset = at;
  w.x_tile_ld = spec.layer_in_padded(0) + 8;
  w.x_tile_bytes_per_warp = int64_t(16) * v.m_tiles * w.x_tile_ld * 2;
  w.stage_offset = w.x_tile_offset + v.warps * w.x_tile_bytes_per_warp;
  w.smem_bytes = w.stage_offset + v.warps * forward_stage_bytes_per_warp(spec, v);
  return w;
}

WgmmaStreamLayout wgmma_stream_layout(const MlpSpec& spec, const MlpVariant& v) {
  WgmmaStreamLayout w;
  const int L = spec.num_layers();
  for (int l = 0; l < L; ++l)
    w.stage_bytes = std::max<int64_t>(
        w.stage_bytes, int64_t(spec.layer_out_padded(l)) * std::min(v.k_chunk, spec.layer_in_padded(l)) * 2);
  // A narrow layer takes as many columns per chunk as a stage holds (the output layer: usually all of them), so
  // that it costs one barrier rather than k / k_chunk.
  for (int l = 0; l < L; ++l) {
    const int n = spec.layer_out_padded(l), k = spec.layer_in_padded(l);
    const int kc = std::min<int>(k, static_cast<int>(w.stage_bytes / (2 * n)) / 16 * 16);
    for (int k0 = 0; k0 < k; k0 += kc) w.chunks.push_back({l, k0, std::min(kc, k - k0)});
  }
  // Two chunks ahead cover the L2 latency (measured). (A row block has two chunks at least: two layers.)
  w.lookahead = 2;
  w.stages = w.lookahead + 2;
  const int64_t warpgroups = v.warps / 4;
  int widest_hidden = 0;
  for (int l = 0; l + 1 < L; ++l) widest_hidden = std::max(widest_hidden, spec.layer_out_padded(l));
  w.x_tile_offset = w.stages * w.stage_bytes;
  w.x_tile_bytes = int64_t(64) * spec.layer_in_padded(0) * 2;
  w.h_tile_offset = w.x_tile_offset + warpgroups * w.x_tile_bytes;
  w.h_tile_bytes = int64_t(64) * widest_hidden * 2;
  w.smem_bytes = w.h_tile_offset + warpgroups * w.h_tile_bytes;
  return w;
}

}  // namespace kfuse::codegen
