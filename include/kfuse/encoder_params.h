// The parameters of one encoder, by bps-nav's state_dict names, in state_dict order.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "kfuse/encoder_config.h"
#include "kfuse/tensor.h"

namespace kfuse {

template <class T>
class EncoderParams {
 public:
  // All parameters zero-filled, with the shapes of `config`.
  explicit EncoderParams(EncoderConfig config);

  // bps-nav's initialization (ResNetEncoder.layer_init with num_fixups = number of blocks): conv1 ~ N(0,
  // sqrt(2/(P*9)) / sqrt(num_fixups)), conv2 = 0, downsample ~ N(0, sqrt(2/P)), FixUp biases 0 and scales 1, stem and
  // SE Linear layers as PyTorch's defaults (uniform within +-1/sqrt(fan_in)). Deterministic for a given seed.
  static EncoderParams fixup_init(const EncoderConfig& config, uint64_t seed);

  // fixup_init, then a fixed random perturbation that makes every residual branch non-trivial: conv2 ~ N(0,
  // sqrt(2/(P*9))/2) and FixUp scalars drawn around their init. The embedded "default network" of the benchmark and
  // the tests: the plain FixUp init would make every residual branch exactly zero.
  static EncoderParams perturbed_init(const EncoderConfig& config, uint64_t seed);

  const EncoderConfig& config() const { return config_; }
  const std::vector<ParamSpec>& specs() const { return specs_; }
  size_t size() const { return tensors_.size(); }

  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  // Throws InvalidArgument naming the parameter when it does not exist.
  HostTensor<T>& at(const std::string& name);
  const HostTensor<T>& at(const std::string& name) const;
  HostTensor<T>& at(size_t i) { return tensors_.at(i); }
  const HostTensor<T>& at(size_t i) const { return tensors_.at(i); }
  // The value of a one-element FixUp scalar such as "layers.0.0.fixup_scale".
  T scalar(const std::string& name) const { return at(name)[0]; }

 private:
  EncoderConfig config_;
  std::vector<ParamSpec> specs_;
  std::vector<HostTensor<T>> tensors_;
  std::unordered_map<std::string, size_t> index_;
};

extern template class EncoderParams<float>;
extern template class EncoderParams<double>;

}  // namespace kfuse
