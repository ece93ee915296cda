// CPU thread and BLAS-kernel settings of a run (SPEC section 1: threads are a setting, else
// OMP_NUM_THREADS, else the measured best for the machine). See docs/benchmarks.md for the measurements.
#pragma once
#include <cstdint>
#include <string>

namespace dew {

/// What a run mostly computes; the best thread split differs (docs/benchmarks.md).
enum class Workload {
  // training: oneDNN convolutions, dew's row-parallel linears and fused kernels, element-wise ops: LibTorch's
  // intra-op threads
  kIntraOp,
  // GEMMs that dew does not split over the intra-op threads (batch-1 generation's one-row products): one
  // intra-op thread, OpenBLAS threads per GEMM
  kGemm,
};

/// Workload for training a registered architecture: kIntraOp for every one today (measured with
/// `dew bench --all` and `--models lm`, docs/benchmarks.md).
Workload workload_of(const std::string& architecture);

/// Sets LibTorch's intra-op threads and OpenBLAS's threads. threads > 0: that many intra-op threads.
/// threads == 0: OMP_NUM_THREADS when set, else the measured default for the workload on this machine
/// (kIntraOp: min(2, cores) intra-op threads and 1 OpenBLAS thread; kGemm: 1 intra-op thread and
/// OpenBLAS on min(2, cores) threads). OPENBLAS_NUM_THREADS, when set, is left to OpenBLAS.
/// Returns the intra-op thread count.
int64_t set_threads(int64_t threads, Workload workload);

/// The kernel set OpenBLAS runs ("SkylakeX", "Haswell", or "Prescott" when it does not recognise the
/// CPU); empty when the loaded BLAS is not OpenBLAS.
std::string blas_core();

/// OpenBLAS picks its kernels once, when it is loaded, from the CPU model; on virtual CPUs it does not
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
