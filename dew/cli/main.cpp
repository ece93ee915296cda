// The dew program. Errors from the library (dew::Error) print as one line and exit 2; a command stopped by a
// signal before writing its outputs (io::Stopped) prints one line and exits 128 + the signal's number.
#include <iostream>

#include "dew/cli/commands.h"
#include "dew/core/error.h"
#include "dew/core/threads.h"
#include "dew/io/stops.h"

int main(int argc, char** argv) {
  dew::reexec_with_blas_kernels(argv);  // before any work: OpenBLAS fixes its kernels at load time
  dew::keep_freed_memory();             // training steps reuse their activations' memory
  std::vector<std::string> args(argv + 1, argv + argc);
  // A signal that ends the process removes the temporary files of the writes under way (io::TempFile).
  const dew::io::StopScope stops(dew::io::OnStop::kExit);
  try {
    return dew::cli::run(args);
  } catch (const dew::io::Stopped& e) {
    std::cerr << "dew: " << e.what() << "; no output was written (rerun the command to produce it)\n";
    return 128 + e.signal();
  } catch (const dew::Error& e) {
    std::cerr << "dew: error: " << e.what() << "\n";
    return 2;
  } catch (const c10::Error& e) {
    std::cerr << "dew: error: " << e.what_without_backtrace() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "dew: error: " << e.what() << "\n";
    return 2;
  }
}
