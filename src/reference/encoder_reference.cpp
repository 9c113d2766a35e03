// The encoder, layer by layer, exactly as shared/spec/se-resnet9-fixup.md states it. The backward pass is derived
// by hand from the same steps; every intermediate the backward pass needs is kept by the forward in BlockTrace.
#include <cmath>
#include <optional>

#include "kfuse/reference.h"
#include "reference/conv2d.h"

namespace kfuse {
namespace {

// PyTorch's relu propagates NaN; its backward passes the gradient wherever the output is not <= 0.
inline double relu(double v) { return v > 0.0 || std::isnan(v) ? v : 0.0; }
inline double relu_grad(double out, double g) { return out <= 0.0 ? 0.0 : g; }
inline double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

template <class T, class F>
HostTensor<T> map(const HostTensor<T>& a, F f) {
  HostTensor<T> out(a.shape());
  for (int64_t i = 0; i < a.numel(); ++i) out[i] = static_cast<T>(f(double(a[i])));
  return out;
}
template <class T, class F>
HostTensor<T> map2(const HostTensor<T>& a, const HostTensor<T>& b, F f) {
  HostTensor<T> out(a.shape());
  for (int64_t i = 0; i < a.numel(); ++i) out[i] = static_cast<T>(f(double(a[i]), double(b[i])));
  return out;
}
template <class T>
void add_into(HostTensor<T>& acc, const HostTensor<T>& b) {
  for (int64_t i = 0; i < acc.numel(); ++i) acc[i] = static_cast<T>(double(acc[i]) + double(b[i]));
}
template <class T>
double sum(const HostTensor<T>& a) {
  double s = 0.0;
  for (int64_t i = 0; i < a.numel(); ++i) s += double(a[i]);
  return s;
}
template <class T>
double dot(const HostTensor<T>& a, const HostTensor<T>& b) {
  double s = 0.0;
  for (int64_t i = 0; i < a.numel(); ++i) s += double(a[i]) * double(b[i]);
  return s;
}

// s[n, dy*4C + dx*C + c, i, j] = x[n, c, 4i + dy, 4j + dx]  (bps-nav's SpaceToDepth)
template <class T>
HostTensor<T> space_to_depth4(const HostTensor<T>& x) {
  const int64_t N = x.dim(0), C = x.dim(1), H = x.dim(2), W = x.dim(3);
  HostTensor<T> s({N, 16 * C, H / 4, W / 4});
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t w = 0; w < W; ++w) s.at(n, (h % 4) * 4 * C + (w % 4) * C + c, h / 4, w / 4) = x.at(n, c, h, w);
  return s;
}
template <class T>
HostTensor<T> depth_to_space4(const HostTensor<T>& s, const Shape& x_shape) {
  HostTensor<T> x(x_shape);
  const int64_t N = x_shape[0], C = x_shape[1], H = x_shape[2], W = x_shape[3];
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t w = 0; w < W; ++w) x.at(n, c, h, w) = s.at(n, (h % 4) * 4 * C + (w % 4) * C + c, h / 4, w / 4);
  return x;
}

// Linear layer on rows: y[n, j] = b[j] + sum_i W[j, i] x[n, i]
template <class T>
HostTensor<T> linear(const HostTensor<T>& x, const HostTensor<T>& w, const HostTensor<T>& b) {
  const int64_t N = x.dim(0), I = x.dim(1), J = w.dim(0);
  HostTensor<T> y({N, J});
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < J; ++j) {
      double s = double(b[j]);
      for (int64_t i = 0; i < I; ++i) s += double(w[j * I + i]) * double(x[n * I + i]);
      y[n * J + j] = static_cast<T>(s);
    }
  return y;
}
// Backward of linear: dx = dy W; dW += dy^T x; db += sum_n dy.
template <class T>
HostTensor<T> linear_backward(const HostTensor<T>& x, const HostTensor<T>& w, const HostTensor<T>& dy,
                              HostTensor<T>& dw, HostTensor<T>& db) {
  const int64_t N = x.dim(0), I = x.dim(1), J = w.dim(0);
  HostTensor<T> dx({N, I});
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < I; ++i) {
      double s = 0.0;
      for (int64_t j = 0; j < J; ++j) s += double(dy[n * J + j]) * double(w[j * I + i]);
      dx[n * I + i] = static_cast<T>(s);
    }
  for (int64_t j = 0; j < J; ++j) {
    double sb = 0.0;
    for (int64_t n = 0; n < N; ++n) sb += double(dy[n * J + j]);
    db[j] = static_cast<T>(sb);
    for (int64_t i = 0; i < I; ++i) {
      double s = 0.0;
      for (int64_t n = 0; n < N; ++n) s += double(dy[n * J + j]) * double(x[n * I + i]);
      dw[j * I + i] = static_cast<T>(s);
    }
  }
  return dx;
}

template <class T>
struct BlockTrace {
  HostTensor<T> a, h, h2, c2, o, pooled, m, z1, r, g, y;
};

