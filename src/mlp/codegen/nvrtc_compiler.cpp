#include "mlp/codegen/nvrtc_compiler.h"

#include <nvrtc.h>

#include <algorithm>

namespace kfuse::codegen {
namespace {

const std::vector<std::string>& base_options() {
  // No include paths: generated sources are self-contained. No fast math: user activations keep IEEE expf/tanhf.
  static const std::vector<std::string> opts{"-std=c++17", "-DNDEBUG", "--fmad=true"};
  return opts;
}

void check(nvrtcResult r, const char* what) {
  KFUSE_CHECK(r == NVRTC_SUCCESS, Error, "NVRTC ", what, " failed: ", nvrtcGetErrorString(r));
}

// Frees the program on every path.
struct Program {
  nvrtcProgram p = nullptr;
  ~Program() {
    if (p) nvrtcDestroyProgram(&p);
  }
};

}  // namespace

CompiledProgram nvrtc_compile(const std::string& source, const std::string& name, const std::string& arch) {
  const bool cubin = arch.rfind("sm_", 0) == 0;
  KFUSE_CHECK(cubin || arch.rfind("compute_", 0) == 0, InvalidArgument, "NVRTC target must be sm_XY or compute_XY, got '",
              arch, "'");
  Program prog;
  check(nvrtcCreateProgram(&prog.p, source.c_str(), name.c_str(), 0, nullptr, nullptr), "nvrtcCreateProgram");
  std::vector<std::string> opts = base_options();
  opts.push_back("--gpu-architecture=" + arch);
  std::vector<const char*> argv;
  for (const auto& o : opts) argv.push_back(o.c_str());
  const nvrtcResult r = nvrtcCompileProgram(prog.p, static_cast<int>(argv.size()), argv.data());
  size_t log_size = 0;
  nvrtcGetProgramLogSize(prog.p, &log_size);
  std::string log(log_size, '\0');
  if (log_size > 1) nvrtcGetProgramLog(prog.p, log.data());
  while (!log.empty() && (log.back() == '\0' || log.back() == '\n')) log.pop_back();
  if (r != NVRTC_SUCCESS)
    throw CompileError("NVRTC could not compile '" + name + "' for " + arch + " (" + nvrtcGetErrorString(r) +
                           "); NVRTC's log:\n" + log,
                       log);
  CompiledProgram out;
  out.is_cubin = cubin;
  out.log = log;
  size_t size = 0;
  if (cubin) {
    check(nvrtcGetCUBINSize(prog.p, &size), "nvrtcGetCUBINSize");
    out.binary.resize(size);
    check(nvrtcGetCUBIN(prog.p, out.binary.data()), "nvrtcGetCUBIN");
  } else {
    check(nvrtcGetPTXSize(prog.p, &size), "nvrtcGetPTXSize");
    out.binary.resize(size);
    check(nvrtcGetPTX(prog.p, out.binary.data()), "nvrtcGetPTX");
  }
  return out;
}

std::string nvrtc_options_string() {
  std::string s;
  for (const auto& o : base_options()) s += (s.empty() ? "" : " ") + o;
  return s;
}

std::string nvrtc_version() {
  int major = 0, minor = 0;
  check(nvrtcVersion(&major, &minor), "nvrtcVersion");
  return std::to_string(major) + "." + std::to_string(minor);
}

std::vector<int> nvrtc_supported_archs() {
  int n = 0;
  check(nvrtcGetNumSupportedArchs(&n), "nvrtcGetNumSupportedArchs");
  std::vector<int> archs(static_cast<size_t>(n));
  if (n) check(nvrtcGetSupportedArchs(archs.data()), "nvrtcGetSupportedArchs");
  return archs;
}

std::string nvrtc_target_for(int major, int minor) {
  const int cc = major * 10 + minor;
  const std::vector<int> archs = nvrtc_supported_archs();
  if (std::find(archs.begin(), archs.end(), cc) != archs.end()) return "sm_" + std::to_string(cc);
  int best = 0;
  for (int a : archs)
    if (a <= cc) best = std::max(best, a);
  KFUSE_CHECK(best >= 80, Unsupported, "NVRTC ", nvrtc_version(), " cannot compile for compute capability ", major,
              ".", minor, " (fused MLPs need sm_80 or newer)");
  return "compute_" + std::to_string(best);
}

}  // namespace kfuse::codegen
