// CPU tier of the training step's cuDNN graphs (src/kernels/conv/cudnn_fused.h): what they refuse before asking
// cuDNN or a GPU, with a reason that names it. The graphs themselves are tested on the GPU (test_cudnn_fused_gpu.cpp).
#include "kernels/conv/cudnn_fused.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>

namespace {

using kfuse::kernels::Conv2dProblem;
using kfuse::kernels::ConvDType;
using kfuse::kernels::CudnnFusedOp;

Conv2dProblem conv3x3(int n, int hw, int c, int k, int stride) {
  return Conv2dProblem{n, hw, hw, c, k, 3, 3, 1, 1, stride, stride};
}

TEST(CudnnFusedOps, RefuseWhatTheyDoNotCover) {
  std::string why;
  // The data gradient is for stride-1 convolutions with pitch >= C; channels must be multiples of 8.
  EXPECT_FALSE(kfuse::kernels::cudnn_fused_prepare(CudnnFusedOp::kDgradMask, conv3x3(2, 8, 16, 16, 2),
                                                   ConvDType::kF16, 16, &why));
  EXPECT_NE(why.find("stride-1"), std::string::npos) << why;
  EXPECT_FALSE(kfuse::kernels::cudnn_fused_prepare(CudnnFusedOp::kDgradMask, conv3x3(2, 8, 16, 16, 1),
                                                   ConvDType::kF16, 8, &why));
  EXPECT_NE(why.find("pitch"), std::string::npos) << why;
  EXPECT_FALSE(kfuse::kernels::cudnn_fused_prepare(CudnnFusedOp::kConvRelu, conv3x3(2, 8, 12, 16, 1),
                                                   ConvDType::kF16, 0, &why));
  EXPECT_NE(why.find("C = 12"), std::string::npos) << why;
  // Launches of ops never prepared are refused without launching.
  EXPECT_EQ(kfuse::kernels::cudnn_fused_conv_relu(conv3x3(1, 8, 8, 8, 1), ConvDType::kF16, nullptr, nullptr, nullptr,
                                                  nullptr, nullptr, nullptr, nullptr),
            cudaErrorNotSupported);
}

}  // namespace
