// Writes the CUDA source of one fused MLP: constants for its widths, one functor per layer activation, and the
// kernels as straight-line code per layer (every size a compile-time constant, so every fragment array stays in
// registers). See mlp_codegen.h for the kernels and device/mlp_device_library.cuh for the helpers they call.
//
// Weights reach the tensor cores through shared memory in one of two ways (MlpVariant::weights_resident):
//   resident: the CTA copies all layers once and then loops over row blocks (persistent CTAs); no barrier inside
//     the loop, since each warp owns its rows from input to output;
//   streamed: the layers' weights pass through two shared buffers in chunks of k_chunk columns; the chunk sequence
//     of a row block is known here, so each chunk's code prefetches the next one (across layer boundaries, and the
//     first chunk of the next row block) while the warps multiply the current one: one barrier per chunk.
// With fused_wgrad (resident weights only) the backward kernel also accumulates the weight and bias gradients
// (WgradWriter; the split among warps in mlp_wgrad_plan.h): one barrier per layer and row block.
#include <cstdlib>
#include <set>
#include <sstream>

#include "mlp/codegen/mlp_codegen.h"
#include "mlp/codegen/mlp_layout.h"
#include "mlp/codegen/mlp_wgmma_backward.h"
#include "mlp/codegen/mlp_wgmma_forward.h"
#include "mlp/codegen/mlp_wgrad_plan.h"
#include "kfuse/error.h"

namespace kfuse::codegen {
namespace {

// One GEMM of a row block: acc (rows x n) += A (rows x k) * W^T, W stored as n rows of k (+ 8 padding) halves at
// `offset` halves of the kernel's weight region.
struct Gemm {
  int k = 0, n = 0;
  int64_t offset = 0;
};

struct Chunk {
  Gemm g;
  int k0 = 0, kc = 0;
};

class KernelWriter {
 public:
  KernelWriter(std::ostringstream& os, const MlpVariant& v, std::vector<Gemm> gemms, int64_t region_bytes)
      : os_(os), v_(v), gemms_(std::move(gemms)), region_bytes_(region_bytes) {
    for (const Gemm& g : gemms_)
      for (int k0 = 0; k0 < g.k; k0 += v_.k_chunk) chunks_.push_back({g, k0, std::min(v_.k_chunk, g.k - k0)});
    for (const Chunk& c : chunks_) buffer_bytes_ = std::max<int64_t>(buffer_bytes_, int64_t(c.g.n) * (c.kc + 8) * 2);
  }

  // Before the row-block loop: resident weights are copied once; streamed, the first chunk is requested. Then
  // `before_loop` (the kernel's own set-up).
  void prologue(const std::string& before_loop = "") {
    os_ << "  extern __shared__ __align__(16) unsigned char kfuse_smem[];\n"
        << "  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, q = lane & 3;\n"
        << "  const u32 smem = smem_addr(kfuse_smem);\n";
    if (v_.weights_resident) {
      os_ << "  copy_flat<" << region_bytes_ << ", THREADS>(smem, reinterpret_cast<const unsigned char*>(p.w));\n"
          << "  cp_async_commit();\n  cp_async_wait_all();\n  __syncthreads();\n";
    } else {
      os_ << "  " << copy_call(chunks_.front(), "smem") << "\n  cp_async_commit();\n  u32 par = 0;\n";
    }
    os_ << before_loop;
    os_ << "  for (i64 blk = blockIdx.x; blk < p.num_blocks; blk += gridDim.x) {\n"
        << "    const i64 row = blk * ROWS + warp * (16 * MT) + (lane >> 2);\n";
  }
  void epilogue() { os_ << "  }\n"; }

