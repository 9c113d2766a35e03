#include "kfuse/encoder_config.h"

#include <map>
#include <regex>
#include <sstream>

namespace kfuse {

std::string EncoderConfig::Block::downsample_weight() const {
  return stride > 1 ? "downsample.1.weight" : "downsample.0.weight";
}

void EncoderConfig::validate() const {
  KFUSE_CHECK(in_channels >= 1, InvalidArgument, "in_channels must be >= 1, got ", in_channels);
  // The SE bottleneck is int(planes / 16) wide and must keep at least one unit.
  KFUSE_CHECK(base_planes >= 16, InvalidArgument, "base_planes must be >= 16 (the SE layer has planes/16 units), got ",
              base_planes);
  KFUSE_CHECK(!layers.empty(), InvalidArgument, "layers must name at least one stage");
  KFUSE_CHECK(layers.size() <= 8, InvalidArgument, "at most 8 stages are supported, got ", layers.size());
  for (size_t i = 0; i < layers.size(); ++i)
    KFUSE_CHECK(layers[i] >= 1, InvalidArgument, "layers[", i, "] must be >= 1, got ", layers[i]);
}

std::vector<EncoderConfig::Block> EncoderConfig::blocks() const {
  validate();
  std::vector<Block> out;
  int inplanes = base_planes;
  for (size_t i = 0; i < layers.size(); ++i) {
    const int planes = base_planes << i;
    // bps-nav: the first stage keeps the resolution only in the four-stage networks.
    const int stage_stride = (i == 0 && layers.size() == 4) ? 1 : 2;
    for (int j = 0; j < layers[i]; ++j) {
      Block b;
      b.stage = static_cast<int>(i);
      b.index = j;
      b.prefix = "layers." + std::to_string(i) + "." + std::to_string(j) + ".";
      b.in_planes = inplanes;
      b.planes = planes;
      b.stride = j == 0 ? stage_stride : 1;
      b.has_downsample = b.stride != 1 || inplanes != planes;
      b.se_hidden = planes / 16;
      out.push_back(b);
      inplanes = planes;
    }
  }
  return out;
}

std::vector<ParamSpec> EncoderConfig::parameter_specs() const {
  std::vector<ParamSpec> specs;
  specs.push_back({"stem.1.weight", {base_planes, 16 * int64_t{in_channels}, 1, 1}});
  for (const Block& b : blocks()) {
    // Module registration order of bps-nav's SEFixupBasicBlock: own parameters first, then children.
    for (const char* s : {"fixup_bias1a", "fixup_bias1b", "fixup_bias2a", "fixup_scale", "fixup_bias2b"})
      specs.push_back({b.prefix + s, {1}});
    specs.push_back({b.prefix + "conv1.weight", {b.planes, b.in_planes, 3, 3}});
    specs.push_back({b.prefix + "conv2.weight", {b.planes, b.planes, 3, 3}});
    if (b.has_downsample) specs.push_back({b.prefix + b.downsample_weight(), {b.planes, b.in_planes, 1, 1}});
    specs.push_back({b.prefix + "se.excite.0.weight", {b.se_hidden, b.planes}});
    specs.push_back({b.prefix + "se.excite.0.bias", {b.se_hidden}});
    specs.push_back({b.prefix + "se.excite.2.weight", {b.planes, b.se_hidden}});
    specs.push_back({b.prefix + "se.excite.2.bias", {b.planes}});
  }
  return specs;
}

int EncoderConfig::backward_stages() const { return int(blocks().size()) + 1; }

std::vector<int> EncoderConfig::backward_stage_of_parameters() const {
  const std::vector<ParamSpec> specs = parameter_specs();
  const std::vector<Block> bs = blocks();
  const int n = int(bs.size());
  std::vector<int> stage(specs.size(), n);  // the stem's
  for (int i = 0; i < n; ++i) {
    const Block& b = bs[size_t(i)];
    for (size_t p = 0; p < specs.size(); ++p) {
      if (specs[p].name.rfind(b.prefix, 0) != 0) continue;
      const bool bias1a_after = specs[p].name == b.prefix + "fixup_bias1a" && (i == 0 || b.has_downsample);
      stage[p] = bias1a_after ? n - i : n - 1 - i;
    }
  }
  return stage;
}

int64_t EncoderConfig::num_parameters() const {
  int64_t n = 0;
  for (const ParamSpec& p : parameter_specs()) n += shape_numel(p.shape);
  return n;
}

int EncoderConfig::out_channels() const {
  validate();
  return base_planes << (layers.size() - 1);
}

int EncoderConfig::spatial_divisor() const {
  int d = 4;
  for (const Block& b : blocks()) d *= b.stride;
  return d;
}

Shape EncoderConfig::output_shape(const Shape& x) const {
  KFUSE_CHECK(x.size() == 4, InvalidArgument, "input must have rank 4 (N, C, H, W), got shape ", shape_str(x));
  KFUSE_CHECK(x[0] >= 1, InvalidArgument, "input batch must be >= 1, got shape ", shape_str(x));
  KFUSE_CHECK(x[1] == in_channels, InvalidArgument, "input has ", x[1], " channels but the encoder expects ",
              in_channels, " (shape ", shape_str(x), ")");
  const int d = spatial_divisor();
  KFUSE_CHECK(x[2] >= d && x[3] >= d && x[2] % d == 0 && x[3] % d == 0, InvalidArgument,
              "input height and width must be positive multiples of ", d, ", got shape ", shape_str(x));
  return {x[0], out_channels(), x[2] / d, x[3] / d};
}

std::string EncoderConfig::to_string() const {
  std::ostringstream os;
  os << "EncoderConfig(in_channels=" << in_channels << ", base_planes=" << base_planes << ", layers=(";
  for (size_t i = 0; i < layers.size(); ++i) os << (i ? "," : "") << layers[i];
  os << "))";
  return os.str();
}

EncoderConfig EncoderConfig::infer(const std::vector<ParamSpec>& params) {
  const ParamSpec* stem = nullptr;
  std::map<int, int> blocks_per_stage;  // stage -> highest block index + 1
  static const std::regex block_key(R"(layers\.(\d+)\.(\d+)\..*)");
  for (const ParamSpec& p : params) {
    if (p.name == "stem.1.weight") stem = &p;
    std::smatch m;
    if (std::regex_match(p.name, m, block_key)) {
      const int stage = std::stoi(m[1]), index = std::stoi(m[2]);
      KFUSE_CHECK(stage < 8 && index < 1024, CheckpointError, "implausible block key '", p.name, "'");
      blocks_per_stage[stage] = std::max(blocks_per_stage[stage], index + 1);
    }
  }
  KFUSE_CHECK(stem, CheckpointError, "missing tensor 'stem.1.weight' (the stem convolution); cannot infer the network");
  KFUSE_CHECK(stem->shape.size() == 4 && stem->shape[2] == 1 && stem->shape[3] == 1 && stem->shape[1] % 16 == 0 &&
                  stem->shape[1] > 0,
              CheckpointError, "'stem.1.weight' has shape ", shape_str(stem->shape),
              ", expected [base_planes, 16 * in_channels, 1, 1]");
  KFUSE_CHECK(!blocks_per_stage.empty(), CheckpointError, "no 'layers.<i>.<j>.*' tensors: not an encoder checkpoint");
  EncoderConfig cfg;
  cfg.base_planes = static_cast<int>(stem->shape[0]);
  cfg.in_channels = static_cast<int>(stem->shape[1] / 16);
  cfg.layers.clear();
  for (int s = 0; s < static_cast<int>(blocks_per_stage.size()); ++s) {
    KFUSE_CHECK(blocks_per_stage.count(s), CheckpointError, "stage ", s, " has no tensors ('layers.", s,
                ".*' missing) but later stages do");
    cfg.layers.push_back(blocks_per_stage[s]);
  }
  try {
    cfg.validate();
  } catch (const InvalidArgument& e) {
    throw CheckpointError(std::string("checkpoint does not describe a valid encoder: ") + e.what());
  }
  return cfg;
}

bool operator==(const EncoderConfig& a, const EncoderConfig& b) {
  return a.in_channels == b.in_channels && a.base_planes == b.base_planes && a.layers == b.layers;
}

}  // namespace kfuse
