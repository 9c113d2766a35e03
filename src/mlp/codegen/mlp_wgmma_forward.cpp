#include "mlp/codegen/mlp_wgmma_forward.h"

#include <cstdlib>
#include <set>
#include <string>

#include "mlp/codegen/device/device_code.h"
#include "mlp/codegen/mlp_codegen.h"

namespace kfuse::codegen {

namespace {

// One wgmma function `name` of width n. Operand numbering: the N / 2 accumulators first, then `operands` (the A
// registers or descriptor, B's descriptor), then the scale-d flag.
void write_mma_function(std::ostringstream& os, const std::string& name, int n, const std::string& params,
                        const std::string& operands, int operand_count, const std::string& flags,
                        const std::string& inputs) {
  const int regs = n / 2;
  os << "__device__ __forceinline__ void " << name << "(float (&d)[1][" << n / 8 << "][4], " << params << ") {\n"
     << "  asm volatile(\"{\\n.reg .pred p;\\nsetp.ne.b32 p, %" << regs + operand_count << ", 0;\\n\"\n"
     << "      \"wgmma.mma_async.sync.aligned.m64n" << n << "k16.f32.\" KFUSE_MMA_TYPE \".\" KFUSE_MMA_TYPE \" {";
  for (int i = 0; i < regs; ++i) os << (i ? "," : "") << "%" << i;
  os << "}, ";
  for (size_t i = 0; i < operands.size(); ++i) {  // "%N" placeholders: '#' is the next operand number
    if (operands[i] == '#') os << "%" << regs + (operands[i + 1] - '0'), ++i;
    else os << operands[i];
  }
  os << ", p, " << flags << ";\\n}\\n\"\n      : ";
  for (int i = 0; i < regs; ++i) os << (i ? ", " : "") << "\"+f\"(d[0][" << i / 4 << "][" << i % 4 << "])";
  os << "\n      : " << inputs << ");\n}\n";
}

}  // namespace

void write_wgmma_library(std::ostringstream& os, const std::set<int>& register_a, const std::set<int>& chain_ss,
                         const std::set<int>& shared_a, const std::set<int>& shared_k) {
  os << device_code::kWgmmaLibrary;
  for (int n : register_a)
    write_mma_function(os, "wgmma_mma", n, "const u32 (&a)[4], unsigned long long desc, int scale_d = 1",
                       "{#0,#1,#2,#3}, #4", 5, "1, 1, 0",
                       "\"r\"(a[0]), \"r\"(a[1]), \"r\"(a[2]), \"r\"(a[3]), \"l\"(desc), \"r\"(scale_d)");
  // A K-major and B MN-major, both in shared memory (imm-trans-a = 0, imm-trans-b = 1): the wgmma backward's chain,
  // dz_l W_l, with dz_l from its tile (no registers held while the MMAs run) and the forward's weights.
  // Or with A in registers (imm-trans-b = 1): where holding dz_l's fragments while the MMAs run costs no spills.
  for (int n : chain_ss) {
    write_mma_function(os, "wgmma_mma_chain", n, "unsigned long long desc_a, unsigned long long desc_b", "#0, #1", 2,
                       "1, 1, 0, 1", "\"l\"(desc_a), \"l\"(desc_b), \"r\"(1)");
    write_mma_function(os, "wgmma_mma_mn", n, "const u32 (&a)[4], unsigned long long desc", "{#0,#1,#2,#3}, #4", 5,
                       "1, 1, 1", "\"r\"(a[0]), \"r\"(a[1]), \"r\"(a[2]), \"r\"(a[3]), \"l\"(desc), \"r\"(1)");
  }
  // Both operands from shared memory, both MN-major (imm-trans-a = imm-trans-b = 1): the weight gradients.
  for (int n : shared_a)
    write_mma_function(os, "wgmma_mma_ss", n, "unsigned long long desc_a, unsigned long long desc_b", "#0, #1", 2,
                       "1, 1, 1, 1", "\"l\"(desc_a), \"l\"(desc_b), \"r\"(1)");
  // Both operands K-major in shared memory: the streamed forward (A = the warpgroup's x or h tile).
  for (int n : shared_k)
    write_mma_function(os, "wgmma_mma_kk", n, "unsigned long long desc_a, unsigned long long desc_b, int scale_d",
                       "#0, #1", 2, "1, 1, 0, 0", "\"l\"(desc_a), \"l\"(desc_b), \"r\"(scale_d)");
  if (!shared_k.empty()) os << device_code::kWgmmaStreamChunk;
  os << device_code::kWgmmaLayers;
}

namespace {

// The forward body's writer: the layer chains of MT row tiles per warp, interleaved so that one chain's MMAs run
// while another's epilogue does.
struct WgmmaForwardWriter {
  std::ostringstream& os;
  const MlpSpec& s;
  const MlpVariant& v;
  const MlpLayout& m;
  const WgmmaForwardLayout w;
  const int L, MT, in_p, stage_ld;
  const MlpOptions& options;
  const std::string x_copy;

