// kfuse._C: the nanobind binding of libkfuse. Tensors cross as DLPack (nb::ndarray accepts torch tensors and numpy
// arrays); every check of device, dtype, layout and shape happens here or in the core and names the tensor.
// No PyTorch header is included: the torch-facing layer is python/kfuse/*.py.
#include <cmath>
#include <optional>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/map.h>

#include "kfuse/checkpoint.h"
#include "kfuse/device.h"
#include "kfuse/encoder_config.h"
#if KFUSE_WITH_CUDA
#include "kfuse/encoder_gpu.h"
#endif
#include "kfuse/encoder_params.h"
#include "kfuse/reference.h"
#include "tuning_report_dict.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace kfuse {
namespace {

using Array = nb::ndarray<>;
using ConfigTuple = std::tuple<int, int, std::vector<int>>;

EncoderConfig to_config(const ConfigTuple& t) {
  EncoderConfig c{std::get<0>(t), std::get<1>(t), std::get<2>(t)};
  c.validate();
  return c;
}
ConfigTuple from_config(const EncoderConfig& c) { return {c.in_channels, c.base_planes, c.layers}; }

#if KFUSE_WITH_CUDA
// EncoderOptions as a {field name: int} dict (bool fields 0 / 1): every field, in both directions.
using OptionMap = std::map<std::string, int>;

std::vector<std::pair<const char*, int EncoderOptions::*>> int_options() {
  return {{"programmatic_launch", &EncoderOptions::programmatic_launch},
          {"fused_down", &EncoderOptions::fused_down},
          {"cudnn_fused", &EncoderOptions::cudnn_fused}};
}
std::vector<std::pair<const char*, bool EncoderOptions::*>> bool_options() {
  return {{"fused_blocks", &EncoderOptions::fused_blocks},   {"fused_stem", &EncoderOptions::fused_stem},
          {"wgmma_blocks", &EncoderOptions::wgmma_blocks},   {"se_weights_t", &EncoderOptions::se_weights_t},
          {"se_projection", &EncoderOptions::se_projection}, {"wgrad_branch", &EncoderOptions::wgrad_branch}};
}

EncoderOptions to_options(const OptionMap& given) {
  EncoderOptions o;
  for (const auto& [name, value] : given) {
    bool known = false;
    for (const auto& [n, field] : int_options())
      if (name == n) o.*field = value, known = true;
    for (const auto& [n, field] : bool_options())
      if (name == n) {
        KFUSE_CHECK(value == 0 || value == 1, InvalidArgument, "encoder option ", name, " is a flag (0 or 1), got ",
                    value);
        o.*field = value == 1, known = true;
      }
    if (!known) {
      std::string names;
      for (const auto& [n, f] : int_options()) names += std::string(names.empty() ? "" : ", ") + n;
      for (const auto& [n, f] : bool_options()) names += std::string(", ") + n;
      throw InvalidArgument("unknown encoder option '" + name + "' (options: " + names + ")");
    }
  }
  return o;
}

OptionMap from_options(const EncoderOptions& o) {
  OptionMap out;
  for (const auto& [n, field] : int_options()) out[n] = o.*field;
  for (const auto& [n, field] : bool_options()) out[n] = o.*field ? 1 : 0;
  return out;
}
#endif

std::string dtype_str(nb::dlpack::dtype d) {
  const char* kind = d.code == uint8_t(nb::dlpack::dtype_code::Float)    ? "float"
                     : d.code == uint8_t(nb::dlpack::dtype_code::Int)    ? "int"
                     : d.code == uint8_t(nb::dlpack::dtype_code::UInt)   ? "uint"
                     : d.code == uint8_t(nb::dlpack::dtype_code::Bfloat) ? "bfloat"
                     : d.code == uint8_t(nb::dlpack::dtype_code::Bool)   ? "bool"
                                                                         : "other";
  return std::string(kind) + std::to_string(d.bits);
}

Shape shape_of(const Array& a) {
  Shape s(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) s[i] = static_cast<int64_t>(a.shape(i));
  return s;
}

bool is_c_contiguous(const Array& a) {
  int64_t expected = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expected) return false;
    expected *= static_cast<int64_t>(a.shape(i));
  }
  return true;
}