  // Emits GEMM number `index` (in the order given) accumulating into `acc` from the A source `src`.
  void gemm(size_t index, const std::string& acc, const std::string& src) {
    const Gemm& g = gemms_.at(index);
    os_ << "    {\n      " << src << "\n";
    if (v_.weights_resident) {
      os_ << "      mma_chunk<MT, " << g.n / 8 << ", 0, " << g.k / 16 << ", 0, " << g.k + 8 << ">(" << acc
          << ", src, smem + " << g.offset * 2 << "u, lane);\n";
    } else {
      for (; next_chunk_ < chunks_.size() && chunks_[next_chunk_].g.offset == g.offset; ++next_chunk_) {
        const Chunk& c = chunks_[next_chunk_];
        os_ << "      cp_async_wait_all();\n      __syncthreads();  // chunk landed; the other buffer is free\n";
        if (next_chunk_ + 1 < chunks_.size()) {
          os_ << "      " << copy_call(chunks_[next_chunk_ + 1], cat("smem + (par ^ 1u) * ", buffer_bytes_, "u"))
              << "\n";
        } else {
          os_ << "      if (blk + gridDim.x < p.num_blocks) "
              << copy_call(chunks_.front(), cat("smem + (par ^ 1u) * ", buffer_bytes_, "u")) << "\n";
        }
        os_ << "      cp_async_commit();\n"
            << "      mma_chunk<MT, " << g.n / 8 << ", " << c.k0 / 16 << ", " << (c.k0 + c.kc) / 16 << ", " << c.k0
            << ", " << c.kc + 8 << ">(" << acc << ", src, smem + par * " << buffer_bytes_ << "u, lane);\n"
            << "      par ^= 1u;\n";
      }
    }
    os_ << "    }\n";
  }

  int64_t smem_bytes() const { return v_.weights_resident ? region_bytes_ : 2 * buffer_bytes_; }

 private:
  std::string copy_call(const Chunk& c, const std::string& dst) const {
    std::ostringstream s;
    s << "copy_tile<" << c.g.n << ", " << c.kc << ", " << c.g.k + 8 << ", " << c.kc + 8 << ", THREADS>(" << dst
      << ", p.w + " << c.g.offset + c.k0 << ");";
    return s.str();
  }

