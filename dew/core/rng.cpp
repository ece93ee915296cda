#include "dew/core/rng.h"

#include <ATen/CPUGeneratorImpl.h>

namespace dew::rng {

static uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t derive(uint64_t seed, uint64_t step, std::string_view purpose) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  for (unsigned char c : purpose) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return splitmix64(splitmix64(splitmix64(seed) ^ step) ^ h);
}

at::Generator generator(uint64_t seed, uint64_t step, std::string_view purpose) {
  return at::make_generator<at::CPUGeneratorImpl>(derive(seed, step, purpose));
}

}  // namespace dew::rng
