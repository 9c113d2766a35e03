// kfuse._C's fused-MLP part: FusedMlpGpu (kfuse::FusedMlp) and the activation helpers. Tensors cross as DLPack;
// every device, dtype, shape and size is checked here against the spec and named in the error, so that the core
// receives only raw pointers it can trust. python/kfuse/mlp.py is the torch-facing layer.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "kfuse/error.h"
#include "kfuse/mlp.h"
#include "tuning_report_dict.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace kfuse {
namespace {

using Array = nb::ndarray<>;
using ActivationTuple = std::tuple<std::string, std::string, std::string>;  // name, expression, derivative

ActivationTuple to_tuple(const Activation& a) { return {a.name, a.expression, a.derivative}; }
Activation from_tuple(const ActivationTuple& t) { return {std::get<0>(t), std::get<1>(t), std::get<2>(t)}; }

std::string shape_text(const Array& a) {
  std::string s = "(";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

bool is_c_contiguous(const Array& a) {
  int64_t expected = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expected) return false;
    expected *= static_cast<int64_t>(a.shape(i));
  }
  return true;
}

std::string dtype_text(nb::dlpack::dtype d) {
  if (d.code == uint8_t(nb::dlpack::dtype_code::Float)) return "float" + std::to_string(d.bits);
  if (d.code == uint8_t(nb::dlpack::dtype_code::Bfloat)) return "bfloat" + std::to_string(d.bits);
  if (d.code == uint8_t(nb::dlpack::dtype_code::UInt)) return "uint" + std::to_string(d.bits);
  if (d.code == uint8_t(nb::dlpack::dtype_code::Int)) return "int" + std::to_string(d.bits);
  return "other" + std::to_string(d.bits);
}

enum class Want { kCompute, kFloat32, kBytes };

// Checks a CUDA tensor: on the MLP's device, contiguous, of the wanted dtype and (when given) shape; returns its
// pointer. Byte buffers must hold at least `min_bytes`.
void* checked(const FusedMlp& mlp, const Array& a, const std::string& what, Want want,
              const std::vector<int64_t>& shape = {}, size_t min_bytes = 0) {
  KFUSE_CHECK(a.device_type() == nb::device::cuda::value, InvalidArgument, what,
              " must be a CUDA tensor (got device type ", a.device_type(), ")");
  KFUSE_CHECK(a.device_id() == mlp.device(), InvalidArgument, what, " is on cuda:", a.device_id(),
              " but the MLP's kernels are on cuda:", mlp.device());
  const auto d = a.dtype();
  if (want == Want::kCompute) {
    const bool bf16 = mlp.spec().dtype == MlpDType::kBFloat16;
    const bool ok = d.bits == 16 && d.code == uint8_t(bf16 ? nb::dlpack::dtype_code::Bfloat : nb::dlpack::dtype_code::Float);
    KFUSE_CHECK(ok, InvalidArgument, what, " has dtype ", dtype_text(d), ", expected ", mlp_dtype_name(mlp.spec().dtype));
  } else if (want == Want::kFloat32) {
    KFUSE_CHECK(d == nb::dtype<float>(), InvalidArgument, what, " has dtype ", dtype_text(d), ", expected float32");
  } else {
    KFUSE_CHECK(d == nb::dtype<uint8_t>(), InvalidArgument, what, " has dtype ", dtype_text(d), ", expected uint8");
  }
  KFUSE_CHECK(is_c_contiguous(a), InvalidArgument, what, " must be contiguous; call .contiguous() first");
  if (!shape.empty()) {
    bool same = a.ndim() == shape.size();
    for (size_t i = 0; same && i < shape.size(); ++i) same = static_cast<int64_t>(a.shape(i)) == shape[i];
    std::string expected = "(";
    for (size_t i = 0; i < shape.size(); ++i) expected += (i ? ", " : "") + std::to_string(shape[i]);
    expected += shape.size() == 1 ? ",)" : ")";
    KFUSE_CHECK(same, InvalidArgument, what, " has shape ", shape_text(a), ", expected ", expected);
  }
  if (want == Want::kBytes)
    KFUSE_CHECK(a.size() >= min_bytes, InvalidArgument, what, " holds ", a.size(), " bytes, needs ", min_bytes);
  return a.data();
}

