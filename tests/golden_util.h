// Reading the committed golden files (tests/golden/, made by the reference code) and the comparison rule
// rms(ours - f64 truth) <= 2 rms(reference_f32 - f64 truth), per tensor.
#pragma once
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include <map>
#include <string>

#include "dew/io/safetensors.h"

namespace dew::test {

/// The path of tests/golden/sd/NAME (the Stable Diffusion goldens: configs, weights and tensors).
inline std::string sd_golden(const std::string& name) {
  return std::string(DEW_SOURCE_DIR) + "/tests/golden/sd/" + name;
}

/// Tensors of tests/golden/NAME.
inline std::map<std::string, at::Tensor> golden(const std::string& name) {
  return io::load_safetensors(std::string(DEW_SOURCE_DIR) + "/tests/golden/" + name);
}

/// Float64 options, for building exact inputs.
inline const at::TensorOptions kF64 = at::TensorOptions().dtype(at::kDouble);

/// The largest absolute elementwise difference, in float64.
inline double max_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

inline double rms(const at::Tensor& x) { return x.to(at::kDouble).pow(2).mean().sqrt().item<double>(); }

/// The golden rule for one tensor: ours (any dtype) against the reference's float32 and float64 results.
/// Prints the max difference. A reference whose f32 equals its f64 exactly gets a floor of 1e-7 rms.
/// `factor` is the rule's 2; a caller that widens it says why.
inline void expect_golden(const std::string& what, const at::Tensor& ours, const at::Tensor& ref_f32,
                          const at::Tensor& ref_f64, double factor = 2.0) {
  ASSERT_EQ(ours.sizes(), ref_f64.sizes()) << what;
  const at::Tensor truth = ref_f64.to(at::kDouble);
  const double err = rms(ours.detach().cpu().to(at::kDouble) - truth);
  const double ref = std::max(rms(ref_f32.to(at::kDouble) - truth), 1e-7 * std::max(1.0, rms(truth)));
  const double maxd = (ours.detach().cpu().to(at::kDouble) - truth).abs().max().item<double>();
  std::printf("  %-40s rms %.3e (reference f32 %.3e), max |diff| %.3e\n", what.c_str(), err, ref, maxd);
  EXPECT_LE(err, factor * ref) << what << ": max |diff| " << maxd;
}

/// The float64 agreement of a diffusers UNet run in float64: diffusers computes the timestep embedding in
/// float32 even then (get_timestep_embedding's torch.arange(..., dtype=float32)), and float32 exp / sin / cos
/// differ in the last bit between LibTorch builds (torch 2.13's against 1.13's, which made the golden files:
/// 3 of 160 exp values, 7 sines, 5 cosines at SD's sizes). That moves the float64 output by up to 1.4e-8 of
/// its scale.
inline constexpr double kUnetFloat64Rel = 5e-8;

/// Float64 agreement: ours run in float64 against the reference's float64 result (relative to its scale).
inline void expect_close_f64(const std::string& what, const at::Tensor& ours, const at::Tensor& ref_f64,
                             double rel = 1e-10) {
  ASSERT_EQ(ours.sizes(), ref_f64.sizes()) << what;
  const at::Tensor d = ours.detach().cpu().to(at::kDouble) - ref_f64.to(at::kDouble);
  const double maxd = d.abs().max().item<double>(), scale = std::max(1e-30, ref_f64.abs().max().item<double>());
  std::printf("  %-40s float64 max |diff| %.3e (scale %.3e)\n", what.c_str(), maxd, scale);
  EXPECT_LE(maxd, rel * scale) << what;
}

/// The "w.PREFIX..." weights of a golden file, as module names without the prefix.
inline std::map<std::string, at::Tensor> golden_weights(const std::map<std::string, at::Tensor>& g,
                                                        const std::string& prefix = "w.") {
  std::map<std::string, at::Tensor> out;
  for (const auto& [k, v] : g)
    if (k.rfind(prefix, 0) == 0) out[k.substr(prefix.size())] = v;
  return out;
}

}  // namespace dew::test
