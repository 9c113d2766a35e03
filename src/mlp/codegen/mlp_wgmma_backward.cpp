#include "mlp/codegen/mlp_wgmma_backward.h"

#include <algorithm>

#include "mlp/codegen/mlp_codegen.h"

namespace kfuse::codegen {
namespace {

int round64(int v) { return (v + 63) / 64 * 64; }

// The cheaper orientation of layer l's weight-gradient MMA (m_tiles = 0: neither fits an MMA's N <= 256).
WgmmaBackwardLayerPlan layer_plan(const MlpSpec& s, int l, bool external) {
  const int out_p = s.layer_out_padded(l), in_p = s.layer_in_padded(l);
  if (external) {
    WgmmaBackwardLayerPlan e;
    e.external = true;
    e.m_tiles = round64(out_p) / 64;
    e.n = s.has_bias(l) ? 8 : 0;
    return e;
  }
  WgmmaBackwardLayerPlan normal, transposed;
  normal.m_tiles = in_p + 8 <= 256 ? round64(out_p) / 64 : 0;
  normal.n = in_p + 8;
  transposed.transposed = true;
  transposed.m_tiles = in_p % 64 == 0 ? in_p / 64 : 0;
  transposed.n = out_p;
  transposed.bias_floats = s.has_bias(l) ? out_p / 4 : 0;
  if (normal.m_tiles == 0) return transposed;
  if (transposed.m_tiles == 0) return normal;
  return transposed.accumulator_floats() < normal.accumulator_floats() ? transposed : normal;
}

// The plan for a given set of external layers (every field but the gradient vector's).
WgmmaBackwardPlan plan_with(const MlpSpec& s, const MlpVariant& v, const std::vector<bool>& external) {
  WgmmaBackwardPlan p;
  const int L = s.num_layers();
  p.warpgroups = std::max(1, v.warps / 4);
  int64_t at = 0;
  for (int l = 0; l < L; ++l) {
    p.weight_offset.push_back(at);
    at += int64_t(s.layer_out_padded(l)) * s.layer_in_padded(l) * 2;
  }
  for (int l = 0; l < L; ++l) {
    p.layers.push_back(layer_plan(s, l, external[l]));
    const WgmmaBackwardLayerPlan& lp = p.layers.back();
    p.accumulator_floats += lp.accumulator_floats();
    p.dz_units = std::max(p.dz_units, lp.transposed ? s.layer_out_padded(l) / 8 : lp.m_tiles * 8);
    p.chain_a_shared = p.chain_a_shared || s.layer_out_padded(l) > 64;
  }
  p.warpgroup_offset = (at + 127) / 128 * 128;
  int64_t wg = 0;
  p.x_units = s.layer_in_padded(0) / 8 + 1;
  p.x_tile_offset = wg;
  p.x_tile_bytes = int64_t(64) * p.x_units * 16;
  wg += 2 * p.x_tile_bytes;
  for (int j = 0; j < L - 1; ++j) {
    p.h_units.push_back(s.layer_out_padded(j) / 8 + 1);
    p.h_tile_offset.push_back(external[j + 1] ? -1 : wg);
    if (!external[j + 1]) wg += int64_t(64) * p.h_units.back() * 16;
  }
  p.dz_tile_offset = wg;
  p.dz_tile_bytes = int64_t(64) * p.dz_units * 16;
  wg += 2 * p.dz_tile_bytes;
  p.warpgroup_bytes = wg;
  // The end-of-kernel reduction: the gradient vector (mlp_wgrad_plan's layout: every parameter, true widths), then
  // the transposed layers' bias sums.
  p.grad_floats = s.num_parameters();
  int64_t reduce = p.grad_floats;
  for (int l = 0; l < L; ++l) {
    const bool sums = p.layers[l].transposed && s.has_bias(l);
    p.bias_sum_offset.push_back(sums ? reduce : -1);
    if (sums) reduce += int64_t(v.warps) * s.layer_out_padded(l);
  }
  p.smem_bytes = std::max(p.warpgroup_offset + p.warpgroups * p.warpgroup_bytes, reduce * 4);
  return p;
}

// A layer inside the kernel with no MMA shape (the problem text), or "".
std::string shape_problem(const MlpSpec& s, const std::vector<bool>& external) {
  for (int l = 0; l < s.num_layers(); ++l)
    if (!external[l] && layer_plan(s, l, false).m_tiles == 0)
      return cat("layer ", l, "'s weight gradient (", s.layer_out(l), " x ", s.layer_in(l),
                 ") has no wgmma shape (input width ", s.layer_in_padded(l), " is over 248 and not a multiple of 64)");
  return "";
}

// External layers, widest accumulators first, until the accumulators and shared memory fit (a layer without an MMA
// shape is external from the start). Returns false where even all of them external does not fit.
bool choose_external(const MlpSpec& s, const MlpVariant& v, std::vector<bool>& external) {
  const int L = s.num_layers();
  external.assign(L, false);
  for (int l = 0; l < L; ++l) external[l] = layer_plan(s, l, false).m_tiles == 0;
  for (;;) {
    const WgmmaBackwardPlan p = plan_with(s, v, external);
    if (p.accumulator_floats <= kMaxWgmmaWgradAccumulatorFloats && p.smem_bytes <= kWgmmaBackwardSmemBudget)
      return true;
    int widest = -1;
    for (int l = 0; l < L; ++l)
      if (!external[l] && (widest < 0 || p.layers[l].accumulator_floats() > p.layers[widest].accumulator_floats()))
        widest = l;
    if (widest < 0) return false;
    external[widest] = true;
  }
}

}  // namespace

std::string wgmma_backward_problem(const MlpSpec& s, const MlpVariant& v) {
  if (!v.wgmma_backward) return "";
  if (!v.wgmma) return "the wgmma backward needs the wgmma forward (wgmma) as well";
  if (!v.fused_wgrad) return "the wgmma backward needs fused weight gradients (fused_wgrad)";
  if (v.m_tiles != 1) return "the wgmma backward needs m_tiles = 1 (one 64-row chain per warpgroup)";
  if (v.warps % 4 != 0) return "the wgmma backward needs whole warpgroups (warps a multiple of 4)";
  std::vector<bool> external;
  if (!choose_external(s, v, external)) {
    const WgmmaBackwardPlan p = plan_with(s, v, external);
    return cat("it does not fit even with every weight gradient outside the kernel: ", p.accumulator_floats,
               " accumulator floats per thread (budget ", kMaxWgmmaWgradAccumulatorFloats, "), ", p.smem_bytes,
               " bytes of shared memory (budget ", kWgmmaBackwardSmemBudget, ")");
  }
  return shape_problem(s, external);
}

std::vector<bool> wgmma_backward_external_layers(const MlpSpec& s, const MlpVariant& v) {
  std::vector<bool> external;
  choose_external(s, v, external);
  return external;
}

WgmmaBackwardPlan wgmma_backward_plan(const MlpSpec& s, const MlpVariant& v) {
  return plan_with(s, v, wgmma_backward_external_layers(s, v));
}

void wgmma_backward_widths(const MlpSpec& s, const WgmmaBackwardPlan& plan, std::set<int>& register_a,
                           std::set<int>& chain_ss, std::set<int>& shared_a) {
  for (int l = 0; l < s.num_layers(); ++l) {
    if (l < s.num_layers() - 1) register_a.insert(s.layer_out_padded(l));  // the recompute
    chain_ss.insert(s.layer_in_padded(l));                                  // the chain (layer 0: _dx only)
    if (plan.layers[l].n) shared_a.insert(plan.layers[l].n);
  }
}

namespace {

// The writer of one backward kernel (dx: kfuse_mlp_backward_dx): the set-up, then per row block the recompute (1.)
// and the chain (2.) of mlp_wgmma_backward.h, then the CTA's partial gradients (3.).
class WgmmaBackwardWriter {
 public:
  WgmmaBackwardWriter(std::ostringstream& os, const MlpSpec& s, const MlpVariant& v, const MlpLayout& m,
                      const WgradPlan& wgrad, bool dx)
      : os_(os), s_(s), m_(m), wgrad_(wgrad), p_(wgmma_backward_plan(s, v)), L_(s.num_layers()),
        in0_(s.layer_in_padded(0)), rc_(std::clamp(v.recompute, 0, L_ - 1)), dx_(dx),
        dz_tile_{tile("wgs", p_.dz_tile_offset), tile("wgs", p_.dz_tile_offset + p_.dz_tile_bytes)} {}

