#include "dew/core/device.h"

#include <ATen/Context.h>

#include "dew/core/error.h"

namespace dew {

namespace {

int64_t cuda_count() { return at::hasCUDA() ? int64_t(at::getNumGPUs()) : 0; }

}  // namespace

std::string available_devices() {
  std::string out = "cpu";
  for (int64_t i = 0; i < cuda_count(); ++i) out += ", cuda:" + std::to_string(i);
  return out;
}

c10::Device parse_device(const std::string& name, const std::string& field) {
  if (name == "auto" || name.empty()) return cuda_count() > 0 ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
  if (name == "cpu") return c10::Device(c10::kCPU);
  int64_t index = -1;
  if (name == "cuda") {
    index = 0;
  } else if (name.rfind("cuda:", 0) == 0 && name.size() > 5 &&
             name.find_first_not_of("0123456789", 5) == std::string::npos && name.size() < 10) {
    index = std::stoll(name.substr(5));
  } else {
    fail(field, ": got \"", name, "\", accepted: auto, cpu, cuda, cuda:N");
  }
  const int64_t n = cuda_count();
  DEW_CHECK(n > 0, field, ": got \"", name,
            "\", but this machine has no CUDA device (or this LibTorch build has no CUDA); ",
            "available: ", available_devices());
  DEW_CHECK(index < n, field, ": got \"", name, "\", but there are ", n,
            " CUDA devices; available: ", available_devices());
  return c10::Device(c10::kCUDA, c10::DeviceIndex(index));
}

c10::Device module_device(const torch::nn::Module& m) {
  const auto params = m.parameters();
  return params.empty() ? c10::Device(c10::kCPU) : params.front().device();
}

}  // namespace dew
