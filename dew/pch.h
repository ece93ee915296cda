// Precompiled header: the LibTorch and JSON includes that almost every translation unit needs.
// Including <torch/torch.h> costs ~25 s per file; compiled once here, it costs nothing per file.
#pragma once
#include <torch/torch.h>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>
