// `dew bench --models sample`: `dew sample`'s sampling (sample_diffusion, Euler, classifier-free guidance) on the
// default recipe's model, one tiny run of both sides (bench/sample_peer.py, which fails unless its parameter count
// is the C++ model's) and the report's table. No timing is asserted: the machine is shared.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

#include "dew/data/dataset.h"
#include "tests/test_util.h"

TEST(BenchCli, SampleRunsDewSampleOnTheDefaultRecipeModelOnBothSides) {
  // runs::prepare completes the recipe's model fields from the data set.
  if (!std::filesystem::exists(std::string(dew::data::kFashionMnistDir) + "/train-images-idx3-ubyte.gz"))
    GTEST_SKIP() << "no Fashion-MNIST in " << dew::data::kFashionMnistDir;
  const bool peer = std::system(DEW_PYTHON " -c 'import torch' >/dev/null 2>&1") == 0;
  auto r = dew::test::run_dew(std::string("bench --models sample --images 4 --sample-steps 2 --steps 1 --warmup 0 ") +
                              "--threads 1 --blas-threads 1 --rounds 1" + (peer ? "" : " --no-peer"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("## dew bench: `dew sample`, 4 images, 2 euler steps"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("classifier-free guidance 3.0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("| C++ | intra 1, blas 1 |"), std::string::npos) << r.output;
  if (peer) {
    EXPECT_NE(r.output.find("| Python | intra 1, blas 1 |"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("Speed-up (Python ms/sampling run / C++ ms/sampling run): "), std::string::npos)
        << r.output;
  }
}

TEST(BenchCli, SampleFlagsNeedTheSampleCase) {
  auto r = dew::test::run_dew("bench --models unet --images 4 --no-peer");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("--images, --sample-steps: only the sample case uses them"), std::string::npos) << r.output;
}