  // The kernel's start: the resident weights and their descriptors.
  void write_weights() {
    const std::string name = dx_ ? "kfuse_mlp_backward_dx" : "kfuse_mlp_backward";
    os_ << "extern \"C\" __global__ void __launch_bounds__(THREADS) " << name << "(BwdParams p) {\n"
        << "  extern __shared__ __align__(128) unsigned char kfuse_smem[];\n"
        << "  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, q = lane & 3, wg = warp >> 2;\n"
        << "  const int wr = (warp & 3) * 16;  // the warp's first row of its warpgroup's 64\n"
        << "  const u32 smem = smem_addr(kfuse_smem);\n"
        << "  // the packed buffer: the forward region precedes p.w (the backward region), the biases follow it\n"
        << "  const u16* fwd_w = reinterpret_cast<const u16*>(reinterpret_cast<const unsigned char*>(p.w) - "
        << m_.bwd_region_byte_offset << ");\n"
        << "  const float* fwd_bias = reinterpret_cast<const float*>(reinterpret_cast<const unsigned char*>(p.w) + "
        << m_.bias_byte_offset - m_.bwd_region_byte_offset << ");\n"
        << "  // resident weights, once: K-major B of the recompute, MN-major B of the chain\n";
    for (int l = 0; l < L_; ++l)
      os_ << "  copy_core_matrices<" << s_.layer_out_padded(l) << ", " << s_.layer_in_padded(l) << ", "
          << s_.layer_in_padded(l) + 8 << ", THREADS>(smem + " << cat_ull(p_.weight_offset[l]) << ", fwd_w + "
          << m_.fwd_weight_offset[l] << ");\n";
    const int last_dgrad = dx_ ? 0 : 1;
    for (int l = 0; l < L_ - 1; ++l)
      os_ << "  const unsigned long long fdesc" << l << " = wgmma_desc(smem + " << cat_ull(p_.weight_offset[l])
          << ", " << s_.layer_in_padded(l) << ");\n";
    for (int l = L_ - 1; l >= last_dgrad; --l)
      os_ << "  const unsigned long long cdesc" << l << " = wgmma_desc_mn<" << s_.layer_in_padded(l) / 8
          << ">(smem + " << cat_ull(p_.weight_offset[l]) << ");\n";
  }

