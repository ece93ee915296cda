// Devices (docs/core.md): `--device cpu|cuda|cuda:N|auto`. auto (the default) is the first CUDA
// device when LibTorch sees one, else the CPU.
#pragma once
#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include <string>

namespace dew {

/// Parses a device name; `field` names the flag or recipe key in the error. A CUDA device on a machine
/// (or LibTorch build) without it, or an index past the device count, is a dew::Error saying what exists.
c10::Device parse_device(const std::string& name, const std::string& field = "--device");

/// The devices this process can use, e.g. "cpu" or "cpu, cuda:0, cuda:1" (for messages and `dew version`).
std::string available_devices();

/// The device of a module's first parameter; the CPU for a module without parameters.
c10::Device module_device(const torch::nn::Module& m);

}  // namespace dew