  std::ostringstream& os_;
  const MlpVariant& v_;
  std::vector<Gemm> gemms_;
  std::vector<Chunk> chunks_;
  size_t next_chunk_ = 0;
  int64_t region_bytes_ = 0, buffer_bytes_ = 0;
};

std::string act_struct(int layer) { return activation_struct_name(layer); }

void write_activation(std::ostringstream& os, const std::string& struct_name, const Activation& a) {
  os << "// activation '" << a.name << "'\n"
     << "struct " << struct_name << " {\n"
     << "  static __device__ __forceinline__ float f(float x) { return (" << a.expression << "); }\n"
     << "  static __device__ __forceinline__ float df(float x, float y) { (void)x; (void)y; return (" << a.derivative
     << "); }\n};\n";
}

void write_pack_kernel(std::ostringstream& os, const MlpSpec& s, const MlpLayout& m) {
  os << "struct PackParams { const u16* w[" << kMaxLayers << "]; const u16* b[" << kMaxLayers
     << "]; u16* out; float* bias_out; };\n"
     << "extern \"C\" __global__ void kfuse_mlp_pack(PackParams p) {\n"
     << "  const i64 first = blockIdx.x * (i64)blockDim.x + threadIdx.x, step = (i64)gridDim.x * blockDim.x;\n"
     << "  u16* fwd = p.out;\n  u16* bwd = p.out + " << m.fwd_region_halves << ";\n";
  for (int l = 0; l < s.num_layers(); ++l) {
    const int n = s.layer_out(l), k = s.layer_in(l), np = s.layer_out_padded(l), kp = s.layer_in_padded(l);
    os << "  {  // layer " << l << ": " << k << " -> " << n << "\n"
       << "    const u16* w = p.w[" << l << "];\n"
       << "    for (i64 i = first; i < " << int64_t(np) * (kp + 8) << "; i += step) {\n"
       << "      const int r = (int)(i / " << kp + 8 << "), c = (int)(i % " << kp + 8 << ");\n"
       << "      fwd[" << m.fwd_weight_offset[l] << " + i] = (r < " << n << " && c < " << k << ") ? w[r * " << k
       << " + c] : (u16)0;\n    }\n"
       << "    for (i64 i = first; i < " << int64_t(kp) * (np + 8) << "; i += step) {\n"
       << "      const int r = (int)(i / " << np + 8 << "), c = (int)(i % " << np + 8 << ");\n"
       << "      bwd[" << m.bwd_weight_offset[l] << " + i] = (r < " << k << " && c < " << n << ") ? w[c * " << k
       << " + r] : (u16)0;\n    }\n"
       << "    for (i64 i = first; i < " << np << "; i += step)\n"
       << "      p.bias_out[" << m.bias_offset[l] << " + i] = (p.b[" << l << "] != nullptr && i < " << n
       << ") ? from_bits(p.b[" << l << "][i]) : 0.0f;\n  }\n";
  }
  os << "}\n\n";
}

// The inference forward and/or the training forward (MlpModulePart).
struct ForwardKernels {
  bool inference = true, train = true;
};

void write_forward_kernels(std::ostringstream& os, ForwardKernels k) {
  if (k.inference)
    os << "extern \"C\" __global__ void __launch_bounds__(THREADS) kfuse_mlp_forward(FwdParams p) { "
          "forward_body<false>(p); }\n";
  if (k.train)
    os << "extern \"C\" __global__ void __launch_bounds__(THREADS) kfuse_mlp_forward_train(FwdParams p) { "
          "forward_body<true>(p); }\n";
  os << "\n";
}

const char* const kFwdParams =
    "struct FwdParams { const u16* x; u16* y; const u16* w; const float* bias; u16* stash; i64 batch; "
    "i64 num_blocks; };\n\n";

void write_forward(std::ostringstream& os, const MlpSpec& s, const MlpVariant& v, const MlpLayout& m,
                   ForwardKernels kernels, const MlpOptions& options) {
  if (v.wgmma) {
    os << kFwdParams;
    if (v.weights_resident) write_wgmma_forward_body(os, s, v, m, options);
    else write_wgmma_stream_forward_body(os, s, v, m);
    write_forward_kernels(os, kernels);
    return;
  }
  const int L = s.num_layers();
  std::vector<Gemm> gemms;
  for (int l = 0; l < L; ++l)
    gemms.push_back({s.layer_in_padded(l), s.layer_out_padded(l), m.fwd_weight_offset[l]});
  KernelWriter w(os, v, gemms, m.fwd_region_halves * 2);
  // Stores go through the warp's staging area after the weights (store_c_staged).
  const int stage_ld = forward_stage_ld(s);
  // Without MlpOptions::staged_stores the fragments are written directly instead (the shared memory stays reserved
  // either way).
  const bool stage_stores = options.staged_stores;
  auto staged = [&](int width, const std::string& acc, const std::string& out) {
    if (!stage_stores) return cat("store_c<", width, ", ", width, ">(", acc, ", ", out, ", row, p.batch, q);");
    return cat("store_c_staged<", width, ", ", stage_ld, ">(", acc, ", ", out,
               ", row - (lane >> 2), p.batch, stage, lane);");
  };
  os << kFwdParams << "template <bool TRAIN>\n__device__ __forceinline__ void forward_body(const FwdParams& p) {\n";
  w.prologue();
  os << "    const u32 stage = smem + " << w.smem_bytes() << "u + warp * " << forward_stage_bytes_per_warp(s, v)
     << "u;\n";
  for (int l = 0; l < L; ++l) {
    const int n = s.layer_out_padded(l), k = s.layer_in_padded(l);
    const Activation& act = s.layer_activation(l);
    const std::string acc = cat("acc", l), nt = cat(n / 8);
    os << "    // layer " << l << ": " << s.layer_in(l) << " -> " << s.layer_out(l) << ", " << act.name << "\n"
       << "    float " << acc << "[MT][" << nt << "][4];\n"
       << "    init_acc<" << (s.has_bias(l) ? "true" : "false") << ">(" << acc << ", p.bias + " << m.bias_offset[l]
       << ", q);\n";
    const std::string src = l == 0 ? cat("const InputA<", s.input_width, "> src{p.x, row, p.batch, q};")
                                   : cat("const RegA<MT, ", k / 16, "> src{a", l, "};");
    w.gemm(l, acc, src);
    if (m.stash_z_offset[l] >= 0)
      os << "    if (TRAIN) " << staged(n, acc, cat("p.stash + ", m.stash_z_offset[l], " * p.batch")) << "\n";
    if (!act.is_identity()) os << "    apply_act<" << act_struct(l) << ">(" << acc << ");\n";
    if (l < L - 1) {
      if (l >= v.recompute)  // the backward recomputes the first v.recompute outputs
        os << "    if (TRAIN) " << staged(n, acc, cat("p.stash + ", m.stash_h_offset[l], " * p.batch")) << "\n";
      os << "    u32 a" << l + 1 << "[MT][" << n / 16 << "][4];\n"
         << "    to_a(" << acc << ", a" << l + 1 << ");\n";
    } else {  // y directly: narrow rows (16 columns in the bench) gained nothing from staging and lost 8% (measured)
      os << "    store_c<" << s.output_width << ", " << s.output_width << ">(" << acc << ", p.y, row, p.batch, q);\n";
    }
  }
  w.epilogue();
  os << "}\n";
  write_forward_kernels(os, kernels);
}

// The fused weight gradients (MlpVariant::fused_wgrad, mlp/codegen/mlp_wgrad_plan.h): what the backward kernel adds
// around its activation-gradient chain. Shared-memory tiles alternate by layer (`par`), so one barrier per layer
// both publishes a layer's tiles and frees the ones the layer before last read.
class WgradWriter {
 public:
  WgradWriter(std::ostringstream& os, const MlpSpec& s, const MlpLayout& m, const WgradPlan& plan)
      : os_(os), s_(s), m_(m), plan_(plan), rc_(plan.recompute) {}

