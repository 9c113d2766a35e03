// The SE-ResNet-FixUp encoder family of bps-nav (ResNet(in_channels, base_planes, ngroups, SEFixupBasicBlock,
// layers, use_normalization=False)): its structure, parameter names and shapes, and input validation.
// The exact semantics are in shared/spec/se-resnet9-fixup.md; the default is se_resnet9_fixup.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kfuse/tensor.h"

namespace kfuse {

struct ParamSpec {
  std::string name;  // bps-nav's state_dict key
  Shape shape;
};

struct EncoderConfig {
  int in_channels = 3;
  int base_planes = 64;
  std::vector<int> layers{1, 1, 1, 1};  // blocks per stage

  // One SEFixupBasicBlock.
  struct Block {
    std::string prefix;  // "layers.<stage>.<index>."
    int stage = 0, index = 0;
    int in_planes = 0, planes = 0, stride = 1;
    bool has_downsample = false;  // shortcut is [avgpool3x3 when stride > 1] + conv1x1, else identity
    int se_hidden = 0;            // int(planes / 16)
    std::string downsample_weight() const;  // "downsample.1.weight" after a pool, "downsample.0.weight" without
  };

  // Throws InvalidArgument naming the field when the configuration is not a valid network.
  void validate() const;
  std::vector<Block> blocks() const;
  // Every parameter in bps-nav's state_dict order.
  std::vector<ParamSpec> parameter_specs() const;
  int64_t num_parameters() const;
  // The CUDA training backward's stages (EncoderGpu::backward_stage): stage s < blocks().size() is the backward of
  // block blocks().size() - 1 - s, the last stage the stem's. Per parameter (parameter_specs order), the stage after
  // which its gradient is final: its block's, except fixup_bias1a (the sum of d(the block's input)), which the stage
  // after the block's completes: the previous block's squeeze-excite backward where the block has a shortcut conv,
  // the stem's for the first block.
  int backward_stages() const;
  std::vector<int> backward_stage_of_parameters() const;
  int out_channels() const;
  // H and W must be multiples of this (4 for the stem times 2 per strided stage: 32 for four stages).
  int spatial_divisor() const;
  // Output shape for an NCHW input; throws InvalidArgument naming the problem when the input does not fit.
  Shape output_shape(const Shape& input_nchw) const;
  std::string to_string() const;

  // The configuration whose parameters have these names and shapes (a checkpoint's); throws CheckpointError when
  // they do not describe a member of the family.
  static EncoderConfig infer(const std::vector<ParamSpec>& params);
};

bool operator==(const EncoderConfig& a, const EncoderConfig& b);

}  // namespace kfuse