  // The warpgroup's tiles, their ones units, the first row block's x and stashed h tiles; the weight-gradient
  // accumulators and bias sums, for the CTA's life.
  void write_tiles_and_accumulators() {
    os_ << "  const u32 wgs = smem + " << cat_ull(p_.warpgroup_offset) << " + wg * " << cat_ull(p_.warpgroup_bytes)
        << ";  // this warpgroup's tiles\n"
        << "  const u32 xt0 = " << tile("wgs", p_.x_tile_offset) << ";\n"
        << "  // the ones units of the input tiles (their weight-gradient columns are the bias gradients), once\n"
        << "  fill_unit_column<" << p_.x_units << ">(xt0, " << p_.x_units - 1 << ", threadIdx.x & 127);\n"
        << "  fill_unit_column<" << p_.x_units << ">(xt0 + " << cat_ull(p_.x_tile_bytes) << ", " << p_.x_units - 1
        << ", threadIdx.x & 127);\n";
    for (int j = 0; j < L_ - 1; ++j)
      if (p_.has_h_tile(j))
        os_ << "  fill_unit_column<" << p_.h_units[j] << ">(" << h_tile(j) << ", " << p_.h_units[j] - 1
            << ", threadIdx.x & 127);\n";
    os_ << "  if (blockIdx.x < p.num_blocks) {\n    " << x_copy_into("xt0", "(i64)blockIdx.x") << "\n";
    for (int j = rc_; j < L_ - 1; ++j)
      if (p_.has_h_tile(j)) os_ << "    " << h_copy_into(j, "(i64)blockIdx.x") << "\n";
    os_ << "  }\n  cp_async_commit();\n  cp_async_wait_all();\n  fence_async_shared();\n  __syncthreads();\n";
    for (int l = 0; l < L_; ++l) {
      const WgmmaBackwardLayerPlan& lp = p_.layers[l];
      for (int t = 0; t < lp.m_tiles && lp.n; ++t)
        os_ << "  float wa" << l << "_" << t << "[1][" << lp.n / 8 << "][4];\n  zero_acc(wa" << l << "_" << t
            << ");\n";
      if (lp.bias_floats) os_ << "  float bs" << l << "[" << s_.layer_out_padded(l) / 8 << "][2] = {};\n";
    }
  }