// Copies a CPU, C-contiguous array of dtype T into a HostTensor<T>; throws InvalidArgument naming `what`.
template <class T>
HostTensor<T> to_host(const Array& a, const std::string& what, const Shape* expected_shape = nullptr) {
  KFUSE_CHECK(a.device_type() == nb::device::cpu::value, InvalidArgument, what,
              " must be a CPU tensor for the CPU reference (got device type ", a.device_type(), ")");
  KFUSE_CHECK(a.dtype() == nb::dtype<T>(), InvalidArgument, what, " has dtype ", dtype_str(a.dtype()), ", expected ",
              sizeof(T) == 8 ? "float64" : "float32");
  KFUSE_CHECK(is_c_contiguous(a), InvalidArgument, what,
              " must be contiguous (row-major); call .contiguous() first");
  const Shape s = shape_of(a);
  if (expected_shape)
    KFUSE_CHECK(s == *expected_shape, InvalidArgument, what, " has shape ", shape_str(s), ", expected ",
                shape_str(*expected_shape));
  HostTensor<T> t(s);
  if (t.numel()) std::memcpy(t.data(), a.data(), sizeof(T) * static_cast<size_t>(t.numel()));
  return t;
}

// Writes t into a caller-allocated CPU tensor of the same dtype and shape (outputs are allocated by the caller, as
// they will be on the GPU, where they live on the caller's device and stream).
template <class T>
void write_to(const HostTensor<T>& t, const Array& out, const std::string& what) {
  KFUSE_CHECK(out.device_type() == nb::device::cpu::value, InvalidArgument, what, " must be a CPU tensor");
  KFUSE_CHECK(out.dtype() == nb::dtype<T>(), InvalidArgument, what, " has dtype ", dtype_str(out.dtype()),
              ", expected ", sizeof(T) == 8 ? "float64" : "float32");
  KFUSE_CHECK(is_c_contiguous(out), InvalidArgument, what, " must be contiguous (row-major)");
  KFUSE_CHECK(shape_of(out) == t.shape(), InvalidArgument, what, " has shape ", shape_str(shape_of(out)),
              ", expected ", shape_str(t.shape()));
  if (t.numel()) std::memcpy(out.data(), t.data(), sizeof(T) * static_cast<size_t>(t.numel()));
}

template <class T>
EncoderParams<T> to_params(const EncoderConfig& config, const std::vector<Array>& arrays,
                           const std::string& what = "parameter") {
  EncoderParams<T> p(config);
  KFUSE_CHECK(arrays.size() == p.size(), InvalidArgument, "expected ", p.size(), " ", what, " tensors for ",
              config.to_string(), ", got ", arrays.size());
  for (size_t i = 0; i < p.size(); ++i)
    p.at(i) = to_host<T>(arrays[i], what + " '" + p.specs()[i].name + "'", &p.specs()[i].shape);
  return p;
}

template <class T>
void write_params(const EncoderParams<T>& p, const std::vector<Array>& out, const std::string& what) {
  KFUSE_CHECK(out.size() == p.size(), InvalidArgument, "expected ", p.size(), " ", what, " tensors for ",
              p.config().to_string(), ", got ", out.size());
  for (size_t i = 0; i < p.size(); ++i) write_to(p.at(i), out[i], what + " '" + p.specs()[i].name + "'");
}

bool is_float64(const Array& x) { return x.dtype() == nb::dtype<double>(); }

void reference_forward_py(const ConfigTuple& cfg, const std::vector<Array>& params, const Array& x,
                          const Array& out) {
  const EncoderConfig config = to_config(cfg);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    EncoderParams<T> p = to_params<T>(config, params);
    HostTensor<T> input = to_host<T>(x, "input");
    HostTensor<T> y;
    {
      nb::gil_scoped_release release;
      y = reference_forward(p, input);
    }
    write_to(y, out, "output");
  };
  is_float64(x) ? run(double{}) : run(float{});
}