template <class T>
BlockTrace<T> block_forward(const EncoderParams<T>& p, const EncoderConfig::Block& b, const HostTensor<T>& x) {
  const std::string& k = b.prefix;
  const double b1a = p.scalar(k + "fixup_bias1a"), b1b = p.scalar(k + "fixup_bias1b");
  const double b2a = p.scalar(k + "fixup_bias2a"), b2b = p.scalar(k + "fixup_bias2b");
  const double scale = p.scalar(k + "fixup_scale");
  BlockTrace<T> t;
  t.a = map(x, [&](double v) { return v + b1a; });
  t.h = map(ref::conv2d(t.a, p.at(k + "conv1.weight"), b.stride, 1), [&](double v) { return relu(v + b1b); });
  // b2a is added before conv2's zero padding: padded taps read 0, not b2a.
  t.h2 = map(t.h, [&](double v) { return v + b2a; });
  t.c2 = ref::conv2d(t.h2, p.at(k + "conv2.weight"), 1, 1);
  t.o = map(t.c2, [&](double v) { return v * scale + b2b; });

  HostTensor<T> identity;
  if (b.has_downsample) {
    // The shortcut sees x + b1a (bps-nav: downsample(x + fixup_bias1a)); the pool counts padding as 0.
    if (b.stride > 1) t.pooled = ref::avg_pool3x3(t.a, b.stride);
    identity = ref::conv2d(b.stride > 1 ? t.pooled : t.a, p.at(k + b.downsample_weight()), 1, 0);
  }
  const HostTensor<T>& idt = b.has_downsample ? identity : x;

  // Squeeze-excitation on o.
  const int64_t N = t.o.dim(0), P = t.o.dim(1), HW = t.o.dim(2) * t.o.dim(3);
  t.m = HostTensor<T>({N, P});
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < P; ++c) {
      double s = 0.0;
      for (int64_t i = 0; i < HW; ++i) s += double(t.o[(n * P + c) * HW + i]);
      t.m[n * P + c] = static_cast<T>(s / double(HW));
    }
  t.z1 = linear(t.m, p.at(k + "se.excite.0.weight"), p.at(k + "se.excite.0.bias"));
  t.r = map(t.z1, relu);
  t.g = map(linear(t.r, p.at(k + "se.excite.2.weight"), p.at(k + "se.excite.2.bias")), sigmoid);

  t.y = HostTensor<T>(t.o.shape());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < P; ++c) {
      const double g = t.g[n * P + c];
      for (int64_t i = 0; i < HW; ++i) {
        const int64_t e = (n * P + c) * HW + i;
        t.y[e] = static_cast<T>(relu(double(t.o[e]) * g + double(idt[e])));
      }
    }
  return t;
}

// Fills the gradients of block b's parameters into `grads` and returns dL/dx.
template <class T>
HostTensor<T> block_backward(const EncoderParams<T>& p, const EncoderConfig::Block& b, const BlockTrace<T>& t,
                             const HostTensor<T>& dy, EncoderParams<T>& grads) {
  const std::string& k = b.prefix;
  const double scale = p.scalar(k + "fixup_scale");
  const int64_t N = t.o.dim(0), P = t.o.dim(1), HW = t.o.dim(2) * t.o.dim(3);

  // y = relu(o * g + idt)
  const HostTensor<T> dpre = map2(t.y, dy, relu_grad);  // = d idt
  HostTensor<T> d_o(t.o.shape());
  HostTensor<T> d_g({N, P});
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < P; ++c) {
      const double g = t.g[n * P + c];
      double s = 0.0;
      for (int64_t i = 0; i < HW; ++i) {
        const int64_t e = (n * P + c) * HW + i;
        d_o[e] = static_cast<T>(double(dpre[e]) * g);
        s += double(dpre[e]) * double(t.o[e]);
      }
      d_g[n * P + c] = static_cast<T>(s);
    }
  // g = sigmoid(z2), z2 = fc2(r), r = relu(z1), z1 = fc1(m), m = mean_hw(o)
  const HostTensor<T> d_z2 = map2(t.g, d_g, [](double g, double dg) { return dg * g * (1.0 - g); });
  const HostTensor<T> d_r = linear_backward(t.r, p.at(k + "se.excite.2.weight"), d_z2,
                                            grads.at(k + "se.excite.2.weight"), grads.at(k + "se.excite.2.bias"));
  const HostTensor<T> d_z1 = map2(t.r, d_r, relu_grad);
  const HostTensor<T> d_m = linear_backward(t.m, p.at(k + "se.excite.0.weight"), d_z1,
                                            grads.at(k + "se.excite.0.weight"), grads.at(k + "se.excite.0.bias"));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < P; ++c) {
      const double dm = double(d_m[n * P + c]) / double(HW);
      for (int64_t i = 0; i < HW; ++i) {
        const int64_t e = (n * P + c) * HW + i;
        d_o[e] = static_cast<T>(double(d_o[e]) + dm);
      }
    }

  // o = c2 * scale + b2b, c2 = conv2(h2), h2 = h + b2a
  grads.at(k + "fixup_bias2b")[0] = static_cast<T>(sum(d_o));
  grads.at(k + "fixup_scale")[0] = static_cast<T>(dot(d_o, t.c2));
  const HostTensor<T> d_c2 = map(d_o, [&](double v) { return v * scale; });
  grads.at(k + "conv2.weight") = ref::conv2d_grad_weight(t.h2, d_c2, p.at(k + "conv2.weight").shape(), 1, 1);
  const HostTensor<T> d_h = ref::conv2d_grad_input(d_c2, p.at(k + "conv2.weight"), t.h2.shape(), 1, 1);
  grads.at(k + "fixup_bias2a")[0] = static_cast<T>(sum(d_h));

  // h = relu(conv1(a) + b1b), a = x + b1a
  const HostTensor<T> d_c1 = map2(t.h, d_h, relu_grad);
  grads.at(k + "fixup_bias1b")[0] = static_cast<T>(sum(d_c1));
  grads.at(k + "conv1.weight") = ref::conv2d_grad_weight(t.a, d_c1, p.at(k + "conv1.weight").shape(), b.stride, 1);
  HostTensor<T> d_a = ref::conv2d_grad_input(d_c1, p.at(k + "conv1.weight"), t.a.shape(), b.stride, 1);

  HostTensor<T> d_x;
  if (b.has_downsample) {
    const HostTensor<T>& pooled = b.stride > 1 ? t.pooled : t.a;
    const HostTensor<T>& w_ds = p.at(k + b.downsample_weight());
    grads.at(k + b.downsample_weight()) = ref::conv2d_grad_weight(pooled, dpre, w_ds.shape(), 1, 0);
    const HostTensor<T> d_pooled = ref::conv2d_grad_input(dpre, w_ds, pooled.shape(), 1, 0);
    add_into(d_a, b.stride > 1 ? ref::avg_pool3x3_grad(d_pooled, t.a.shape(), b.stride) : d_pooled);
    grads.at(k + "fixup_bias1a")[0] = static_cast<T>(sum(d_a));
    d_x = std::move(d_a);
  } else {
    // Identity shortcut: x itself, not x + b1a.
    grads.at(k + "fixup_bias1a")[0] = static_cast<T>(sum(d_a));
    d_x = std::move(d_a);
    add_into(d_x, dpre);
  }
  return d_x;
}

