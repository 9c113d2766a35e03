// Plain CPU convolution and pooling for the reference: NCHW tensors of T (float or double), float64 accumulation,
// PyTorch semantics (cross-correlation, zero padding, avg pool counting padding). Written for clarity; OpenMP
// spreads the outer loops over cores.
#pragma once

#include "kfuse/tensor.h"

namespace kfuse::ref {

// y[n, co, oh, ow] = sum_{ci, kh, kw} w[co, ci, kh, kw] * x[n, ci, oh*stride + kh - pad, ow*stride + kw - pad]
template <class T>
HostTensor<T> conv2d(const HostTensor<T>& x, const HostTensor<T>& w, int stride, int pad);
// The gradient of conv2d with respect to x, given dL/dy.
template <class T>
HostTensor<T> conv2d_grad_input(const HostTensor<T>& dy, const HostTensor<T>& w, const Shape& x_shape, int stride,
                                int pad);
// The gradient of conv2d with respect to w, given dL/dy.
template <class T>
HostTensor<T> conv2d_grad_weight(const HostTensor<T>& x, const HostTensor<T>& dy, const Shape& w_shape, int stride,
                                 int pad);
// 3x3 average pool, padding 1, always divided by 9 (PyTorch's count_include_pad=True).
template <class T>
HostTensor<T> avg_pool3x3(const HostTensor<T>& x, int stride);
template <class T>
HostTensor<T> avg_pool3x3_grad(const HostTensor<T>& dy, const Shape& x_shape, int stride);

}  // namespace kfuse::ref
