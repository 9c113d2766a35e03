#include "mlp/codegen/mlp_wgrad_plan.h"

#include <algorithm>
#include <tuple>

#include "mlp/codegen/mlp_layout.h"
#include "mlp/codegen/mlp_wgmma_backward.h"

namespace kfuse::codegen {
namespace {

int ceil_div(int a, int b) { return (a + b - 1) / b; }

// The warp grid for one layer: fewest blocks per warp (the barrier waits for the busiest warp), then fewest
// accumulators, then fewest ldmatrix per k-step (out_tiles_per_warp + in_pairs_per_warp).
WgradLayerPlan split_layer(int out_tiles, int in_pairs, int warps, bool bias) {
  WgradLayerPlan best;
  bool have = false;
  for (int wm = 1; wm <= warps; ++wm) {
    if (warps % wm) continue;
    WgradLayerPlan p;
    p.out_tiles = out_tiles;
    p.in_pairs = in_pairs;
    p.warps_out = wm;
    p.warps_in = warps / wm;
    p.out_tiles_per_warp = ceil_div(out_tiles, wm);
    p.in_pairs_per_warp = ceil_div(in_pairs, p.warps_in);
    p.bias = bias;
    const auto key = [](const WgradLayerPlan& x) {
      return std::make_tuple(x.out_tiles_per_warp * x.in_pairs_per_warp, x.accumulator_floats(),
                             x.out_tiles_per_warp + x.in_pairs_per_warp);
    };
    if (!have || key(p) < key(best)) best = p;
    have = true;
  }
  return best;
}

int64_t align16(int64_t bytes) { return (bytes + 15) / 16 * 16; }

}  // namespace

WgradPlan mlp_wgrad_plan(const MlpSpec& s, const MlpVariant& v) {
  WgradPlan p;
  const int L = s.num_layers();
  const int rows = v.rows_per_cta();
  p.k_steps = rows / 16;
  int max_out = 0;
  int64_t grad = 0, scratch = 0;
  for (int l = 0; l < L; ++l) {
    const int out = s.layer_out_padded(l), in = s.layer_in_padded(l);
    max_out = std::max(max_out, out);
    p.layers.push_back(split_layer(out / 16, in / 16, v.warps, s.has_bias(l)));
    p.accumulator_floats += p.layers.back().accumulator_floats();
    p.grad_weight_offset.push_back(grad);
    grad += int64_t(s.layer_out(l)) * s.layer_in(l);
    p.grad_bias_offset.push_back(s.has_bias(l) ? grad : -1);
    if (s.has_bias(l)) grad += s.layer_out(l);
    p.bias_scratch_offset.push_back(scratch);
    if (s.has_bias(l)) scratch += int64_t(p.layers.back().warps_in) * out;
  }
  p.grad_floats = grad;
  p.partial_stride_floats = (grad + 31) / 32 * 32;
  // The wgmma backward (mlp/codegen/mlp_wgmma_backward.h) has its own budget, shared memory and choice of external
  // layers: only the gradient vector's layout above and which weight gradients are outside apply to it.
  if (v.wgmma_backward) {
    p.recompute = std::clamp(v.recompute, 0, L - 1);
    const std::vector<bool> external = wgmma_backward_external_layers(s, v);
    for (int l = 0; l < L; ++l) p.layers[l].weight = !external[l];
    return p;
  }
  // Weight gradients outside the kernel, widest first, until the accumulators fit (biases always inside).
  while (p.accumulator_floats > kMaxWgradAccumulatorFloats) {
    WgradLayerPlan* widest = nullptr;
    for (WgradLayerPlan& l : p.layers)
      if (l.weight && l.weight_floats() > 0 && (!widest || l.weight_floats() > widest->weight_floats())) widest = &l;
    if (!widest) break;
    p.accumulator_floats -= widest->weight_floats();
    widest->weight = false;
  }
  // Shared memory: the input tiles are as wide as the widest input of a layer whose weight gradient stays inside;
  // past the budget, that layer's weight gradient goes outside too.
  const MlpLayout layout = mlp_layout(s);
  p.recompute = std::clamp(v.recompute, 0, L - 1);  // validate_variant rejects what the clamp changes
  const int rc = p.recompute;
  int rc_width = 0;
  for (int l = 0; l < rc; ++l) rc_width = std::max(rc_width, s.layer_out_padded(l));
  for (;;) {
    int max_in = 0, widest = -1;
    for (int l = 0; l < L; ++l)
      if (p.layers[l].weight && !p.recomputed_input(l) && s.layer_in_padded(l) > max_in) {
        max_in = s.layer_in_padded(l);
        widest = l;
      }
    p.dz_tile_offset = align16(layout.bwd_region_halves * 2);
    p.dz_tile_bytes = int64_t(rows) * (max_out + 8) * 2;
    p.h_tile_offset = p.dz_tile_offset + 2 * p.dz_tile_bytes;
    p.h_tile_bytes = max_in ? int64_t(rows) * (max_in + 8) * 2 : 0;
    p.rc_tile_offset = p.h_tile_offset + 2 * p.h_tile_bytes;
    p.rc_tile_bytes = rc ? int64_t(rows) * (rc_width + 8) * 2 : 0;
    p.fwd_weight_smem_offset = p.rc_tile_offset + rc * p.rc_tile_bytes;
    p.fwd_weight_bytes = rc ? layout.fwd_weight_offset[rc] * 2 : 0;
    p.smem_bytes = std::max(p.fwd_weight_smem_offset + p.fwd_weight_bytes, scratch * 4);
    if (p.smem_bytes <= kWgradSmemBudget || widest < 0) break;
    p.accumulator_floats -= p.layers[widest].weight_floats();
    p.layers[widest].weight = false;
  }
  return p;
}

}  // namespace kfuse::codegen