  void write_row_block_start() {
    os_ << "  u32 xb = 0;\n"
        << "  for (i64 blk = blockIdx.x; blk < p.num_blocks; blk += gridDim.x) {\n"
        << "    const i64 wrow = blk * ROWS + wg * 64 + wr;  // the warp's first row\n"
        << "    const i64 row = wrow + (lane >> 2);\n"
        << "    const u32 xt = xt0 + xb * " << cat_ull(p_.x_tile_bytes) << ";\n"
        << "    cp_async_wait_all();\n    __syncwarp();  // this row block's x rows (the warp's own)\n"
        << "    // the next row block's x into the other buffer (its last reader, the previous block's layer-0 weight\n"
        << "    // gradient, completed at that block's end)\n"
        << "    if (blk + gridDim.x < p.num_blocks) "
        << x_copy_into(cat("(xt0 + (xb ^ 1u) * ", p_.x_tile_bytes, "u)"), "(blk + gridDim.x)")
        << "\n    cp_async_commit();\n";
  }

  // 1. The recompute: the wgmma forward's chain over the first rc hidden layers, each output into its tile or its
  //    stash array.
  void write_recompute() {
    if (rc_ > 0)
      os_ << "    u32 ra0[1][" << in0_ / 16 << "][4];\n"
          << "    load_a_units<" << p_.x_units << ">(ra0, xt, wr, lane);\n";
    for (int l = 0; l < rc_; ++l) {
      const int n = s_.layer_out_padded(l);
      const std::string acc = cat("rz", l), a = cat("ra", l);
      os_ << "    // recompute layer " << l << " (" << s_.layer_in(l) << " -> " << s_.layer_out(l) << ", "
          << s_.layer_activation(l).name << ")\n"
          << "    float " << acc << "[1][" << n / 8 << "][4];\n"
          << "    init_acc<" << (s_.has_bias(l) ? "true" : "false") << ">(" << acc << ", fwd_bias + "
          << m_.bias_offset[l] << ", q);\n"
          << "    wgmma_fence();\n    wgmma_layer(" << acc << ", " << a << ", fdesc" << l << ");\n"
          << "    wgmma_commit();\n    wgmma_wait<0>();\n    wgmma_fence_acc(" << acc << ");\n";
      if (!s_.layer_activation(l).is_identity())
        os_ << "    apply_act<" << activation_struct_name(l) << ">(" << acc << ");\n";
      os_ << "    u32 ra" << l + 1 << "[1][" << n / 16 << "][4];\n"
          << "    to_a(" << acc << ", ra" << l + 1 << ");\n";
      if (p_.has_h_tile(l))
        os_ << "    store_a_units<" << p_.h_units[l] << ">(" << h_tile(l) << ", ra" << l + 1 << ", wr, lane);\n";
      else  // layer l + 1's weight gradient is cuBLAS's: h_l to the stash, staged in a (still free) dz tile
        os_ << "    store_a_units<" << p_.dz_units << ">(" << dz_tile_[l % 2] << ", ra" << l + 1 << ", wr, lane);\n"
            << "    __syncwarp();\n    copy_units_out<" << p_.dz_units << ", " << n / 8 << ", " << n << ">("
            << h_stash(l) << ", " << dz_tile_[l % 2] << ", wr, wrow, p.batch, lane);\n    __syncwarp();\n";
    }
  }

