#include "dew/core/threads.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <malloc.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <thread>

#include "dew/core/error.h"
#include "dew/core/log.h"

namespace dew {

namespace {

using json = nlohmann::json;

// Layout version of the thread cache file:
//   {"format": 1, "machines": {MACHINE_KEY: {"intra_op": {"intra": 2, "blas": 1, "ms": 271.4,
//                                                         "measured_at": "2026-12-02 10:15 UTC"}, "gemm": {...}}}}
constexpr int kThreadCacheFormat = 1;

// The BLAS is whatever the loaded LibTorch links (oneMKL inside the torch wheels, OpenBLAS behind Debian's
// libtorch-dev), so its thread and kernel functions are looked up at run time by their exported names.
template <class Fn>
Fn blas_fn(const char* name) {
  return reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, name));
}

// oneMKL's kernel set as its verbose mode names it on the first call ("MKL_VERBOSE oneMKL 2024.2 Product
// build ... for Intel(R) 64 architecture Intel(R) Advanced Vector Extensions 2 (Intel(R) AVX2) enabled
// processors, ..."): the line is captured from stdout around one small GEMM. "" when MKL is not loaded.
std::string mkl_core() {
  auto verbose = blas_fn<int (*)(int)>("MKL_Verbose");
  auto version = blas_fn<void (*)(char*, int)>("MKL_Get_Version_String");
  if (!verbose || !version) return "";
  char buf[256] = {0};
  version(buf, sizeof buf - 1);
  std::string v(buf);  // "Intel(R) oneAPI Math Kernel Library Version 2024.2-Product Build ..."
  const auto at = v.find("Version ");
  std::string name =
      "oneMKL " + (at == std::string::npos ? v : v.substr(at + 8, v.find_first_of("- ", at + 8) - at - 8));
  std::fflush(stdout);
  char path[] = "/tmp/dew_mkl_verboseXXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) return name;
  const int saved = dup(1);
  dup2(fd, 1);
  const int before = verbose(1);
  {
    at::NoGradGuard no_grad;
    const at::Tensor a = at::ones({64, 64});
    (void)at::mm(a, a);  // MKL's sgemm prints its banner on this first verbose call
  }
  verbose(before > 0 ? before : 0);
  std::fflush(stdout);
  dup2(saved, 1);
  close(saved);
  close(fd);
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::remove(path);
  // The banner names the kernel set after "64 architecture ", up to " processors," or ", Lnx":
  //   "Intel(R) Advanced Vector Extensions 2 (Intel(R) AVX2) enabled processors, Lnx ..." (Intel, AVX2)
  //   "Intel(R) Advanced Vector Extensions 512 (Intel(R) AVX-512) with support for INT8, BF16, FP16 (limited)
  //    instructions, and Intel(R) Advanced Matrix Extensions (Intel(R) AMX) with INT8 and BF16, Lnx ..."
  //   "Intel(R) Architecture processors, Lnx ..." (a CPU oneMKL has no tuned path for, e.g. AMD)
  const std::string from = "64 architecture ";
  const auto arch = text.find(from);
  if (arch == std::string::npos) return name;
  const auto start = arch + from.size();
  const auto end = std::min(text.find(" processors,", start), text.find(", Lnx", start));
  if (end == std::string::npos) return name;
  std::string isa = text.substr(start, end - start);
  // The short names in "(Intel(R) X)", joined: "AVX2", "AVX-512 + AMX".
  std::string shorts;
  const std::string tag = "(Intel(R) ";
  for (auto at = isa.find(tag); at != std::string::npos; at = isa.find(tag, at + 1)) {
    const auto close = isa.find(')', at + tag.size());
    if (close == std::string::npos) break;
    shorts += (shorts.empty() ? "" : " + ") + isa.substr(at + tag.size(), close - at - tag.size());
  }
  if (!shorts.empty()) return name + " " + shorts;
  for (auto at = isa.find("Intel(R) "); at != std::string::npos; at = isa.find("Intel(R) ")) isa.erase(at, 9);
  return name + " " + isa + " processors";  // "oneMKL 2024.2 Architecture processors"
}

