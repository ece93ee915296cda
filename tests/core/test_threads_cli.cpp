// `dew tune threads`: its flags (a bad one is a one-line error naming it, exit 2) and --dry-run, which
// measures nothing. The measurement itself is never run in tests (it is a timing).
#include <gtest/gtest.h>

#include <algorithm>

#include "tests/test_util.h"

namespace {

using dew::test::run_dew;

size_t lines(const std::string& s) { return size_t(std::count(s.begin(), s.end(), '\n')); }

TEST(ThreadsCli, BadFlagsAreOneLineErrorsNamingTheFlag) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"tune threads --bogus 1", "--bogus"},
      {"tune threads --splits 2y1 --dry-run", "--splits"},
      {"tune threads --splits 0x1 --dry-run", "--splits"},
      {"tune threads --workloads matmul --dry-run", "--workloads"},
      {"tune threads --steps 0 --dry-run", "--steps"},
      {"tune threads --rounds -1 --dry-run", "--rounds"},
      {"tune threads --split 2x1", "--split"},
      {"tune cores", "tune"},
      {"tune", "tune"},
  };
  for (const auto& [args, flag] : cases) {
    const auto r = run_dew(args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.output;
    EXPECT_EQ(lines(r.output), 1u) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(flag), std::string::npos) << args << "\n" << r.output;
  }
}

TEST(ThreadsCli, DryRunShowsTheMachineAndTheDefaultsWithoutMeasuring) {
  const auto r = run_dew("tune threads --dry-run --splits 1x1,2x1 --workloads gemm");
  // DEW_THREADS_CACHE is "off" in the tests (test_threads.cpp) unless set: the dry run says so.
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("machine: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("cache: off"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("1x1, 2x1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("current default gemm: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("(built-in default)"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("current default intra_op"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("wrote"), std::string::npos) << r.output;
  const auto help = run_dew("tune threads --help");
  EXPECT_EQ(help.code, 0) << help.output;
  EXPECT_NE(help.output.find("usage: dew tune threads"), std::string::npos) << help.output;
}

}  // namespace
