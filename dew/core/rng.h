// Explicit randomness: every stochastic draw uses a generator derived from (run seed, step, purpose),
// so a run is reproducible and a resumed run continues bit for bit.
#pragma once
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <cstdint>
#include <string_view>

namespace dew::rng {

/// Mixes (seed, step, purpose) into a 64-bit seed (FNV-1a of purpose, splitmix64 finaliser).
/// Different purposes or steps give statistically independent streams.
uint64_t derive(uint64_t seed, uint64_t step, std::string_view purpose);

/// A CPU generator seeded with derive(seed, step, purpose). Draw on the CPU and move the result, so
/// the numbers do not depend on the device.
at::Generator generator(uint64_t seed, uint64_t step, std::string_view purpose);

/// LibTorch's parameter initialisers (torch::nn::init, Tensor::normal_) and dropout take no generator:
/// they draw from the default generators. Within this scope those are seeded with
/// derive(seed, step, purpose) (the CPU one, and every CUDA one when CUDA is present), so those draws
/// come from the run's seed too; the CPU generator's previous state is restored at scope exit.
///
///   { rng::DefaultGeneratorScope init(seed, 0, "init"); model = models::build(...); }
class DefaultGeneratorScope {
 public:
  DefaultGeneratorScope(uint64_t seed, uint64_t step, std::string_view purpose);
  ~DefaultGeneratorScope();
  DefaultGeneratorScope(const DefaultGeneratorScope&) = delete;
  DefaultGeneratorScope& operator=(const DefaultGeneratorScope&) = delete;

 private:
  at::Tensor saved_;  // the CPU default generator's state before the scope
};

}  // namespace dew::rng