std::string trimmed(const std::string& s) {
  const auto b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

// The cache file parsed and checked (dew::Error saying what is wrong); a missing file is an empty cache.
json read_cache(const std::string& path) {
  std::ifstream in(path);
  if (!in) return json{{"format", kThreadCacheFormat}, {"machines", json::object()}};
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    fail("not JSON (", e.what(), ")");
  }
  DEW_CHECK(j.is_object() && j.contains("format") && j.contains("machines") && j["machines"].is_object(),
            "expected {\"format\": ", kThreadCacheFormat, ", \"machines\": {...}}");
  DEW_CHECK(j["format"] == kThreadCacheFormat, "format ", j["format"].dump(), ", this dew reads format ",
            kThreadCacheFormat);
  for (const auto& m : j["machines"].items()) {
    DEW_CHECK(m.value().is_object(), "machine \"", m.key(), "\": expected an object, got ", m.value().dump());
    for (const auto& w : m.value().items()) {
      for (const char* k : {"intra", "blas"}) {
        const json& e = w.value();
        const bool ok = e.is_object() && e.contains(k) && e[k].is_number_integer() && e[k].get<int64_t>() >= 1;
        DEW_CHECK(ok, "machine \"", m.key(), "\", ", w.key(), ".", k, ": expected an integer >= 1, got ",
                  e.is_object() && e.contains(k) ? e[k].dump() : "nothing");
      }
    }
  }
  return j;
}

}  // namespace

Workload workload_of(const std::string& architecture) {
  // dew bench --all and --models lm measured one split for every architecture (2026-11-30, LibTorch 1.13);
  // the name stays a parameter for the next one that differs.
  (void)architecture;
  return Workload::kIntraOp;
}

std::string workload_name(Workload workload) { return workload == Workload::kIntraOp ? "intra_op" : "gemm"; }

Workload parse_workload(const std::string& name, const std::string& what) {
  if (name == "intra_op") return Workload::kIntraOp;
  if (name == "gemm") return Workload::kGemm;
  fail(what, ": unknown workload \"", name, "\"; accepted: intra_op, gemm");
}

int64_t usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max<int64_t>(1, std::thread::hardware_concurrency());
}

int64_t default_blas_threads(int64_t intra) {
  // OpenBLAS runs its own thread pool: intra-op threads and OpenBLAS threads on the same two cores
  // oversubscribe them (2 + 2 ran a transformer step 2.4x slower than 1 + 2), so it gets the cores LibTorch
  // leaves. oneMKL runs on ATen's OpenMP threads (one thread inside ATen's parallel regions): as many.
  if (blas_fn<void (*)(int)>("openblas_set_num_threads")) return std::max<int64_t>(1, usable_cores() / intra);
  return intra;
}

std::string set_blas_threads(int64_t n) {
  DEW_CHECK(n >= 1, "BLAS threads: must be >= 1, got ", n);
  if (auto set = blas_fn<void (*)(int)>("openblas_set_num_threads")) {
    set(int(n));
    return std::to_string(n) + " OpenBLAS";
  }
  // MKL's C entry points are the mixed-case names (mkl_service.h maps the lower-case spellings to them); the
  // exported lower-case symbols are its Fortran interface, which takes pointers.
  if (auto set = blas_fn<int (*)(int)>("MKL_Set_Num_Threads_Local")) {
    set(int(n));  // this thread's count: the GEMMs it calls outside ATen's parallel regions
    return std::to_string(n) + " oneMKL";
  }
  return "";
}

int64_t blas_threads() {
  if (auto get = blas_fn<int (*)()>("openblas_get_num_threads")) return get();
  if (auto get = blas_fn<int (*)()>("MKL_Get_Max_Threads")) return get();
  return -1;
}

ThreadSplit builtin_split(Workload workload) {
  const int64_t cores = usable_cores();
  if (workload == Workload::kGemm) return {1, std::min<int64_t>(2, cores)};
  const int64_t intra = std::min<int64_t>(2, cores);
  return {intra, default_blas_threads(intra)};
}

std::string machine_key() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, model, flags;
  while ((model.empty() || flags.empty()) && std::getline(in, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::string name = trimmed(line.substr(0, colon)), value = trimmed(line.substr(colon + 1));
    if (name == "model name" && model.empty()) model = value;
    if (name == "flags" && flags.empty()) flags = " " + value + " ";
  }
  std::string isa;
  for (const std::string f : {"avx512f", "avx2"})
    if (flags.find(" " + f + " ") != std::string::npos) isa += (isa.empty() ? "" : " ") + f;
  return (model.empty() ? "unknown CPU" : model) + " | " + (isa.empty() ? "no avx2" : isa) + " | " +
         std::to_string(usable_cores()) + " cores";
}

std::string threads_cache_path() {
  if (const char* e = std::getenv("DEW_THREADS_CACHE"); e && *e) return std::string(e) == "off" ? "" : e;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/dew/threads.json";
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache/dew/threads.json";
  return "";
}

