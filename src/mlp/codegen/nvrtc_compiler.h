// NVRTC: CUDA source -> CUBIN (for a real architecture, "sm_90") or PTX (for a virtual one, "compute_80"). NVRTC is
// a host library (no driver, no GPU): the CPU tier compiles generated sources with it.
#pragma once

#include <string>
#include <vector>

#include "kfuse/error.h"

namespace kfuse::codegen {

// The program did not compile; what() quotes NVRTC's log, log() is the log alone.
class CompileError : public Error {
 public:
  CompileError(const std::string& what, std::string log) : Error(what), log_(std::move(log)) {}
  const std::string& log() const { return log_; }

 private:
  std::string log_;
};

struct CompiledProgram {
  std::string binary;  // CUBIN bytes, or PTX text
  bool is_cubin = false;
  std::string log;     // NVRTC's warnings, if any
};

// `arch`: "sm_XY" -> CUBIN, "compute_XY" -> PTX. `name` appears in NVRTC's messages. Throws CompileError.
CompiledProgram nvrtc_compile(const std::string& source, const std::string& name, const std::string& arch);

// The options every compile uses (part of the cache key).
std::string nvrtc_options_string();
// e.g. "13.0".
std::string nvrtc_version();
// The architectures this NVRTC can compile for, e.g. {75, 80, 86, 89, 90, ...}.
std::vector<int> nvrtc_supported_archs();
// The target for a device of compute capability major.minor: "sm_XY" when NVRTC knows it, else PTX for the newest
// virtual architecture it knows (the driver compiles that PTX for the device).
std::string nvrtc_target_for(int major, int minor);

}  // namespace kfuse::codegen
