// A preload library for the test Golden.ParityHoldsWithOneMklsIntelKernels (tests/numerics/mkl_intel_kernels.sh):
// oneMKL asks mkl_serv_intel_cpu_true() whether the CPU is an Intel one and picks its vector-math kernels (the
// float32 exp / sin / cos LibTorch calls) by the answer, so on an AMD CPU this shim makes it take the kernels an
// Intel Xeon gets, whose last bits differ. It leaves a mark (DEW_MKL_SHIM_MARK) the first time oneMKL asks, so the
// test can tell that the preload took effect.
#include <cstdio>
#include <cstdlib>

extern "C" int mkl_serv_intel_cpu_true() {
  static bool marked = false;
  if (!marked) {
    marked = true;
    if (const char* mark = std::getenv("DEW_MKL_SHIM_MARK"))
      if (std::FILE* f = std::fopen(mark, "w")) std::fclose(f);
  }
  return 1;
}
