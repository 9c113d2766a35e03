// The Python spelling of a tuning mode ('off', 'on', 'retune'), and one tuner report row (kfuse/tuner.h) as the
// Python dict that model.tune() and FusedMLP.tune() return and kfuse.tuning_table.format_tuning_table prints (times in
// ms; None where unknown).
#pragma once

#include <cmath>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "kfuse/error.h"
#include "kfuse/tuner.h"

namespace kfuse {

inline TuningMode parse_tuning_mode(const std::string& mode) {
  if (mode == "off") return TuningMode::kOff;
  if (mode == "on") return TuningMode::kOnFirstUse;
  if (mode == "retune") return TuningMode::kRetune;
  throw InvalidArgument("tuning mode must be 'off', 'on' or 'retune', got '" + mode + "'");
}

inline nanobind::dict report_dict(const OpTuningReport& r) {
  auto num = [](double v) -> nanobind::object { return std::isnan(v) ? nanobind::none() : nanobind::cast(v); };
  nanobind::dict d;
  d["op"] = r.op;
  d["shape"] = r.shape;
  d["dtype"] = r.dtype;
  d["default"] = r.default_choice;
  d["choice"] = r.choice;
  d["default_ms"] = num(r.default_ms);
  d["tuned_ms"] = num(r.tuned_ms);
  d["spread_ms"] = num(r.spread_ms);
  d["cudnn_ms"] = num(r.cudnn_ms);
  d["from_cache"] = r.from_cache;
  nanobind::list cands;
  for (const auto& c : r.candidates) {
    nanobind::dict cd;
    cd["name"] = c.name;
    cd["median_ms"] = c.rejected ? nanobind::none() : nanobind::cast(c.median_ms);
    cd["min_ms"] = c.rejected ? nanobind::none() : nanobind::cast(c.min_ms);
    cd["max_ms"] = c.rejected ? nanobind::none() : nanobind::cast(c.max_ms);
    cd["rejected"] = c.rejected;
    cands.append(cd);
  }
  d["candidates"] = cands;
  return d;
}

}  // namespace kfuse
