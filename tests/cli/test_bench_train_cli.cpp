// `dew bench --models train`: `dew train`'s default recipe with its Fashion-MNIST data loader, one tiny run
// of both sides (bench/train_peer.py reads the images dew dumps) and the report's table. No timing is
// asserted: the machine is shared.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

#include "dew/data/dataset.h"
#include "tests/test_util.h"

TEST(BenchCli, TrainThroughputRunsTheDefaultRecipeOnBothSides) {
  if (!std::filesystem::exists(std::string(dew::data::kFashionMnistDir) + "/train-images-idx3-ubyte.gz"))
    GTEST_SKIP() << "no Fashion-MNIST in " << dew::data::kFashionMnistDir;
  const bool peer = std::system(DEW_PYTHON " -c 'import torch' >/dev/null 2>&1") == 0;
  auto r = dew::test::run_dew(std::string("bench --models train --steps 1 --warmup 0 --batch 4 --threads 1 ") +
                              "--blas-threads 1 --rounds 1 --no-compile" + (peer ? "" : " --no-peer"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("## dew bench: `dew train` throughput, the default recipe with its data loader"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("| C++ | intra 1, blas 1 |"), std::string::npos) << r.output;
  if (peer) {
    EXPECT_NE(r.output.find("Speed-up (C++ samples/s / Python samples/s): "), std::string::npos) << r.output;
  }
}
