// Reading a diffusers scheduler_config.json for the scheduler classes (schedulers.cpp): typed settings with
// errors naming the file, the key, the value and what is accepted, and the betas every class takes. Not part
// of the public API (that is dew/sampling/schedulers.h).
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "dew/core/options.h"
#include "dew/diffusion/schedules.h"

namespace dew::sampling::detail {

/// The settings of one class's config; a value the class does not support is a dew::Error.
class ConfigReader {
 public:
  ConfigReader(const json& cfg, std::string where, std::string cls)
      : cfg_(cfg), where_(std::move(where)), cls_(std::move(cls)) {}
  const std::string& where() const { return where_; }
  const std::string& cls() const { return cls_; }
  /// The value of a key, or null when absent or null (diffusers treats null as "not set").
  const json* find(const std::string& key) const;
  [[noreturn]] void bad(const std::string& key, const json& v, const std::string& accepted) const;
  double number(const std::string& key, double def) const;
  std::optional<double> optional_number(const std::string& key) const;
  int64_t integer(const std::string& key, int64_t def) const;
  bool flag(const std::string& key, bool def) const;
  std::string choice(const std::string& key, const std::string& def, const std::vector<std::string>& ok) const;
  /// A boolean setting only `ok` is supported for (e.g. thresholding false).
  void require_flag(const std::string& key, bool def, bool ok, const std::string& why = "") const;

 private:
  const json& cfg_;
  std::string where_, cls_;
};

// The settings every class takes: the betas and the prediction type.
struct ConfigBase {
  int64_t T = 1000;
  diffusion::SchedulePtr schedule;
  std::vector<double> ac;  // alphabar, float64
  std::string prediction;
  std::string spacing;
  int64_t offset = 0;
};

/// The betas (trained_betas or beta_schedule), prediction type, spacing and offset of a class that accepts
/// `predictions` and spaces its steps `default_spacing` unless told; `takes_rescale`: it reads
/// rescale_betas_zero_snr; `tiny_terminal_alphabar`: under that rescale the last alphabar is 2^-24.
ConfigBase parse_base(const ConfigReader& r, const std::vector<std::string>& predictions,
                      const std::string& default_spacing, bool takes_rescale, bool tiny_terminal_alphabar);

}  // namespace dew::sampling::detail
