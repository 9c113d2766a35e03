// The wgmma forward with streamed weights (MlpVariant::wgmma without weights_resident), for networks whose weights
// do not fit in shared memory (width 256: 418 KB). Each warpgroup runs one 64-row chain with its activations in
// registers, as the resident wgmma forward does; the weights pass through `stages` shared buffers one chunk at a
// time (wgmma_stream_layout), every warpgroup of the CTA multiplying the same chunk.
//
// Per chunk g: wait for its cp.async group, make it visible to wgmma (fence.proxy.async), one __syncthreads; request
// chunk g + lookahead into the stage chunk g - 2 held (every thread waited for chunk g - 2's MMAs before the
// barrier); issue the chunk's K = 16 slices; wait until only this chunk's MMAs are pending. The tensor cores so
// always hold the current chunk and the one after it is issued behind it at the next barrier.
//
// Why beside the mma.sync streamed kernel: its straight-line code for 16 unrolled 64-column chunks per row block
// took NVRTC 5.3 s at width 256 (a wgmma multiplies 64 x 256 x 16 per instruction, mma.sync 16 x 8 x 16); this
// one's forward module takes 0.9 s, so it is the default on Hopper. Both are bound by L2 (the weights per row
// block); at width 256 the tuner still picks the mma.sync one, 3.0 against 3.4 ms (H100).
#include <algorithm>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "mlp/codegen/mlp_codegen.h"
#include "mlp/codegen/mlp_layout.h"
#include "mlp/codegen/mlp_wgmma_forward.h"

namespace kfuse::codegen {

namespace {

// Consecutive hidden layers of one shape (widths, activation, bias, stashed pre-activation) run as one loop over
// `count` layers (`r` at run time): their weights, biases and stash arrays are equally far apart. The code of a
// 256 x 256 layer costs NVRTC about 0.5 s, so the bench's network compiles its three hidden layers once.
// Layer 0 (A = the x tile) and the output layer (y) are segments of their own.
struct Segment {
  int first = 0, count = 1;
  std::vector<WgmmaStreamChunk> chunks;  // of one layer
};

std::vector<Segment> segments(const MlpSpec& s, const WgmmaStreamLayout& w) {
  const int L = s.num_layers();
  auto chunks_of = [&](int l) {
    std::vector<WgmmaStreamChunk> out;
    for (const WgmmaStreamChunk& c : w.chunks)
      if (c.layer == l) out.push_back(c);
    return out;
  };
  auto same_shape = [&](int a, int b) {
    const Activation &x = s.layer_activation(a), &y = s.layer_activation(b);
    return s.layer_in_padded(a) == s.layer_in_padded(b) && s.layer_out_padded(a) == s.layer_out_padded(b) &&
           x.name == y.name && x.expression == y.expression && x.derivative == y.derivative &&
           s.has_bias(a) == s.has_bias(b);
  };
  std::vector<Segment> out;
  for (int l = 0; l < L; ++l) {
    if (!out.empty()) {
      Segment& g = out.back();
      // (a loop needs the chunk La ahead to lie at most in the next layer: chunks per layer >= La)
      if (g.first >= 1 && l < L - 1 && same_shape(g.first, l) && static_cast<int>(g.chunks.size()) >= w.lookahead) {
        ++g.count;
        continue;
      }
    }
    out.push_back({l, 1, chunks_of(l)});
  }
  return out;
}

// The forward body's writer: the chunk sequence of a row block, segment by segment, each chunk's code requesting
// the one La chunks ahead.
class WgmmaStreamForwardWriter {
 public:
  WgmmaStreamForwardWriter(std::ostringstream& os, const MlpSpec& s, const MlpVariant& v, const MlpLayout& m)
      : os_(os), s_(s), m_(m), w_(wgmma_stream_layout(s, v)), segs_(segments(s, w_)), L_(s.num_layers()),
        C_(static_cast<int>(w_.chunks.size())), La_(w_.lookahead), S_(w_.stages), in_p_(s.layer_in_padded(0)) {
    // Flat positions of a row block's chunk sequence: segment g's layer r, chunk j at start[g] + r * size + j.
    for (int g = 0, at = 0; g < static_cast<int>(segs_.size()); ++g) {
      start_.push_back(at);
      at += segs_[g].count * static_cast<int>(segs_[g].chunks.size());
    }
    // The next row block's x goes into the x tile once layer 0's MMAs are done with it: with the first request of
    // layer 1 (an MLP has two layers at least). Its group must have landed at the next row block's first chunk,
    // where the wait leaves La - 1 groups pending: fewer if fewer were committed after it.
    x_chunk_ = start_.at(1);
    first_wait_ = std::min(La_ - 1, C_ - 1 - x_chunk_);
  }

