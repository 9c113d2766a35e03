// MlpSpec: validation and the derived sizes (padded widths, parameter counts); MlpVariant: names, shared memory
// needs, where fused weight gradients fit, the heuristic default and the candidate set the autotuner chooses from.
#include <algorithm>
#include <sstream>
#include <utility>

#include "mlp/codegen/mlp_layout.h"
#include "mlp/codegen/mlp_wgmma_backward.h"
#include "mlp/codegen/mlp_wgrad_plan.h"
#include "kfuse/error.h"
#include "kfuse/mlp.h"

namespace kfuse {
namespace {
int round16(int v) { return (v + 15) / 16 * 16; }
}  // namespace

const char* mlp_dtype_name(MlpDType d) { return d == MlpDType::kFloat16 ? "float16" : "bfloat16"; }

void MlpSpec::validate() const {
  KFUSE_CHECK(input_width >= 1 && input_width <= kMaxIoWidth, InvalidArgument, "MLP input width must be in [1, ",
              kMaxIoWidth, "], got ", input_width);
  KFUSE_CHECK(output_width >= 1 && output_width <= kMaxIoWidth, InvalidArgument, "MLP output width must be in [1, ",
              kMaxIoWidth, "], got ", output_width);
  KFUSE_CHECK(!hidden_widths.empty(), InvalidArgument, "an MLP needs at least one hidden layer (got none)");
  KFUSE_CHECK(static_cast<int>(hidden_widths.size()) <= kMaxHiddenLayers, InvalidArgument, "at most ",
              kMaxHiddenLayers, " hidden layers, got ", hidden_widths.size());
  for (size_t i = 0; i < hidden_widths.size(); ++i) {
    const int w = hidden_widths[i];
    KFUSE_CHECK(w >= 16 && w % 16 == 0, InvalidArgument, "hidden width ", i, " is ", w,
                ": hidden widths must be positive multiples of 16");
    KFUSE_CHECK(w <= kMaxWidth, InvalidArgument, "hidden width ", i, " is ", w, ": at most ", kMaxWidth,
                " is supported");
  }
  KFUSE_CHECK(activations.size() == hidden_widths.size(), InvalidArgument, "expected one activation per hidden layer (",
              hidden_widths.size(), "), got ", activations.size());
  for (const Activation& a : activations) a.check_syntax();
  output_activation.check_syntax();
  KFUSE_CHECK(bias.empty() || static_cast<int>(bias.size()) == num_layers(), InvalidArgument,
              "expected one bias flag per layer (", num_layers(), "), got ", bias.size());
}

int MlpSpec::layer_in(int l) const { return l == 0 ? input_width : hidden_widths.at(l - 1); }
int MlpSpec::layer_out(int l) const {
  return l == num_layers() - 1 ? output_width : hidden_widths.at(l);
}
int MlpSpec::layer_in_padded(int l) const { return round16(layer_in(l)); }
int MlpSpec::layer_out_padded(int l) const { return round16(layer_out(l)); }
bool MlpSpec::has_bias(int l) const { return bias.empty() ? true : bool(bias.at(l)); }
const Activation& MlpSpec::layer_activation(int l) const {
  return l == num_layers() - 1 ? output_activation : activations.at(l);
}

int64_t MlpSpec::num_parameters() const {
  int64_t n = 0;
  for (int l = 0; l < num_layers(); ++l)
    n += int64_t(layer_out(l)) * layer_in(l) + (has_bias(l) ? layer_out(l) : 0);
  return n;
}

std::string MlpSpec::to_string() const {
  std::ostringstream os;
  os << "MLP(" << input_width;
  for (size_t i = 0; i < hidden_widths.size(); ++i) os << " -> " << hidden_widths[i] << " " << activations.at(i).name;
  os << " -> " << output_width;
  if (!output_activation.is_identity()) os << " " << output_activation.name;
  os << ", " << mlp_dtype_name(dtype) << ")";
  return os.str();
}

namespace {
// Why a variant cannot recompute its first v.recompute hidden layers in the backward ("" where it can).
std::string recompute_problem(const MlpSpec& spec, const MlpVariant& v) {
  if (v.recompute == 0) return "";
  if (!v.fused_wgrad) return "recomputed activations need the fused weight gradients (fused_wgrad)";
  const codegen::WgradPlan plan = codegen::mlp_wgrad_plan(spec, v);
  std::ostringstream os;
  for (int l = 0; l < v.recompute; ++l) {
    const Activation& a = spec.layer_activation(l);
    if (!a.is_identity() && a.derivative_uses_x()) {
      os << "layer " << l << "'s activation '" << a.name
         << "' needs its pre-activation in the backward; it cannot be recomputed";
      return os.str();
    }
    // (the wgmma backward stores a recomputed input of an external layer to the stash for cuBLAS itself)
    if (!v.wgmma_backward && !plan.layers[l + 1].weight) {
      os << "layer " << l + 1 << "'s weight gradient does not fit the kernel's register or shared-memory budget "
         << "and is a cuBLAS GEMM over the stashed input, so layer " << l
         << "'s output cannot be recomputed; use recompute <= " << l << " or more warps";
      return os.str();
    }
  }
  return "";
}
}  // namespace

void validate_variant(const MlpSpec& spec, const MlpVariant& v) {
  spec.validate();  // the checks below index the spec's layers
  KFUSE_CHECK(v.m_tiles == 1 || v.m_tiles == 2, InvalidArgument, "MLP variant: m_tiles must be 1 or 2, got ",
              v.m_tiles);
  KFUSE_CHECK(v.warps >= 1 && v.warps <= 16, InvalidArgument, "MLP variant: warps must be in [1, 16], got ", v.warps);
  KFUSE_CHECK(v.k_chunk >= 16 && v.k_chunk % 16 == 0, InvalidArgument,
              "MLP variant: k_chunk must be a positive multiple of 16, got ", v.k_chunk);
  KFUSE_CHECK(v.recompute >= 0 && v.recompute < spec.num_layers(), InvalidArgument, "variant ", v.name(),
              ": recompute must be in [0, ", spec.num_layers() - 1, "] (the hidden layers), got ", v.recompute);
  const std::string wgb = codegen::wgmma_backward_problem(spec, v);
  KFUSE_CHECK(wgb.empty(), InvalidArgument, "variant ", v.name(), ": ", wgb);
  if (v.fused_wgrad && !v.wgmma_backward) {  // (the wgmma backward has its own accumulator budget, checked above)
    KFUSE_CHECK(v.weights_resident, InvalidArgument, "variant ", v.name(),
                ": fused weight gradients need resident weights");
    const int regs = codegen::mlp_wgrad_plan(spec, v).accumulator_floats;
    KFUSE_CHECK(regs <= codegen::kMaxWgradAccumulatorFloats, InvalidArgument, "variant ", v.name(),
                ": fused weight gradients of ", spec.to_string(), " need ", regs,
                " accumulators per thread, more than the ", codegen::kMaxWgradAccumulatorFloats,
                " that fit; use fused_wgrad = false or more warps");
  }
  const std::string rc = recompute_problem(spec, v);
  KFUSE_CHECK(rc.empty(), InvalidArgument, "variant ", v.name(), ": ", rc);
  if (v.wgmma) {
    // Streamed weights: one chain per warpgroup (two would hold four layers' accumulators at the widths that stream).
    KFUSE_CHECK(v.weights_resident || v.m_tiles == 1, InvalidArgument, "variant ", v.name(),
                ": the wgmma forward with streamed weights needs m_tiles 1, got ", v.m_tiles);
    KFUSE_CHECK(v.warps % 4 == 0, InvalidArgument, "variant ", v.name(),
                ": the wgmma forward needs whole warpgroups (warps a multiple of 4), got ", v.warps, " warps");
  }
}

std::string MlpVariant::name() const {
  std::ostringstream os;
  os << "mt" << m_tiles << "_w" << warps << (weights_resident ? "_resident" : "_stream" + std::to_string(k_chunk))
     << (fused_wgrad ? "_fw" : "") << (wgmma ? "_wg" : "");
  if (recompute > 0) os << "_rc" << recompute;
  if (wgmma_backward) os << "_wgb";
  return os.str();
}

// Shared-memory rows are padded by 8 halves (16 bytes) so that ldmatrix's eight row addresses fall into distinct
// bank groups (row strides of 16 * odd bytes).
size_t mlp_forward_smem_bytes(const MlpSpec& s, const MlpVariant& v, const MlpOptions& options) {
  if (v.wgmma)
    return static_cast<size_t>(v.weights_resident ? codegen::wgmma_forward_layout(s, v, options).smem_bytes
                                                  : codegen::wgmma_stream_layout(s, v).smem_bytes);
  size_t total = 0, chunk = 0;
  for (int l = 0; l < s.num_layers(); ++l) {
    const size_t n = s.layer_out_padded(l), k = s.layer_in_padded(l);
    total += n * (k + 8) * 2;
    chunk = std::max(chunk, n * (std::min<size_t>(v.k_chunk, k) + 8) * 2);
  }
  // The weights (or the two streaming buffers), then every warp's store staging area.
  return (v.weights_resident ? total : 2 * chunk) +
         size_t(v.warps) * size_t(codegen::forward_stage_bytes_per_warp(s, v));
}

size_t mlp_backward_smem_bytes(const MlpSpec& s, const MlpVariant& v) {
  if (v.wgmma_backward) return static_cast<size_t>(codegen::wgmma_backward_plan(s, v).smem_bytes);
  if (v.fused_wgrad) return static_cast<size_t>(codegen::mlp_wgrad_plan(s, v).smem_bytes);
  // Transposed weights: layer l as (in_padded rows) x (out_padded columns).
  size_t total = 0, chunk = 0;
  for (int l = 0; l < s.num_layers(); ++l) {
    const size_t n = s.layer_in_padded(l), k = s.layer_out_padded(l);
    total += n * (k + 8) * 2;
    chunk = std::max(chunk, n * (std::min<size_t>(v.k_chunk, k) + 8) * 2);
  }
  return v.weights_resident ? total : 2 * chunk;
}

namespace {
int max_width(const MlpSpec& s) {
  int w = 0;
  for (int l = 0; l < s.num_layers(); ++l) w = std::max({w, s.layer_in_padded(l), s.layer_out_padded(l)});
  return w;
}
bool fits(const MlpSpec& s, const MlpVariant& v, size_t smem_optin, const MlpOptions& options) {
  return std::max(mlp_forward_smem_bytes(s, v, options), mlp_backward_smem_bytes(s, v)) <= smem_optin;
}
}  // namespace

MlpVariant mlp_default_variant(const MlpSpec& spec, size_t smem_optin, bool hopper, const MlpOptions& options) {
  MlpVariant v;
  // Registers per thread hold a warp's activations: 16 * m_tiles rows x width as fp32 accumulators (width / 2 per
  // 16 rows) plus the previous layer as fp16 fragments (width / 4): two 16-row tiles fit up to width 64.
  v.m_tiles = max_width(spec) <= 64 ? 2 : 1;
  v.warps = v.m_tiles == 2 ? 4 : 8;
  v.weights_resident = fits(spec, v, smem_optin, options);
  v.k_chunk = 64;
  if (!v.weights_resident && !fits(spec, v, smem_optin, options)) v.k_chunk = 32;
  if (hopper && !v.weights_resident) {
    // Streamed weights on Hopper: the wgmma forward, whose module compiles in a sixth of the mma.sync one's time
    // (0.9 against 5.3 s at width 256); the tuner may still pick the mma.sync one, 10% faster there (3.0 against
    // 3.4 ms on H100). The widest chunks that fit.
    for (int kc : {64, 32}) {
      MlpVariant g{1, 8, false, kc};
      g.wgmma = true;
      if (fits(spec, g, smem_optin, options)) return g;
    }
  }
  // Fused weight gradients wherever they fit: with the CTA as it is, else with 8 warps to share the accumulators
  // (the same rows per warp: the forward's per-warp code stays the same), else also with one 16-row tile per warp.
  for (const auto& [m_tiles, warps] : {std::pair{v.m_tiles, v.warps}, {v.m_tiles, 8}, {1, 8}}) {
    MlpVariant f = v;
    f.m_tiles = m_tiles;
    f.warps = warps;
    if (mlp_fused_wgrad_fits(spec, f, smem_optin, options)) {
      f.fused_wgrad = true;
      return f;
    }
  }
  return v;
}

bool mlp_fused_wgrad_fits(const MlpSpec& spec, const MlpVariant& v, size_t smem_optin, const MlpOptions& options) {
  if (!v.weights_resident) return false;
  // The chain's registers beside the accumulators: with two 16-row tiles per warp, ptxas needs 240 registers at
  // width 48 (ReLU) and spills at 64; one tile leaves room (about 210 at width 64).
  if (v.m_tiles == 2 && max_width(spec) > 32) return false;
  MlpVariant f = v;
  f.fused_wgrad = true;
  return codegen::mlp_wgrad_plan(spec, f).accumulator_floats <= codegen::kMaxWgradAccumulatorFloats &&
         fits(spec, f, smem_optin, options);
}

std::vector<MlpVariant> mlp_candidate_variants(const MlpSpec& spec, size_t smem_optin, bool hopper,
                                               const MlpOptions& options) {
  std::vector<MlpVariant> out{mlp_default_variant(spec, smem_optin, hopper, options)};
  for (int mt : {1, 2})
    for (int warps : {4, 8, 16})
      for (int kc : {0, 32, 64}) {
        MlpVariant v{mt, warps, kc == 0, kc == 0 ? 64 : kc};
        if (mt == 2 && max_width(spec) > 128) continue;  // would spill registers
        // 16 warps (128 registers per thread at most): one row tile, resident weights, widths up to 64; more warps
        // per SM hide the latency of the fused backward, which runs one CTA per SM.
        if (warps == 16 && (mt == 2 || kc != 0 || max_width(spec) > 64)) continue;
        if (!fits(spec, v, smem_optin, options)) continue;
        for (bool fused : {false, true}) {
          v.fused_wgrad = fused;
          if (fused && !mlp_fused_wgrad_fits(spec, v, smem_optin, options)) continue;
          if (std::find(out.begin(), out.end(), v) == out.end()) out.push_back(v);
        }
      }
  if (hopper) {
    // The wgmma forward: whole warpgroups, resident weights; with fused weight gradients too where they fit (the
    // training step pairs its forward_train with that backward).
    for (int mt : {1, 2})
      for (int warps : {4, 8, 16}) {
        MlpVariant v{mt, warps, true, 64};
        v.wgmma = true;
        if (warps == 16 && (mt == 2 || max_width(spec) > 64)) continue;
        // Two chains hold two layers' accumulators each: past width 64 ptxas spills and serializes the wgmmas.
        if (mt == 2 && max_width(spec) > 64) continue;
        if (!fits(spec, v, smem_optin, options)) continue;
        out.push_back(v);
        if (mlp_fused_wgrad_fits(spec, v, smem_optin, options)) {
          v.fused_wgrad = true;
          out.push_back(v);
        }
      }
    // With streamed weights, where they do not all fit: one or two warpgroups per CTA, 32 or 64 columns per chunk.
    MlpVariant resident{1, 8, true, 64};
    resident.wgmma = true;
    if (!fits(spec, resident, smem_optin, options))
      for (int warps : {8, 4})
        for (int kc : {64, 32}) {
          MlpVariant v{1, warps, false, kc};
          v.wgmma = true;
          if (fits(spec, v, smem_optin, options) && std::find(out.begin(), out.end(), v) == out.end())
            out.push_back(v);
        }
  }
  // The training step with recomputed activations: two hidden layers, or all of them.
  const int hidden = spec.num_layers() - 1;
  const size_t fused_end = out.size();
  for (size_t i = 0; i < fused_end; ++i) {
    if (!out[i].fused_wgrad) continue;
    for (int r : {2, hidden}) {
      MlpVariant v = out[i];
      v.recompute = r;
      if (r < 1 || r > hidden || std::find(out.begin(), out.end(), v) != out.end()) continue;
      if (recompute_problem(spec, v).empty() && fits(spec, v, smem_optin, options)) out.push_back(v);
    }
  }
  if (hopper) {
    // The wgmma backward: one or two warpgroups per CTA, every hidden output recomputed or every one stashed.
    for (int r : {hidden, 0})
      for (int warps : {4, 8}) {
        MlpVariant v{1, warps, true, 64};
        v.fused_wgrad = v.wgmma = v.wgmma_backward = true;
        v.recompute = r;
        if (codegen::wgmma_backward_problem(spec, v).empty() && recompute_problem(spec, v).empty() &&
            fits(spec, v, smem_optin, options))
          out.push_back(v);
      }
  }
  return out;
}

}  // namespace kfuse
