#include "kfuse/encoder_params.h"

#include <cmath>
#include <random>

namespace kfuse {

template <class T>
EncoderParams<T>::EncoderParams(EncoderConfig config) : config_(std::move(config)), specs_(config_.parameter_specs()) {
  tensors_.reserve(specs_.size());
  for (size_t i = 0; i < specs_.size(); ++i) {
    tensors_.emplace_back(specs_[i].shape);
    index_.emplace(specs_[i].name, i);
  }
}

template <class T>
HostTensor<T>& EncoderParams<T>::at(const std::string& name) {
  auto it = index_.find(name);
  KFUSE_CHECK(it != index_.end(), InvalidArgument, "the encoder has no parameter '", name, "' (", config_.to_string(),
              ")");
  return tensors_[it->second];
}

template <class T>
const HostTensor<T>& EncoderParams<T>::at(const std::string& name) const {
  return const_cast<EncoderParams*>(this)->at(name);
}

namespace {

template <class T>
void fill_normal(HostTensor<T>& t, double stddev, std::mt19937_64& rng) {
  std::normal_distribution<double> d(0.0, stddev);
  for (auto& v : t.values()) v = static_cast<T>(d(rng));
}

template <class T>
void fill_uniform(HostTensor<T>& t, double bound, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> d(-bound, bound);
  for (auto& v : t.values()) v = static_cast<T>(d(rng));
}

}  // namespace

template <class T>
EncoderParams<T> EncoderParams<T>::fixup_init(const EncoderConfig& config, uint64_t seed) {
  EncoderParams p(config);
  std::mt19937_64 rng(seed);
  const auto blocks = config.blocks();
  const double num_fixups = static_cast<double>(blocks.size());
  // PyTorch's default for Conv2d/Linear weights (kaiming_uniform with a = sqrt(5)) and biases: U(+-1/sqrt(fan_in)).
  fill_uniform(p.at("stem.1.weight"), 1.0 / std::sqrt(16.0 * config.in_channels), rng);
  for (const auto& b : blocks) {
    p.at(b.prefix + "fixup_scale")[0] = T(1);
    fill_normal(p.at(b.prefix + "conv1.weight"), std::sqrt(2.0 / (b.planes * 9.0)) / std::sqrt(num_fixups), rng);
    if (b.has_downsample) fill_normal(p.at(b.prefix + b.downsample_weight()), std::sqrt(2.0 / b.planes), rng);
    fill_uniform(p.at(b.prefix + "se.excite.0.weight"), 1.0 / std::sqrt(double(b.planes)), rng);
    fill_uniform(p.at(b.prefix + "se.excite.0.bias"), 1.0 / std::sqrt(double(b.planes)), rng);
    fill_uniform(p.at(b.prefix + "se.excite.2.weight"), 1.0 / std::sqrt(double(b.se_hidden)), rng);
    fill_uniform(p.at(b.prefix + "se.excite.2.bias"), 1.0 / std::sqrt(double(b.se_hidden)), rng);
  }
  return p;
}

template <class T>
EncoderParams<T> EncoderParams<T>::perturbed_init(const EncoderConfig& config, uint64_t seed) {
  EncoderParams p = fixup_init(config, seed);
  std::mt19937_64 rng(seed ^ 0x9e3779b97f4a7c15ull);
  std::uniform_real_distribution<double> bias(-0.2, 0.2), scale(0.5, 1.5);
  for (const auto& b : config.blocks()) {
    fill_normal(p.at(b.prefix + "conv2.weight"), std::sqrt(2.0 / (b.planes * 9.0)) / 2.0, rng);
    for (const char* s : {"fixup_bias1a", "fixup_bias1b", "fixup_bias2a", "fixup_bias2b"})
      p.at(b.prefix + s)[0] = static_cast<T>(bias(rng));
    p.at(b.prefix + "fixup_scale")[0] = static_cast<T>(scale(rng));
  }
  return p;
}

template class EncoderParams<float>;
template class EncoderParams<double>;

}  // namespace kfuse