  // Accumulators, tile addresses and the first row block's input tile of the last layer.
  std::string before_loop() const {
    std::ostringstream o;
    o << "  // fused weight gradients: the warp's dW blocks (wg) and bias partials (wb) per layer, for the CTA's life\n";
    const int L = s_.num_layers();
    for (int l = 0; l < L; ++l) {
      const WgradLayerPlan& lp = plan_.layers[l];
      if (lp.weight)
        o << "  float wg" << l << "[" << lp.out_tiles_per_warp << "][" << 2 * lp.in_pairs_per_warp << "][4];\n"
          << "  zero_acc(wg" << l << ");\n";
      o << "  float wb" << l << "[" << lp.out_tiles_per_warp << "][4] = {};\n";
    }
    o << "  const u32 dz_tiles = smem + " << plan_.dz_tile_offset << "u, h_tiles = smem + " << plan_.h_tile_offset
      << "u;\n"
      << "  const int trow = warp * (16 * MT) + (lane >> 2);  // the lane's first row inside a row block's tiles\n"
      << "  u32 par = 0;\n";
    if (rc_ > 0)  // the recomputed layers' forward weights: the packed buffer's forward region precedes p.w
      o << "  copy_flat<" << plan_.fwd_weight_bytes << ", THREADS>(smem + " << plan_.fwd_weight_smem_offset
        << "u, reinterpret_cast<const unsigned char*>(p.w) - " << m_.bwd_region_byte_offset << ");\n"
        << "  cp_async_commit();\n  cp_async_wait_all();\n  __syncthreads();\n";
    if (plan_.layers[L - 1].weight && !recomputed_input(L - 1))
      o << "  if (blockIdx.x < p.num_blocks) " << input_tile_copy(L - 1, "h_tiles", "blockIdx.x * ROWS") << "\n";
    o << "  cp_async_commit();\n";
    return o.str();
  }

  // Layer l's dz (the A fragments `d`) into this layer's dz tile, then the barrier, the next layer's input tile
  // requested, and this layer's dW and db accumulated.
  void layer(int l, const std::string& d) const {
    const WgradLayerPlan& lp = plan_.layers[l];
    const int out_p = s_.layer_out_padded(l), in_p = s_.layer_in_padded(l);
    os_ << "    store_a_shared<" << out_p + 8 << ">(" << dz_tile("par") << ", " << d << ", trow, row, p.batch, q);\n"
        << "    cp_async_wait_all();\n"
        << "    __syncthreads();  // this layer's tiles complete; the other buffers' readers done\n";
    const int L = s_.num_layers();
    if (l > 0) {
      if (plan_.layers[l - 1].weight && !recomputed_input(l - 1))
        os_ << "    " << input_tile_copy(l - 1, h_tile("par ^ 1u"), "blk * ROWS") << "\n";
    } else if (plan_.layers[L - 1].weight && !recomputed_input(L - 1)) {
      os_ << "    if (blk + gridDim.x < p.num_blocks) "
          << input_tile_copy(L - 1, h_tile("par ^ 1u"), "(blk + gridDim.x) * ROWS") << "\n";
    }
    os_ << "    cp_async_commit();\n";
    if (lp.weight) {
      os_ << "    wgrad_accumulate<" << lp.out_tiles_per_warp << ", " << lp.in_pairs_per_warp << ", " << lp.warps_out
          << ", " << lp.warps_in << ", " << lp.out_tiles << ", " << lp.in_pairs << ", " << plan_.k_steps << ", "
          << out_p + 8 << ", " << in_p + 8 << ", " << (lp.bias ? "true" : "false") << ">(wg" << l << ", wb" << l
          << ", " << dz_tile("par") << ", " << (recomputed_input(l) ? rc_tile(l - 1) : h_tile("par"))
          << ", warp, lane);\n";
    } else if (lp.bias) {
      os_ << "    bias_accumulate<" << lp.out_tiles_per_warp << ", " << lp.warps_out << ", " << lp.warps_in << ", "
          << lp.out_tiles << ", " << plan_.k_steps << ", " << out_p + 8 << ">(wb" << l << ", " << dz_tile("par")
          << ", warp, lane);\n";
    }
    os_ << "    par ^= 1u;\n";
  }