void reference_backward_py(const ConfigTuple& cfg, const std::vector<Array>& params, const Array& x,
                           const Array& grad_output, const std::vector<Array>& grad_params,
                           std::optional<Array> grad_input) {
  const EncoderConfig config = to_config(cfg);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    EncoderParams<T> p = to_params<T>(config, params);
    HostTensor<T> input = to_host<T>(x, "input");
    const Shape out_shape = config.output_shape(input.shape());
    HostTensor<T> dy = to_host<T>(grad_output, "grad_output", &out_shape);
    ReferenceGradients<T> g{EncoderParams<T>(config), {}};
    {
      nb::gil_scoped_release release;
      g = reference_backward(p, input, dy, grad_input.has_value());
    }
    write_params(g.params, grad_params, "parameter gradient");
    if (grad_input) write_to(g.input, *grad_input, "input gradient");
  };
  is_float64(x) ? run(double{}) : run(float{});
}

#if KFUSE_WITH_CUDA
// A CUDA tensor (any strides) as the core's DeviceTensorView.
DeviceTensorView to_view(const Array& a, const std::string& what) {
  KFUSE_CHECK(a.device_type() == nb::device::cuda::value, InvalidArgument, what,
              " must be a CUDA tensor (got device type ", a.device_type(), ")");
  DeviceTensorView v;
  v.data = a.data();
  v.device = a.device_id();
  const auto d = a.dtype();
  if (d == nb::dtype<float>()) v.dtype = DType::F32;
  else if (d.code == uint8_t(nb::dlpack::dtype_code::Float) && d.bits == 16) v.dtype = DType::F16;
  else if (d.code == uint8_t(nb::dlpack::dtype_code::Bfloat) && d.bits == 16) v.dtype = DType::BF16;
  else if (d == nb::dtype<uint8_t>()) v.dtype = DType::U8;
  else throw InvalidArgument(what + " has dtype " + dtype_str(d) + ", expected float32, float16, bfloat16 or uint8");
  v.shape = shape_of(a);
  for (size_t i = 0; i < a.ndim(); ++i) v.strides.push_back(a.stride(i));
  return v;
}
#endif

std::vector<std::pair<std::string, std::vector<int64_t>>> param_specs_py(const ConfigTuple& cfg) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (const ParamSpec& s : to_config(cfg).parameter_specs()) out.emplace_back(s.name, s.shape);
  return out;
}

}  // namespace
}  // namespace kfuse

