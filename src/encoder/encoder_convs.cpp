// The forward's convolutions (EncoderGpu::Impl::conv), their tuning per geometry and their workspace.
#include "encoder/encoder_gpu_impl.h"

namespace kfuse {

std::vector<OpTuningReport> EncoderGpu::Impl::tune(const Geometry& g, TuningMode mode,
                                                   const EncoderGpu::TuneProgress& progress) {
  if (!tuning_scratch) tuning_scratch = std::make_unique<ConvTuningScratch>();
  if (!tuning_cache) tuning_cache = std::make_unique<TuningCache>();
  std::vector<std::pair<Conv2dProblem, bool>> todo;
  int h = g.h / 4, w = g.w / 4;
  for (const auto& b : blocks) {
    const auto probs = problems(b, g.n, h, w);
    for (size_t j = 0; j < probs.size(); ++j) todo.emplace_back(probs[j], j == 0);
    h /= b.stride;
    w /= b.stride;
  }
  std::vector<OpTuningReport> rows;
  bool changed = false;
  for (const auto& [p, relu] : todo) {
    OpTuningReport row;
    const ConvConfig before = choose(p, relu);
    const ConvConfig c = tuning_scratch->tune(p, dtype, relu, *tuning_cache, mode, row);
    conv_choice[choice_key(p, relu)] = c;
    changed = changed || !(c == before);
    rows.push_back(row);
    if (progress) progress(rows.size(), todo.size(), rows.back());
  }
  tuned.insert(g);
  if (changed) {  // workspace sizes and captured kernels may be stale; graphs in flight must finish first
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    checked.clear();
    prepared_for.clear();
    clear_graphs();
  }
  return rows;
}

void EncoderGpu::Impl::conv(const Conv2dProblem& p, const void* x, size_t w, void* y, const kernels::FixupEpilogue& e,
                            cudaStream_t stream, bool side_branch, bool training) {
  ConvConfig c = choose(p, e.relu);
  const void* filter = wptr(w);
  if (prepared_filter_bytes(c, p, dtype) > 0) {
    const auto it = training ? prepared.end() : prepared.find(prepared_key(c, p, w));
    if (it != prepared.end())
      filter = it->second.data;
    else
      c = c.unprepared();
  }
  const size_t need = fixup_conv_workspace_bytes(c, p, dtype);
  if (need > conv_workspace_bytes) throw Error("kfuse: conv workspace too small (internal error)");
  void* ws =
      conv_workspace ? static_cast<uint8_t*>(conv_workspace) + (side_branch ? conv_workspace_bytes : 0) : nullptr;
  check_cuda(run_fixup_conv(c, p, dtype, x, filter, y, e, ws, conv_workspace_bytes, stream),
             "conv2d_fprop_fixup (" + c.name() + ", " + conv_shape_key(p) + ")");
}

void EncoderGpu::Impl::ensure_workspace(const Geometry& g) {
  if (checked.count(g)) return;
  size_t need = 0;
  int h = g.h / 4, w = g.w / 4;
  for (const auto& b : blocks) {
    const auto probs = problems(b, g.n, h, w);
    for (size_t j = 0; j < probs.size(); ++j) {
      const Conv2dProblem& p = probs[j];
      const ConvConfig c = choose(p, j == 0);
      if (!fixup_conv_can_implement(c, p, dtype))
        throw InvalidArgument("kfuse: the fused conv kernels cannot run block '" + b.prefix + "' at this size");
      need = std::max({need, fixup_conv_workspace_bytes(c, p, dtype),
                       fixup_conv_workspace_bytes(c.unprepared(), p, dtype)});  // conv(): either may run
    }
    h /= b.stride;
    w /= b.stride;
  }
  grow_conv_workspace(need);
  checked[g] = true;
}

}  // namespace kfuse