  // Whether layer l's own weight gradient is accumulated here (else its dz goes to the workspace for cuBLAS).
  bool weight_inside(int l) const { return plan_.layers[l].weight; }

  // Layer l's activation output h_l for its derivative: the input tile of layer l + 1 (requested one layer ahead;
  // the barrier of layer l + 1 made it complete, and it is not overwritten before the barrier of layer l). Only
  // where layer l + 1's weight gradient is accumulated here (its input tile is loaded).
  // A recomputed output is in its own tile (written by this warp for its rows).
  bool has_stored_output(int l) const { return l < rc_ || plan_.layers[l + 1].weight; }
  std::string stored_output(int l, const std::string& dst) const {
    return cat("load_c_shared<", s_.layer_out_padded(l) + 8, ">(", dst, ", ", l < rc_ ? rc_tile(l) : h_tile("par ^ 1u"),
               ", trow, q);");
  }

  // MlpVariant::recompute, at the start of a row block: this warp's rows of h_0 .. h_{rc-1} from x through the
  // resident forward weights, each into its tile (zero rows beyond the batch, as the stash copies would be). A lane's
  // derivative reads (load_c_shared) get back exactly the values it stored; other warps read the tiles only after
  // the next layer barrier, and the last reads of a row block's tiles (layer 1's weight gradient, layer 0's
  // derivative) come before its last barrier, so one row block's recompute never overwrites what another warp still
  // reads. The mma.sync chain here may round h differently from a wgmma forward (other summation order): the
  // backward then differentiates its own recomputed h, within the storage rounding.
  void recompute() const {
    if (rc_ == 0) return;
    const int64_t bias_delta = m_.bias_byte_offset - m_.bwd_region_byte_offset;
    os_ << "    {  // recompute the first " << rc_ << " hidden outputs (not stashed)\n"
        << "      const float* fwd_bias = reinterpret_cast<const float*>(reinterpret_cast<const unsigned char*>(p.w) + "
        << bias_delta << ");\n";
    for (int l = 0; l < rc_; ++l) {
      const int n = s_.layer_out_padded(l), k = s_.layer_in_padded(l);
      const std::string acc = cat("rz", l);
      os_ << "      float " << acc << "[MT][" << n / 8 << "][4];\n"
          << "      init_acc<" << (s_.has_bias(l) ? "true" : "false") << ">(" << acc << ", fwd_bias + "
          << m_.bias_offset[l] << ", q);\n      {\n        "
          << (l == 0 ? cat("const InputA<", s_.input_width, "> src{p.x, row, p.batch, q};")
                     : cat("const RegA<MT, ", k / 16, "> src{ra", l, "};"))
          << "\n        mma_chunk<MT, " << n / 8 << ", 0, " << k / 16 << ", 0, " << k + 8 << ">(" << acc
          << ", src, smem + " << plan_.fwd_weight_smem_offset + m_.fwd_weight_offset[l] * 2 << "u, lane);\n      }\n";
      const Activation& act = s_.layer_activation(l);
      if (!act.is_identity()) os_ << "      apply_act<" << act_struct(l) << ">(" << acc << ");\n";
      os_ << "      u32 ra" << l + 1 << "[MT][" << n / 16 << "][4];\n"
          << "      to_a(" << acc << ", ra" << l + 1 << ");\n"
          << "      store_a_shared<" << n + 8 << ">(" << rc_tile(l) << ", ra" << l + 1
          << ", trow, row, p.batch, q);\n";
    }
    os_ << "    }\n";
  }

