// Explicit randomness: every stochastic draw uses a generator derived from (run seed, step, purpose),
// so a run is reproducible and a resumed run continues bit for bit.
#pragma once
#include <ATen/core/Generator.h>
#include <cstdint>
#include <string_view>

namespace dew::rng {

/// Mixes (seed, step, purpose) into a 64-bit seed (FNV-1a of purpose, splitmix64 finaliser).
/// Different purposes or steps give statistically independent streams.
uint64_t derive(uint64_t seed, uint64_t step, std::string_view purpose);

/// A CPU generator seeded with derive(seed, step, purpose). Draw on the CPU and move the result, so
/// the numbers do not depend on the device.
at::Generator generator(uint64_t seed, uint64_t step, std::string_view purpose);

}  // namespace dew::rng
