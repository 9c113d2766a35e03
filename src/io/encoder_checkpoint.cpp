#include <algorithm>

#include "kfuse/checkpoint.h"
#include "kfuse/safetensors.h"

namespace kfuse {

template <class T>
EncoderParams<T> load_encoder_checkpoint(const std::string& path, const LoadOptions& options) {
  SafetensorsFile file = read_safetensors(path);
  const std::string where = "'" + path + "'";

  std::map<std::string, const SafetensorsTensor*> tensors;
  std::vector<ParamSpec> found;
  for (const auto& [name, t] : file.tensors) {
    if (name.compare(0, options.prefix.size(), options.prefix) != 0) continue;
    const std::string key = name.substr(options.prefix.size());
    tensors[key] = &t;
    found.push_back({key, t.shape});
  }
  KFUSE_CHECK(!tensors.empty(), CheckpointError, where, " holds no tensor",
              options.prefix.empty() ? "" : " whose name starts with '" + options.prefix + "'");

  EncoderConfig config;
  try {
    config = options.expect ? *options.expect : EncoderConfig::infer(found);
    config.validate();
  } catch (const Error& e) {
    throw CheckpointError(where + ": " + e.what());
  }

  EncoderParams<T> params(config);
  std::vector<std::string> missing, unexpected;
  for (const ParamSpec& spec : params.specs()) {
    auto it = tensors.find(spec.name);
    if (it == tensors.end()) {
      missing.push_back(spec.name);
      continue;
    }
    const SafetensorsTensor& t = *it->second;
    const std::string what = where + ": tensor '" + options.prefix + spec.name + "'";
    KFUSE_CHECK(t.shape == spec.shape, CheckpointError, what, " has shape ", shape_str(t.shape), ", expected ",
                shape_str(spec.shape), " for ", config.to_string());
    params.at(spec.name).values() = t.to_floats<T>(what);
  }
  for (const auto& [key, t] : tensors)
    if (!params.contains(key)) unexpected.push_back(options.prefix + key);

  auto join = [](const std::vector<std::string>& v) {
    std::string s;
    for (size_t i = 0; i < v.size() && i < 8; ++i) s += (i ? ", '" : "'") + v[i] + "'";
    if (v.size() > 8) s += ", ... (" + std::to_string(v.size()) + " in all)";
    return s;
  };
  KFUSE_CHECK(missing.empty(), CheckpointError, where, " lacks ", missing.size(), " tensor(s) of ",
              config.to_string(), ": ", join(missing));
  KFUSE_CHECK(unexpected.empty(), CheckpointError, where, " has ", unexpected.size(), " tensor(s) that ",
              config.to_string(), " does not have: ", join(unexpected));
  return params;
}

template <class T>
void save_encoder_checkpoint(const std::string& path, const EncoderParams<T>& params) {
  SafetensorsFile file;
  const EncoderConfig& c = params.config();
  file.metadata["format"] = "pt";  // what safetensors.torch writes; lets torch tools open the file
  file.metadata["kfuse.config"] = c.to_string();
  for (size_t i = 0; i < params.size(); ++i)
    file.tensors.emplace(params.specs()[i].name, make_safetensors_tensor(params.at(i)));
  write_safetensors(path, file);
}

template EncoderParams<float> load_encoder_checkpoint(const std::string&, const LoadOptions&);
template EncoderParams<double> load_encoder_checkpoint(const std::string&, const LoadOptions&);
template void save_encoder_checkpoint(const std::string&, const EncoderParams<float>&);
template void save_encoder_checkpoint(const std::string&, const EncoderParams<double>&);

}  // namespace kfuse
