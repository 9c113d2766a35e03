// The built-in activations as CUDA float expressions (value of x; derivative of x and/or y = the value), and the
// checks of user-defined ones. The derivatives prefer y where it is exact, since y is stored for the next layer's
// weight gradient anyway; x (the pre-activation) costs an extra stored tensor.
#include <cctype>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>

#include "kfuse/error.h"
#include "kfuse/mlp.h"

namespace kfuse {
namespace {

// The identifiers of a C expression (so that "fmaxf(x, 0.f)" uses x and "exp" does not).
std::set<std::string> identifiers(const std::string& expr) {
  std::set<std::string> out;
  for (size_t i = 0; i < expr.size();) {
    const unsigned char c = static_cast<unsigned char>(expr[i]);
    if (std::isalpha(c) || c == '_') {
      size_t j = i;
      while (j < expr.size() && (std::isalnum(static_cast<unsigned char>(expr[j])) || expr[j] == '_')) ++j;
      out.insert(expr.substr(i, j - i));
      i = j;
    } else if (std::isdigit(c) || c == '.') {
      // A number with its suffix and exponent (1.0f, 2e-3f): not identifiers.
      size_t j = i;
      while (j < expr.size() && (std::isalnum(static_cast<unsigned char>(expr[j])) || expr[j] == '.' ||
                                 ((expr[j] == '-' || expr[j] == '+') && (expr[j - 1] == 'e' || expr[j - 1] == 'E'))))
        ++j;
      i = j;
    } else {
      ++i;
    }
  }
  return out;
}

std::string flt(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9gf", v);
  const std::string s = buf;  // "%g" may print an integer ("2f"), not a float literal
  if (s.find_first_of(".e") != std::string::npos) return s;
  return s.substr(0, s.size() - 1) + ".0f";
}

}  // namespace

bool Activation::derivative_uses_x() const { return identifiers(derivative).count("x") > 0; }
bool Activation::derivative_uses_y() const { return identifiers(derivative).count("y") > 0; }

void Activation::check_syntax() const {
  KFUSE_CHECK(!name.empty(), InvalidArgument, "activation name is empty");
  for (char c : name)
    KFUSE_CHECK(std::isalnum(static_cast<unsigned char>(c)) || c == '_', InvalidArgument, "activation name '", name,
                "' may hold only letters, digits and '_'");
  auto check = [&](const std::string& what, const std::string& e) {
    KFUSE_CHECK(e.find_first_not_of(" \t") != std::string::npos, InvalidArgument, "activation '", name, "': ", what,
                " is empty");
    KFUSE_CHECK(e.find_first_of(";{}#\\\n\r") == std::string::npos, InvalidArgument, "activation '", name, "': ",
                what, " '", e, "' must be a single CUDA expression (no ';', '{', '}', '#', '\\' or newline)");
  };
  check("expression", expression);
  check("derivative", derivative);
  KFUSE_CHECK(identifiers(expression).count("y") == 0, InvalidArgument, "activation '", name, "': expression '",
              expression, "' may use x only (y is the activation's value, known to the derivative)");
}

std::vector<std::string> builtin_activation_names() {
  return {"relu", "leaky_relu", "sigmoid", "tanh", "silu", "gelu", "softplus", "identity"};
}

Activation builtin_activation(const std::string& name, double alpha) {
  if (name == "identity") return {"identity", "x", "1.0f"};
  if (name == "relu") return {"relu", "fmaxf(x, 0.0f)", "(y > 0.0f ? 1.0f : 0.0f)"};
  if (name == "leaky_relu") {
    const double a = std::isnan(alpha) ? 0.01 : alpha;
    const std::string s = flt(a);
    // With a positive slope y > 0 exactly when x > 0: the derivative needs no stored pre-activation.
    return {"leaky_relu", "(x > 0.0f ? x : " + s + " * x)",
            a > 0 ? "(y > 0.0f ? 1.0f : " + s + ")" : "(x > 0.0f ? 1.0f : " + s + ")"};
  }
  if (name == "sigmoid") return {"sigmoid", "(1.0f / (1.0f + expf(-x)))", "(y * (1.0f - y))"};
  if (name == "tanh") return {"tanh", "tanhf(x)", "(1.0f - y * y)"};
  if (name == "silu") return {"silu", "(x / (1.0f + expf(-x)))",
                              "((1.0f / (1.0f + expf(-x))) * (1.0f + x * (1.0f - 1.0f / (1.0f + expf(-x)))))"};
  if (name == "gelu") {
    // PyTorch's gelu(approximate='tanh'): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
    const std::string inner = "(0.7978845608f * (x + 0.044715f * x * x * x))";
    return {"gelu", "(0.5f * x * (1.0f + tanhf" + inner + "))",
            "(0.5f * (1.0f + tanhf" + inner + ") + 0.5f * x * (1.0f - tanhf" + inner + " * tanhf" + inner +
                ") * 0.7978845608f * (1.0f + 0.134145f * x * x))"};
  }
  if (name == "softplus") {
    // PyTorch's softplus(beta, threshold=20): x where beta x > 20, else log1p(exp(beta x)) / beta.
    const double beta = std::isnan(alpha) ? 1.0 : alpha;
    KFUSE_CHECK(beta > 0, InvalidArgument, "softplus beta must be > 0, got ", beta);
    const std::string b = flt(beta);
    return {"softplus", "(x * " + b + " > 20.0f ? x : log1pf(expf(x * " + b + ")) / " + b + ")",
            "(x * " + b + " > 20.0f ? 1.0f : 1.0f / (1.0f + expf(-x * " + b + ")))"};
  }
  std::string known;
  for (const auto& n : builtin_activation_names()) known += (known.empty() ? "" : ", ") + n;
  throw InvalidArgument("unknown activation '" + name + "' (built-in: " + known +
                        "; or define one with a CUDA expression and its derivative)");
}

Activation user_activation(const std::string& name, const std::string& expression, const std::string& derivative) {
  Activation a{name, expression, derivative};
  a.check_syntax();
  validate_activation(a);
  return a;
}

}  // namespace kfuse
