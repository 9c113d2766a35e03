// User activations are checked by compiling them alone (a few milliseconds of NVRTC) when they are defined, so
// that a typo surfaces with the activation's name and NVRTC's message, not later inside a whole MLP module.
#include "kfuse/error.h"
#include "kfuse/mlp.h"
#if KFUSE_WITH_CUDA
#include "mlp/codegen/mlp_codegen.h"
#include "mlp/codegen/nvrtc_compiler.h"
#endif

namespace kfuse {

void validate_activation(const Activation& a) {
  a.check_syntax();
#if KFUSE_WITH_CUDA
  try {
    codegen::nvrtc_compile(codegen::activation_probe_source(a), "activation_" + a.name + ".cu", "compute_80");
  } catch (const codegen::CompileError& e) {
    throw InvalidArgument("activation '" + a.name + "' does not compile (expression '" + a.expression +
                          "', derivative '" + a.derivative + "'); NVRTC's log:\n" + e.log());
  }
#else
  throw Unsupported("user-defined activations need a CUDA build of kfuse (NVRTC checks them)");
#endif
}

}  // namespace kfuse
