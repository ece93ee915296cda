// Precompiled header: the LibTorch and JSON includes that almost every translation unit needs.
// Including <torch/torch.h> costs ~25 s per file; compiled once here, it costs nothing per file.
#pragma once
#include <torch/torch.h>
#include <nlohmann/json.hpp>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>