  // 2. The chain, from dy.
  void write_chain() {
    const int out_nt = s_.layer_out_padded(L_ - 1) / 8;
    os_ << "    float g" << L_ - 1 << "[1][" << out_nt << "][4];\n"
        << "    load_c<" << s_.output_width << ", " << s_.output_width << ">(g" << L_ - 1
        << ", p.dy, row, p.batch, q);\n";
    for (int l = L_ - 1; l >= 0; --l) {
      write_activation_derivative(l);
      write_dz_tile(l);
      write_data_gradient(l);
      write_weight_gradient(l);
      write_layer_wait(l);
    }
  }

  void write_row_block_end() {
    os_ << "    wgmma_wait<0>();\n";
    if (!dx_ && rc_ == 0 && p_.has_h_tile(0)) os_ << h_prefetch(0);  // step 0 had no wait
    os_ << "    xb ^= 1u;\n  }\n";
  }

  // 3. The CTA's partial gradients: the warpgroups add theirs in order into shared memory.
  void write_partials() {
    os_ << "  cp_async_wait_all();\n"
        << "  __syncthreads();  // tiles and weights dead: the sums reuse shared memory\n"
        << "  float* red = reinterpret_cast<float*>(kfuse_smem);\n"
        << "  for (int i = threadIdx.x; i < " << p_.grad_floats << "; i += THREADS) red[i] = 0.0f;\n"
        << "  __syncthreads();\n"
        << "  for (int w = 0; w < " << p_.warpgroups << "; ++w) {\n"
        << "    if (wg == w) {\n";
    for (int l = 0; l < L_; ++l) {
      const WgmmaBackwardLayerPlan& lp = p_.layers[l];
      const int64_t bias_at = wgrad_.grad_bias_offset[l];
      if (!lp.n) continue;
      // An external layer's accumulators are its bias's alone: the normal form with no input columns.
      const int in = lp.external ? 0 : s_.layer_in(l), in_p = lp.external ? 0 : s_.layer_in_padded(l);
      for (int t = 0; t < lp.m_tiles; ++t)
        os_ << "      add_wgrad<" << (lp.transposed ? "true" : "false") << ", "
            << (!lp.transposed && s_.has_bias(l) ? "true" : "false") << ", " << s_.layer_out(l) << ", " << in << ", "
            << in_p << ", " << t * 64 << ">(wa" << l << "_" << t << ", red + " << wgrad_.grad_weight_offset[l]
            << ", red + " << (bias_at >= 0 ? bias_at : 0) << ", warp & 3, lane);\n";
    }
    os_ << "    }\n    __syncthreads();\n  }\n";
    for (int l = 0; l < L_; ++l)
      if (p_.bias_sum_offset[l] >= 0)
        os_ << "  store_row_sums<" << s_.layer_out_padded(l) << ">(bs" << l << ", red + " << p_.bias_sum_offset[l]
            << ", warp, lane);\n";
    os_ << "  __syncthreads();\n";
    for (int l = 0; l < L_; ++l)
      if (p_.bias_sum_offset[l] >= 0)
        os_ << "  sum_bias_partials<" << s_.layer_out(l) << ", " << s_.layer_out_padded(l)
            << ", WARPS, THREADS>(red + " << p_.bias_sum_offset[l] << ", red + " << wgrad_.grad_bias_offset[l]
            << ");\n";
    os_ << "  __syncthreads();\n"
        << "  float* partial = p.partials + (i64)blockIdx.x * " << wgrad_.partial_stride_floats << ";\n"
        << "  for (int i = threadIdx.x; i < " << p_.grad_floats << "; i += THREADS) partial[i] = red[i];\n"
        << "}\n\n";
  }