  int segment_count() const { return static_cast<int>(segs_.size()); }

  // The tiles, the first row block's x and first La weight chunks, the accumulators.
  void write_prologue() {
    os_ << "template <bool TRAIN>\n__device__ __forceinline__ void forward_body(const FwdParams& p) {\n"
        << "  extern __shared__ __align__(128) unsigned char kfuse_smem[];\n"
        << "  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, q = lane & 3, wr = (warp & 3) * 16;\n"
        << "  const u32 smem = smem_addr(kfuse_smem);\n"
        << "  // the warpgroup's x and h tiles (the warp's rows from wr)\n"
        << "  const u32 xtile = smem + " << w_.x_tile_offset << "u + (warp >> 2) * " << w_.x_tile_bytes << "u;\n"
        << "  const u32 htile = smem + " << w_.h_tile_offset << "u + (warp >> 2) * " << w_.h_tile_bytes << "u;\n"
        << "  // the first row block's x and its first " << La_ << " weight chunks, one cp.async group each\n"
        << "  if (blockIdx.x < p.num_blocks) {\n"
        << "    " << x_copy("blockIdx.x") << "\n";
    for (int j = 0; j < La_; ++j) {
      if (j > 0) os_ << "  if (blockIdx.x < p.num_blocks) {\n";
      os_ << "    " << copy_flat(j, cat(j, "u")) << "\n  }\n  cp_async_commit();\n";
    }
    std::set<int> widths;
    for (int l = 0; l < L_; ++l) widths.insert(s_.layer_out_padded(l));
    for (int n : widths) os_ << "  float acc" << n << "[1][" << n / 8 << "][4];\n";
  }

  void write_row_block_start() {
    os_ << "  u32 st = 0;  // the current chunk's stage\n"
        << "  for (i64 blk = blockIdx.x; blk < p.num_blocks; blk += gridDim.x) {\n"
        << "    const i64 row = blk * ROWS + warp * 16 + (lane >> 2);\n"
        << "    const bool more = blk + gridDim.x < p.num_blocks;\n";
  }

  // Segment gi's chunks: straight-line code for one layer, or a loop over its layers.
  void write_segment(int gi) {
    const Segment& g = segs_[gi];
    const int l = g.first;
    const bool loop = g.count > 1;
    os_ << "    // layer" << (loop ? cat("s ", l, " .. ", l + g.count - 1) : cat(" ", l)) << " (" << s_.layer_in(l)
        << " -> " << s_.layer_out(l) << ")\n";
    if (loop) os_ << "#pragma unroll 1\n    for (int r = 0; r < " << g.count << "; ++r) {\n";
    for (int j = 0; j < static_cast<int>(g.chunks.size()); ++j) write_chunk(gi, j);
    if (loop) os_ << "    }\n";
  }

  void write_row_block_end() { os_ << "  }\n}\n"; }

