// Encoder checkpoints in the safetensors format, under bps-nav's state_dict names, so that a file written from a
// bps-nav backbone's state_dict (safetensors.torch.save_file(backbone.state_dict(), path)) loads as is.
#pragma once

#include <optional>
#include <string>

#include "kfuse/encoder_params.h"

namespace kfuse {

struct LoadOptions {
  // When set, the checkpoint must describe exactly this network; otherwise the network is inferred from it.
  std::optional<EncoderConfig> expect;
  // Only keys starting with this prefix are read, with the prefix removed (for example
  // "actor_critic.net.visual_encoder.backbone." to read the encoder out of a whole policy's state_dict).
  std::string prefix;
};

// Loads every parameter, converting floating-point dtypes (F16, BF16, F32, F64) to T. Missing, unexpected,
// misshapen or non-floating-point tensors, and unreadable, truncated or corrupt files throw CheckpointError
// naming the file and the tensor.
template <class T>
EncoderParams<T> load_encoder_checkpoint(const std::string& path, const LoadOptions& options = {});

// Saves every parameter as F32 (float) or F64 (double), with the configuration in the metadata.
template <class T>
void save_encoder_checkpoint(const std::string& path, const EncoderParams<T>& params);

extern template EncoderParams<float> load_encoder_checkpoint(const std::string&, const LoadOptions&);
extern template EncoderParams<double> load_encoder_checkpoint(const std::string&, const LoadOptions&);
extern template void save_encoder_checkpoint(const std::string&, const EncoderParams<float>&);
extern template void save_encoder_checkpoint(const std::string&, const EncoderParams<double>&);

}  // namespace kfuse