 private:
  // Chain step l: dz = dL/dh * f', the activation's derivative from the stash, y, the h tile, prefetched pairs or a
  // constant.
  void write_activation_derivative(int l) {
    const WgmmaBackwardLayerPlan& lp = p_.layers[l];
    const int n = s_.layer_out_padded(l);
    const std::string g = cat("g", l);
    const Activation& act = s_.layer_activation(l);
    os_ << "    // layer " << l << " (" << s_.layer_in(l) << " -> " << s_.layer_out(l) << ", " << act.name
        << (lp.external ? ", weight gradient by cuBLAS" : "") << "): dz = dL/dh * f'\n";
    if (act.is_identity()) return;
    if (m_.stash_z_offset[l] >= 0) {  // the output layer's, or a stashed hidden layer's
      os_ << "    {\n      float t[1][" << n / 8 << "][4];\n      load_c<" << n << ", " << n << ">(t, p.stash + "
          << m_.stash_z_offset[l] << " * p.batch, row, p.batch, q);\n      dact_from_x<"
          << activation_struct_name(l) << ">(" << g << ", t);\n    }\n";
    } else if (act.derivative_uses_y()) {
      os_ << "    {\n      float t[1][" << n / 8 << "][4];\n";
      if (l == L_ - 1)
        os_ << "      load_c<" << s_.output_width << ", " << s_.output_width << ">(t, p.y, row, p.batch, q);\n";
      else if (p_.has_h_tile(l))
        os_ << "      load_c_units<" << p_.h_units[l] << ">(t, " << h_tile(l) << ", wr, lane);\n";
      else
        os_ << "      unpack_pairs(t, hp" << l << ");\n";
      os_ << "      dact_from_y<" << activation_struct_name(l) << ">(" << g << ", t);\n    }\n";
    } else {
      os_ << "    dact_const<" << activation_struct_name(l) << ">(" << g << ");\n";
    }
    if (l == L_ - 1 && s_.output_width % 16 != 0)
      os_ << "    mask_columns<" << s_.output_width << ">(" << g << ", q);\n";
  }

  // dz_l's A fragments, and the dz tile: the chain's A, the weight gradient's operand, the staging of an external
  // layer's dz.
  void write_dz_tile(int l) {
    const WgmmaBackwardLayerPlan& lp = p_.layers[l];
    const int n = s_.layer_out_padded(l);
    const std::string g = cat("g", l), d = cat("d", l);
    if (lp.bias_floats) os_ << "    add_row_sums(bs" << l << ", " << g << ");\n";
    os_ << "    u32 " << d << "[1][" << n / 16 << "][4];\n    to_a(" << g << ", " << d << ");\n";
    os_ << "    store_a_units<" << p_.dz_units << ">(" << dz_tile_[l % 2] << ", " << d << ", wr, lane);\n";
    if (lp.external)  // dz_l for cuBLAS, from the tile: whole rows per store
      os_ << "    __syncwarp();\n    copy_units_out<" << p_.dz_units << ", " << n / 8 << ", " << n << ">(p.dz + "
          << m_.dz_offset[l] << " * p.batch, " << dz_tile_[l % 2] << ", wr, wrow, p.batch, lane);\n"
          << "    __syncwarp();\n";
    if (weight_group(l) && !lp.transposed && n < lp.m_tiles * 64)
      os_ << "    zero_units<" << p_.dz_units << ", " << n / 8 << ", " << lp.m_tiles * 8 << ">(" << dz_tile_[l % 2]
          << ", wr, lane);  // M padding\n";
    if (weight_group(l) || chain_goes_on(l))
      os_ << "    fence_async_shared();\n"
          << "    warpgroup_barrier(wg);  // the warpgroup's dz rows in place for the MMAs\n";
  }

