// The CPU reference of the encoder: forward and backward, written for clarity, T = float (float32 storage, the
// oracle of every GPU kernel) or double; every sum is accumulated in float64. NCHW tensors throughout.
#pragma once

#include "kfuse/encoder_params.h"
#include "kfuse/tensor.h"

namespace kfuse {

// The encoder's output (N, out_channels, H/32, W/32) for an input x (N, C, H, W). Throws InvalidArgument when x
// does not fit the network (rank, channels, spatial size).
template <class T>
HostTensor<T> reference_forward(const EncoderParams<T>& params, const HostTensor<T>& x);

template <class T>
struct ReferenceGradients {
  EncoderParams<T> params;  // dL/d(parameter), same names and shapes as the parameters
  HostTensor<T> input;      // dL/dx, empty when not requested
};

// Recomputes the forward pass and returns the gradients of L for dL/d(output) = grad_output.
template <class T>
ReferenceGradients<T> reference_backward(const EncoderParams<T>& params, const HostTensor<T>& x,
                                         const HostTensor<T>& grad_output, bool input_grad = true);

extern template HostTensor<float> reference_forward(const EncoderParams<float>&, const HostTensor<float>&);
extern template HostTensor<double> reference_forward(const EncoderParams<double>&, const HostTensor<double>&);
extern template ReferenceGradients<float> reference_backward(const EncoderParams<float>&, const HostTensor<float>&,
                                                             const HostTensor<float>&, bool);
extern template ReferenceGradients<double> reference_backward(const EncoderParams<double>&,
                                                              const HostTensor<double>&, const HostTensor<double>&,
                                                              bool);

}  // namespace kfuse
