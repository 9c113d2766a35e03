// The convolution problem the kernel launchers take (conv_fixup.h), as plain data: free of CUTLASS headers, so that
// only the kernel TUs pay CUTLASS's compile cost and objects built by another host compiler link safely.
// Layouts: activations NHWC, filters KRSC (K output channels, R x S taps, C input channels), outputs NPQK.
#pragma once

#define KFUSE_KERNEL_API __attribute__((visibility("default")))

namespace kfuse::kernels {

struct Conv2dProblem {
  int n = 0, h = 0, w = 0, c = 0;
  int k = 0, r = 0, s = 0;
  int pad_h = 0, pad_w = 0;
  int stride_h = 1, stride_w = 1;

  // Output extents; 0 when the (padded) input is smaller than the filter or the stride is not positive.
  int p() const { return out_extent(h, pad_h, r, stride_h); }
  int q() const { return out_extent(w, pad_w, s, stride_w); }

 private:
  static int out_extent(int in, int pad, int filt, int stride) {
    const int span = in + 2 * pad - filt;  // checked before dividing: negative spans must not round to 0
    return (stride > 0 && span >= 0) ? span / stride + 1 : 0;
  }
};

}  // namespace kfuse::kernels
