// Helpers shared by the generated MLP's CPU tests (test_mlp_codegen.cpp, test_mlp_nvrtc.cpp).
#pragma once

#include <string>
#include <vector>

#include "kfuse/error.h"
#include "kfuse/mlp.h"

namespace kfuse::mlp_test {

inline MlpSpec make_spec(int in, std::vector<int> hidden, int out, const std::string& act = "relu",
                  MlpDType dtype = MlpDType::kFloat16) {
  MlpSpec s;
  s.input_width = in;
  s.hidden_widths = hidden;
  s.output_width = out;
  s.activations.assign(hidden.size(), builtin_activation(act));
  s.output_activation = builtin_activation("identity");
  s.dtype = dtype;
  return s;
}

template <class Fn>
inline std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "<no InvalidArgument>";
}

}  // namespace kfuse::mlp_test
