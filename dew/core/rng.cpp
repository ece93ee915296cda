#include "dew/core/rng.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>

#include <mutex>

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

DefaultGeneratorScope::DefaultGeneratorScope(uint64_t seed, uint64_t step, std::string_view purpose) {
  const uint64_t s = derive(seed, step, purpose);
  auto cpu = at::detail::getDefaultCPUGenerator();
  {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    saved_ = cpu.get_state();
    cpu.set_current_seed(s);
  }
  // at::getNumGPUs and Context::defaultGenerator are the same calls in LibTorch 1.13 and 2.x.
  if (at::hasCUDA()) {
    for (size_t i = 0; i < at::getNumGPUs(); ++i) {
      auto g = at::globalContext().defaultGenerator(at::Device(at::kCUDA, c10::DeviceIndex(i)));
      std::lock_guard<std::mutex> lock(g.mutex());
      g.set_current_seed(s);
    }
  }
}

DefaultGeneratorScope::~DefaultGeneratorScope() {
  auto cpu = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(cpu.mutex());
  cpu.set_state(saved_);
}

}  // namespace dew::rng
