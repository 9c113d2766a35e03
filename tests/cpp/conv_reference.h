// float64 references of the convolutions (conv_backward.h conventions: the FORWARD problem p, NHWC activations,
// KRSC filters, NPQK outputs and output gradients), shared by the GPU tests of the candidates the tuner may choose.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/conv/conv_fixup.h"
#include "kernels/conv/conv_problem.h"
#include "runtime/half_bits.h"

namespace kfuse::testing {

using kernels::Conv2dProblem;
using kernels::ConvDType;

// A 3x3 convolution with padding 1, the encoder's kind.
inline Conv2dProblem conv3x3(int n, int hw, int c, int k, int stride) {
  return Conv2dProblem{n, hw, hw, c, k, 3, 3, 1, 1, stride, stride};
}
inline const char* dtype_name(ConvDType dt) { return dt == ConvDType::kF16 ? "f16" : "bf16"; }

// Normwise relative error ||out - ref|| / ||ref||; `bad` receives the number of non-finite outputs (NaN poison left
// unwritten included).
inline double rel_err(const std::vector<double>& out, const std::vector<double>& ref, size_t* bad) {
  double num = 0, den = 0;
  *bad = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i])) ++*bad;
    num += (out[i] - ref[i]) * (out[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

inline size_t act_elems(const Conv2dProblem& p) { return size_t(p.n) * p.h * p.w * p.c; }
inline size_t grad_elems(const Conv2dProblem& p) { return size_t(p.n) * p.p() * p.q() * p.k; }
inline size_t filter_elems(const Conv2dProblem& p) { return size_t(p.k) * p.r * p.s * p.c; }

// float64 forward on decoded values with a multiplier per output channel: post + act(alpha[k] * conv(x, w) + pre),
// act = relu if `relu`.
inline std::vector<double> reference_fprop_scaled(const Conv2dProblem& p, const std::vector<double>& xd,
                                                  const std::vector<double>& wd, const std::vector<double>& alpha,
                                                  double pre, double post, bool relu) {
  const int P = p.p(), Q = p.q();
  std::vector<double> y(grad_elems(p));
  for (int n = 0; n < p.n; ++n)
    for (int op = 0; op < P; ++op)
      for (int oq = 0; oq < Q; ++oq)
        for (int k = 0; k < p.k; ++k) {
          double acc = 0.0;
          for (int r = 0; r < p.r; ++r) {
            const int ih = op * p.stride_h - p.pad_h + r;
            if (ih < 0 || ih >= p.h) continue;
            for (int s = 0; s < p.s; ++s) {
              const int iw = oq * p.stride_w - p.pad_w + s;
              if (iw < 0 || iw >= p.w) continue;
              const double* xs = &xd[((size_t(n) * p.h + ih) * p.w + iw) * p.c];
              const double* ws = &wd[((size_t(k) * p.r + r) * p.s + s) * p.c];
              for (int ci = 0; ci < p.c; ++ci) acc += xs[ci] * ws[ci];
            }
          }
          double v = alpha[size_t(k)] * acc + pre;
          if (relu && v < 0.0) v = 0.0;
          y[((size_t(n) * P + op) * Q + oq) * p.k + k] = post + v;
        }
  return y;
}

// float64 forward with the FixUp epilogue: post + act(alpha * conv(x, w) + pre), act = relu if `relu`.
inline std::vector<double> reference_fprop_fixup(const Conv2dProblem& p, const std::vector<uint16_t>& x,
                                                 const std::vector<uint16_t>& w, ConvDType dt, double alpha,
                                                 double pre, double post, bool relu) {
  std::vector<double> xd(x.size()), wd(w.size());
  for (size_t i = 0; i < x.size(); ++i) xd[i] = bits_to_float(x[i], dt);
  for (size_t i = 0; i < w.size(); ++i) wd[i] = bits_to_float(w[i], dt);
  return reference_fprop_scaled(p, xd, wd, std::vector<double>(size_t(p.k), alpha), pre, post, relu);
}

// float64 weight gradient, NPQK (dy) x NHWC (x) -> KRSC, zero padding, cross-correlation.
inline std::vector<double> reference_wgrad(const Conv2dProblem& p, const std::vector<uint16_t>& dy,
                                    const std::vector<uint16_t>& x, ConvDType dt) {
  const int P = p.p(), Q = p.q();
  std::vector<double> dyd(dy.size()), xd(x.size());
  for (size_t i = 0; i < dy.size(); ++i) dyd[i] = bits_to_float(dy[i], dt);
  for (size_t i = 0; i < x.size(); ++i) xd[i] = bits_to_float(x[i], dt);
  std::vector<double> dw(filter_elems(p), 0.0);
  for (int n = 0; n < p.n; ++n)
    for (int op = 0; op < P; ++op)
      for (int oq = 0; oq < Q; ++oq) {
        const double* g = &dyd[((size_t(n) * P + op) * Q + oq) * p.k];
        for (int r = 0; r < p.r; ++r) {
          const int ih = op * p.stride_h - p.pad_h + r;
          if (ih < 0 || ih >= p.h) continue;
          for (int s = 0; s < p.s; ++s) {
            const int iw = oq * p.stride_w - p.pad_w + s;
            if (iw < 0 || iw >= p.w) continue;
            const double* xs = &xd[((size_t(n) * p.h + ih) * p.w + iw) * p.c];
            for (int k = 0; k < p.k; ++k) {
              const double gk = g[k];
              double* d = &dw[((size_t(k) * p.r + r) * p.s + s) * p.c];
              for (int ci = 0; ci < p.c; ++ci) d[ci] += gk * xs[ci];
            }
          }
        }
      }
  return dw;
}

// float64 data gradient, scattered from every (n, p, q, r, s) tap into the input pixel it reads in the forward conv.
// covered[n, y, x] says whether any tap reaches the pixel (dx must be exactly 0 where none does).
inline std::vector<double> reference_dgrad(const Conv2dProblem& p, const std::vector<uint16_t>& dy,
                                    const std::vector<uint16_t>& w, ConvDType dt, std::vector<char>* covered) {
  const int P = p.p(), Q = p.q();
  std::vector<double> dyd(dy.size()), wd(w.size());
  for (size_t i = 0; i < dy.size(); ++i) dyd[i] = bits_to_float(dy[i], dt);
  for (size_t i = 0; i < w.size(); ++i) wd[i] = bits_to_float(w[i], dt);
  std::vector<double> dx(act_elems(p), 0.0);
  covered->assign(size_t(p.n) * p.h * p.w, 0);
  for (int n = 0; n < p.n; ++n)
    for (int op = 0; op < P; ++op)
      for (int oq = 0; oq < Q; ++oq)
        for (int r = 0; r < p.r; ++r) {
          const int y = op * p.stride_h + r - p.pad_h;
          if (y < 0 || y >= p.h) continue;
          for (int s = 0; s < p.s; ++s) {
            const int x = oq * p.stride_w + s - p.pad_w;
            if (x < 0 || x >= p.w) continue;
            const size_t pixel = (size_t(n) * p.h + y) * p.w + x;
            (*covered)[pixel] = 1;
            double* dxs = &dx[pixel * p.c];
            const double* dys = &dyd[((size_t(n) * P + op) * Q + oq) * p.k];
            for (int k = 0; k < p.k; ++k) {
              const double g = dys[k];
              const double* ws = &wd[((size_t(k) * p.r + r) * p.s + s) * p.c];
              for (int c = 0; c < p.c; ++c) dxs[c] += g * ws[c];
            }
          }
        }
  return dx;
}

}  // namespace kfuse::testing