  // The chain's next data gradient dz_l W_l (A = the dz tile or dz_l's fragments).
  void write_data_gradient(int l) {
    const int n = s_.layer_out_padded(l), k = s_.layer_in_padded(l);
    const std::string d = cat("d", l), next = next_gradient(l);
    if (chain_goes_on(l))
      os_ << "    float " << next << "[1][" << k / 8 << "][4];\n    zero_acc(" << next << ");\n"
          << "    wgmma_fence();\n    wgmma_layer_chain<" << k / 8
          << (p_.chain_a_shared
                  ? cat(", ", n / 16, ">(", next, ", wgmma_desc(", dz_tile_[l % 2], ", ", p_.dz_units * 8, ")")
                  : cat(">(", next, ", ", d))
          << ", cdesc" << l << ");\n    wgmma_commit();\n";
    else if (weight_group(l))
      os_ << "    wgmma_fence();\n";
  }

  void write_weight_gradient(int l) {
    if (!weight_group(l)) return;
    const WgmmaBackwardLayerPlan& lp = p_.layers[l];
    // The weight gradient (the bias's alone for an external layer): A and B descriptors of each 16-row k-step
    // and M tile.
    std::string a_tile, b_tile;
    int a_units, b_units;
    if (lp.external) {
      a_tile = dz_tile_[l % 2], a_units = p_.dz_units;
      b_tile = cat("(xt + ", (p_.x_units - 1) * 128, "u)"), b_units = p_.x_units;  // the ones unit
    } else {
      const std::string in_tile = input_tile(l);
      const int in_units = input_units(l);
      a_tile = lp.transposed ? in_tile : dz_tile_[l % 2];
      b_tile = lp.transposed ? dz_tile_[l % 2] : in_tile;
      a_units = lp.transposed ? in_units : p_.dz_units, b_units = lp.transposed ? p_.dz_units : in_units;
    }
    os_ << "    {\n      const unsigned long long da = wgmma_desc_mn<" << a_units << ">(" << a_tile
        << "), db = wgmma_desc_mn<" << b_units << ">(" << b_tile << ");\n"
        << "#pragma unroll\n      for (int ks = 0; ks < 4; ++ks) {\n";
    for (int t = 0; t < lp.m_tiles; ++t)
      os_ << "        wgmma_mma_ss(wa" << l << "_" << t << ", da + " << t * 64 << "ull + ks * " << 16 * a_units
          << "ull, db + ks * " << 16 * b_units << "ull);\n";
    os_ << "      }\n    }\n    wgmma_commit();\n";
  }

  // The wait for the data gradient (the weight gradient runs on), with the next layer's stash reads issued before
  // it, and a stashed tile's next row block after it.
  void write_layer_wait(int l) {
    // The stash reads of the next layer's f' go out before the wait, under the MMAs.
    if (l > 0 && prefetched(l - 1))
      os_ << "    u32 hp" << l - 1 << "[" << s_.layer_out_padded(l - 1) / 8 << "][2];\n    load_pairs<"
          << s_.layer_out_padded(l - 1) << ">(hp" << l - 1 << ", " << h_stash(l - 1) << ", row, p.batch, q);\n";
    if (chain_goes_on(l)) {
      if (weight_group(l))
        os_ << "    wgmma_wait<1>();  // the data gradient; the weight gradient runs on\n";
      else
        os_ << "    wgmma_wait<0>();\n";
      os_ << "    wgmma_fence_acc(" << next_gradient(l) << ");\n";
      if (l < L_ - 1 && l >= rc_ && p_.has_h_tile(l)) os_ << h_prefetch(l);
    }
    if (l == 0 && dx_)
      os_ << "    store_c<" << s_.input_width << ", " << s_.input_width << ">(gx, p.dx, row, p.batch, q);\n";
  }