 private:
  // Chunk j of segment gi's layer: the barrier that completes it, the request of the chunk La ahead, its MMAs, and
  // after the layer's last chunk the epilogue.
  void write_chunk(int gi, int j) {
    const Segment& g = segs_[gi];
    const WgmmaStreamChunk& c = g.chunks[j];
    const int l = g.first, k = s_.layer_in_padded(l);
    const bool loop = g.count > 1;
    const int pos = start_[gi] + j;  // (of the segment's first layer)
    os_ << "    // columns " << c.k0 << " .. " << c.k0 + c.kc << "\n"
        << "    cp_async_wait_group<" << (pos == 0 ? first_wait_ : La_ - 1) << ">();\n"
        << "    fence_async_shared();  // the chunk (cp.async) and the tiles (st.shared) to wgmma's reads\n"
        << "    __syncthreads();  // the chunk and the A tile are complete; the stage of two chunks back is free\n";
    if (pos == x_chunk_)
      os_ << "    if (" << (loop ? "r == 0 && " : "") << "more) " << x_copy("(blk + gridDim.x)") << "\n";
    write_request(gi, j);
    os_ << "    wgmma_fence();\n"
        << "    wgmma_chunk_ss<" << c.k0 / 16 << ", " << (c.k0 + c.kc) / 16 << ">(" << acc_name(l)
        << ", wgmma_desc(" << (l == 0 ? "xtile" : "htile") << ", " << k << "), wgmma_desc(smem + st * "
        << w_.stage_bytes << "u, " << c.kc << "));\n"
        << "    wgmma_commit();\n"
        << "    st = st + 1u == " << S_ << "u ? 0u : st + 1u;\n";
    if (c.k0 + c.kc < k) {
      os_ << "    wgmma_wait<1>();\n";
    } else {
      os_ << "    wgmma_wait<0>();\n    wgmma_fence_acc(" << acc_name(l) << ");\n";
      epilogue(g, loop ? "r" : "");
    }
  }

  // The request of the chunk La after chunk j of segment gi's layer, into the stage it frees.
  void write_request(int gi, int j) {
    const Segment& g = segs_[gi];
    const int size = static_cast<int>(g.chunks.size());
    os_ << "    {\n      const u32 rq = st + " << La_ << "u < " << S_ << "u ? st + " << La_ << "u : st - " << S_ - La_
        << "u;\n";
    if (g.count == 1) {
      os_ << "      " << copy_flat(start_[gi] + j + La_, "rq") << "\n";
    } else if (j + La_ < size) {
      os_ << "      " << copy_chunk(g, "r", j + La_, "rq") << "\n";
    } else {  // in the segment's next layer, or past the segment
      const int t = j + La_ - size;
      os_ << "      if (r + 1 < " << g.count << ") " << copy_chunk(g, "r + 1", t, "rq") << "\n"
          << "      else {\n        " << copy_flat(start_[gi] + g.count * size + t, "rq") << "\n      }\n";
    }
    os_ << "    }\n    cp_async_commit();\n";
  }

