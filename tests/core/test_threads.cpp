#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <thread>

#include "dew/core/options.h"
#include "dew/core/threads.h"
#include "tests/test_util.h"

namespace {

// No test reads the thread cache of the machine's user (~/.cache/dew/threads.json), so every test's thread
// counts are the built-in ones whatever `dew tune threads` measured on the machine; a test that needs a cache
// points DEW_THREADS_CACHE at a file of its own. (A DEW_THREADS_CACHE set by whoever runs the tests stays.)
class NoUserThreadCache : public ::testing::Environment {
 public:
  void SetUp() override { setenv("DEW_THREADS_CACHE", "off", 0); }
};
[[maybe_unused]] ::testing::Environment* const kNoUserThreadCache =
    ::testing::AddGlobalTestEnvironment(new NoUserThreadCache);

// Saves an environment variable, removes it (or sets it to `value`), and restores it at scope exit.
struct EnvUnset {
  std::string name;
  std::optional<std::string> saved;
  explicit EnvUnset(std::string n, const char* value = nullptr) : name(std::move(n)) {
    if (const char* v = std::getenv(name.c_str())) saved = v;
    if (value) {
      setenv(name.c_str(), value, 1);
    } else {
      unsetenv(name.c_str());
    }
  }
  ~EnvUnset() {
    if (saved) {
      setenv(name.c_str(), saved->c_str(), 1);
    } else {
      unsetenv(name.c_str());
    }
  }
};
using EnvSet = EnvUnset;

bool openblas_loaded() { return dlsym(RTLD_DEFAULT, "openblas_set_num_threads") != nullptr; }

TEST(Threads, DefaultsSplitTheCoresBetweenLibTorchAndTheBlas) {
  const int before = at::get_num_threads();
  EnvUnset omp("OMP_NUM_THREADS"), blas("OPENBLAS_NUM_THREADS");
  EnvSet cache("DEW_THREADS_CACHE", "off");
  const int64_t cores = dew::usable_cores();
  const int64_t two = std::min<int64_t>(2, cores);
  ASSERT_GT(dew::blas_threads(), 0) << "neither oneMKL nor OpenBLAS is reachable from dew's LibTorch";
  // OpenBLAS's own pool gets the cores the intra-op threads leave; oneMKL runs on ATen's OpenMP threads.
  const int64_t blas_beside_two = openblas_loaded() ? std::max<int64_t>(1, cores / two) : two;
  EXPECT_EQ(dew::default_blas_threads(two), blas_beside_two);

  EXPECT_EQ(dew::set_threads(0, dew::Workload::kIntraOp), two);
  EXPECT_EQ(at::get_num_threads(), two);
  EXPECT_EQ(dew::blas_threads(), blas_beside_two);

  EXPECT_EQ(dew::set_threads(0, dew::Workload::kGemm), 1);
  EXPECT_EQ(at::get_num_threads(), 1);
  EXPECT_EQ(dew::blas_threads(), two);  // batch-1 generation's GEMMs get the cores

  setenv("OMP_NUM_THREADS", "1", 1);
  EXPECT_EQ(dew::set_threads(0, dew::Workload::kIntraOp), 1);  // the environment wins over the default
  EXPECT_EQ(dew::set_threads(2, dew::Workload::kGemm), 2);     // an explicit count wins over both
  EXPECT_EQ(at::get_num_threads(), 2);
  unsetenv("OMP_NUM_THREADS");
  at::set_num_threads(before);
  dew::set_blas_threads(dew::default_blas_threads(before));
}

TEST(Threads, NegativeCountIsAnError) {
  const auto msg = dew::test::error_of([] { dew::set_threads(-3, dew::Workload::kIntraOp); });
  EXPECT_NE(msg.find("threads"), std::string::npos) << msg;
  EXPECT_NE(msg.find("-3"), std::string::npos) << msg;
}

TEST(Threads, TheBlasReportsItsKernels) {
  // The torch wheel's oneMKL names its kernel set in verbose mode ("oneMKL 2024.2 AVX2"), OpenBLAS by
  // openblas_get_corename ("OpenBLAS Haswell"); either names an instruction set this CPU has.
  const std::string core = dew::blas_core();
  std::cout << "BLAS: " << core << "\n";
  ASSERT_FALSE(core.empty());
  EXPECT_TRUE(core.rfind("oneMKL ", 0) == 0 || core.rfind("OpenBLAS ", 0) == 0) << core;
  // "oneMKL 2024.2 AVX2" / "oneMKL 2024.2 Architecture processors" (MKL's words on a CPU it does not tune for)
  // / "OpenBLAS Haswell": a kernel set of at least a word after the name and version.
  const auto set = core.rfind("oneMKL ", 0) == 0 ? core.find(' ', 7) : core.find(' ');
  ASSERT_NE(set, std::string::npos) << core;
  EXPECT_GE(core.size() - set - 1, 4u) << "no kernel set in \"" << core << "\"";
}

void write_text(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

TEST(Threads, MachineKeyNamesTheCpuItsInstructionSetAndCores) {
  const std::string key = dew::machine_key();
  EXPECT_NE(key.find(" | "), std::string::npos) << key;
  EXPECT_NE(key.find("| " + std::to_string(dew::usable_cores()) + " cores"), std::string::npos) << key;
  EXPECT_EQ(key, dew::machine_key());  // stable within a process
}

TEST(Threads, CachePathFollowsTheEnvironment) {
  EnvSet off("DEW_THREADS_CACHE", "off");
  EXPECT_EQ(dew::threads_cache_path(), "");
  EnvSet own("DEW_THREADS_CACHE", "/tmp/x/threads.json");
  EXPECT_EQ(dew::threads_cache_path(), "/tmp/x/threads.json");
  unsetenv("DEW_THREADS_CACHE");
  EnvSet xdg("XDG_CACHE_HOME", "/tmp/xdg");
  EXPECT_EQ(dew::threads_cache_path(), "/tmp/xdg/dew/threads.json");
  unsetenv("XDG_CACHE_HOME");
  EnvSet home("HOME", "/tmp/home");
  EXPECT_EQ(dew::threads_cache_path(), "/tmp/home/.cache/dew/threads.json");
}

TEST(Threads, MeasuredSplitInTheCacheIsTheDefault) {
  const int before = at::get_num_threads();
  dew::test::TempDir dir("threads_cache");
  const std::string path = dir.file("sub/threads.json");  // the directory is created on write
  EnvUnset omp("OMP_NUM_THREADS"), blas("OPENBLAS_NUM_THREADS");
  EnvSet cache("DEW_THREADS_CACHE", path.c_str());
  EXPECT_FALSE(dew::cached_split(path, dew::Workload::kIntraOp));  // no file yet: none, no warning needed

  // 1 x 1 differs from the built-in 2 x 1 of kIntraOp on a machine with 2 or more cores.
  dew::record_measured_splits(path, {{dew::Workload::kIntraOp, {{1, 1}, 12.5, "2026-12-02 10:15 UTC"}}});
  const auto m = dew::cached_split(path, dew::Workload::kIntraOp);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->split.intra, 1);
  EXPECT_EQ(m->split.blas, 1);
  EXPECT_DOUBLE_EQ(m->ms, 12.5);
  EXPECT_EQ(m->measured_at, "2026-12-02 10:15 UTC");
  EXPECT_FALSE(dew::cached_split(path, dew::Workload::kGemm));  // not measured: the built-in default

  EXPECT_EQ(dew::set_threads(0, dew::Workload::kIntraOp), 1);
  EXPECT_EQ(at::get_num_threads(), 1);
  EXPECT_EQ(dew::blas_threads(), 1);  // the measured split's BLAS count, whichever BLAS
  EXPECT_EQ(dew::set_threads(0, dew::Workload::kGemm), dew::builtin_split(dew::Workload::kGemm).intra);

  // Recording another workload keeps the first; the environment and an explicit count still win.
  dew::record_measured_splits(path, {{dew::Workload::kGemm, {{2, 1}, 3.0, "2026-12-03 08:00 UTC"}}});
  EXPECT_EQ(dew::cached_split(path, dew::Workload::kIntraOp)->split.intra, 1);
  EXPECT_EQ(dew::set_threads(0, dew::Workload::kGemm), 2);
  EXPECT_EQ(at::get_num_threads(), 2);
  setenv("OMP_NUM_THREADS", "2", 1);
  EXPECT_EQ(dew::set_threads(0, dew::Workload::kIntraOp), 2);
  unsetenv("OMP_NUM_THREADS");
  EXPECT_EQ(dew::set_threads(3, dew::Workload::kIntraOp), 3);

  // The file is what the header says: format 1, machines by key, workloads by name.
  const auto j = dew::json::parse(std::ifstream(path));
  EXPECT_EQ(j["format"], 1);
  EXPECT_EQ(j["machines"][dew::machine_key()]["intra_op"]["intra"], 1);
  EXPECT_EQ(j["machines"][dew::machine_key()]["gemm"]["measured_at"], "2026-12-03 08:00 UTC");
  at::set_num_threads(before);
}

TEST(Threads, AnEntryForAnotherMachineIsIgnored) {
  const int before = at::get_num_threads();
  dew::test::TempDir dir("threads_other");
  const std::string path = dir.file("threads.json");
  EnvUnset omp("OMP_NUM_THREADS");
  EnvSet cache("DEW_THREADS_CACHE", path.c_str());
  const dew::json other = {{"intra_op", {{"intra", 7}, {"blas", 3}, {"ms", 1.0}, {"measured_at", "x"}}}};
  write_text(path, dew::json{{"format", 1}, {"machines", {{dew::machine_key() + " (another)", other}}}}.dump());
  EXPECT_FALSE(dew::cached_split(path, dew::Workload::kIntraOp));
  EXPECT_EQ(dew::set_threads(0, dew::Workload::kIntraOp), dew::builtin_split(dew::Workload::kIntraOp).intra);

  // Writing this machine's entry keeps the other machine's.
  dew::record_measured_splits(path, {{dew::Workload::kIntraOp, {{1, 2}, 5.0, "today"}}});
  const auto j = dew::json::parse(std::ifstream(path));
  EXPECT_EQ(j["machines"][dew::machine_key() + " (another)"], other);
  EXPECT_EQ(dew::cached_split(path, dew::Workload::kIntraOp)->split.blas, 2);
  at::set_num_threads(before);
}

TEST(Threads, ACorruptCacheFallsBackToTheBuiltInDefault) {
  const int before = at::get_num_threads();
  dew::test::TempDir dir("threads_corrupt");
  const std::string path = dir.file("threads.json");
  EnvUnset omp("OMP_NUM_THREADS");
  EnvSet cache("DEW_THREADS_CACHE", path.c_str());
  const int64_t builtin = dew::builtin_split(dew::Workload::kIntraOp).intra;
  const dew::json bad_count = {{"intra_op", {{"intra", 0}, {"blas", 1}}}};
  for (const std::string& text :
       {std::string("{not json"), std::string("[1, 2]"), std::string(R"({"format": 99, "machines": {}})"),
        dew::json{{"format", 1}, {"machines", {{dew::machine_key(), bad_count}}}}.dump(),
        dew::json{{"format", 1}, {"machines", {{dew::machine_key(), {{"intra_op", {{"intra", "2"}, {"blas", 1}}}}}}}}
            .dump()}) {
    write_text(path, text);
    EXPECT_FALSE(dew::cached_split(path, dew::Workload::kIntraOp)) << text;
    int64_t got = -1;
    EXPECT_NO_THROW(got = dew::set_threads(0, dew::Workload::kIntraOp)) << text;
    EXPECT_EQ(got, builtin) << text;
  }
  // tune replaces a corrupt file.
  dew::record_measured_splits(path, {{dew::Workload::kIntraOp, {{1, 1}, 1.0, "today"}}});
  EXPECT_EQ(dew::cached_split(path, dew::Workload::kIntraOp)->split.intra, 1);
  at::set_num_threads(before);
}

TEST(Threads, WorkloadNamesRoundTrip) {
  for (auto w : {dew::Workload::kIntraOp, dew::Workload::kGemm})
    EXPECT_EQ(dew::parse_workload(dew::workload_name(w), "--workloads"), w);
  const auto msg = dew::test::error_of([] { dew::parse_workload("matmul", "--workloads"); });
  EXPECT_NE(msg.find("--workloads"), std::string::npos) << msg;
  EXPECT_NE(msg.find("intra_op, gemm"), std::string::npos) << msg;
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
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer's allocator stands in for glibc's malloc, whose mallopt settings this measures";
#endif
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
