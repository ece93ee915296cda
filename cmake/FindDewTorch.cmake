# Finds LibTorch >= 2.6 for dew, or stops CMake with one line saying what was found and what is needed.
# Order: a Torch_DIR the user gives; else torch.utils.cmake_prefix_path of DEW_PYTHON's torch wheel; else
# CMAKE_PREFIX_PATH and the system (Debian's libtorch-dev).
set(DEW_TORCH_MIN 2.6)
set(_dew_torch_hint "run scripts/setup (the pinned torch wheel in .venv), or pass -DTorch_DIR=<libtorch>/share/cmake/Torch")
if(Torch_DIR AND NOT EXISTS "${Torch_DIR}/TorchConfig.cmake" AND NOT EXISTS "${Torch_DIR}/torch-config.cmake")
  message(FATAL_ERROR "dew: Torch_DIR=${Torch_DIR} holds no TorchConfig.cmake; dew needs LibTorch >= ${DEW_TORCH_MIN} (${_dew_torch_hint})")
endif()
if(NOT Torch_DIR AND DEW_PYTHON)
  execute_process(COMMAND "${DEW_PYTHON}" -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
                  OUTPUT_VARIABLE _dew_torch_prefix RESULT_VARIABLE _dew_torch_rc ERROR_QUIET
                  OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(_dew_torch_rc EQUAL 0 AND _dew_torch_prefix)
    list(PREPEND CMAKE_PREFIX_PATH "${_dew_torch_prefix}")
  endif()
endif()
find_package(Torch QUIET)
if(NOT Torch_FOUND)
  message(FATAL_ERROR "dew: no LibTorch found (Torch_DIR=${Torch_DIR}, DEW_PYTHON=${DEW_PYTHON} has no torch); dew needs LibTorch >= ${DEW_TORCH_MIN} (${_dew_torch_hint})")
endif()
if(Torch_VERSION VERSION_LESS DEW_TORCH_MIN)
  message(FATAL_ERROR "dew: found LibTorch ${Torch_VERSION} at ${Torch_DIR}; dew needs LibTorch >= ${DEW_TORCH_MIN} (${_dew_torch_hint})")
endif()
message(STATUS "dew: LibTorch ${Torch_VERSION} from ${Torch_DIR}")
# A torch wheel's CUDA libraries (cuBLAS, cuDNN, NCCL, ...) sit beside it in site-packages/nvidia/*/lib, where
# libtorch_cuda finds them at run time through its own RPATH. The linker needs them named: it would otherwise
# resolve libtorch_cuda's libnccl.so.2 to the CUDA toolkit's older NCCL and miss symbols.
set(DEW_TORCH_LINK_OPTIONS "")
file(GLOB _dew_wheel_cuda_libs LIST_DIRECTORIES true "${TORCH_INSTALL_PREFIX}/../nvidia/*/lib")
foreach(_dir IN LISTS _dew_wheel_cuda_libs)
  list(APPEND DEW_TORCH_LINK_OPTIONS "LINKER:-rpath-link,${_dir}")
endforeach()
