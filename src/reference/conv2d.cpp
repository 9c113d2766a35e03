#include "reference/conv2d.h"

#include <algorithm>
#include <vector>

namespace kfuse::ref {
namespace {

int64_t out_size(int64_t in, int64_t k, int stride, int pad) { return (in + 2 * pad - k) / stride + 1; }

// The output positions o in [0, out) whose input position o*stride + tap - pad lies in [0, in).
struct ValidRange {
  int64_t begin, end;
};
ValidRange valid_range(int64_t in, int64_t out, int64_t tap, int stride, int pad) {
  int64_t begin = 0;
  while (begin < out && begin * stride + tap - pad < 0) ++begin;
  int64_t end = out;
  while (end > begin && (end - 1) * stride + tap - pad >= in) --end;
  return {begin, end};
}

}  // namespace

template <class T>
HostTensor<T> conv2d(const HostTensor<T>& x, const HostTensor<T>& w, int stride, int pad) {
  const int64_t N = x.dim(0), Ci = x.dim(1), H = x.dim(2), W = x.dim(3);
  const int64_t Co = w.dim(0), K = w.dim(2);
  KFUSE_CHECK(w.dim(1) == Ci && w.dim(3) == K, InvalidArgument, "conv2d: weight ", shape_str(w.shape()),
              " does not fit input ", shape_str(x.shape()));
  const int64_t Ho = out_size(H, K, stride, pad), Wo = out_size(W, K, stride, pad);
  HostTensor<T> y({N, Co, Ho, Wo});
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t co = 0; co < Co; ++co) {
      std::vector<double> acc(static_cast<size_t>(Ho * Wo), 0.0);
      for (int64_t ci = 0; ci < Ci; ++ci) {
        const T* plane = &x.at(n, ci, 0, 0);
        for (int64_t kh = 0; kh < K; ++kh) {
          const ValidRange rows = valid_range(H, Ho, kh, stride, pad);
          for (int64_t kw = 0; kw < K; ++kw) {
            const ValidRange cols = valid_range(W, Wo, kw, stride, pad);
            const double wv = w.at(co, ci, kh, kw);
            for (int64_t oh = rows.begin; oh < rows.end; ++oh) {
              const int64_t base = (oh * stride + kh - pad) * W + kw - pad;  // input index of ow = 0
              double* a = acc.data() + oh * Wo;
              for (int64_t ow = cols.begin; ow < cols.end; ++ow) a[ow] += wv * double(plane[base + ow * stride]);
            }
          }
        }
      }
      T* out = &y.at(n, co, 0, 0);
      for (int64_t i = 0; i < Ho * Wo; ++i) out[i] = static_cast<T>(acc[static_cast<size_t>(i)]);
    }
  }
  return y;
}

template <class T>
HostTensor<T> conv2d_grad_input(const HostTensor<T>& dy, const HostTensor<T>& w, const Shape& x_shape, int stride,
                                int pad) {
  const int64_t N = x_shape[0], Ci = x_shape[1], H = x_shape[2], W = x_shape[3];
  const int64_t Co = w.dim(0), K = w.dim(2), Ho = dy.dim(2), Wo = dy.dim(3);
  HostTensor<T> dx(x_shape);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t ci = 0; ci < Ci; ++ci) {
      std::vector<double> acc(static_cast<size_t>(H * W), 0.0);
      for (int64_t co = 0; co < Co; ++co) {
        const T* g = &dy.at(n, co, 0, 0);
        for (int64_t kh = 0; kh < K; ++kh) {
          const ValidRange rows = valid_range(H, Ho, kh, stride, pad);
          for (int64_t kw = 0; kw < K; ++kw) {
            const ValidRange cols = valid_range(W, Wo, kw, stride, pad);
            const double wv = w.at(co, ci, kh, kw);
            for (int64_t oh = rows.begin; oh < rows.end; ++oh) {
              const int64_t base = (oh * stride + kh - pad) * W + kw - pad;
              const T* grow = g + oh * Wo;
              for (int64_t ow = cols.begin; ow < cols.end; ++ow)
                acc[static_cast<size_t>(base + ow * stride)] += wv * double(grow[ow]);
            }
          }
        }
      }
      T* out = &dx.at(n, ci, 0, 0);
      for (int64_t i = 0; i < H * W; ++i) out[i] = static_cast<T>(acc[static_cast<size_t>(i)]);
    }
  }
  return dx;
}