  WgmmaForwardWriter(std::ostringstream& os_, const MlpSpec& s_, const MlpVariant& v_, const MlpLayout& m_,
                     const MlpOptions& options_)
      : os(os_), s(s_), v(v_), m(m_), w(wgmma_forward_layout(s_, v_, options_)), L(s_.num_layers()), MT(v_.m_tiles),
        in_p(s_.layer_in_padded(0)), stage_ld(forward_stage_ld(s_)), options(options_),
        x_copy("copy_rows_zero_fill<16 * MT, " + std::to_string(s_.input_width) + ", " + std::to_string(in_p) + ", " +
               std::to_string(w.x_tile_ld) + ", 32>(xtile, p.x, ") {}

  static std::string acc_name(int l, int c) { return "acc" + std::to_string(l) + "_" + std::to_string(c); }

  // A layer's accumulators start as its bias. They are loaded before the wait for the layer's input (the previous
  // layer's wgmma, or layer 0's x tile): that wait's memory clobber would otherwise hold the loads, and their
  // latency, between the wait and the next issue.
  // With the bias slice (w.bias_k) the first MMA of a layer sets them instead (scale-d 0, A = a ones column).
  void init(int l, int c) {
    const std::string acc = acc_name(l, c);
    os << "    float " << acc << "[1][" << s.layer_out_padded(l) / 8 << "][4];\n";
    if (!w.bias_k)
      os << "    init_acc<" << (s.has_bias(l) ? "true" : "false") << ">(" << acc << ", p.bias + " << m.bias_offset[l]
         << ", q);\n";
  }

  void issue(int l, int c) {
    os << "    wgmma_fence();\n";
    if (w.bias_k)
      os << "    wgmma_mma(" << acc_name(l, c) << ", ones_a, desc" << l << " + " << s.layer_in_padded(l) / 16 * 16
         << "ull, 0);\n";
    os << "    wgmma_layer(" << acc_name(l, c) << ", a" << l << "_" << c << ", desc" << l << ");\n"
       << "    wgmma_commit();\n";
  }

  std::string staged(int width, const std::string& acc, const std::string& out, int c) const {
    return "store_c_staged<" + std::to_string(width) + ", " + std::to_string(stage_ld) + ">(" + acc + ", " + out +
           ", row - (lane >> 2) + " + std::to_string(16 * c) + ", p.batch, stage, lane);";
  }

  // The weights into shared memory once (packed rows -> core matrices), their descriptors, the x tile and staging
  // area of each warp, the first row block's x.
  void write_prologue() {
    os << "template <bool TRAIN>\n__device__ __forceinline__ void forward_body(const FwdParams& p) {\n"
       << "  extern __shared__ __align__(128) unsigned char kfuse_smem[];\n"
       << "  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, q = lane & 3;\n"
       << "  const u32 smem = smem_addr(kfuse_smem);\n"
       << "  // the weights, once: packed rows -> core matrices\n";
    for (int l = 0; l < L; ++l) {
      const int n = s.layer_out_padded(l), k = s.layer_in_padded(l), pieces = (k + w.bias_k) / 8;
      os << "  copy_core_matrices<" << n << ", " << k << ", " << k + 8 << ", THREADS, " << pieces << ">(smem + "
         << w.weight_offset[l] << "u, p.w + " << m.fwd_weight_offset[l] << ");\n";
      if (w.bias_k)
        os << "  fill_bias_slice<" << n << ", " << pieces << ", " << k / 8 << ", THREADS>(smem + "
           << w.weight_offset[l] << "u, p.bias + " << m.bias_offset[l] << ");\n";
    }
    for (int l = 0; l < L; ++l)
      os << "  const unsigned long long desc" << l << " = wgmma_desc(smem + " << w.weight_offset[l] << "u, "
         << s.layer_in_padded(l) + w.bias_k << ");\n";
    if (w.bias_k)
      os << "  // A's ones column (k = 0 of the bias slice): rows g and g + 8 of lanes with q = 0\n"
         << "  const u32 one_lo = q == 0 ? static_cast<u32>(to_bits(1.0f)) : 0u;\n"
         << "  const u32 ones_a[4] = {one_lo, one_lo, 0u, 0u};\n";
    os << "  // the warp's x tile (its 16 * MT rows of the next row block) and store staging area\n"
       << "  const u32 xtile = smem + " << w.x_tile_offset << "u + warp * " << w.x_tile_bytes_per_warp << "u;\n"
       << "  const u32 stage = smem + " << w.stage_offset << "u + warp * " << forward_stage_bytes_per_warp(s, v)
       << "u;\n"
       << "  if (blockIdx.x < p.num_blocks) " << x_copy << "blockIdx.x * ROWS + warp * (16 * MT), p.batch, lane);\n"
       << "  cp_async_commit();\n  cp_async_wait_all();\n"
       << "  fence_async_shared();  // the bias slices (st.shared) before wgmma reads them\n  __syncthreads();\n";
  }