  // After the row-block loop: every CTA writes its partial gradient vector.
  void after_loop() const {
    os_ << "  // the CTA's partial gradients: weights straight from the registers, biases through shared memory\n"
        << "  cp_async_wait_all();\n"
        << "  __syncthreads();  // tiles and weights dead: the bias scratch reuses shared memory\n"
        << "  float* partial = p.partials + (i64)blockIdx.x * " << plan_.partial_stride_floats << ";\n"
        << "  float* scratch = reinterpret_cast<float*>(kfuse_smem);\n";
    for (int l = 0; l < s_.num_layers(); ++l) {
      const WgradLayerPlan& lp = plan_.layers[l];
      if (lp.weight)
        os_ << "  store_wgrad_partial<" << lp.out_tiles_per_warp << ", " << lp.in_pairs_per_warp << ", "
            << lp.warps_out << ", " << lp.warps_in << ", " << s_.layer_out(l) << ", " << s_.layer_in(l) << ">(wg" << l
            << ", partial + " << plan_.grad_weight_offset[l] << ", warp, lane);\n";
      if (lp.bias)
        os_ << "  store_bias_partial<" << lp.out_tiles_per_warp << ", " << lp.warps_out << ", " << lp.warps_in << ", "
            << lp.out_tiles << ", " << s_.layer_out_padded(l) << ">(wb" << l << ", scratch + "
            << plan_.bias_scratch_offset[l] << ", warp, lane);\n";
    }
    os_ << "  __syncthreads();\n";
    for (int l = 0; l < s_.num_layers(); ++l)
      if (plan_.layers[l].bias)
        os_ << "  sum_bias_partials<" << s_.layer_out(l) << ", " << s_.layer_out_padded(l) << ", "
            << plan_.layers[l].warps_in << ", THREADS>(scratch + " << plan_.bias_scratch_offset[l] << ", partial + "
            << plan_.grad_bias_offset[l] << ");\n";
  }

 private:
  std::string dz_tile(const std::string& parity) const {
    return cat("dz_tiles + (", parity, ") * ", plan_.dz_tile_bytes, "u");
  }
  std::string h_tile(const std::string& parity) const {
    return cat("h_tiles + (", parity, ") * ", plan_.h_tile_bytes, "u");
  }
  std::string rc_tile(int l) const { return cat("smem + ", plan_.rc_tile_offset + l * plan_.rc_tile_bytes, "u"); }
  bool recomputed_input(int l) const { return plan_.recomputed_input(l); }
  // Layer l's input (x, or the stashed output of layer l - 1) for the rows from `row0` into the tile at `dst`.
  std::string input_tile_copy(int l, const std::string& dst, const std::string& row0) const {
    const int in_p = s_.layer_in_padded(l);
    if (l == 0)
      return cat("copy_rows_zero_fill<ROWS, ", s_.input_width, ", ", in_p, ", ", in_p + 8, ", THREADS>(", dst,
                 ", p.x, ", row0, ", p.batch, threadIdx.x);");
    return cat("copy_rows_zero_fill<ROWS, ", in_p, ", ", in_p, ", ", in_p + 8, ", THREADS>(", dst, ", p.stash + ",
               m_.stash_h_offset[l - 1], " * p.batch, ", row0, ", p.batch, threadIdx.x);");
  }