int64_t batch_of(const FusedMlp& mlp, const Array& x) {
  KFUSE_CHECK(x.ndim() == 2, InvalidArgument, "input must be 2-D (batch, ", mlp.spec().input_width, "), got shape ",
              shape_text(x));
  KFUSE_CHECK(static_cast<int64_t>(x.shape(1)) == mlp.spec().input_width, InvalidArgument, "input has ", x.shape(1),
              " features, the MLP takes ", mlp.spec().input_width);
  return static_cast<int64_t>(x.shape(0));
}

FusedMlp::Stream as_stream(uintptr_t s) { return reinterpret_cast<FusedMlp::Stream>(s); }
void* raw(uintptr_t p) { return reinterpret_cast<void*>(p); }

// (m_tiles, warps, weights_resident, k_chunk[, fused_wgrad[, wgmma[, recompute[, wgmma_backward]]]]): MlpVariant's
// fields in order.
MlpVariant variant_from_tuple(const nb::tuple& t) {
  KFUSE_CHECK(t.size() >= 4 && t.size() <= 8, InvalidArgument,
              "variant must be (m_tiles, warps, weights_resident, k_chunk[, fused_wgrad[, wgmma[, recompute[, "
              "wgmma_backward]]]]), got ",
              t.size(), " items");
  MlpVariant v{nb::cast<int>(t[0]), nb::cast<int>(t[1]), nb::cast<bool>(t[2]), nb::cast<int>(t[3])};
  if (t.size() >= 5) v.fused_wgrad = nb::cast<bool>(t[4]);
  if (t.size() >= 6) v.wgmma = nb::cast<bool>(t[5]);
  if (t.size() >= 7) v.recompute = nb::cast<int>(t[6]);
  if (t.size() == 8) v.wgmma_backward = nb::cast<bool>(t[7]);
  return v;
}

nb::tuple variant_tuple(const MlpVariant& v) {
  return nb::make_tuple(v.m_tiles, v.warps, v.weights_resident, v.k_chunk, v.fused_wgrad, v.wgmma, v.recompute,
                        v.wgmma_backward);
}

// MlpOptions (kfuse/mlp_options.h) by field name, as Python passes them: the names not given keep their defaults.
using MlpOptionMap = std::map<std::string, bool>;
constexpr std::pair<const char*, bool MlpOptions::*> kMlpOptionFields[] = {
    {"packed_relu", &MlpOptions::packed_relu},
    {"staged_stores", &MlpOptions::staged_stores},
    {"mma_bias", &MlpOptions::mma_bias}};

MlpOptions to_mlp_options(const MlpOptionMap& given) {
  MlpOptions o;
  for (const auto& [name, value] : given) {
    bool known = false;
    for (const auto& [n, field] : kMlpOptionFields)
      if (name == n) o.*field = value, known = true;
    if (!known) {
      std::string names;
      for (const auto& [n, field] : kMlpOptionFields) names += std::string(names.empty() ? "" : ", ") + n;
      throw InvalidArgument("unknown MLP option '" + name + "' (options: " + names + ")");
    }
  }
  return o;
}

MlpOptionMap from_mlp_options(const MlpOptions& o) {
  MlpOptionMap out;
  for (const auto& [n, field] : kMlpOptionFields) out[n] = o.*field;
  return out;
}

nb::dict build_info_dict(const FusedMlp& mlp) {
  const MlpBuildInfo& b = mlp.build_info();
  nb::dict d;
  d["cache_file"] = b.cache_file;
  d["from_disk_cache"] = b.from_disk_cache;
  d["from_memory"] = b.from_memory;
  d["compile_seconds"] = b.compile_seconds;
  d["load_seconds"] = b.load_seconds;
  d["arch"] = b.arch;
  d["variant"] = mlp.variant().name();
  return d;
}

}  // namespace
}  // namespace kfuse