  // A row block's start: layer 0's accumulators, its A fragments from the x tile, the next row block's x into the
  // freed tile, layer 0's MMAs of every chain.
  void write_row_block_start() {
    os << "  for (i64 blk = blockIdx.x; blk < p.num_blocks; blk += gridDim.x) {\n"
       << "    const i64 row = blk * ROWS + warp * (16 * MT) + (lane >> 2);\n";
    for (int c = 0; c < MT; ++c) init(0, c);
    os << "    cp_async_wait_all();\n    __syncwarp();  // this row block's x tile landed\n";
    for (int c = 0; c < MT; ++c)
      os << "    u32 a0_" << c << "[1][" << in_p / 16 << "][4];\n    load_a_tile<" << w.x_tile_ld << ">(a0_" << c
         << ", xtile + " << c * 16 * w.x_tile_ld * 2 << "u, lane);\n";
    os << "    __syncwarp();  // the tile is free: the next row block's x goes into it while the chains run\n"
       << "    if (blk + gridDim.x < p.num_blocks) " << x_copy
       << "(blk + gridDim.x) * ROWS + warp * (16 * MT), p.batch, lane);\n"
       << "    cp_async_commit();\n";
    for (int c = 0; c < MT; ++c) {
      os << "    // layer 0, chain " << c << "\n";
      issue(0, c);
    }
  }

  // Layer l's epilogue for chain c: wait for its MMAs, stash, activation, then the next layer's A fragments and
  // MMAs (or the output store after the last layer).
  void write_layer_epilogue(int l, int c) {
    const int n = s.layer_out_padded(l);
    const Activation& act = s.layer_activation(l);
    const std::string acc = acc_name(l, c);
    // Groups complete in commit order; those committed after this one may stay pending: the other chains' groups
    // of this layer and of the next (none after the last layer).
    const int pending = l < L - 1 ? MT - 1 : MT - 1 - c;
    os << "    // layer " << l << " (" << s.layer_in(l) << " -> " << s.layer_out(l) << ", " << act.name << "), chain "
       << c << "\n";
    if (l < L - 1) init(l + 1, c);
    os << "    wgmma_wait<" << pending << ">();\n"
       << "    wgmma_fence_acc(" << acc << ");\n";
    if (m.stash_z_offset[l] >= 0)
      os << "    if (TRAIN) " << staged(n, acc, "p.stash + " + std::to_string(m.stash_z_offset[l]) + " * p.batch", c)
         << "\n";
    const std::string a = cat("a", l + 1, "_", c);
    // A ReLU feeding the next layer runs on the rounded 16-bit pairs (half the instructions; exact, since rounding
    // is monotone and keeps 0), unless the training forward stashes its fp32 output. Without
    // MlpOptions::packed_relu it stays in fp32 (the A/B alternative).
    const bool packed_relu = l < L - 1 && options.packed_relu && act.name == "relu" &&
                             act.expression == builtin_activation("relu").expression;
    if (packed_relu) {
      os << "    u32 " << a << "[1][" << n / 16 << "][4];\n";
      const std::string packed = cat("to_a(", acc, ", ", a, ");\n    relu_pairs(", a, ");\n");
      if (l >= v.recompute)
        os << "    if (TRAIN) {\n      apply_act<" << activation_struct_name(l) << ">(" << acc << ");\n      to_a("
           << acc << ", " << a << ");\n    } else {\n    " << packed << "    }\n";
      else
        os << "    " << packed;
      issue(l + 1, c);
    } else if (!act.is_identity()) {
      os << "    apply_act<" << activation_struct_name(l) << ">(" << acc << ");\n";
    }
    if (l == L - 1) {
      os << "    store_c<" << s.output_width << ", " << s.output_width << ">(" << acc << ", p.y, row + " << 16 * c
         << ", p.batch, q);\n";
      return;
    }
    if (!packed_relu) {
      os << "    u32 " << a << "[1][" << n / 16 << "][4];\n    to_a(" << acc << ", " << a << ");\n";
      issue(l + 1, c);
    }
    // The stash store overlaps the next layer's MMAs (none for outputs the backward recomputes).
    if (l >= v.recompute)
      os << "    if (TRAIN) " << staged(n, acc, "p.stash + " + std::to_string(m.stash_h_offset[l]) + " * p.batch", c)
         << "\n";
  }
};

}  // namespace

void write_wgmma_forward_body(std::ostringstream& os, const MlpSpec& s, const MlpVariant& v, const MlpLayout& m,
                              const MlpOptions& options) {
  WgmmaForwardWriter writer(os, s, v, m, options);
  writer.write_prologue();
  writer.write_row_block_start();
  for (int l = 0; l < writer.L; ++l)
    for (int c = 0; c < writer.MT; ++c) writer.write_layer_epilogue(l, c);
  os << "  }\n}\n";
}

}  // namespace kfuse::codegen