  bool weight_group(int l) const { return p_.layers[l].n > 0; }
  bool chain_goes_on(int l) const { return l > 0 || dx_; }
  static std::string next_gradient(int l) { return l > 0 ? cat("g", l - 1) : std::string("gx"); }
  static std::string cat_ull(int64_t v) { return cat(v, "u"); }
  static std::string tile(const std::string& base, int64_t offset) { return cat("(", base, " + ", offset, "u)"); }
  std::string h_tile(int j) const { return tile("wgs", p_.h_tile_offset[j]); }
  // Hidden output j's stash array: the training forward's (j >= recompute), or written here for cuBLAS (a
  // recomputed input of an external layer).
  std::string h_stash(int j) const {
    return cat("const_cast<u16*>(p.stash) + ", m_.stash_h_offset[j], " * p.batch");
  }
  // Layer l's input tile (its weight gradient's h operand): x, or h_{l-1} (recomputed or from the stash).
  std::string input_tile(int l) const { return l == 0 ? std::string("xt") : h_tile(l - 1); }
  int input_units(int l) const { return l == 0 ? p_.x_units : p_.h_units[l - 1]; }
  // A stashed h_j's tile (the input of layer j + 1's weight gradient) for row block blk, by cp.async.
  std::string h_copy_into(int j, const std::string& blk) const {
    const int n = s_.layer_out_padded(j);
    return cat("copy_rows_zero_fill<16, ", n, ", ", n, ", 0, 32, ", p_.h_units[j], ">(", h_tile(j),
               " + (wr >> 3) * ", p_.h_units[j] * 128, "u, ", h_stash(j), ", ", blk,
               " * ROWS + wg * 64 + wr, p.batch, lane);");
  }
  std::string x_copy_into(const std::string& buffer, const std::string& blk) const {
    return cat("copy_rows_zero_fill<16, ", s_.input_width, ", ", in0_, ", 0, 32, ", p_.x_units, ">(", buffer,
               " + (wr >> 3) * ", p_.x_units * 128, "u, p.x, ", blk, " * ROWS + wg * 64 + wr, p.batch, lane);");
  }
  // Hidden layer j's f' reads h_j from the stash (no tile) and needs y: prefetched before the wait for g_j.
  bool prefetched(int j) const {
    const Activation& a = s_.layer_activation(j);
    return j < L_ - 1 && !p_.has_h_tile(j) && !a.is_identity() && a.derivative_uses_y();
  }
  // A stashed tile's next row block goes out once its last reader is done: the weight gradient of layer j + 1,
  // complete at the wait of chain step j (after that step's f' read of the tile).
  std::string h_prefetch(int j) const {
    return cat("    __syncwarp();\n    if (blk + gridDim.x < p.num_blocks) ", h_copy_into(j, "(blk + gridDim.x)"),
               "\n    cp_async_commit();  // the next row block's h", j, "\n");
  }

  std::ostringstream& os_;
  const MlpSpec& s_;
  const MlpLayout& m_;
  const WgradPlan& wgrad_;
  const WgmmaBackwardPlan p_;
  const int L_, in0_;
  // Hidden outputs j < rc are recomputed here; the training forward stashed the others.
  const int rc_;
  const bool dx_;
  const std::string dz_tile_[2];
};

}  // namespace

void write_wgmma_backward(std::ostringstream& os, const MlpSpec& s, const MlpVariant& v, const MlpLayout& m,
                          const WgradPlan& wgrad, bool dx) {
  WgmmaBackwardWriter writer(os, s, v, m, wgrad, dx);
  writer.write_weights();
  writer.write_tiles_and_accumulators();
  writer.write_row_block_start();
  writer.write_recompute();
  writer.write_chain();
  writer.write_row_block_end();
  writer.write_partials();
}

}  // namespace kfuse::codegen
