// kfuse's error types. Every check that rejects user input throws one of these with a message that names the
// problem (the tensor, the expected and actual shape / dtype / device, the file, ...). The Python binding maps
// InvalidArgument to ValueError, CheckpointError to ValueError, Unsupported to NotImplementedError and other
// kfuse::Error to RuntimeError.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace kfuse {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A call's arguments are wrong: shape, dtype, layout, device, configuration.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// A checkpoint file cannot be read or does not fit the network: missing/extra/misshapen/mistyped tensors,
// truncated or corrupt files.
class CheckpointError : public Error {
 public:
  using Error::Error;
};

// The request is valid but this build or this device cannot serve it (no GPU, architecture too old, ...).
class Unsupported : public Error {
 public:
  using Error::Error;
};

namespace detail {
template <class... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace kfuse

// KFUSE_CHECK(cond, ErrorType, message parts...): throws ErrorType(concat(parts...)) when cond is false.
#define KFUSE_CHECK(cond, ErrorType, ...)                            \
  do {                                                               \
    if (!(cond)) throw ::kfuse::ErrorType(::kfuse::detail::concat(__VA_ARGS__)); \
  } while (0)