template <class T>
void check_input(const EncoderParams<T>& params, const HostTensor<T>& x) {
  params.config().output_shape(x.shape());  // throws on a misfit
}

}  // namespace

template <class T>
HostTensor<T> reference_forward(const EncoderParams<T>& params, const HostTensor<T>& x) {
  check_input(params, x);
  HostTensor<T> act = map(ref::conv2d(space_to_depth4(x), params.at("stem.1.weight"), 1, 0), relu);
  for (const auto& b : params.config().blocks()) act = std::move(block_forward(params, b, act).y);
  return act;
}

template <class T>
ReferenceGradients<T> reference_backward(const EncoderParams<T>& params, const HostTensor<T>& x,
                                         const HostTensor<T>& grad_output, bool input_grad) {
  const Shape out_shape = params.config().output_shape(x.shape());
  KFUSE_CHECK(grad_output.shape() == out_shape, InvalidArgument, "grad_output has shape ",
              shape_str(grad_output.shape()), " but the output has shape ", shape_str(out_shape));
  const auto blocks = params.config().blocks();

  // Forward, keeping each block's trace.
  const HostTensor<T> s = space_to_depth4(x);
  const HostTensor<T> stem = map(ref::conv2d(s, params.at("stem.1.weight"), 1, 0), relu);
  std::vector<BlockTrace<T>> traces;
  for (const auto& b : blocks) traces.push_back(block_forward(params, b, traces.empty() ? stem : traces.back().y));

  ReferenceGradients<T> out{EncoderParams<T>(params.config()), HostTensor<T>()};
  HostTensor<T> grad = grad_output;
  for (size_t i = blocks.size(); i-- > 0;)
    grad = block_backward(params, blocks[i], traces[i], grad, out.params);

  const HostTensor<T> d_stem = map2(stem, grad, relu_grad);
  const HostTensor<T>& w_stem = params.at("stem.1.weight");
  out.params.at("stem.1.weight") = ref::conv2d_grad_weight(s, d_stem, w_stem.shape(), 1, 0);
  if (input_grad) out.input = depth_to_space4(ref::conv2d_grad_input(d_stem, w_stem, s.shape(), 1, 0), x.shape());
  return out;
}

template HostTensor<float> reference_forward(const EncoderParams<float>&, const HostTensor<float>&);
template HostTensor<double> reference_forward(const EncoderParams<double>&, const HostTensor<double>&);
template ReferenceGradients<float> reference_backward(const EncoderParams<float>&, const HostTensor<float>&,
                                                      const HostTensor<float>&, bool);
template ReferenceGradients<double> reference_backward(const EncoderParams<double>&, const HostTensor<double>&,
                                                       const HostTensor<double>&, bool);

}  // namespace kfuse