template <class T>
HostTensor<T> conv2d_grad_weight(const HostTensor<T>& x, const HostTensor<T>& dy, const Shape& w_shape, int stride,
                                 int pad) {
  const int64_t N = x.dim(0), H = x.dim(2), W = x.dim(3);
  const int64_t Co = w_shape[0], Ci = w_shape[1], K = w_shape[2], Ho = dy.dim(2), Wo = dy.dim(3);
  HostTensor<T> dw(w_shape);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t co = 0; co < Co; ++co) {
    for (int64_t ci = 0; ci < Ci; ++ci) {
      for (int64_t kh = 0; kh < K; ++kh) {
        const ValidRange rows = valid_range(H, Ho, kh, stride, pad);
        for (int64_t kw = 0; kw < K; ++kw) {
          const ValidRange cols = valid_range(W, Wo, kw, stride, pad);
          double acc = 0.0;
          for (int64_t n = 0; n < N; ++n) {
            const T* g = &dy.at(n, co, 0, 0);
            const T* plane = &x.at(n, ci, 0, 0);
            for (int64_t oh = rows.begin; oh < rows.end; ++oh) {
              const int64_t base = (oh * stride + kh - pad) * W + kw - pad;
              for (int64_t ow = cols.begin; ow < cols.end; ++ow)
                acc += double(g[oh * Wo + ow]) * double(plane[base + ow * stride]);
            }
          }
          dw.at(co, ci, kh, kw) = static_cast<T>(acc);
        }
      }
    }
  }
  return dw;
}

template <class T>
HostTensor<T> avg_pool3x3(const HostTensor<T>& x, int stride) {
  const int64_t N = x.dim(0), C = x.dim(1), H = x.dim(2), W = x.dim(3);
  const int64_t Ho = out_size(H, 3, stride, 1), Wo = out_size(W, 3, stride, 1);
  HostTensor<T> y({N, C, Ho, Wo});
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t oh = 0; oh < Ho; ++oh)
        for (int64_t ow = 0; ow < Wo; ++ow) {
          double s = 0.0;
          for (int64_t kh = 0; kh < 3; ++kh)
            for (int64_t kw = 0; kw < 3; ++kw) {
              const int64_t ih = oh * stride + kh - 1, iw = ow * stride + kw - 1;
              if (ih >= 0 && ih < H && iw >= 0 && iw < W) s += double(x.at(n, c, ih, iw));
            }
          y.at(n, c, oh, ow) = static_cast<T>(s / 9.0);
        }
  return y;
}

template <class T>
HostTensor<T> avg_pool3x3_grad(const HostTensor<T>& dy, const Shape& x_shape, int stride) {
  const int64_t N = x_shape[0], C = x_shape[1], H = x_shape[2], W = x_shape[3];
  const int64_t Ho = dy.dim(2), Wo = dy.dim(3);
  HostTensor<T> dx(x_shape);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c) {
      std::vector<double> acc(static_cast<size_t>(H * W), 0.0);
      for (int64_t oh = 0; oh < Ho; ++oh)
        for (int64_t ow = 0; ow < Wo; ++ow) {
          const double g = double(dy.at(n, c, oh, ow)) / 9.0;
          for (int64_t kh = 0; kh < 3; ++kh)
            for (int64_t kw = 0; kw < 3; ++kw) {
              const int64_t ih = oh * stride + kh - 1, iw = ow * stride + kw - 1;
              if (ih >= 0 && ih < H && iw >= 0 && iw < W) acc[static_cast<size_t>(ih * W + iw)] += g;
            }
        }
      for (int64_t i = 0; i < H * W; ++i) (&dx.at(n, c, 0, 0))[i] = static_cast<T>(acc[static_cast<size_t>(i)]);
    }
  return dx;
}

#define KFUSE_INSTANTIATE(T)                                                                                  \
  template HostTensor<T> conv2d(const HostTensor<T>&, const HostTensor<T>&, int, int);                       \
  template HostTensor<T> conv2d_grad_input(const HostTensor<T>&, const HostTensor<T>&, const Shape&, int, int); \
  template HostTensor<T> conv2d_grad_weight(const HostTensor<T>&, const HostTensor<T>&, const Shape&, int, int); \
  template HostTensor<T> avg_pool3x3(const HostTensor<T>&, int);                                               \
  template HostTensor<T> avg_pool3x3_grad(const HostTensor<T>&, const Shape&, int);
KFUSE_INSTANTIATE(float)
KFUSE_INSTANTIATE(double)
#undef KFUSE_INSTANTIATE

}  // namespace kfuse::ref
