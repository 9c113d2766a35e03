// Filters prepared ahead of time for the inference forward (EncoderGpu::Impl::PreparedFilter): made per geometry,
// remade in place when the weights change, with the last block's squeeze projection rows.
#include "encoder/encoder_gpu_impl.h"

namespace kfuse {

void EncoderGpu::Impl::make_squeeze_projection(const PreparedFilter& f, cudaStream_t stream, const unsigned* run_flag) {
  const Conv2dProblem& p = f.problem;
  kernels::SqueezeProjectionArgs a;
  a.wd = f.data;
  a.po_count = p.p() * p.q();
  a.k = p.k;
  a.kd = p.h * p.w * p.c;
  a.hidden = f.extra_rows;
  a.w1 = fptr(bw[f.block].fc1_w);
  a.proj = static_cast<uint8_t*>(f.data) + size_t(a.po_count) * a.k * a.kd * 2;
  a.rowsum = reinterpret_cast<float*>(static_cast<uint8_t*>(f.data) + f.rowsum_at);
  a.run_flag = run_flag;
  check_cuda(kernels::launch_squeeze_projection(a, dtype, stream), "squeeze projection kernel");
}

void EncoderGpu::Impl::ensure_prepared_filters(const Geometry& g, cudaStream_t stream) {
  if (prepared_for.count(g)) return;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;  // allocates: never inside someone's capture
  check_cuda(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
  if (capture != cudaStreamCaptureStatusNone) return;
  int h = g.h / 4, w = g.w / 4;
  const size_t before = prepared.size();
  for (size_t i = 0; i < blocks.size(); ++i) {
    const auto probs = problems(blocks[i], g.n, h, w);
    for (size_t j = 0; j < probs.size(); ++j) {
      const ConvConfig c = choose(probs[j], j == 0);
      size_t bytes = prepared_filter_bytes(c, probs[j], dtype);
      const size_t wo = problem_filter(i, j);
      if (bytes == 0 || prepared.count(prepared_key(c, probs[j], wo))) continue;
      PreparedFilter f{c, probs[j], wo, nullptr};
      if (j == 1 && (f.extra_rows = squeeze_projection_rows(i, c, probs[j])) > 0) {
        const Conv2dProblem& p = probs[j];
        const size_t rows = size_t(p.p()) * p.q() * p.k + f.extra_rows, kd = size_t(p.h) * p.w * p.c;
        f.rowsum_at = std::max(bytes, (rows * kd * 2 + 255) / 256 * 256);
        f.block = i;
        bytes = f.rowsum_at + sizeof(float) * f.extra_rows;
      }
      check_cuda(cudaMalloc(&f.data, bytes), "cudaMalloc (prepared filter)");
      prepared.emplace(prepared_key(c, probs[j], wo), f);
      check_cuda(prepare_conv_filter(c, probs[j], dtype, wptr(wo), f.data, stream),
                 "preparing the filter of " + c.name() + " (" + conv_shape_key(probs[j]) + ")");
      if (f.extra_rows > 0) make_squeeze_projection(f, stream);
    }
    h /= blocks[i].stride;
    w /= blocks[i].stride;
  }
  prepared_for.insert(g);
  // Captured graphs repack the prepared filters that existed when they were captured: recapture them all, so that
  // every graph's repack covers the new ones too.
  if (prepared.size() != before) clear_graphs();
}

void EncoderGpu::Impl::remake_prepared_filters(cudaStream_t stream, const unsigned* run_flag) {
  for (auto& [k, f] : prepared) {
    check_cuda(prepare_conv_filter(f.config, f.problem, dtype, wptr(f.w), f.data, stream, run_flag),
               "preparing the filter of " + f.config.name());
    if (f.extra_rows > 0) make_squeeze_projection(f, stream, run_flag);  // from the new fc1 weights too
  }
}

}  // namespace kfuse