  // Distances between consecutive layers of a segment (halves of the packed weights, floats of the biases, stash
  // elements per row), and the expressions of layer first + r.
  int64_t weight_stride(const Segment& g) const {
    return g.count > 1 ? m_.fwd_weight_offset[g.first + 1] - m_.fwd_weight_offset[g.first] : 0;
  }
  static std::string plus_r(int64_t base, int64_t stride, const std::string& r) {
    return stride == 0 || r.empty() ? std::to_string(base) : cat(base, " + ", r, " * ", stride);
  }
  // The copy of chunk j of segment g's layer `r` (an expression: a run-time index, or a number) into `stage`.
  std::string copy_chunk(const Segment& g, const std::string& r, int j, const std::string& stage) const {
    const WgmmaStreamChunk& c = g.chunks.at(j);
    const int l = g.first;
    return cat("copy_chunk_core_matrices<", s_.layer_out_padded(l), ", ", c.kc, ", ", s_.layer_in_padded(l) + 8,
               ", THREADS, ", m_.fwd_weight_offset[l] + c.k0, ">(smem + ", stage, " * ", w_.stage_bytes, "u, p.w, ",
               r.empty() || r == "0" || weight_stride(g) == 0 ? "0" : cat("(", r, ") * ", weight_stride(g)), ");");
  }
  // The copy of the chunk at flat position `pos` (known here), the next row block's beyond the last.
  std::string copy_flat(int pos, const std::string& stage) const {
    const bool next_block = pos >= C_;
    if (next_block) pos -= C_;
    int g = static_cast<int>(segs_.size()) - 1;
    while (start_[g] > pos) --g;
    const int size = static_cast<int>(segs_[g].chunks.size()), r = (pos - start_[g]) / size;
    return std::string(next_block ? "if (more) " : "") +
           copy_chunk(segs_[g], segs_[g].count > 1 ? std::to_string(r) : "", (pos - start_[g]) % size, stage);
  }
  std::string x_copy(const std::string& block) const {
    return cat("copy_rows_zero_fill<16, ", s_.input_width, ", ", in_p_, ", 0, 32, ", in_p_ / 8,
               ">(xtile + wr / 8 * ", in_p_ / 8 * 128, "u, p.x, ", block, " * ROWS + warp * 16, p.batch, lane);");
  }
  // One accumulator array per layer width, declared before the row-block loop: a layer's first MMA overwrites it
  // (scale-d 0) and its epilogue adds the bias. (Accumulators of the next layer set to its bias in the epilogue let
  // ptxas load the bias early and hold two 256-wide layers' accumulators at once: it spilled and serialized the
  // MMAs.)
  std::string acc_name(int l) const { return cat("acc", s_.layer_out_padded(l)); }
  // A layer's output through the warp's rows of the h tile: the next layer's A operand, and in the training
  // forward the stash rows (whole 16-byte units per lane).
  void to_tile(int l, const std::string& indent) {
    os_ << indent << "store_c_units<" << s_.layer_out_padded(l) / 8 << ">(htile, " << acc_name(l)
        << ", wr, lane);\n";
  }
  void tile_out(int l, const std::string& offset, const std::string& indent) {
    const int n = s_.layer_out_padded(l);
    os_ << indent << "__syncwarp();\n"
        << indent << "copy_units_out<" << n / 8 << ", " << n / 8 << ", " << n << ">(p.stash + (" << offset
        << ") * p.batch, htile, wr, blk * ROWS + warp * 16, p.batch, lane);\n"
        << indent << "__syncwarp();\n";
  }
  // After the last chunk of segment g's layer r (its MMAs done): the bias, the stash, the activation, the next
  // layer's A.
  void epilogue(const Segment& g, const std::string& r) {
    const int l = g.first;
    const Activation& act = s_.layer_activation(l);
    const std::string acc = acc_name(l);
    const int64_t n = s_.layer_out_padded(l);
    if (s_.has_bias(l))
      os_ << "    add_bias(" << acc << ", p.bias + " << plus_r(m_.bias_offset[l], n, r) << ", q);\n";
    // (the stash arrays of consecutive layers of one shape are equally far apart)
    const int64_t stash_stride = g.count > 1 ? m_.stash_h_offset[l + 1] - m_.stash_h_offset[l] : 0;
    if (m_.stash_z_offset[l] >= 0) {
      os_ << "    if (TRAIN) {\n";
      to_tile(l, "      ");
      tile_out(l, plus_r(m_.stash_z_offset[l], stash_stride, r), "      ");
      os_ << "    }\n";
    }
    if (!act.is_identity()) os_ << "    apply_act<" << activation_struct_name(l) << ">(" << acc << ");\n";
    if (l == L_ - 1) {
      os_ << "    store_c<" << s_.output_width << ", " << s_.output_width << ">(" << acc
          << ", p.y, row, p.batch, q);\n";
      return;
    }
    to_tile(l, "    ");
    os_ << "    if (TRAIN) {\n";
    tile_out(l, plus_r(m_.stash_h_offset[l], stash_stride, r), "      ");
    os_ << "    }\n";
  }

  std::ostringstream& os_;
  const MlpSpec& s_;
  const MlpLayout& m_;
  const WgmmaStreamLayout w_;
  const std::vector<Segment> segs_;
  const int L_, C_, La_, S_, in_p_;
  std::vector<int> start_;
  int x_chunk_ = 0, first_wait_ = 0;
};

}  // namespace

void write_wgmma_stream_forward_body(std::ostringstream& os, const MlpSpec& s, const MlpVariant& v,
                                     const MlpLayout& m) {
  WgmmaStreamForwardWriter writer(os, s, v, m);
  writer.write_prologue();
  writer.write_row_block_start();
  for (int g = 0; g < writer.segment_count(); ++g) writer.write_segment(g);
  writer.write_row_block_end();
}

}  // namespace kfuse::codegen
