// `dew bench --models ddp`: the measured child as one rank and as two under `dew launch` (one result line, from
// rank 0, whose numbers agree with each other), the case outside --all, and one tiny run of both sides with the
// report's table. No timing is asserted: the machine is shared.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "dew/bench/child_process.h"
#include "dew/core/options.h"
#include "dew/data/dataset.h"
#include "tests/test_util.h"

namespace {

using dew::test::run_dew;

bool have_fashion_mnist() {
  return std::filesystem::exists(std::string(dew::data::kFashionMnistDir) + "/train-images-idx3-ubyte.gz");
}

// The last line of the output: the child's result line (launch's ranks log to stderr, which run_dew also reads).
dew::json last_line(const std::string& output) {
  std::string line = output.substr(0, output.find_last_not_of('\n') + 1);
  line = line.substr(line.rfind('\n') == std::string::npos ? 0 : line.rfind('\n') + 1);
  return dew::json::parse(line);
}

// The lines that are JSON objects (result lines) in the output.
int result_lines(const std::string& output) {
  int n = 0;
  for (size_t at = 0; at < output.size(); at = output.find('\n', at) + 1) {
    if (output.compare(at, 2, "{\"") == 0) ++n;
    if (output.find('\n', at) == std::string::npos) break;
  }
  return n;
}

}  // namespace

TEST(BenchCli, DdpChildTimesTheGradientAllReduceOnRankZeroOnly) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "no Fashion-MNIST in " << dew::data::kFashionMnistDir;
  const std::string child = "bench --one ddp --batch 4 --steps 2 --warmup 1 --threads 1";
  auto one = run_dew(child);
  ASSERT_EQ(one.code, 0) << one.output;
  const dew::json j1 = last_line(one.output);
  EXPECT_EQ(j1["ranks"], 1);
  EXPECT_EQ(j1["allreduce_ms"].get<double>(), 0.0);  // no group, no all-reduce

  auto two = run_dew("launch --nproc-per-node 2 --threads 1 --master-port " +
                     std::to_string(dew::bench::free_local_port()) + " -- " + child);
  ASSERT_EQ(two.code, 0) << two.output;
  EXPECT_EQ(result_lines(two.output), 1) << "one result line, rank 0's:\n" << two.output;
  const dew::json j2 = last_line(two.output);
  EXPECT_EQ(j2["ranks"], 2);
  const double ar = j2["allreduce_ms"], ms = j2["ms_per_step"], share = j2["allreduce_share"];
  EXPECT_GT(ar, 0.0);
  EXPECT_LT(ar, ms);
  EXPECT_NEAR(share, ar / ms, 1e-9 + 1e-9 * share);
  // dist.overlap: the buckets are in flight during backward; what backward did not hide is a part of it.
  EXPECT_GT(j2["allreduce_exposed_ms"].get<double>(), 0.0);
  EXPECT_LE(j2["allreduce_exposed_ms"].get<double>(), ar);
  // samples/s counts the global batch: 4 items per step of ms_per_step.
  EXPECT_NEAR(j2["samples_per_s"].get<double>() * ms / 1e3, 4.0, 1e-9);
  EXPECT_EQ(j2["params"], j1["params"]);
}

TEST(BenchCli, DdpIsSelectedByNameOnly) {
  auto r = run_dew("bench --models nope");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find(", ddp"), std::string::npos) << r.output;  // accepted by name
  auto help = run_dew("bench --help");
  EXPECT_NE(help.output.find("included (not ddp)"), std::string::npos) << help.output;
}

TEST(BenchCli, DdpComparesOneAndTwoRanksOnBothSides) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "no Fashion-MNIST in " << dew::data::kFashionMnistDir;
  const bool peer = std::system(DEW_PYTHON " -c 'import torch' >/dev/null 2>&1") == 0;
  auto r =
      run_dew(std::string("bench --models ddp --steps 2 --warmup 1 --batch 4 --rounds 1") + (peer ? "" : " --no-peer"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("## dew bench: data-parallel `dew train`, 1 rank against 2 ranks, against PyTorch DDP"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("## dew bench: summary"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("| dew | 1 x 2 | "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("| dew | 2 x 1 | "), std::string::npos) << r.output;
  // dew's overlap against its recipe's default in the same run (DDP's peer has no such row).
  EXPECT_NE(r.output.find("| dew | 2 x 1, dist.overlap on | "), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("| PyTorch DDP | 2 x 1, dist.overlap on"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("dew with dist.overlap on at 2 ranks: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("Scaling efficiency (2-rank samples/s / 1-rank samples/s): dew "), std::string::npos)
      << r.output;
  if (peer) {
    EXPECT_NE(r.output.find("| PyTorch | 1 x 2 | "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("| PyTorch DDP | 2 x 1 | "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(", PyTorch DDP "), std::string::npos) << r.output;
  }
}
