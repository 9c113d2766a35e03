// The activation buffers of one input geometry (EncoderGpu::Impl::buffers): every block's tensors in one device
// allocation, laid out once per geometry.
#include "encoder/encoder_gpu_impl.h"

namespace kfuse {

Activations& EncoderGpu::Impl::buffers(const Geometry& g) {
  auto it = activations.find(g);
  if (it != activations.end()) return it->second;
  const size_t es = 2;
  std::vector<size_t> sizes;  // element counts in allocation order
  Activations act;
  int h = g.h / 4, w = g.w / 4;
  size_t total = 0;
  auto take = [&](size_t elems) {
    const size_t off = total;
    total += (elems * es + 255) / 256 * 256;
    return off;
  };
  const size_t x0 = take(size_t(g.n) * h * w * config.base_planes);
  struct Offs {
    size_t x, a, h2, idt, o, partials = SIZE_MAX, sync = SIZE_MAX;
  };
  std::vector<Offs> offs;
  for (const auto& b : blocks) {
    const size_t in = size_t(g.n) * h * w * b.in_planes;
    const int ho = h / b.stride, wo = w / b.stride;
    const size_t out = size_t(g.n) * ho * wo * b.planes;
    Offs o{};
    o.x = b.has_downsample ? SIZE_MAX : take(in);
    o.a = take(in);
    o.h2 = take(out);
    o.idt = b.has_downsample ? take(out) : SIZE_MAX;
    // The last block's o has room for fc1's pre-activations per image (squeeze_projection_rows).
    o.o = take(&b == &blocks.back() ? out + size_t(g.n) * projection_rows_max(b) : out);
    if (fusable_down_block_shape(b) && down_stream_offsets(b).ranks > 1) {
      const size_t groups = size_t(kernels::fused_down_block_groups(g.n));
      o.partials = take(groups * 1024 / es);
      o.sync = take((1 + 2 * groups) * 4 / es + 2);
    }
    offs.push_back(o);
    h = ho;
    w = wo;
  }
  check_cuda(cudaMalloc(&act.base, total), "cudaMalloc (activations)");
  auto at = [&](size_t off) {
    return off == SIZE_MAX ? nullptr : static_cast<void*>(static_cast<uint8_t*>(act.base) + off);
  };
  act.x0 = at(x0);
  for (const Offs& o : offs) {
    act.x.push_back(at(o.x));
    act.a.push_back(at(o.a));
    act.h2.push_back(at(o.h2));
    act.idt.push_back(at(o.idt));
    act.o.push_back(at(o.o));
    act.partials.push_back(static_cast<float*>(at(o.partials)));
    act.sync.push_back(static_cast<unsigned*>(at(o.sync)));
    if (o.sync != SIZE_MAX)  // the counters start at zero; every launch leaves them ready for the next
      check_cuda(cudaMemset(at(o.sync), 0, (1 + 2 * size_t(kernels::fused_down_block_groups(g.n))) * 4),
                 "cudaMemset (block synchronization counters)");
  }
  // Block 1's identity is the stem output itself.
  if (!blocks.empty() && !blocks[0].has_downsample) act.x[0] = act.x0;
  return activations.emplace(g, std::move(act)).first->second;
}

}  // namespace kfuse