  std::ostringstream& os_;
  const MlpSpec& s_;
  const MlpLayout& m_;
  const WgradPlan& plan_;
  int rc_ = 0;
};

void write_backward(std::ostringstream& os, const MlpSpec& s, const MlpVariant& v, const MlpLayout& m, bool dx) {
  if (v.wgmma_backward) {
    write_wgmma_backward(os, s, v, m, mlp_wgrad_plan(s, v), dx);
    return;
  }
  const int L = s.num_layers();
  std::vector<Gemm> gemms;  // layer l's transpose: k = out_padded(l), n = in_padded(l)
  for (int l = L - 1; l >= (dx ? 0 : 1); --l)
    gemms.push_back({s.layer_out_padded(l), s.layer_in_padded(l), m.bwd_weight_offset[l]});
  KernelWriter w(os, v, gemms, m.bwd_region_halves * 2);
  const WgradPlan plan = v.fused_wgrad ? mlp_wgrad_plan(s, v) : WgradPlan{};
  const WgradWriter wg(os, s, m, plan);
  const std::string name = dx ? "kfuse_mlp_backward_dx" : "kfuse_mlp_backward";
  os << "extern \"C\" __global__ void __launch_bounds__(THREADS) " << name << "(BwdParams p) {\n";
  w.prologue(v.fused_wgrad ? wg.before_loop() : "");
  wg.recompute();
  const int out_nt = s.layer_out_padded(L - 1) / 8;
  os << "    float g" << L - 1 << "[MT][" << out_nt << "][4];\n"
     << "    load_c<" << s.output_width << ", " << s.output_width << ">(g" << L - 1 << ", p.dy, row, p.batch, q);\n";
  size_t gemm_index = 0;
  for (int l = L - 1; l >= 0; --l) {
    const int n = s.layer_out_padded(l), k = s.layer_in_padded(l);
    const std::string g = cat("g", l), nt = cat(n / 8), d = cat("d", l);
    const Activation& act = s.layer_activation(l);
    os << "    // layer " << l << " (" << s.layer_in(l) << " -> " << s.layer_out(l) << ", " << act.name
       << "): dz = dL/dh * f'\n";
    if (!act.is_identity()) {
      if (m.stash_z_offset[l] >= 0) {
        os << "    {\n      float t[MT][" << nt << "][4];\n      load_c<" << n << ", " << n << ">(t, p.stash + "
           << m.stash_z_offset[l] << " * p.batch, row, p.batch, q);\n      dact_from_x<" << act_struct(l) << ">("
           << g << ", t);\n    }\n";
      } else if (act.derivative_uses_y()) {
        os << "    {\n      float t[MT][" << nt << "][4];\n";
        if (l == L - 1)
          os << "      load_c<" << s.output_width << ", " << s.output_width << ">(t, p.y, row, p.batch, q);\n";
        else if (v.fused_wgrad && wg.has_stored_output(l))
          os << "      " << wg.stored_output(l, "t") << "\n";
        else
          os << "      load_c<" << n << ", " << n << ">(t, p.stash + " << m.stash_h_offset[l]
             << " * p.batch, row, p.batch, q);\n";
        os << "      dact_from_y<" << act_struct(l) << ">(" << g << ", t);\n    }\n";
      } else {
        os << "    dact_const<" << act_struct(l) << ">(" << g << ");\n";
      }
      // The padding columns of a narrow output layer must stay exactly zero whatever f'(0) is.
      if (l == L - 1 && s.output_width % 16 != 0) os << "    mask_columns<" << s.output_width << ">(" << g << ", q);\n";
    }
    const bool chain_goes_on = l > 0 || dx;
    if (v.fused_wgrad) {
      if (!wg.weight_inside(l))  // cuBLAS makes dW_l from it
        os << "    store_c<" << n << ", " << n << ">(" << g << ", p.dz + " << m.dz_offset[l]
           << " * p.batch, row, p.batch, q);\n";
      os << "    u32 " << d << "[MT][" << n / 16 << "][4];\n    to_a(" << g << ", " << d << ");\n";
      wg.layer(l, d);
    } else {
      os << "    store_c<" << n << ", " << n << ">(" << g << ", p.dz + " << m.dz_offset[l]
         << " * p.batch, row, p.batch, q);\n";
      if (chain_goes_on) os << "    u32 " << d << "[MT][" << n / 16 << "][4];\n    to_a(" << g << ", " << d << ");\n";
    }
    if (!chain_goes_on) break;
    const std::string next = l > 0 ? cat("g", l - 1) : std::string("gx");
    os << "    float " << next << "[MT][" << k / 8 << "][4];\n    zero_acc(" << next << ");\n";
    w.gemm(gemm_index++, next, cat("const RegA<MT, ", n / 16, "> src{", d, "};"));
    if (l == 0)
      os << "    store_c<" << s.input_width << ", " << s.input_width << ">(gx, p.dx, row, p.batch, q);\n";
  }
  w.epilogue();
  if (v.fused_wgrad) wg.after_loop();
  os << "}\n\n";
}

// Sums the CTAs' partial gradient vectors (fused_wgrad) in CTA order. A CTA of 256 threads owns 32 consecutive
// gradient entries; its 8 warps read every 8th partial (coalesced 128-byte rows) and add their sums in warp order.
void write_wgrad_reduce(std::ostringstream& os, const MlpSpec& spec, const WgradPlan& plan) {
  // Entries of weight gradients made outside the kernel (cuBLAS writes them after this kernel) are skipped.
  std::ostringstream inside;
  inside << "i < " << plan.grad_floats;
  for (int l = 0; l < spec.num_layers(); ++l)
    if (!plan.layers[l].weight)
      inside << " && !(i >= " << plan.grad_weight_offset[l] << " && i < "
             << plan.grad_weight_offset[l] + int64_t(spec.layer_out(l)) * spec.layer_in(l) << ")";
  os << "struct ReduceParams { const float* partials; void* grads; int slices; int grads_16bit; };\n"
     << "extern \"C\" __global__ void __launch_bounds__(256) kfuse_mlp_wgrad_reduce(ReduceParams p) {\n"
     << "  __shared__ float sums[8][33];\n"
     << "  const int c = threadIdx.x & 31, w = threadIdx.x >> 5;\n"
     << "  const i64 i = (i64)blockIdx.x * 32 + c;\n"
     << "  const bool inside = " << inside.str() << ";\n"
     << "  float s = 0.0f;\n"
     << "  if (inside)\n"
     << "#pragma unroll 4\n"
     << "    for (int k = w; k < p.slices; k += 8) s += p.partials[(i64)k * " << plan.partial_stride_floats
     << " + i];\n"
     << "  sums[w][c] = s;\n"
     << "  __syncthreads();\n"
     << "  if (w == 0 && inside) {\n"
     << "    float t = 0.0f;\n"
     << "#pragma unroll\n"
     << "    for (int k = 0; k < 8; ++k) t += sums[k][c];\n"
     << "    if (p.grads_16bit) static_cast<u16*>(p.grads)[i] = to_bits(t);\n"
     << "    else static_cast<float*>(p.grads)[i] = t;\n"
     << "  }\n"
     << "}\n\n";
}

}  // namespace

std::string generate_mlp_source(const MlpSpec& spec, const MlpVariant& variant, MlpModulePart part,
                                const MlpOptions& options) {
  spec.validate();
  validate_variant(spec, variant);
  const MlpLayout m = mlp_layout(spec);
  std::ostringstream os;
  // Both parts hold the forward body (the inference kernel, the training one); the training part the backward.
  const bool inference = part != MlpModulePart::kTraining, bwd = part != MlpModulePart::kForward;
  os << "// kfuse fused MLP: " << spec.to_string() << ", variant " << variant.name()
     << (part == MlpModulePart::kForward ? ", forward" : part == MlpModulePart::kTraining ? ", training" : "")
     << " (generated)\n"
     << "#define KFUSE_BF16 " << (spec.dtype == MlpDType::kBFloat16 ? 1 : 0) << "\n"
     << mlp_device_library() << "\n";
  // sm_90a only: the wgmma forward's part, and the backward part of a wgmma-backward variant.
  std::set<int> register_a, chain_ss, shared_a, shared_k;
  if (variant.wgmma)
    for (int l = 0; l < spec.num_layers(); ++l)
      (variant.weights_resident ? register_a : shared_k).insert(spec.layer_out_padded(l));
  if (bwd && variant.wgmma_backward)
    wgmma_backward_widths(spec, wgmma_backward_plan(spec, variant), register_a, chain_ss, shared_a);
  if (!register_a.empty() || !chain_ss.empty() || !shared_a.empty() || !shared_k.empty())
    write_wgmma_library(os, register_a, chain_ss, shared_a, shared_k);
  os << "constexpr int MT = " << variant.m_tiles << ";\n"
     << "constexpr int WARPS = " << variant.warps << ";\n"
     << "constexpr int THREADS = WARPS * 32;\n"
     << "constexpr int ROWS = WARPS * 16 * MT;\n\n";
  for (int l = 0; l < spec.num_layers(); ++l) write_activation(os, act_struct(l), spec.layer_activation(l));
  os << "\n";
  if (inference) write_pack_kernel(os, spec, m);
  write_forward(os, spec, variant, m, ForwardKernels{inference, bwd}, options);
  if (bwd) {
    os << "struct BwdParams { const u16* dy; const u16* y; const u16* stash; const u16* w; u16* dz; u16* dx; "
          "const u16* x; float* partials; i64 batch; i64 num_blocks; };\n\n";
    write_backward(os, spec, variant, m, false);
    write_backward(os, spec, variant, m, true);
    if (variant.fused_wgrad) write_wgrad_reduce(os, spec, mlp_wgrad_plan(spec, variant));
  }
  return os.str();
}

std::string activation_probe_source(const Activation& a) {
  std::ostringstream os;
  os << "// kfuse activation probe\n";
  write_activation(os, "Probe", a);
  os << "extern \"C\" __global__ void kfuse_probe(float* v) {\n"
     << "  const float x = v[threadIdx.x];\n"
     << "  v[threadIdx.x] = Probe::f(x) + Probe::df(x, Probe::f(x));\n}\n";
  return os.str();
}

}  // namespace kfuse::codegen
