#include "dew/core/threads.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "dew/core/error.h"

namespace dew {

namespace {

// dew links the generic libblas interface, not OpenBLAS by name, so its extensions are looked up at run time.
template <class Fn>
Fn openblas_fn(const char* name) {
  return reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, name));
}

int64_t cores() { return std::max<int64_t>(1, std::thread::hardware_concurrency()); }

}  // namespace

Workload workload_of(const std::string& architecture) {
  // dew bench --all and --models lm (2026-11-30): since dew's linears split their rows over the intra-op
  // threads (dew/nn/fused.h), 2 intra + 1 BLAS trains fastest for every architecture, uvit and the
  // language model included (they were 1 + 2 before). The name stays a parameter for the next one that
  // differs.
  (void)architecture;
  return Workload::kIntraOp;
}

int64_t set_threads(int64_t threads, Workload workload) {
  DEW_CHECK(threads >= 0, "threads: must be >= 0 (0 = the measured default), got ", threads);
  bool defaulted = false;
  if (threads == 0) {
    if (const char* env = std::getenv("OMP_NUM_THREADS")) threads = std::max(0LL, std::atoll(env));
  }
  if (threads == 0) {
    defaulted = true;
    threads = workload == Workload::kIntraOp ? std::min<int64_t>(2, cores()) : 1;
  }
  at::set_num_threads(int(threads));
  // Intra-op threads and OpenBLAS threads on the same two cores oversubscribe them (2 + 2 ran a transformer
  // step 2.4x slower than 1 + 2), so OpenBLAS gets the cores LibTorch leaves.
  if (!std::getenv("OPENBLAS_NUM_THREADS")) {
    if (auto set = openblas_fn<void (*)(int)>("openblas_set_num_threads")) {
      const int64_t blas = defaulted && workload == Workload::kGemm ? std::min<int64_t>(2, cores())
                                                                             : std::max<int64_t>(1, cores() / threads);
      set(int(blas));
    }
  }
  return threads;
}

std::string blas_core() {
  auto fn = openblas_fn<char* (*)()>("openblas_get_corename");
  return fn ? std::string(fn()) : std::string();
}

void reexec_with_blas_kernels(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") || std::getenv(kCoretypeMarker)) return;
  if (const char* off = std::getenv("DEW_BLAS_REEXEC"); off && std::string(off) == "0") return;
  std::string core = blas_core();
  std::transform(core.begin(), core.end(), core.begin(), ::tolower);
  if (core != "prescott") return;
  // __builtin_cpu_supports also checks that the OS saves the AVX/AVX-512 register state (XCR0).
  const char* want = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")
                         ? "SkylakeX"
                     : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? "Haswell"
                                                                                        : nullptr;
  if (!want) return;
  setenv("OPENBLAS_CORETYPE", want, 1);
  setenv(kCoretypeMarker, want, 1);  // never loop, whatever the new image's OpenBLAS decides
  execv("/proc/self/exe", argv);
  // exec failed: carry on with the kernels we have.
  unsetenv("OPENBLAS_CORETYPE");
  unsetenv(kCoretypeMarker);
}

bool keep_freed_memory() {
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  const char* opt_out = std::getenv("DEW_MALLOC_TUNE");
  if ((tunables && std::strstr(tunables, "glibc.malloc.")) || (opt_out && std::string(opt_out) == "0")) return false;
  // Setting either value turns off glibc's adaptive threshold, so both are set: 32 MiB is the largest
  // mmap threshold glibc accepts on 64-bit (larger blocks are still mapped and unmapped per use).
  const bool mmap_ok = mallopt(M_MMAP_THRESHOLD, kMallocMmapThreshold) == 1;
  const bool trim_ok = mallopt(M_TRIM_THRESHOLD, kMallocTrimThreshold) == 1;
  return mmap_ok && trim_ok;
}

}  // namespace dew
