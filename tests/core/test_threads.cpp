#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <cstdlib>
#include <cstring>
#include <optional>
#include <thread>

#include "dew/core/threads.h"
#include "tests/test_util.h"

namespace {

// Saves an environment variable, removes it, and puts it back at scope exit.
struct EnvUnset {
  std::string name;
  std::optional<std::string> saved;
  explicit EnvUnset(std::string n) : name(std::move(n)) {
    if (const char* v = std::getenv(name.c_str())) saved = v;
    unsetenv(name.c_str());
  }
  ~EnvUnset() {
    if (saved) setenv(name.c_str(), saved->c_str(), 1);
  }
};

int openblas_threads() {
  auto fn = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  return fn ? fn() : -1;
}

TEST(Threads, DefaultsSplitTheCoresBetweenLibTorchAndOpenBLAS) {
  const int before = at::get_num_threads();
  EnvUnset omp("OMP_NUM_THREADS"), blas("OPENBLAS_NUM_THREADS");
  const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  const int64_t two = std::min<int64_t>(2, cores);

  EXPECT_EQ(dew::set_threads(0, dew::Workload::kIntraOp), two);
  EXPECT_EQ(at::get_num_threads(), two);
  if (openblas_threads() > 0) {
    EXPECT_EQ(openblas_threads(), std::max<int64_t>(1, cores / two));
  }

  EXPECT_EQ(dew::set_threads(0, dew::Workload::kGemm), 1);
  EXPECT_EQ(at::get_num_threads(), 1);
  if (openblas_threads() > 0) {
    EXPECT_EQ(openblas_threads(), two);
  }

  setenv("OMP_NUM_THREADS", "1", 1);
  EXPECT_EQ(dew::set_threads(0, dew::Workload::kIntraOp), 1);  // the environment wins over the default
  EXPECT_EQ(dew::set_threads(2, dew::Workload::kGemm), 2);  // an explicit count wins over both
  EXPECT_EQ(at::get_num_threads(), 2);
  unsetenv("OMP_NUM_THREADS");
  at::set_num_threads(before);
}

TEST(Threads, NegativeCountIsAnError) {
  const auto msg = dew::test::error_of([] { dew::set_threads(-3, dew::Workload::kIntraOp); });
  EXPECT_NE(msg.find("threads"), std::string::npos) << msg;
  EXPECT_NE(msg.find("-3"), std::string::npos) << msg;
}

TEST(Threads, OpenBLASReportsItsKernels) {
  // dew links OpenBLAS through libblas (scripts/setup installs libopenblas0-pthread); its kernel set is known.
  EXPECT_FALSE(dew::blas_core().empty());
}

}  // namespace

namespace {

long minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

// Allocates n bytes, writes every page, frees them; returns the minor page faults this took.
long faults_of_one_use(size_t n) {
  const long before = minor_faults();
  auto* p = static_cast<volatile char*>(std::malloc(n));
  for (size_t i = 0; i < n; i += 4096) p[i] = static_cast<char>(i);
  std::free(const_cast<char*>(p));
  return minor_faults() - before;
}

}  // namespace

TEST(Threads, KeepFreedMemoryReusesLargeBlocksWithoutPageFaults) {
  EnvUnset tunables("GLIBC_TUNABLES"), opt_out("DEW_MALLOC_TUNE");
  ASSERT_TRUE(dew::keep_freed_memory());
  // 24 MiB: above glibc's default mmap threshold (128 KiB, adapted upwards only by earlier frees) and
  // trim threshold, so with the defaults every use maps fresh pages (6144 faults of 4 KiB).
  constexpr size_t n = 24u << 20;
  faults_of_one_use(n);  // the first use grows the heap
  EXPECT_LT(faults_of_one_use(n), 64);
  setenv("DEW_MALLOC_TUNE", "0", 1);
  EXPECT_FALSE(dew::keep_freed_memory());  // the opt-out
  // The tunables string handed to other processes says the same as the two mallopt values.
  EXPECT_EQ(std::string(dew::kKeepFreedMemoryTunables),
            "glibc.malloc.mmap_threshold=" + std::to_string(dew::kMallocMmapThreshold) +
                ":glibc.malloc.trim_threshold=" + std::to_string(dew::kMallocTrimThreshold));
}