#if KFUSE_WITH_CUDA
namespace kfuse {
namespace {

// The inference hot path's validated call: the input and output views of one (geometry, dtype, strides, device)
// made once through DLPack; later calls of the same kind pass only the two data pointers (EncoderGpu::forward
// still checks everything else), which saves the two DLPack exports per call.
struct CallSpec {
  DeviceTensorView x, y;
  // The same call on other data pointers (tensors of the same shape, dtype, strides and device).
  CallSpec on(uintptr_t x_ptr, uintptr_t y_ptr) const {
    CallSpec c = *this;
    c.x.data = reinterpret_cast<void*>(x_ptr);
    c.y.data = reinterpret_cast<void*>(y_ptr);
    return c;
  }
};

// EncoderGpu::backward (stage < 0) or backward_stage(stage) on DLPack tensors; the GIL released while it launches.
void run_encoder_backward(EncoderGpu& e, int stage, uint64_t stash, const Array& x, const Array& dy,
                          const Array& grads, const std::optional<Array>& dx, uintptr_t stream) {
  const DeviceTensorView xv = to_view(x, "input"), dyv = to_view(dy, "output gradient");
  const DeviceTensorView gv = to_view(grads, "gradient buffer");
  KFUSE_CHECK(gv.dtype == DType::F32 && gv.shape.size() == 1 && gv.shape[0] == e.config().num_parameters() &&
                  gv.strides[0] == 1,
              InvalidArgument, "gradient buffer must be a contiguous float32 vector of ", e.config().num_parameters(),
              " elements");
  KFUSE_CHECK(gv.device == xv.device, InvalidArgument, "gradient buffer must be on cuda:", xv.device);
  std::optional<DeviceTensorView> dxv;
  if (dx) dxv = to_view(*dx, "input gradient");
  nb::gil_scoped_release release;
  float* const g = static_cast<float*>(gv.data);
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  if (stage < 0) e.backward(stash, xv, dyv, g, dxv ? &*dxv : nullptr, s);
  else e.backward_stage(stage, stash, xv, dyv, g, dxv ? &*dxv : nullptr, s);
}

// run_encoder_backward on data pointers: the views are those of the forward's prepared call (`spec`: x as it was
// given, y as allocated) on other pointers; dy like y, dx a contiguous tensor like x, grads the flat float32 buffer.
// The autograd nodes allocate all of them themselves, and the four DLPack exports per call cost ~0.1 ms of host.
void run_encoder_backward_ptrs(EncoderGpu& e, const CallSpec& spec, int stage, uint64_t stash, uintptr_t x,
                               uintptr_t dy, uintptr_t grads, uintptr_t dx, uintptr_t stream) {
  const CallSpec c = spec.on(x, dy);
  std::optional<DeviceTensorView> dxv;
  if (dx) {
    dxv = c.x;
    dxv->data = reinterpret_cast<void*>(dx);
    int64_t stride = 1;
    for (size_t i = dxv->shape.size(); i-- > 0;) dxv->strides[i] = stride, stride *= dxv->shape[i];
  }
  nb::gil_scoped_release release;
  float* const g = reinterpret_cast<float*>(grads);
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  if (stage < 0) e.backward(stash, c.x, c.y, g, dxv ? &*dxv : nullptr, s);
  else e.backward_stage(stage, stash, c.x, c.y, g, dxv ? &*dxv : nullptr, s);
}

}  // namespace
}  // namespace kfuse
#endif

void bind_mlp(nanobind::module_& m);  // mlp_bindings.cpp: the generated fused MLP