std::optional<MeasuredSplit> cached_split(const std::string& path, Workload workload) {
  if (path.empty()) return std::nullopt;
  json cache;
  try {
    cache = read_cache(path);
  } catch (const Error& e) {
    log::warn("threads: ignoring the thread cache ", path, ": ", e.what(),
              "; using the built-in default (dew tune threads rewrites it)");
    return std::nullopt;
  }
  const json& machines = cache["machines"];
  const auto m = machines.find(machine_key());
  if (m == machines.end() || !m->contains(workload_name(workload))) return std::nullopt;
  const json& e = (*m)[workload_name(workload)];
  MeasuredSplit out;
  out.split = {e["intra"].get<int64_t>(), e["blas"].get<int64_t>()};
  out.ms = e.contains("ms") && e["ms"].is_number() ? e["ms"].get<double>() : 0.0;
  out.measured_at = e.contains("measured_at") && e["measured_at"].is_string() ? e["measured_at"].get<std::string>()
                                                                              : "an unknown date";
  return out;
}

void record_measured_splits(const std::string& path, const std::map<Workload, MeasuredSplit>& splits) {
  namespace fs = std::filesystem;
  DEW_CHECK(!path.empty(),
            "thread cache: no file to write (DEW_THREADS_CACHE=off, or neither XDG_CACHE_HOME nor "
            "HOME is set)");
  json cache;
  try {
    cache = read_cache(path);
  } catch (const Error& e) {
    log::warn("threads: replacing the thread cache ", path, ": ", e.what());
    cache = json{{"format", kThreadCacheFormat}, {"machines", json::object()}};
  }
  json& entry = cache["machines"][machine_key()];
  if (!entry.is_object()) entry = json::object();
  for (const auto& [workload, m] : splits)
    entry[workload_name(workload)] = {
        {"intra", m.split.intra}, {"blas", m.split.blas}, {"ms", m.ms}, {"measured_at", m.measured_at}};
  const fs::path target(path);
  std::error_code ec;
  if (target.has_parent_path()) fs::create_directories(target.parent_path(), ec);
  DEW_CHECK(!ec, "thread cache ", path, ": cannot create its directory: ", ec.message());
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::trunc);
    DEW_CHECK(out.good(), "thread cache ", path, ": cannot write ", tmp, ": ", std::strerror(errno));
    out << cache.dump(2) << "\n";
    out.close();
    DEW_CHECK(!out.fail(), "thread cache ", path, ": writing ", tmp, " failed");
  }
  fs::rename(tmp, target, ec);
  if (ec) {
    fs::remove(tmp);
    fail("thread cache ", path, ": cannot rename ", tmp, " over it: ", ec.message());
  }
}

int64_t set_threads(int64_t threads, Workload workload) {
  DEW_CHECK(threads >= 0, "threads: must be >= 0 (0 = the measured default), got ", threads);
  std::string source = "the threads setting";
  std::optional<int64_t> blas;  // unset: the cores the intra-op threads leave
  bool measured = false;
  if (threads == 0) {
    if (const char* env = std::getenv("OMP_NUM_THREADS")) threads = std::max(0LL, std::atoll(env));
    source = "OMP_NUM_THREADS";
  }
  if (threads == 0) {
    ThreadSplit split = builtin_split(workload);
    source = "built-in default";
    if (auto m = cached_split(threads_cache_path(), workload)) {
      split = m->split;
      source = "measured by dew tune threads on " + m->measured_at;
      measured = true;
    }
    threads = split.intra;
    blas = split.blas;
  }
  at::set_num_threads(int(threads));  // oneMKL's global count too, where LibTorch links it
  std::string blas_text;
  if (const char* env = std::getenv("OPENBLAS_NUM_THREADS");
      env && blas_fn<void (*)(int)>("openblas_set_num_threads")) {
    blas_text = std::string("OpenBLAS's OPENBLAS_NUM_THREADS=") + env;
  } else {
    blas_text = set_blas_threads(blas.value_or(default_blas_threads(threads)));
    if (blas_text.empty()) blas_text = "the BLAS's own threads";
  }
  const std::string line = str("threads: ", threads, " intra-op x ", blas_text, " (", source, ")");
  if (measured) {
    log::info(line);
  } else {
    log::debug(line);
  }
  return threads;
}

std::string blas_core() {
  if (auto fn = blas_fn<char* (*)()>("openblas_get_corename")) return "OpenBLAS " + std::string(fn());
  static const std::string mkl = mkl_core();  // one verbose GEMM per process
  return mkl;
}

void reexec_with_blas_kernels(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") || std::getenv(kCoretypeMarker)) return;
  if (const char* off = std::getenv("DEW_BLAS_REEXEC"); off && std::string(off) == "0") return;
  auto corename = blas_fn<char* (*)()>("openblas_get_corename");
  if (!corename) return;  // not OpenBLAS: oneMKL picks its kernels from the CPU's instruction sets itself
  std::string core = corename();
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
