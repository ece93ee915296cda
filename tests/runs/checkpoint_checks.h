// Comparing the checkpoints of two runs, for the reproducibility and resume tests.
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <string>

#include "tests/test_util.h"

namespace dew::test {

// Every file of two checkpoints is byte-for-byte equal (model, EMA, optimizer moments and state.json).
inline void expect_same_checkpoint(const std::string& a, const std::string& b, int64_t step) {
  namespace fs = std::filesystem;
  const std::string dir = "step_" + std::to_string(step);
  for (const char* name : {"model.safetensors", "ema.safetensors", "optimizer.safetensors", "state.json"}) {
    const auto pa = fs::path(a) / "checkpoints" / dir / name;
    const auto pb = fs::path(b) / "checkpoints" / dir / name;
    ASSERT_TRUE(fs::exists(pa)) << pa;
    ASSERT_TRUE(fs::exists(pb)) << pb;
    EXPECT_TRUE(read_bytes(pa) == read_bytes(pb)) << pa << " and " << pb << " differ";
  }
  // The objective's state (GRPO's rollout buffer), where it has one.
  const auto oa = fs::path(a) / "checkpoints" / dir / "objective.safetensors";
  const auto ob = fs::path(b) / "checkpoints" / dir / "objective.safetensors";
  EXPECT_EQ(fs::exists(oa), fs::exists(ob)) << oa;
  if (fs::exists(oa)) {
    EXPECT_TRUE(read_bytes(oa) == read_bytes(ob)) << oa << " and " << ob << " differ";
  }
}

}  // namespace dew::test