namespace kfuse {
namespace {

// The activations and the generated source (module functions) ...
void bind_mlp_codegen(nb::module_& m) {
  m.def("mlp_builtin_activation",
        [](const std::string& name, std::optional<double> alpha) {
          return to_tuple(alpha ? builtin_activation(name, *alpha) : builtin_activation(name));
        },
        "name"_a, "alpha"_a = nb::none(), "(name, expression, derivative) of a built-in activation");
  m.def("mlp_builtin_activation_names", &builtin_activation_names);
  m.def("mlp_validate_activation",
        [](const std::string& name, const std::string& expression, const std::string& derivative, bool compile) {
          Activation a{name, expression, derivative};
          a.check_syntax();
          if (compile) {
            nb::gil_scoped_release release;
            validate_activation(a);
          }
          return nb::make_tuple(a.derivative_uses_x(), a.derivative_uses_y());
        },
        "name"_a, "expression"_a, "derivative"_a, "compile"_a = true,
        "Checks a user activation (syntax; with compile=True also NVRTC); returns (derivative uses x, uses y)");
  m.def("mlp_options", [](const MlpOptionMap& given) { return from_mlp_options(to_mlp_options(given)); },
        "options"_a, "Every MlpOptions field (kfuse/mlp_options.h): the given ones, the rest at their defaults; "
        "raises ValueError naming an unknown field");
  m.def("mlp_spec_string",
        [](int in, const std::vector<int>& hidden, int out, const std::vector<ActivationTuple>& acts,
           const ActivationTuple& out_act, const std::vector<bool>& bias, const std::string& dtype) {
          MlpSpec s{in, hidden, out, {}, from_tuple(out_act), bias,
                    dtype == "bfloat16" ? MlpDType::kBFloat16 : MlpDType::kFloat16};
          for (const auto& a : acts) s.activations.push_back(from_tuple(a));
          s.validate();
          return s.to_string();
        },
        "input_width"_a, "hidden_widths"_a, "output_width"_a, "activations"_a, "output_activation"_a, "bias"_a,
        "dtype"_a, "Validates an MLP spec (raises ValueError naming the problem) and describes it");

#if KFUSE_WITH_CUDA
  m.def(
      "mlp_tune",
      [](int in, const std::vector<int>& hidden, int out, const std::vector<ActivationTuple>& acts,
         const ActivationTuple& out_act, const std::vector<bool>& bias, const std::string& dtype, int device,
         int64_t batch, const std::string& mode, const MlpOptionMap& options) {
        KFUSE_CHECK(dtype == "float16" || dtype == "bfloat16", InvalidArgument,
                    "MLP dtype must be 'float16' or 'bfloat16', got '", dtype, "'");
        MlpSpec s{in, hidden, out, {}, from_tuple(out_act), bias,
                  dtype == "bfloat16" ? MlpDType::kBFloat16 : MlpDType::kFloat16};
        for (const auto& a : acts) s.activations.push_back(from_tuple(a));
        const TuningMode tm = parse_tuning_mode(mode);
        const MlpOptions o = to_mlp_options(options);
        MlpTuning t;
        {
          nb::gil_scoped_release release;
          t = tune_mlp(s, device, batch, tm, {}, o);
        }
        nb::list rows;
        for (const auto& r : t.rows) rows.append(report_dict(r));
        return nb::make_tuple(variant_tuple(t.forward), variant_tuple(t.backward), rows);
      },
      "input_width"_a, "hidden_widths"_a, "output_width"_a, "activations"_a, "output_activation"_a, "bias"_a,
      "dtype"_a, "device"_a, "batch"_a, "mode"_a = "on", "options"_a = MlpOptionMap{},
      "Tunes the forward and backward kernel variants (kfuse::tune_mlp) of an MLP with `options` (mlp_options); "
      "returns (forward, backward, report rows)");
}

// ... the module's construction, weights and sizes ...
void bind_mlp_setup(nb::class_<FusedMlp>& mlp) {
  mlp.def("__init__",
           [](FusedMlp* self, int in, const std::vector<int>& hidden, int out, const std::vector<ActivationTuple>& acts,
              const ActivationTuple& out_act, const std::vector<bool>& bias, const std::string& dtype, int device,
              std::optional<nb::tuple> variant, const MlpOptionMap& options) {
             KFUSE_CHECK(dtype == "float16" || dtype == "bfloat16", InvalidArgument,
                         "MLP dtype must be 'float16' or 'bfloat16', got '", dtype, "'");
             MlpSpec s{in, hidden, out, {}, from_tuple(out_act), bias,
                       dtype == "bfloat16" ? MlpDType::kBFloat16 : MlpDType::kFloat16};
             for (const auto& a : acts) s.activations.push_back(from_tuple(a));
             const std::optional<MlpVariant> v =
                 variant ? std::optional<MlpVariant>(variant_from_tuple(*variant)) : std::nullopt;
             const MlpOptions o = to_mlp_options(options);
             nb::gil_scoped_release release;
             if (v) {
               new (self) FusedMlp(s, device, *v, o);
             } else {
               new (self) FusedMlp(s, device, o);
             }
           },
           "input_width"_a, "hidden_widths"_a, "output_width"_a, "activations"_a, "output_activation"_a, "bias"_a,
           "dtype"_a, "device"_a, "variant"_a = nb::none(), "options"_a = MlpOptionMap{},
           "options: MlpOptions fields by name (kfuse/mlp_options.h), bools; the rest keep their defaults")
      .def("options", [](const FusedMlp& f) { return from_mlp_options(f.options()); },
           "the options in effect (given, with developer overrides from the environment applied)")
      .def_prop_ro("build_info", &build_info_dict)
      .def_prop_ro("num_parameters", [](const FusedMlp& f) { return f.spec().num_parameters(); })
      .def("packed_weights_bytes", &FusedMlp::packed_weights_bytes)
      .def("stash_bytes", &FusedMlp::stash_bytes, "batch"_a)
      .def("backward_workspace_bytes", &FusedMlp::backward_workspace_bytes, "batch"_a)
      .def("pack_weights",
           [](const FusedMlp& f, const std::vector<Array>& weights, const std::vector<std::optional<Array>>& biases,
              const Array& packed, uintptr_t stream) {
             const MlpSpec& s = f.spec();
             KFUSE_CHECK(static_cast<int>(weights.size()) == s.num_layers() &&
                             static_cast<int>(biases.size()) == s.num_layers(),
                         InvalidArgument, "expected ", s.num_layers(), " weights and biases, got ", weights.size(),
                         " and ", biases.size());
             std::vector<const void*> w, b;
             for (int l = 0; l < s.num_layers(); ++l) {
               const std::string name = "layer " + std::to_string(l);
               w.push_back(checked(f, weights[l], name + " weight", Want::kCompute, {s.layer_out(l), s.layer_in(l)}));
               KFUSE_CHECK(biases[l].has_value() == s.has_bias(l), InvalidArgument, name,
                           s.has_bias(l) ? " needs a bias" : " has no bias, but one was given");
               b.push_back(biases[l] ? checked(f, *biases[l], name + " bias", Want::kCompute, {s.layer_out(l)})
                                     : nullptr);
             }
             void* out = checked(f, packed, "packed weight buffer", Want::kBytes, {}, f.packed_weights_bytes());
             nb::gil_scoped_release release;
             f.pack_weights(w, b, out, as_stream(stream));
           },
           "weights"_a, "biases"_a, "packed"_a, "stream"_a);
}

// ... and its calls (tensors, or raw pointers for the dispatcher ops).
void bind_mlp_calls(nb::class_<FusedMlp>& mlp) {
  mlp.def("forward",
           [](const FusedMlp& f, const Array& packed, const Array& x, const Array& y, uintptr_t stream) {
             const int64_t n = batch_of(f, x);
             const void* pk = checked(f, packed, "packed weight buffer", Want::kBytes, {}, f.packed_weights_bytes());
             const void* xp = checked(f, x, "input", Want::kCompute);
             void* yp = checked(f, y, "output", Want::kCompute, {n, f.spec().output_width});
             nb::gil_scoped_release release;
             f.forward(pk, xp, yp, n, as_stream(stream));
           },
           "packed"_a, "x"_a, "y"_a, "stream"_a)
      .def("forward_train",
           [](const FusedMlp& f, const Array& packed, const Array& x, const Array& y, const Array& stash,
              uintptr_t stream) {
             const int64_t n = batch_of(f, x);
             const void* pk = checked(f, packed, "packed weight buffer", Want::kBytes, {}, f.packed_weights_bytes());
             const void* xp = checked(f, x, "input", Want::kCompute);
             void* yp = checked(f, y, "output", Want::kCompute, {n, f.spec().output_width});
             void* st = checked(f, stash, "stash", Want::kBytes, {}, f.stash_bytes(n));
             nb::gil_scoped_release release;
             f.forward_train(pk, xp, yp, st, n, as_stream(stream));
           },
           "packed"_a, "x"_a, "y"_a, "stash"_a, "stream"_a)
      .def("backward",
           [](const FusedMlp& f, const Array& packed, const Array& x, const Array& y, const Array& dy,
              const Array& stash, const Array& workspace, const Array& grads, std::optional<Array> dx,
              uintptr_t stream) {
             const int64_t n = batch_of(f, x);
             const std::vector<int64_t> out_shape{n, f.spec().output_width};
             const void* pk = checked(f, packed, "packed weight buffer", Want::kBytes, {}, f.packed_weights_bytes());
             const void* xp = checked(f, x, "input", Want::kCompute);
             const void* yp = checked(f, y, "output", Want::kCompute, out_shape);
             const void* dyp = checked(f, dy, "output gradient", Want::kCompute, out_shape);
             const void* st = checked(f, stash, "stash", Want::kBytes, {}, f.stash_bytes(n));
             void* ws = checked(f, workspace, "backward workspace", Want::kBytes, {}, f.backward_workspace_bytes(n));
             // float32 gradients, or 16-bit ones in the MLP's dtype (rounded once by the kernels).
             const bool grads_f32 = grads.dtype() == nb::dtype<float>();
             void* g = checked(f, grads, "gradient buffer", grads_f32 ? Want::kFloat32 : Want::kCompute,
                               {f.spec().num_parameters()});
             void* dxp = dx ? checked(f, *dx, "input gradient", Want::kCompute, {n, f.spec().input_width}) : nullptr;
             nb::gil_scoped_release release;
             f.backward(pk, xp, yp, dyp, st, ws, g, grads_f32 ? MlpGradDType::kFloat32 : MlpGradDType::kSpecDType,
                        dxp, n, as_stream(stream));
           },
           "packed"_a, "x"_a, "y"_a, "dy"_a, "stash"_a, "workspace"_a, "grads"_a, "dx"_a.none(), "stream"_a)
      // The module's hot path (kfuse.FusedMLP, which made or checked every buffer itself: dtype, shape, contiguity,
      // device): device pointers instead of tensors, so that a training step exchanges no DLPack capsules (a dozen
      // per step cost ~0.1 ms of host time, measured). FusedMlp still checks batch, alignment and null pointers.
      .def("forward_raw",
           [](const FusedMlp& f, uintptr_t packed, uintptr_t x, uintptr_t y, int64_t batch, uintptr_t stream) {
             nb::gil_scoped_release release;
             f.forward(raw(packed), raw(x), raw(y), batch, as_stream(stream));
           },
           "packed"_a, "x"_a, "y"_a, "batch"_a, "stream"_a)
      .def("forward_train_raw",
           [](const FusedMlp& f, uintptr_t packed, uintptr_t x, uintptr_t y, uintptr_t stash, int64_t batch,
              uintptr_t stream) {
             nb::gil_scoped_release release;
             f.forward_train(raw(packed), raw(x), raw(y), raw(stash), batch, as_stream(stream));
           },
           "packed"_a, "x"_a, "y"_a, "stash"_a, "batch"_a, "stream"_a)
      .def("backward_raw",
           [](const FusedMlp& f, uintptr_t packed, uintptr_t x, uintptr_t y, uintptr_t dy, uintptr_t stash,
              uintptr_t workspace, uintptr_t grads, bool grads_16bit, uintptr_t dx, int64_t batch,
              uintptr_t stream) {
             nb::gil_scoped_release release;
             f.backward(raw(packed), raw(x), raw(y), raw(dy), raw(stash), raw(workspace), raw(grads),
                        grads_16bit ? MlpGradDType::kSpecDType : MlpGradDType::kFloat32, raw(dx), batch,
                        as_stream(stream));
           },
           "packed"_a, "x"_a, "y"_a, "dy"_a, "stash"_a, "workspace"_a, "grads"_a, "grads_16bit"_a, "dx"_a, "batch"_a,
           "stream"_a);
#endif;
}

}  // namespace
}  // namespace kfuse

void bind_mlp(nb::module_& m) {
  using namespace kfuse;
  bind_mlp_codegen(m);
  nb::class_<FusedMlp> mlp(m, "FusedMlpGpu", "A fused MLP's generated kernels on one CUDA device (kfuse::FusedMlp)");
  bind_mlp_setup(mlp);
  bind_mlp_calls(mlp);
}
