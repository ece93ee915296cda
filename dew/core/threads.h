// CPU thread and BLAS-kernel settings of a run (README.md: threads are a setting, else
// OMP_NUM_THREADS, else the measured best for the machine: what `dew tune threads` measured on this machine
// and cached, else a built-in rule). See docs/benchmarks.md ("Thread defaults") for the measurements.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>

namespace dew {

/// What a run mostly computes; the best thread split differs (docs/benchmarks.md).
enum class Workload {
  // training: oneDNN convolutions, dew's row-parallel linears and fused kernels, element-wise ops: LibTorch's
  // intra-op threads
  kIntraOp,
  // GEMMs that dew does not split over the intra-op threads (batch-1 generation's one-row products): one
  // intra-op thread, BLAS threads per GEMM
  kGemm,
};

/// Workload for training a registered architecture: kIntraOp for every one today (measured with
/// `dew bench --all` and `--models lm`, docs/benchmarks.md).
Workload workload_of(const std::string& architecture);

/// "intra_op" | "gemm": a workload's name in the thread cache and in `dew tune threads`.
std::string workload_name(Workload workload);
/// The workload of a name; dew::Error naming `what` (e.g. "--workloads") and the accepted names.
Workload parse_workload(const std::string& name, const std::string& what);

/// How many threads of each kind a process runs on the CPU.
struct ThreadSplit {
  int64_t intra = 1;  // LibTorch intra-op (OpenMP) threads, e.g. 2
  int64_t blas = 1;   // BLAS threads per GEMM outside ATen's parallel regions, e.g. 1
};

/// The CPUs this process may run on (its affinity mask), at least 1.
int64_t usable_cores();

/// The built-in split, used where nothing was measured: kIntraOp: min(2, cores) intra-op threads and
/// default_blas_threads() of them; kGemm: 1 intra-op thread and min(2, cores) BLAS threads.
ThreadSplit builtin_split(Workload workload);

/// BLAS threads beside `intra` intra-op threads when nothing else says: OpenBLAS (its own thread pool) gets
/// the cores they leave, max(1, cores / intra); oneMKL (on ATen's OpenMP threads) gets `intra`.
int64_t default_blas_threads(int64_t intra);

/// Sets the BLAS's threads for the GEMMs this thread calls outside ATen's parallel regions: OpenBLAS's pool
/// size, or oneMKL's count for the calling thread. Returns what it set ("2 OpenBLAS", "1 oneMKL"), "" for
/// another BLAS. dew::Error when n < 1.
std::string set_blas_threads(int64_t n);

/// The BLAS's thread count as this thread sees it (openblas_get_num_threads, mkl_get_max_threads); -1 for
/// another BLAS.
int64_t blas_threads();

/// This machine's key in the thread cache: /proc/cpuinfo's model name, which of avx512f and avx2 its flags
/// list, and usable_cores(), e.g. "AMD EPYC | avx512f avx2 | 2 cores". A measured split holds only for the
/// same key: another CPU model, instruction set or core count is another machine.
std::string machine_key();

/// The thread cache file: DEW_THREADS_CACHE when set ("off" = no cache: returns ""), else
/// $XDG_CACHE_HOME/dew/threads.json, else $HOME/.cache/dew/threads.json ("" without either variable).
std::string threads_cache_path();

/// A split that `dew tune threads` measured fastest for one workload on one machine.
struct MeasuredSplit {
  ThreadSplit split;
  double ms = 0;            // median time of its step (or generation), e.g. 271.4
  std::string measured_at;  // UTC, e.g. "2026-12-02 10:15 UTC"
};

/// The cached split of `workload` for machine_key() in the file at `path`: none when the path is empty, the
/// file is missing or holds no entry for this machine and workload. A file that is not a thread cache
/// (unparsable JSON, wrong shape, counts < 1) logs a warning and gives none; it never throws.
std::optional<MeasuredSplit> cached_split(const std::string& path, Workload workload);

/// Records `splits` as machine_key()'s entries in the cache at `path` (creating its directory), keeping the
/// entries of other machines and of workloads not in `splits`; a corrupt file is replaced. Written to a
/// temporary file and renamed over `path`, so readers see the old file or the new one. dew::Error naming
/// the path when it cannot be written.
void record_measured_splits(const std::string& path, const std::map<Workload, MeasuredSplit>& splits);

/// Sets LibTorch's intra-op threads and the BLAS's threads. threads > 0: that many intra-op threads and
/// default_blas_threads(threads) BLAS threads. threads == 0: OMP_NUM_THREADS when set
/// (OpenBLAS as for threads > 0); else the split `dew tune threads` measured for this workload on this
/// machine, when the thread cache (threads_cache_path()) holds one for machine_key(); else builtin_split().
/// OPENBLAS_NUM_THREADS, when set, is left to OpenBLAS. The log says which source was used (info for a
/// measured split, debug otherwise). A measured split changes only when tune is rerun; another thread
/// count can change the order of float reductions, hence the last bits of results. Returns the intra-op
/// thread count.
int64_t set_threads(int64_t threads, Workload workload);

/// The BLAS LibTorch runs and its kernel set: "oneMKL 2024.2 AVX2" (the torch wheels; the kernel set as
/// MKL's verbose mode names it), "OpenBLAS Haswell" (Debian's libtorch-dev; "Prescott" when OpenBLAS does
/// not recognise the CPU); empty for another BLAS.
std::string blas_core();

/// Only with an OpenBLAS LibTorch (oneMKL needs nothing of this): OpenBLAS picks its kernels once, when it
/// is loaded, from the CPU model; on virtual CPUs it does not
/// know (this project's CI machine) it falls back to SSE3 "Prescott" kernels, 2x slower than the AVX-512
/// ones the CPU supports. When OPENBLAS_CORETYPE is unset, OpenBLAS chose Prescott and the CPU (and OS)
/// support AVX-512 or AVX2, this re-executes the program with OPENBLAS_CORETYPE set to SkylakeX or
/// Haswell, and kCoretypeMarker to the same value (so child processes can tell the setting was dew's, not
/// the user's). Returns only when nothing is to be done (or exec failed); DEW_BLAS_REEXEC=0 disables it.
void reexec_with_blas_kernels(char** argv);
inline constexpr const char* kCoretypeMarker = "DEW_OPENBLAS_CORETYPE_SET_BY_DEW";

/// Keeps freed tensor memory in the process for reuse (glibc malloc: mmap threshold 32 MiB, trimming
/// only above 1 GiB free). With glibc's defaults a training step returns its large activations to the
/// kernel and faults them back in on the next step (7% of a unet step in page faults); with these, later
/// steps reuse the same memory: 6-10% faster steps, at the price of holding the peak. Skipped when
/// GLIBC_TUNABLES already sets a glibc.malloc option or DEW_MALLOC_TUNE=0. Returns whether it applied.
bool keep_freed_memory();
inline constexpr int kMallocMmapThreshold = 32 << 20;
inline constexpr int kMallocTrimThreshold = 1 << 30;
/// The same two settings as a GLIBC_TUNABLES value, for another process (`dew bench --peer-malloc-like-dew`
/// gives them to the Python peer).
inline constexpr const char* kKeepFreedMemoryTunables =
    "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824";

}  // namespace dew