namespace kfuse {
namespace {

void bind_reference(nb::module_& m) {
  m.def(
      "backward_stage_of_parameters",
      [](const ConfigTuple& cfg) { return to_config(cfg).backward_stage_of_parameters(); }, "config"_a,
      "Per parameter (param_specs order): the CUDA training backward's stage after which its gradient is final "
      "(0 = the last block's, ..., the stem's last)");
  m.def("param_specs", &param_specs_py, "config"_a,
        "[(name, shape)] of every parameter in bps-nav's state_dict order; config = (in_channels, base_planes, "
        "layers)");
  m.def("num_parameters", [](const ConfigTuple& c) { return to_config(c).num_parameters(); }, "config"_a);
  m.def("output_shape", [](const ConfigTuple& c, const Shape& x) { return to_config(c).output_shape(x); },
        "config"_a, "input_shape"_a);
  m.def("infer_config",
        [](const std::vector<std::pair<std::string, std::vector<int64_t>>>& specs) {
          std::vector<ParamSpec> ps;
          for (const auto& [n, s] : specs) ps.push_back({n, s});
          return from_config(EncoderConfig::infer(ps));
        },
        "specs"_a, "The configuration of a state_dict given as [(name, shape)]");
  m.def("default_params",
        [](const ConfigTuple& c, uint64_t seed, bool perturbed, const std::vector<Array>& out) {
          const EncoderConfig config = to_config(c);
          write_params(perturbed ? EncoderParams<float>::perturbed_init(config, seed)
                                 : EncoderParams<float>::fixup_init(config, seed),
                       out, "parameter");
        },
        "config"_a, "seed"_a, "perturbed"_a, "out"_a,
        "Writes float32 parameters into `out`: bps-nav's FixUp init, plus (perturbed=True) the fixed perturbation "
        "of the embedded default network");
  m.def("reference_forward", &reference_forward_py, "config"_a, "params"_a, "x"_a, "out"_a,
        "CPU reference forward into `out` (float32 or float64, C-contiguous NCHW)");
  m.def("reference_backward", &reference_backward_py, "config"_a, "params"_a, "x"_a, "grad_output"_a,
        "grad_params"_a, "grad_input"_a = nb::none(),
        "CPU reference backward into `grad_params` (and `grad_input` when given)");
  m.def("checkpoint_config",
        [](const std::string& path, const std::string& prefix) {
          LoadOptions o;
          o.prefix = prefix;
          return from_config(load_encoder_checkpoint<float>(path, o).config());
        },
        "path"_a, "prefix"_a = "", "The network an encoder checkpoint (safetensors) describes");
  m.def("load_checkpoint",
        [](const std::string& path, const std::string& prefix, const ConfigTuple& expect,
           const std::vector<Array>& out) {
          LoadOptions o;
          o.prefix = prefix;
          o.expect = to_config(expect);
          write_params(load_encoder_checkpoint<float>(path, o), out, "parameter");
        },
        "path"_a, "prefix"_a, "config"_a, "out"_a,
        "Loads an encoder checkpoint of network `config` into float32 tensors `out` (param_specs order)");
  m.def("save_checkpoint",
        [](const std::string& path, const ConfigTuple& c, const std::vector<Array>& params) {
          save_encoder_checkpoint(path, to_params<float>(to_config(c), params));
        },
        "path"_a, "config"_a, "params"_a, "Saves float32 parameters as an encoder checkpoint (safetensors)");
}

#if KFUSE_WITH_CUDA
// EncoderGpu: construction, weights, the inference call and tuning ...
void bind_encoder_inference(nb::class_<EncoderGpu>& encoder) {
  encoder.def("__init__",
           [](EncoderGpu* self, const ConfigTuple& c, const std::string& precision, int device,
              const OptionMap& options) {
             KFUSE_CHECK(precision == "float16" || precision == "bfloat16", InvalidArgument,
                         "precision must be 'float16' or 'bfloat16', got '", precision, "'");
             const EncoderOptions o = to_options(options);
             new (self) EncoderGpu(to_config(c), precision == "float16" ? GpuPrecision::kFloat16
                                                                        : GpuPrecision::kBFloat16,
                                   device, o);
           },
           "config"_a, "precision"_a, "device"_a, "options"_a = OptionMap{},
           "options: EncoderOptions fields by name (kfuse/encoder_options.h), ints; the rest keep their defaults")
      .def("options", [](const EncoderGpu& e) { return from_options(e.options()); },
           "the options in effect (given, with developer overrides from the environment applied)")
      .def("set_weights",
           [](EncoderGpu& e, const std::vector<Array>& params) {
             e.set_weights(to_params<float>(e.config(), params));
           },
           "params"_a, "float32 CPU tensors in param_specs order")
      .def("set_input_affine", &EncoderGpu::set_input_affine, "scale"_a, "shift"_a)
      .def("forward",
           [](EncoderGpu& e, const Array& x, const Array& y, uintptr_t stream) {
             const DeviceTensorView xv = to_view(x, "input"), yv = to_view(y, "output");
             nb::gil_scoped_release release;
             e.forward(xv, yv, reinterpret_cast<cudaStream_t>(stream));
           },
           "x"_a, "y"_a, "stream"_a, "y = encoder(x) on the CUDA stream `stream` (an integer handle)")
      .def("prepare_call",
           [](EncoderGpu&, const Array& x, const Array& y) { return CallSpec{to_view(x, "input"), to_view(y, "output")}; },
           "x"_a, "y"_a, "A reusable call for tensors like x and y (same shape, dtype, strides, device)")
      .def("run",
           [](EncoderGpu& e, const CallSpec& spec, uintptr_t x, uintptr_t y, uintptr_t stream) {
             const CallSpec c = spec.on(x, y);
             nb::gil_scoped_release release;
             e.forward(c.x, c.y, reinterpret_cast<cudaStream_t>(stream));
           },
           "spec"_a, "x_ptr"_a, "y_ptr"_a, "stream"_a,
           "forward() on the data pointers of tensors like the ones `spec` was prepared with")
      .def("set_tuning_mode", [](EncoderGpu& e, const std::string& mode) { e.set_tuning_mode(parse_tuning_mode(mode)); },
           "mode"_a, "'off' (heuristic), 'on' (tune new shapes on first use, cached) or 'retune'")
      .def("tune",
           [](EncoderGpu& e, int n, int h, int w, const std::string& mode, nb::object progress, bool training) {
             EncoderGpu::TuneProgress cb;
             if (!progress.is_none())
               cb = [&](size_t done, size_t total, const OpTuningReport& row) {
                 nb::gil_scoped_acquire gil;
                 progress(done, total, report_dict(row));
               };
             std::vector<OpTuningReport> rows;
             {
               nb::gil_scoped_release release;
               rows = training ? e.tune_training(n, h, w, parse_tuning_mode(mode), cb)
                               : e.tune(n, h, w, parse_tuning_mode(mode), cb);
             }
             nb::list out;
             for (const auto& r : rows) out.append(report_dict(r));
             return out;
           },
           "n"_a, "h"_a, "w"_a, "mode"_a = "retune", "progress"_a = nb::none(), "training"_a = false,
           "Tunes every convolution of the (N, H, W) geometry (training: also the backward's weight and data "
           "gradients); one dict per convolution");
}

// ... and the training step, graphs and the launch plan.
void bind_encoder_training(nb::class_<EncoderGpu>& encoder) {
  encoder.def("set_weights_device",
           [](EncoderGpu& e, const std::vector<uintptr_t>& ptrs, const std::string& dtype, uintptr_t stream) {
             KFUSE_CHECK(dtype == "float32" || dtype == "float16" || dtype == "bfloat16", InvalidArgument,
                         "parameter dtype must be float32, float16 or bfloat16, got ", dtype);
             std::vector<const void*> params;
             for (uintptr_t p : ptrs) params.push_back(reinterpret_cast<const void*>(p));
             const DType d = dtype == "float32" ? DType::F32 : dtype == "float16" ? DType::F16 : DType::BF16;
             nb::gil_scoped_release release;
             e.set_weights_device(params, d, reinterpret_cast<cudaStream_t>(stream));
           },
           "param_ptrs"_a, "dtype"_a, "stream"_a,
           "Binds the parameters in CUDA memory (contiguous, PyTorch layouts, param_specs order): every later forward "
           "computes with their current values (a device-side check repacks what changed); `stream` is unused")
      .def("forward_train",
           [](EncoderGpu& e, const Array& x, const Array& y, uintptr_t stream) {
             const DeviceTensorView xv = to_view(x, "input"), yv = to_view(y, "output");
             nb::gil_scoped_release release;
             return e.forward_train(xv, yv, reinterpret_cast<cudaStream_t>(stream));
           },
           "x"_a, "y"_a, "stream"_a, "The training forward; returns the id of the state kept for backward")
      .def("run_train",
           [](EncoderGpu& e, const CallSpec& spec, uintptr_t x, uintptr_t y, uintptr_t stream) {
             const CallSpec c = spec.on(x, y);
             nb::gil_scoped_release release;
             return e.forward_train(c.x, c.y, reinterpret_cast<cudaStream_t>(stream));
           },
           "spec"_a, "x_ptr"_a, "y_ptr"_a, "stream"_a,
           "forward_train() on the data pointers of tensors like the ones `spec` was prepared with")
      .def("stash_valid", &EncoderGpu::stash_valid, "stash"_a)
      .def("backward",
           [](EncoderGpu& e, uint64_t stash, const Array& x, const Array& dy, const Array& grads,
              std::optional<Array> dx, uintptr_t stream) {
             run_encoder_backward(e, -1, stash, x, dy, grads, dx, stream);
           },
           "stash"_a, "x"_a, "dy"_a, "grads"_a, "dx"_a.none(), "stream"_a,
           "Every parameter's gradient (flat float32, param_specs order) and optionally dL/dx")
      .def("backward_stage",
           [](EncoderGpu& e, int stage, uint64_t stash, const Array& x, const Array& dy, const Array& grads,
              std::optional<Array> dx, uintptr_t stream) {
             run_encoder_backward(e, stage, stash, x, dy, grads, dx, stream);
           },
           "stage"_a, "stash"_a, "x"_a, "dy"_a, "grads"_a, "dx"_a.none(), "stream"_a,
           "One stage of the backward (0 = the last block's, ..., backward_stages - 1 = the stem's), backward's "
           "arguments; run all in order")
      .def("run_backward", &run_encoder_backward_ptrs, "spec"_a, "stage"_a, "stash"_a, "x_ptr"_a, "dy_ptr"_a,
           "grads_ptr"_a, "dx_ptr"_a, "stream"_a,
           "backward() (stage < 0) or backward_stage() on data pointers: x like the forward's prepared call's input, "
           "dy like its output, dx (0: none) a contiguous tensor like x, grads the flat float32 gradient buffer")
      .def_prop_ro("backward_stages", &EncoderGpu::backward_stages)
      .def_prop_ro("config", [](const EncoderGpu& e) { return from_config(e.config()); },
                   "(in_channels, base_planes, layers) of the network the engine runs")
      .def("backward_stage_of_parameters", &EncoderGpu::backward_stage_of_parameters,
           "Per parameter (param_specs order): the backward stage after which its gradient is final")
      .def("set_use_graphs", &EncoderGpu::set_use_graphs, "on"_a)
      .def_prop_ro("graph_count", &EncoderGpu::graph_count)
      .def_prop_ro("uses_programmatic_launch", &EncoderGpu::uses_programmatic_launch)
      .def("launch_plan", &EncoderGpu::launch_plan, "n"_a, "h"_a, "w"_a, "training"_a = false,
           "Which kernels run: one entry per step of the inference forward (or of the training step) on n x C x h x w "
           "inputs, e.g. 'stem', 'block1:fused_block_wgmma', 'block4:conv1,conv2_squeeze_projection,squeeze_excite'");
}
#endif

void bind_devices(nb::module_& m) {
  m.def("built_with_cuda", &built_with_cuda);
  m.def("cuda_device_count", &cuda_device_count);
  m.def("compiled_architectures", &compiled_architectures);
  m.def("cuda_device_info", [](int i) {
    const DeviceInfo d = cuda_device_info(i);
    nb::dict r;
    r["index"] = d.index;
    r["name"] = d.name;
    r["compute_capability"] = nb::make_tuple(d.major, d.minor);
    r["sm_count"] = d.sm_count;
    r["l2_bytes"] = d.l2_bytes;
    r["memory_bytes"] = d.memory_bytes;
    r["driver_version"] = d.driver_version;
    r["runtime_version"] = d.runtime_version;
    return r;
  });
}

}  // namespace
}  // namespace kfuse

NB_MODULE(_C, m) {
  using namespace kfuse;
  m.doc() = "kfuse C++ core (CPU reference, checkpoints, device queries, kernels)";

  static nb::exception<CheckpointError> checkpoint_error(m, "CheckpointError", PyExc_ValueError);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const Unsupported& e) {
      PyErr_SetString(PyExc_NotImplementedError, e.what());
    }
  });

  bind_reference(m);
#if KFUSE_WITH_CUDA
  nb::class_<CallSpec>(m, "CallSpec", "A validated encoder call (EncoderGpu.prepare_call)");
  nb::class_<EncoderGpu> encoder(m, "EncoderGpu",
                                 "The fused CUDA path of one encoder on one device (weights, activations, graphs)");
  bind_encoder_inference(encoder);
  bind_encoder_training(encoder);
#endif
  bind_mlp(m);
  bind_devices(m);
}
