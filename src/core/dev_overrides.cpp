#include "core/dev_overrides.h"

#include <cstdlib>
#include <initializer_list>
#include <string>

#include "kfuse/error.h"

namespace kfuse {

namespace {

// The variable's value, or nullptr where it is unset or empty.
const char* value_of(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

// One of `choices` (their index), or an error that lists them with `meaning`.
int choice(const char* name, const char* value, std::initializer_list<const char*> choices, const char* meaning) {
  int i = 0;
  for (const char* c : choices) {
    if (std::string(value) == c) return i;
    ++i;
  }
  throw InvalidArgument(std::string(name) + " must be " + meaning + ", got '" + value + "'");
}

void read_flag(const char* name, const char* off, bool& flag) {
  if (const char* v = value_of(name))
    flag = choice(name, v, {"0", "1"}, (std::string("0 (") + off + ") or 1").c_str()) == 1;
}

}  // namespace

EncoderOptions with_dev_overrides(EncoderOptions o) {
  if (const char* v = value_of("KFUSE_PDL"))
    o.programmatic_launch =
        choice("KFUSE_PDL", v, {"0", "1", "2", "3"}, "0 (off), 1, 2 or 3 (which kernel boundaries launch early)");
  read_flag("KFUSE_FUSED_BLOCK", "off", o.fused_blocks);
  read_flag("KFUSE_FUSED_STEM", "off", o.fused_stem);
  read_flag("KFUSE_WGMMA_BLOCK", "off", o.wgmma_blocks);
  if (const char* v = value_of("KFUSE_FUSED_DOWN"))
    o.fused_down = choice("KFUSE_FUSED_DOWN", v, {"0", "1", "2"}, "0 (off), 1 (blocks 2 and 3) or 2 (block 2 only)");
  read_flag("KFUSE_SE_WEIGHTS_T", "fp32 fc weights", o.se_weights_t);
  read_flag("KFUSE_SE_PROJECTION", "off", o.se_projection);
  read_flag("KFUSE_WGRAD_BRANCH", "everything on the main stream", o.wgrad_branch);
  if (const char* v = value_of("KFUSE_CUDNN_FUSED"))
    o.cudnn_fused =
        choice("KFUSE_CUDNN_FUSED", v, {"0", "1", "all"}, "0 (never), 1 (where the tuner runs conv1 in cuDNN) or all");
  return o;
}

MlpOptions with_dev_overrides(MlpOptions o) {
  read_flag("KFUSE_MLP_PACKED_RELU", "ReLU per element", o.packed_relu);
  read_flag("KFUSE_MLP_STAGED_STORES", "direct stores", o.staged_stores);
  read_flag("KFUSE_MLP_MMA_BIAS", "the bias added after the MMA", o.mma_bias);
  return o;
}

}  // namespace kfuse
